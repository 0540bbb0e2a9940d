// Parity of the transformer with Hugging Face transformers: tiny random models saved by
// tests/policy/make_hf_models.py, logits recorded by transformers for a padded batch and a
// packed row, matched here to 1e-4 in float32.
#include <doctest/doctest.h>

#include <fstream>

#include <torch/torch.h>

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
