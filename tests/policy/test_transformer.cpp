// Parity of the transformer with Hugging Face transformers: tiny random models saved by
// tests/policy/make_hf_models.py, logits recorded by transformers for a padded batch and a
// packed row, matched here to 1e-4 in float32.
#include <doctest/doctest.h>

#include <fstream>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "kernels/packed_linear.hpp"
#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "tests/test_util.hpp"

using namespace troupe;

namespace {

const char* kModels[] = {"llama3", "qwen2", "qwen3", "llama_tied"};


std::map<std::string, torch::Tensor> read_reference(const std::string& name) {
  // reference.safetensors sits beside the model; Checkpoint wants a folder, File a path.
  auto file = safetensors::File::open(test::fixtures() / "hf_models" / name / "reference.safetensors");
  std::map<std::string, torch::Tensor> out;
  for (const auto& v : file->tensors()) {
    auto dtype = v.dtype == safetensors::Dtype::F32 ? torch::kFloat32 : torch::kInt64;
    out[v.name] = torch::from_blob(const_cast<std::byte*>(v.data), v.shape, dtype).clone();
  }
  return out;
}

LoadedModel load(const std::string& name, torch::Dtype dtype = torch::kFloat32) {
  return load_model(test::fixtures() / "hf_models" / name, {.dtype = dtype, .tokenizer = false});
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

}  // namespace

TEST_CASE("logits match transformers on a padded batch (left, right, none)") {
  torch::NoGradGuard no_grad;
  for (const char* name : kModels) {
    CAPTURE(name);
    auto m = load(name);
    auto ref = read_reference(name);
    auto mask = ref["attention_mask"];
    auto positions = positions_from_mask(mask);
    CHECK(torch::equal(positions, ref["position_ids"]));
    auto hidden = m.model->forward(ref["input_ids"], positions, attention_mask(mask, positions));
    auto logits = m.model->logits(hidden);
    auto real = mask.to(torch::kBool);
    double err = max_abs_diff(logits.index({real}), ref["logits"].index({real}));
    MESSAGE(std::string(name) << " padded max abs error " << err);
    CHECK(real.sum().item<int64_t>() == 24);
    CHECK(err < 1e-4);
    // Negative control: attending to the padding must change the left-padded row.
    auto all = torch::ones_like(mask);
    auto naive = torch::arange(mask.size(1)).expand_as(mask).contiguous();
    auto wrong = m.model->logits(m.model->forward(ref["input_ids"], naive, attention_mask(all, naive)));
    CHECK(max_abs_diff(wrong[2].index({real[2]}), ref["logits"][2].index({real[2]})) > 1e-2);
  }
}

TEST_CASE("a packed row equals its documents run one by one") {
  torch::NoGradGuard no_grad;
  for (const char* name : kModels) {
    CAPTURE(name);
    auto m = load(name);
    auto ref = read_reference(name);
    auto ids = ref["packed_input_ids"], positions = ref["packed_position_ids"];
    auto hidden = m.model->forward(ids, positions, attention_mask(torch::ones_like(ids), positions));
    double err = max_abs_diff(m.model->logits(hidden), ref["packed_logits"]);
    MESSAGE(std::string(name) << " packed max abs error " << err);
    CHECK(err < 1e-4);
  }
}

TEST_CASE("decoding over the KV cache reproduces the full forward pass") {
  torch::NoGradGuard no_grad;
  for (const char* name : {"llama3", "qwen3"}) {
    CAPTURE(name);
    auto m = load(name);
    auto ids = read_reference(name)["input_ids"].select(0, 0).unsqueeze(0);  // the unpadded row (1, 12)
    const int64_t T = ids.size(1);
    auto full = m.model->logits(m.model->forward(ids, torch::arange(T).unsqueeze(0)));
    auto cache = KVCache::allocate(m.config, 1, T, torch::kFloat32);
    std::vector<torch::Tensor> steps;
    steps.push_back(m.model->logits(m.model->forward(ids.narrow(1, 0, 5), torch::arange(5).unsqueeze(0), {}, &cache)));
    for (int64_t t = 5; t < T; ++t)
      steps.push_back(m.model->logits(m.model->forward(ids.narrow(1, t, 1), torch::full({1, 1}, t), {}, &cache)));
    CHECK(cache.length == T);
    CHECK(max_abs_diff(torch::cat(steps, 1), full) < 1e-5);
  }
}

TEST_CASE("kept fused weights follow in-place weight changes, and autograd still reaches each projection") {
  auto kept = load("qwen2");  // q/k/v biases: the fused bias is kept too
  auto fresh = load("qwen2");
  kept.model->keep_fused_weights(true);
  auto ids = read_reference("qwen2")["input_ids"].select(0, 0).unsqueeze(0);
  auto positions = torch::arange(ids.size(1)).unsqueeze(0);
  auto logits = [&](LoadedModel& m) { return m.model->logits(m.model->forward(ids, positions)); };
  {
    torch::NoGradGuard no_grad;
    CHECK(torch::equal(logits(kept), logits(fresh)));
    // No copy is kept: the fused GEMMs read the parameters themselves, which now lie side by side.
    auto side_by_side = [](LoadedModel& m, std::vector<std::string> names) {
      auto params = m.model->named_parameters();
      for (size_t i = 1; i < names.size(); ++i) {
        const auto& a = params[names[i - 1]];
        const auto& b = params[names[i]];
        if (!a.storage().is_alias_of(b.storage()) || static_cast<char*>(a.data_ptr()) + a.nbytes() != b.data_ptr())
          return false;
      }
      return true;
    };
    const std::vector<std::string> qkv = {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                                          "model.layers.1.self_attn.v_proj.weight"};
    const std::vector<std::string> qkv_bias = {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
                                               "model.layers.0.self_attn.v_proj.bias"};
    const std::vector<std::string> gate_up = {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"};
    CHECK(side_by_side(kept, qkv));
    CHECK(side_by_side(kept, qkv_bias));
    CHECK(side_by_side(kept, gate_up));
    CHECK_FALSE(side_by_side(fresh, qkv));  // what loading gives: one tensor each
    // A step's worth of change, written in place into both (as an optimizer or update_weights does).
    torch::manual_seed(3);
    for (const char* name : {"model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.bias",
                             "model.layers.0.mlp.up_proj.weight"}) {
      auto delta = torch::randn_like(kept.model->named_parameters()[name]) * 0.05;
      kept.model->named_parameters()[name].add_(delta);
      fresh.model->named_parameters()[name].add_(delta);
    }
    auto after = logits(kept);
    CHECK(torch::equal(after, logits(fresh)));
    auto original = load("qwen2");
    CHECK(max_abs_diff(after, logits(original)) > 1e-3);  // the change is visible at all
  }
  // With autograd on, nothing is kept: gradients reach the projections' own weights.
  logits(kept).sum().backward();
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"}) {
    CAPTURE(name);
    auto grad = kept.model->named_parameters()[name].grad();
    REQUIRE(grad.defined());
    CHECK(grad.abs().sum().item<double>() > 0);
  }
}

TEST_CASE("kept weights (packed for oneDNN: float32, and bf16 where native) follow in-place weight changes") {
  torch::NoGradGuard no_grad;
  // float32 outputs differ from the plain path's by the order of summation; bf16 ones by rounding too.
  for (auto [dtype, tolerance] : {std::pair{torch::kFloat32, 1e-5}, std::pair{torch::kBFloat16, 0.02}}) {
    CAPTURE(dtype);
    auto kept = load("qwen2", dtype);
    auto fresh = load("qwen2", dtype);
    kept.model->keep_fused_weights(true);
    const bool packed = kernels::packed_linear_pays(kept.model->lm_head_weight(), dtype);
    const std::string path = std::string(c10::toString(dtype)) + (packed ? ": packed weights" : ": plain weights");
    MESSAGE(path);
    if (dtype == torch::kFloat32) CHECK(packed == at::hasMKLDNN());
    CHECK(kept.model->prepare_weights(dtype) == (packed ? 2 * 4 + 1 : 0));  // 2 layers of 4 GEMMs, LM head
    CHECK(kept.model->prepare_weights(dtype) == 0);  // current: nothing packed again
    auto ids = read_reference("qwen2")["input_ids"].select(0, 0).unsqueeze(0);
    auto positions = torch::arange(ids.size(1)).unsqueeze(0);
    auto logits = [&](LoadedModel& m) { return m.model->logits(m.model->forward(ids, positions)); };
    const double scale = logits(fresh).abs().max().item<double>();
    // Packed or not, the same weights: only the order of summation may differ.
    const double before = max_abs_diff(logits(kept), logits(fresh));
    MESSAGE("kept against plain: " << before << " (logit scale " << scale << ")");
    CHECK(before < tolerance * scale);
    torch::manual_seed(3);
    for (const char* name : {"model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.bias",
                             "model.layers.0.mlp.up_proj.weight", "lm_head.weight"}) {
      auto param = kept.model->named_parameters()[name];
      auto delta = (torch::randn(param.sizes()) * 0.2).to(dtype);
      param.add_(delta);
      fresh.model->named_parameters()[name].add_(delta);
    }
    auto after = logits(kept);
    auto original = load("qwen2", dtype);
    const double moved = max_abs_diff(after, logits(original)), followed = max_abs_diff(after, logits(fresh));
    const double changed_scale = logits(fresh).abs().max().item<double>();
    MESSAGE("after the change: " << followed << " from the changed model (logit scale " << changed_scale << "), "
                                 << moved << " from the original");
    CHECK(followed < tolerance * changed_scale);
    CHECK(moved > 5 * followed);  // the packed copies were made again, not read stale
  }
}

TEST_CASE("rows of one document without padding take the causal path, with the same logits") {
  torch::NoGradGuard no_grad;
  auto m = load("llama3");
  auto ids = read_reference("llama3")["input_ids"].select(0, 0).unsqueeze(0).repeat({2, 1});  // (2, 12), no padding
  auto ones = torch::ones_like(ids);
  auto positions = positions_from_mask(ones);
  CHECK_FALSE(attention_mask_unless_causal(ones, positions).defined());
  auto explicit_mask = m.model->logits(m.model->forward(ids, positions, attention_mask(ones, positions)));
  auto causal = m.model->logits(m.model->forward(ids, positions));
  CHECK(max_abs_diff(explicit_mask, causal) < 1e-5);
  // Padding, or a second document in a row, keeps the explicit mask.
  auto padded = ones.clone();
  padded[1][0] = 0;
  CHECK(attention_mask_unless_causal(padded, positions_from_mask(padded)).defined());
  auto packed = positions.clone();
  packed[0].narrow(0, 6, 6).copy_(torch::arange(6));
  CHECK(attention_mask_unless_causal(ones, packed).defined());
}

TEST_CASE("bfloat16 forward stays close to float32") {
  torch::NoGradGuard no_grad;
  auto m32 = load("qwen2");
  auto m16 = load("qwen2", torch::kBFloat16);
  auto ids = read_reference("qwen2")["input_ids"].select(0, 0).unsqueeze(0);
  auto pos = torch::arange(ids.size(1)).unsqueeze(0);
  auto a = m32.model->logits(m32.model->forward(ids, pos));
  auto b = m16.model->logits(m16.model->forward(ids, pos));
  CHECK((b.scalar_type() == torch::kBFloat16));
  double err = max_abs_diff(a, b);
  MESSAGE("bfloat16 vs float32 max abs error " << err << " (logit scale " << a.abs().max().item<double>() << ")");
  CHECK(err < 0.05 * a.abs().max().item<double>());
}

TEST_CASE("logits match transformers with the fused kernels (inference) and without them (autograd), on the CPU and a GPU") {
  // A model set up for inference (set_fused_kernels) runs RMSNorm, the residual add and RoPE as
  // kernels/fused.hpp's kernels without autograd (on a GPU where the build has them); with
  // autograd on, the same forward runs the plain ops.
  std::vector<torch::Device> devices = {torch::kCPU};
  if (torch::cuda::is_available())
    devices.emplace_back(torch::kCUDA, 0);
  else
    MESSAGE("GPU part skipped: no CUDA device here");
  for (const auto& device : devices) {
    for (const char* name : kModels) {
      CAPTURE(name);
      auto ref = read_reference(name);
      auto mask = ref["attention_mask"].to(device);
      auto positions = positions_from_mask(mask);
      auto ids = ref["input_ids"].to(device);
      auto real = ref["attention_mask"].to(torch::kBool);
      for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
        auto m = load_model(test::fixtures() / "hf_models" / name, {.dtype = dtype, .device = device, .tokenizer = false});
        m.model->set_fused_kernels(true);
        auto forward = [&](bool grad) {
          torch::AutoGradMode mode(grad);
          return m.model->logits(m.model->forward(ids, positions, attention_mask(mask, positions))).detach().cpu();
        };
        auto fused = forward(false), plain = forward(true);
        double err_fused = max_abs_diff(fused.index({real}), ref["logits"].index({real}));
        double err_plain = max_abs_diff(plain.index({real}), ref["logits"].index({real}));
        double scale = ref["logits"].abs().max().item<double>();
        const std::string what = std::string(name) + (dtype == torch::kFloat32 ? " float32 on " : " bfloat16 on ") + device.str();
        MESSAGE(what << ": max abs error, inference " << err_fused << ", autograd " << err_plain
                     << ", fused against plain " << max_abs_diff(fused, plain) << " (logit scale " << scale << ")");
        CHECK(err_fused < (dtype == torch::kFloat32 ? 1e-4 : 0.05 * scale));
        CHECK(err_plain < (dtype == torch::kFloat32 ? 1e-4 : 0.05 * scale));
        // The fused kernels did run: in float32 their sums of squares round otherwise (in bfloat16
        // the logits' rounding hides it).
        if (device.is_cpu() && dtype == torch::kFloat32) CHECK(max_abs_diff(fused, plain) > 0);
      }
    }
  }
}

