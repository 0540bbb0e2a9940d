// Checkpoint round trips: load, save, load gives identical tensors; saved folders carry our
// logits so that tests/policy/check_hf_loads_saved.py can show transformers reproduces them.
#include <doctest/doctest.h>

#include <fstream>

#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "tests/test_util.hpp"

using namespace troupe;
namespace fs = std::filesystem;

namespace {

fs::path saved_dir() { return test::fixtures() / "saved"; }

LoadedModel load(const fs::path& path, torch::Dtype dtype = torch::kFloat32) {
  return load_model(path, {.dtype = dtype, .tokenizer = false});
}

void check_same_tensors(TransformerImpl& a, TransformerImpl& b) {
  auto sa = state_dict(a), sb = state_dict(b);
  REQUIRE(sa.size() == sb.size());
  for (const auto& [name, t] : sa) {
    CAPTURE(name);
    REQUIRE(sb.count(name));
    CHECK(torch::equal(t, sb.at(name)));
  }
}

// Our logits for a padded batch, stored beside a saved model for the Python check.
void write_logits(TransformerImpl& model, const fs::path& dir, int64_t vocab) {
  torch::NoGradGuard no_grad;
  auto ids = torch::randint(3, vocab, {2, 10}, torch::TensorOptions().dtype(torch::kLong));
  auto mask = torch::ones({2, 10}, torch::kLong);
  mask[1].narrow(0, 0, 3).zero_();  // left padding on row 1
  ids.masked_fill_(mask == 0, 0);
  auto positions = positions_from_mask(mask);
  auto logits = model.logits(model.forward(ids, positions, attention_mask(mask, positions))).contiguous();
  std::vector<safetensors::TensorRef> refs = {
      {"input_ids", safetensors::Dtype::I64, ids.sizes().vec(), ids.data_ptr(), ids.nbytes()},
      {"attention_mask", safetensors::Dtype::I64, mask.sizes().vec(), mask.data_ptr(), mask.nbytes()},
      {"position_ids", safetensors::Dtype::I64, positions.sizes().vec(), positions.data_ptr(), positions.nbytes()},
      {"logits", safetensors::Dtype::F32, logits.sizes().vec(), logits.data_ptr(), logits.nbytes()},
  };
  safetensors::write_file(dir / "troupe_logits.safetensors", refs);
}

}  // namespace

TEST_CASE("load, save, load gives identical tensors; the saved folder carries our logits") {
  torch::manual_seed(0);
  for (const char* name : {"llama3", "qwen2", "qwen3", "llama_tied"}) {
    CAPTURE(std::string(name));
    auto original = load(test::fixtures() / "hf_models" / name);
    auto out = saved_dir() / name;
    fs::remove_all(out);
    save_hf_dir(original, out);
    CHECK(fs::exists(out / "config.json"));
    CHECK(fs::exists(out / "generation_config.json"));
    CHECK(fs::exists(out / "model.safetensors"));
    auto again = load(out);
    check_same_tensors(*original.model, *again.model);
    CHECK(again.config.architecture == original.config.architecture);
    write_logits(*again.model, out, again.config.vocab_size);
  }
}

TEST_CASE("sharded save writes an index and loads back identically") {
  auto original = load(test::fixtures() / "hf_models" / "qwen3");
  auto out = saved_dir() / "qwen3_sharded";
  fs::remove_all(out);
  save_hf_dir(original, out, {.max_shard_bytes = 100 * 1024});
  CHECK(fs::exists(out / "model.safetensors.index.json"));
  CHECK(!fs::exists(out / "model.safetensors"));
  auto again = load(out);
  check_same_tensors(*original.model, *again.model);
}

TEST_CASE("bfloat16 save halves the file and rounds like a cast") {
  auto original = load(test::fixtures() / "hf_models" / "llama_tied");
  auto out = saved_dir() / "llama_tied_bf16";
  fs::remove_all(out);
  save_hf_dir(original, out, {.dtype = torch::kBFloat16});
  auto again = load(out);
  auto a = state_dict(*original.model), b = state_dict(*again.model);
  for (const auto& [name, t] : a) CHECK(torch::equal(t.to(torch::kBFloat16).to(torch::kFloat32), b.at(name)));
  auto size32 = fs::file_size(saved_dir() / "llama_tied" / "model.safetensors");
  auto size16 = fs::file_size(out / "model.safetensors");
  CHECK(size16 < size32 * 0.6);
}

