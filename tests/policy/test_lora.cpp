// LoRA against PEFT: adapters PEFT made (make_lora_fixtures.py) give PEFT's logits here, and
// adapters we save give our logits in peft.PeftModel (check_peft_loads.py), both to 1e-4 in
// float32. Also: only adapters train, merging equals the unmerged model, bad folders are named.
#include <doctest/doctest.h>

#include <fstream>
#include <regex>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/lora.hpp"
#include "policy/safetensors.hpp"
#include "tests/test_util.hpp"

using namespace troupe;
namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kAll = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

fs::path model_dir(const std::string& name) { return test::fixtures() / "hf_models" / name; }

LoadedModel load(const std::string& name) { return load_model(model_dir(name), {.tokenizer = false}); }

std::map<std::string, torch::Tensor> read_tensors(const fs::path& path) {
  auto file = safetensors::File::open(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& v : file->tensors()) {
    auto dtype = v.dtype == safetensors::Dtype::F32 ? torch::kFloat32 : torch::kInt64;
    out[v.name] = torch::from_blob(const_cast<std::byte*>(v.data), v.shape, dtype).clone();
  }
  return out;
}

// The padded batch transformers' reference logits were made with (left, right, no padding).
struct Batch {
  torch::Tensor ids, mask, positions;
};
Batch reference_batch(const std::string& name) {
  auto ref = read_tensors(model_dir(name) / "reference.safetensors");
  return {ref["input_ids"], ref["attention_mask"], ref["position_ids"]};
}

torch::Tensor logits(TransformerImpl& model, const Batch& b) {
  return model.logits(model.forward(b.ids, b.positions, attention_mask(b.mask, b.positions)));
}

double max_abs_diff_real(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& mask) {
  auto real = mask.to(torch::kBool);
  return (a.index({real}).to(torch::kFloat64) - b.index({real}).to(torch::kFloat64)).abs().max().item<double>();
}

// Non-zero adapters, as after some training: A and B drawn from N(0, 0.1^2).
void randomize_adapters(TransformerImpl& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& [name, t] : lora_state_dict(model)) t.copy_(0.1 * torch::randn(t.sizes(), gen));
}

void write_tensors(const fs::path& path, const std::map<std::string, torch::Tensor>& tensors) {
  std::vector<torch::Tensor> keep;
  std::vector<safetensors::TensorRef> refs;
  for (const auto& [name, t] : tensors) {
    auto c = t.contiguous();
    keep.push_back(c);
    auto dtype = c.scalar_type() == torch::kFloat32 ? safetensors::Dtype::F32 : safetensors::Dtype::I64;
    refs.push_back({name, dtype, c.sizes().vec(), c.data_ptr(), c.nbytes()});
  }
  safetensors::write_file(path, refs);
}

template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

nlohmann::json read_json(const fs::path& path) { return nlohmann::json::parse(std::ifstream(path)); }
void write_json(const fs::path& path, const nlohmann::json& j) { std::ofstream(path) << j.dump(2); }

}  // namespace