TEST_CASE("parameter names are Hugging Face's") {
  auto m = load("qwen3");
  auto names = state_dict(*m.model);
  CHECK(names.count("model.embed_tokens.weight"));
  CHECK(names.count("model.layers.1.self_attn.q_norm.weight"));
  CHECK(names.count("model.layers.0.mlp.down_proj.weight"));
  CHECK(names.count("lm_head.weight"));
  CHECK(!load("llama_tied").model->named_parameters().contains("lm_head.weight"));
  CHECK(load("qwen2").model->named_parameters().contains("model.layers.0.self_attn.q_proj.bias"));
}

TEST_CASE("config.json errors name the file and the key") {
  auto dir = std::filesystem::temp_directory_path() / "troupe_test_config";
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& text) {
    std::ofstream(dir / "config.json") << text;
    return dir / "config.json";
  };
  CHECK_THROWS_WITH_AS(ModelConfig::from_file(write(R"({"architectures": ["MambaForCausalLM"]})")),
                       doctest::Contains("unknown architecture 'MambaForCausalLM'"), Error);
  CHECK_THROWS_WITH_AS(ModelConfig::from_file(write(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": "64"})")),
                       doctest::Contains("key 'vocab_size' is missing"), Error);
  CHECK_THROWS_WITH_AS(ModelConfig::from_file(write(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": "64"})")),
                       doctest::Contains("key 'hidden_size' must be an integer"), Error);
  CHECK_THROWS_WITH_AS(ModelConfig::from_file(write("{not json")), doctest::Contains("config.json: not valid JSON"), Error);
  CHECK_THROWS_WITH_AS(ModelConfig::from_file(dir / "missing.json"), doctest::Contains("missing.json: cannot open"), Error);
}

TEST_CASE("config.json nested deeper than any real config is an error naming the file (a tests/fuzz/ reproducer)") {
  // The config is kept whole and written back on save; copying it recursed once per level, and an
  // unused key nested 16k deep overflowed the stack.
  const auto path = test::source() / "tests/fuzz/regressions/model_config/deep_unused_key.json";
  const std::string message = path.string() + ": JSON nested 16385 levels deep (at most 64)";
  CHECK_THROWS_WITH_AS(ModelConfig::from_file(path), message.c_str(), Error);
}

TEST_CASE("config.json sizes past int32's range are errors naming the key (a tests/fuzz/ reproducer)") {
  // head_dim 2^62 with 4 heads was accepted: the attention layer's heads * head_dim overflowed int64.
  const auto path = test::source() / "tests/fuzz/regressions/model_config/heads_times_head_dim_overflow.json";
  const std::string message = path.string() + ": key 'head_dim' must be at most 2147483647, got 4611686018427387904";
  CHECK_THROWS_WITH_AS(ModelConfig::from_file(path), message.c_str(), Error);
}