TEST_CASE("weights that do not fit the config are named") {
  auto m = load(test::fixtures() / "hf_models" / "qwen2");
  auto weights = state_dict(*m.model);
  auto missing = weights;
  missing.erase("model.layers.1.mlp.up_proj.weight");
  CHECK_THROWS_WITH_AS(load_weights(*m.model, missing, "x/model.safetensors"),
                       doctest::Contains("x/model.safetensors: weights do not fit the Qwen2ForCausalLM config; "
                                         "missing tensors: model.layers.1.mlp.up_proj.weight"),
                       Error);
  auto extra = weights;
  extra["model.layers.9.mlp.up_proj.weight"] = torch::zeros({2});
  CHECK_THROWS_WITH_AS(load_weights(*m.model, extra, "x"), doctest::Contains("unexpected tensors: model.layers.9"),
                       Error);
  auto wrong = weights;
  wrong["model.norm.weight"] = torch::zeros({3});
  CHECK_THROWS_WITH_AS(load_weights(*m.model, wrong, "x"),
                       doctest::Contains("shape mismatch: model.norm.weight is [3] in the file, [64] in the model"), Error);
}

TEST_CASE("paths that are not models give clear errors") {
  auto dir = fs::temp_directory_path() / "troupe_test_not_a_model";
  fs::create_directories(dir);
  CHECK_THROWS_WITH_AS(load(dir / "nothing_here"), doctest::Contains("nothing_here: no such file or folder"), Error);
  CHECK_THROWS_WITH_AS(load(dir), doctest::Contains("config.json: cannot open"), Error);
  std::ofstream(dir / "notes.txt") << "hello";
  CHECK_THROWS_WITH_AS(load(dir / "notes.txt"), doctest::Contains("notes.txt: not a model"), Error);
  CHECK_THROWS_WITH_AS(load_config(dir / "nothing_here"), doctest::Contains("nothing_here: no such file or folder"), Error);
  CHECK_THROWS_WITH_AS(load_config(dir), doctest::Contains("config.json: cannot open"), Error);
  CHECK_THROWS_WITH_AS(load_config(dir / "notes.txt"), doctest::Contains("notes.txt: not a model"), Error);
}

TEST_CASE("the SmolLM2 GGUF converts to a Hugging Face folder") {
  auto gguf = load(test::smollm2_gguf());
  CHECK(gguf.config.architecture == "LlamaForCausalLM");
  CHECK(gguf.config.tie_word_embeddings);
  auto out = saved_dir() / "smollm2";
  fs::remove_all(out);
  save_hf_dir(gguf, out);
  CHECK(fs::exists(out / "tokenizer.json"));
  CHECK(fs::exists(out / "tokenizer_config.json"));
  auto again = load(out);
  check_same_tensors(*gguf.model, *again.model);
  // The config alone, from the GGUF's metadata and from the folder's config.json, is the loaded model's.
  for (const auto& path : {test::smollm2_gguf(), out}) {
    CAPTURE(path);
    const auto c = load_config(path);
    CHECK(c.architecture == gguf.config.architecture);
    CHECK(c.vocab_size == gguf.config.vocab_size);
    CHECK(c.hidden_size == gguf.config.hidden_size);
    CHECK(c.intermediate_size == gguf.config.intermediate_size);
    CHECK(c.num_hidden_layers == gguf.config.num_hidden_layers);
    CHECK(c.num_attention_heads == gguf.config.num_attention_heads);
    CHECK(c.num_key_value_heads == gguf.config.num_key_value_heads);
    CHECK(c.head_dim == gguf.config.head_dim);
    CHECK(c.rms_norm_eps == gguf.config.rms_norm_eps);
    CHECK(c.rope_theta == gguf.config.rope_theta);
    CHECK(c.tie_word_embeddings == gguf.config.tie_word_embeddings);
    CHECK(c.eos_token_ids == gguf.config.eos_token_ids);
  }
  torch::manual_seed(1);
  write_logits(*again.model, out, again.config.vocab_size);
}