TEST_CASE("adapters sit under their projections with PEFT's names; everything else is frozen") {
  auto m = load("qwen2");
  // attach_lora draws A from its own generator: the global one is left where it was.
  torch::manual_seed(5);
  auto expected_next = torch::rand({4});
  torch::manual_seed(5);
  LoraConfig config{.rank = 4, .alpha = 8, .target_modules = {"q_proj", "down_proj"}};
  attach_lora(*m.model, config, 11);
  CHECK(torch::equal(torch::rand({4}), expected_next));

  auto params = m.model->named_parameters();
  CHECK(params.contains("model.layers.0.self_attn.q_proj.lora_A.weight"));
  CHECK(params.contains("model.layers.1.mlp.down_proj.lora_B.weight"));
  CHECK(!params.contains("model.layers.0.self_attn.k_proj.lora_A.weight"));
  CHECK(params["model.layers.0.self_attn.q_proj.lora_A.weight"].sizes() == torch::IntArrayRef{4, 64});
  CHECK(params["model.layers.0.self_attn.q_proj.lora_B.weight"].sizes() == torch::IntArrayRef{64, 4});
  CHECK(params["model.layers.0.mlp.down_proj.lora_A.weight"].sizes() == torch::IntArrayRef{4, 96});
  for (const auto& p : params) {
    CAPTURE(p.key());
    CHECK(p.value().requires_grad() == is_lora_parameter(p.key()));
  }
  CHECK(lora_parameters(*m.model).size() == 2 * 2 * 2);  // A and B, two modules, two layers

  // A as PEFT draws it, U(-1/sqrt(in), 1/sqrt(in)), reproducible from the seed; B zero.
  auto A = params["model.layers.0.mlp.down_proj.lora_A.weight"];
  CHECK(A.abs().max().item<double>() <= 1.0 / std::sqrt(96.0));
  CHECK(A.abs().max().item<double>() > 0.8 / std::sqrt(96.0));
  CHECK(params["model.layers.0.mlp.down_proj.lora_B.weight"].abs().sum().item<double>() == 0.0);
  auto again = load("qwen2");
  attach_lora(*again.model, config, 11);
  CHECK(torch::equal(again.model->named_parameters()["model.layers.0.mlp.down_proj.lora_A.weight"], A));
  auto other = load("qwen2");
  attach_lora(*other.model, config, 12);
  CHECK(!torch::equal(other.model->named_parameters()["model.layers.0.mlp.down_proj.lora_A.weight"], A));

  // state_dict holds Hugging Face weights only, so it refuses rather than drop the adapters.
  CHECK_THROWS_WITH_AS(state_dict(*m.model), doctest::Contains("merged_state_dict()"), Error);
  CHECK_THROWS_WITH_AS(attach_lora(*m.model, config, 1), doctest::Contains("already has LoRA adapters"), Error);
  auto fresh = load("qwen2");
  CHECK_THROWS_WITH_AS(attach_lora(*fresh.model, {.target_modules = {"q_proj", "lm_head"}}, 1),
                       doctest::Contains("target module 'lm_head' matches none of the model's projections"), Error);
  CHECK_THROWS_WITH_AS(attach_lora(*fresh.model, {.rank = 0}, 1), doctest::Contains("rank must be positive"), Error);
  CHECK(!has_lora(*fresh.model));
}

TEST_CASE("with B = 0 the adapted model computes exactly the base model") {
  torch::NoGradGuard no_grad;
  for (const char* name : {"llama3", "qwen2", "qwen3", "llama_tied"}) {
    CAPTURE(name);
    auto m = load(name);
    auto batch = reference_batch(name);
    auto base = logits(*m.model, batch);
    attach_lora(*m.model, {.rank = 4, .alpha = 8, .target_modules = kAll}, 1);
    CHECK(torch::equal(logits(*m.model, batch), base));
    merge_lora(*m.model);
    CHECK(!has_lora(*m.model));
    CHECK(torch::equal(logits(*m.model, batch), base));
    auto reloaded = load(name);
    for (const auto& [key, t] : state_dict(*reloaded.model)) {
      CAPTURE(key);
      CHECK(torch::equal(state_dict(*m.model).at(key), t));
    }
  }
}

TEST_CASE("an optimizer step over all parameters changes only the adapters, and the loss falls") {
  torch::manual_seed(0);
  auto m = load("llama3");
  attach_lora(*m.model, {.rank = 4, .alpha = 8, .dropout = 0.1, .target_modules = kAll}, 3);
  m.model->train();
  std::map<std::string, torch::Tensor> base_before, lora_before;
  for (const auto& p : m.model->named_parameters())
    (is_lora_parameter(p.key()) ? lora_before : base_before)[p.key()] = p.value().detach().clone();

  // As the trainer does: the optimizer holds every parameter; frozen ones get no gradient.
  torch::optim::AdamW optimizer(m.model->parameters(), torch::optim::AdamWOptions(1e-2));
  auto ids = torch::randint(3, m.config.vocab_size, {4, 16}, torch::kLong);
  auto positions = torch::arange(16).expand({4, 16});
  std::vector<double> losses;
  for (int step = 0; step < 8; ++step) {
    optimizer.zero_grad();
    auto lg = m.model->logits(m.model->forward(ids.narrow(1, 0, 15), positions.narrow(1, 0, 15)));
    auto loss = torch::nn::functional::cross_entropy(lg.reshape({-1, lg.size(-1)}), ids.narrow(1, 1, 15).reshape(-1));
    loss.backward();
    for (const auto& p : m.model->named_parameters())
      if (!is_lora_parameter(p.key())) CHECK_MESSAGE(!p.value().grad().defined(), p.key());
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  MESSAGE("LoRA training loss " << losses.front() << " -> " << losses.back());
  CHECK(losses.back() < losses.front() - 0.05);
  auto after = m.model->named_parameters();
  for (const auto& [name, t] : base_before) {
    CAPTURE(name);
    CHECK(torch::equal(after[name], t));
  }
  CHECK(lora_before.size() == 2 * 7 * 2);
  for (const auto& [name, t] : lora_before) {
    CAPTURE(name);
    CHECK(!torch::equal(after[name], t));
  }
}

TEST_CASE("bfloat16: adapters take the model's dtype, train, and merge to within bfloat16 rounding") {
  auto m = load_model(model_dir("qwen3"), {.dtype = torch::kBFloat16, .tokenizer = false});
  attach_lora(*m.model, {.rank = 4, .alpha = 8, .target_modules = kAll}, 1);
  randomize_adapters(*m.model, 2);
  for (const auto& t : lora_parameters(*m.model)) CHECK((t.scalar_type() == torch::kBFloat16));
  auto batch = reference_batch("qwen3");
  auto lg = logits(*m.model, batch);
  lg.index({batch.mask.to(torch::kBool)}).to(torch::kFloat32).logsumexp(-1).sum().backward();
  for (const auto& t : lora_parameters(*m.model)) CHECK((t.grad().defined() && t.grad().abs().sum().item<double>() > 0));
  torch::NoGradGuard no_grad;
  merge_lora(*m.model);
  double err = max_abs_diff_real(logits(*m.model, batch), lg, batch.mask);
  double scale = lg.abs().max().item<double>();
  MESSAGE("bfloat16 merged vs unmerged max abs error " << err << " (logit scale " << scale << ")");
  CHECK(err < 0.05 * scale);
}

TEST_CASE("merging equals the unmerged adapters; merged_state_dict leaves the model as it is") {
  torch::NoGradGuard no_grad;
  for (const char* name : {"llama3", "qwen2", "qwen3", "llama_tied"}) {
    CAPTURE(name);
    auto m = load(name);
    auto batch = reference_batch(name);
    auto base = logits(*m.model, batch);
    LoraConfig config{.rank = 4, .alpha = 8, .target_modules = kAll};
    attach_lora(*m.model, config, 2);
    randomize_adapters(*m.model, 9);
    auto adapted = logits(*m.model, batch);
    double effect = max_abs_diff_real(adapted, base, batch.mask);
    CHECK(effect > 0.1);  // the adapters matter, so the comparisons below mean something

    // merged_state_dict into a fresh model, the generators' path.
    auto merged = merged_state_dict(*m.model);
    auto generator = load(name);
    CHECK(merged.size() == state_dict(*generator.model).size());
    load_weights(*generator.model, merged, "merged_state_dict");
    double err_sync = max_abs_diff_real(logits(*generator.model, batch), adapted, batch.mask);
    CHECK(has_lora(*m.model));
    CHECK(torch::equal(logits(*m.model, batch), adapted));

    // merge_lora in place.
    merge_lora(*m.model);
    CHECK(!has_lora(*m.model));
    for (const auto& p : m.model->named_parameters()) CHECK_MESSAGE(!is_lora_parameter(p.key()), p.key());
    double err_merge = max_abs_diff_real(logits(*m.model, batch), adapted, batch.mask);
    MESSAGE(std::string(name) << ": adapter effect " << effect << ", merged vs unmerged max abs error " << err_merge
                 << " (merge_lora), " << err_sync << " (merged_state_dict)");
    CHECK(err_merge <= 1e-5);
    CHECK(err_sync <= 1e-5);
    for (const auto& [key, t] : state_dict(*m.model)) CHECK(torch::equal(t, merged.at(key)));
  }
}

TEST_CASE("adapters made by PEFT give PEFT's logits, and save back to the same file") {
  torch::NoGradGuard no_grad;
  for (const char* name : {"llama3", "qwen2", "qwen3", "llama_tied"}) {
    CAPTURE(name);
    auto dir = test::fixtures() / "lora" / name;
    auto m = load(name);
    LoraConfig config = load_peft_adapter(*m.model, dir);
    auto ref = read_tensors(dir / "peft_logits.safetensors");
    Batch batch{ref["input_ids"], ref["attention_mask"], ref["position_ids"]};
    CHECK(torch::equal(positions_from_mask(batch.mask), batch.positions));
    double err = max_abs_diff_real(logits(*m.model, batch), ref["logits"], batch.mask);
    double effect = max_abs_diff_real(logits(*load(name).model, batch), ref["logits"], batch.mask);
    MESSAGE(std::string(name) << ": PEFT's adapter in troupe, max abs logit error " << err << " (adapter effect " << effect << ")");
    CHECK(err < 1e-4);
    CHECK(effect > 0.1);

    auto out = fs::temp_directory_path() / "troupe_test_lora_resave" / name;
    fs::remove_all(out);
    save_peft_adapter(*m.model, config, out, model_dir(name).string());
    auto theirs = safetensors::File::open(dir / "adapter_model.safetensors");
    auto ours = safetensors::File::open(out / "adapter_model.safetensors");
    REQUIRE(ours->tensors().size() == theirs->tensors().size());
    for (const auto& v : theirs->tensors()) {
      CAPTURE(v.name);
      const auto& w = ours->at(v.name);
      CHECK(w.shape == v.shape);
      CHECK(std::equal(v.data, v.data + v.nbytes, w.data, w.data + w.nbytes));
    }
    auto saved = read_json(out / "adapter_config.json");
    auto original = read_json(dir / "adapter_config.json");
    for (const char* key : {"peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "task_type"}) {
      CAPTURE(key);
      CHECK(saved[key] == original[key]);
    }
  }
}

TEST_CASE("peft.PeftModel loads the adapters we save and reproduces our logits") {
  const std::map<std::string, LoraConfig> configs = {
      {"llama3", {.rank = 4, .alpha = 8, .dropout = 0.05, .target_modules = kAll}},
      {"qwen2", {.rank = 8, .alpha = 16, .target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"}}},
      {"qwen3", {.rank = 2, .alpha = 4, .target_modules = {"mlp.up_proj", "gate_proj", "k_proj"}, .use_rslora = true}},
      {"llama_tied", {.rank = 6, .alpha = 3, .target_modules = {"v_proj", "o_proj", "down_proj"}}},
  };
  auto saved = test::fixtures() / "lora_saved";
  fs::remove_all(saved);
  std::map<std::string, double> effects;
  for (const auto& [name, config] : configs) {
    CAPTURE(name);
    auto m = load(name);
    auto batch = reference_batch(name);
    torch::NoGradGuard no_grad;
    auto base = logits(*m.model, batch);
    attach_lora(*m.model, config, 21);
    randomize_adapters(*m.model, 22);
    auto lg = logits(*m.model, batch);
    effects[name] = max_abs_diff_real(lg, base, batch.mask);
    save_peft_adapter(*m.model, config, saved / name, fs::absolute(model_dir(name)).string());
    write_tensors(saved / name / "troupe_logits.safetensors",
                  {{"input_ids", batch.ids}, {"attention_mask", batch.mask}, {"position_ids", batch.positions},
                   {"logits", lg}});
  }

  auto script = test::source() / "tests" / "policy" / "check_peft_loads.py";
  auto result = test::run_command(test::shell_quote(test::env_dir("TROUPE_PYTHON").string()) + " " +
                                  test::shell_quote(script.string()) + " " + test::shell_quote(saved.string()) + " 2>&1");
  MESSAGE(result.out);
  REQUIRE(result.status == 0);
  std::regex line(R"((\w+): peft_error (\S+) merged_error (\S+) adapter_effect (\S+))");
  int seen = 0;
  for (auto it = std::sregex_iterator(result.out.begin(), result.out.end(), line); it != std::sregex_iterator(); ++it) {
    std::string name = (*it)[1];
    CAPTURE(name);
    double err = std::stod((*it)[2]), merged_err = std::stod((*it)[3]), effect = std::stod((*it)[4]);
    CHECK(err < 1e-4);
    CHECK(merged_err < 1e-4);
    CHECK(effect > 0.1);
    CHECK(std::abs(effect - effects.at(name)) < 1e-3);  // PEFT sees the adapter's effect we see
    ++seen;
  }
  CHECK(seen == 4);
}

TEST_CASE("bad adapter folders give errors naming the file; the model is left as it was") {
  auto good = test::fixtures() / "lora" / "llama3";
  auto tmp = fs::temp_directory_path() / "troupe_test_lora_bad";
  fs::remove_all(tmp);
  auto copy = [&](const std::string& name) {
    auto dir = tmp / name;
    fs::create_directories(dir);
    fs::copy_file(good / "adapter_config.json", dir / "adapter_config.json");
    fs::copy_file(good / "adapter_model.safetensors", dir / "adapter_model.safetensors");
    return dir;
  };
  auto m = load("llama3");
  auto check_untouched = [&] {
    CHECK(!has_lora(*m.model));
    CHECK(m.model->named_parameters()["model.norm.weight"].requires_grad());
  };

  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, tmp / "nowhere"), doctest::Contains("nowhere: no such folder"), Error);

  auto no_config = copy("no_config");
  fs::remove(no_config / "adapter_config.json");
  auto no_config_error = (no_config / "adapter_config.json").string() + ": cannot open";
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, no_config), doctest::Contains(no_config_error.c_str()), Error);

  auto no_weights = copy("no_weights");
  fs::remove(no_weights / "adapter_model.safetensors");
  auto no_weights_error = (no_weights / "adapter_model.safetensors").string() + ": missing";
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, no_weights), doctest::Contains(no_weights_error.c_str()), Error);

  auto edit_config = [&](const std::string& name, auto edit) {
    auto dir = copy(name);
    auto j = read_json(dir / "adapter_config.json");
    edit(j);
    write_json(dir / "adapter_config.json", j);
    return dir;
  };
  auto prefix = edit_config("prefix", [](auto& j) { j["peft_type"] = "PREFIX_TUNING"; });
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, prefix),
                       doctest::Contains("adapter_config.json: peft_type is 'PREFIX_TUNING', troupe reads LORA"), Error);
  auto rank = edit_config("rank", [](auto& j) { j["r"] = 8; });
  auto rank_error = error_of([&] { load_peft_adapter(*m.model, rank); });
  CHECK_MESSAGE(rank_error.starts_with((rank / "adapter_model.safetensors").string() + ": rank mismatch: tensor 'base_model"),
                rank_error);
  CHECK_MESSAGE(rank_error.ends_with("' has rank 4 but adapter_config.json says r = 8"), rank_error);
  auto dora = edit_config("dora", [](auto& j) { j["use_dora"] = true; });
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, dora), doctest::Contains("adapter_config.json: use_dora true is not supported"),
                       Error);
  auto regex = edit_config("regex", [](auto& j) { j["target_modules"] = ".*proj"; });
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, regex), doctest::Contains("target_modules is a regular expression"),
                       Error);
  auto head = edit_config("head", [](auto& j) { j["target_modules"] = {"q_proj", "lm_head"}; });
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, head),
                       doctest::Contains("adapter_config.json: target module 'lm_head' matches none"), Error);
  auto narrow = edit_config("narrow", [](auto& j) { j["target_modules"] = {"q_proj"}; });
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, narrow),
                       doctest::Contains("', which adapter_config.json's target_modules do not target"), Error);

  auto edit_weights = [&](const std::string& name, auto edit) {
    auto dir = copy(name);
    auto tensors = read_tensors(dir / "adapter_model.safetensors");
    edit(tensors);
    write_tensors(dir / "adapter_model.safetensors", tensors);
    return dir;
  };
  auto unknown = edit_weights("unknown", [](auto& t) {
    t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch::zeros({4, 64});
  });
  auto unknown_error = (unknown / "adapter_model.safetensors").string() +
                       ": tensor 'base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight' is for module "
                       "'model.layers.7.self_attn.q_proj', which the LlamaForCausalLM model does not have";
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, unknown), doctest::Contains(unknown_error.c_str()), Error);
  auto missing = edit_weights("missing", [](auto& t) { t.erase("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"); });
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, missing),
                       doctest::Contains("missing tensors: base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"),
                       Error);
  auto shape = edit_weights("shape", [](auto& t) {
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = torch::zeros({63, 4});
  });
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, shape),
                       doctest::Contains("q_proj.lora_B.weight' is [63, 4], the model needs [64, 4]"), Error);
  auto stray = edit_weights("stray", [](auto& t) { t["lm_head.weight"] = torch::zeros({2}); });
  CHECK_THROWS_WITH_AS(load_peft_adapter(*m.model, stray), doctest::Contains("tensor 'lm_head.weight' is not a LoRA weight"),
                       Error);
  check_untouched();

  // Into a model that already has adapters: same modules and rank, or a clear refusal.
  auto attached = load("llama3");
  attach_lora(*attached.model, {.rank = 2, .alpha = 4, .target_modules = kAll}, 1);
  CHECK_THROWS_WITH_AS(load_peft_adapter(*attached.model, good),
                       doctest::Contains("adapter_config.json: rank mismatch: r = 4 but the model's adapter on "
                                         "model.layers.0.self_attn.q_proj has rank 2"),
                       Error);
  auto same = load("llama3");
  attach_lora(*same.model, {.rank = 4, .alpha = 1, .target_modules = kAll}, 1);
  load_peft_adapter(*same.model, good);
  auto fresh = load("llama3");
  load_peft_adapter(*fresh.model, good);
  torch::NoGradGuard no_grad;
  auto batch = reference_batch("llama3");
  CHECK(torch::equal(logits(*same.model, batch), logits(*fresh.model, batch)));

  CHECK_THROWS_WITH_AS(save_peft_adapter(*fresh.model, {.rank = 4, .alpha = 16, .target_modules = kAll}, tmp / "out"),
                       doctest::Contains("the config says r = 4 and scale 4"), Error);
  CHECK_THROWS_WITH_AS(save_peft_adapter(*fresh.model, {.rank = 4, .alpha = 8, .target_modules = {"q_proj"}}, tmp / "out"),
                       doctest::Contains("has an adapter the config does not target"), Error);
}

TEST_CASE("adapter_config.json nested deeper than PEFT writes is an error naming the file (a tests/fuzz/ reproducer)") {
  // A refused option is quoted with dump(), which recursed once per level: a "bias" nested 16k
  // deep overflowed the stack.
  const auto path = test::source() / "tests/fuzz/regressions/adapter_config/deep_bias.json";
  const std::string message = path.string() + ": JSON nested 16385 levels deep (at most 64)";
  CHECK_THROWS_WITH_AS(read_adapter_config(path), message.c_str(), Error);
}
