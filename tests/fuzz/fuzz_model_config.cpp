// ModelConfig::from_file on arbitrary config.json text: an accepted config holds what the model's
// constructors rely on, and the config.json that to_json writes on save loads back the same.
#include <cstdint>
#include <string>
#include <tuple>

#include "policy/error.hpp"
#include "policy/model_config.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using troupe::ModelConfig;
using troupe::fuzz::fail;

namespace {

bool fits_product(int64_t a, int64_t b) {
  int64_t p;
  return !__builtin_mul_overflow(a, b, &p);
}

void check_accepted(const ModelConfig& c) {
  const bool family = (c.architecture == "LlamaForCausalLM" && c.model_type == "llama") ||
                      (c.architecture == "Qwen2ForCausalLM" && c.model_type == "qwen2") ||
                      (c.architecture == "Qwen3ForCausalLM" && c.model_type == "qwen3");
  if (!family) fail("architecture '" + c.architecture + "' with model_type '" + c.model_type + "'");
  for (int64_t n : {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                    c.num_key_value_heads, c.max_position_embeddings})
    if (n < 1) fail("a size below 1: " + std::to_string(n));
  if (c.num_attention_heads % c.num_key_value_heads != 0) fail("num_key_value_heads does not divide num_attention_heads");
  // RoPE rotates pairs of a head's dimensions.
  if (c.head_dim < 2 || c.head_dim % 2 != 0) fail("head_dim " + std::to_string(c.head_dim) + " is not even and positive");
  // The attention layer sizes its projections as heads * head_dim in int64.
  if (!fits_product(c.num_attention_heads, c.head_dim) || !fits_product(c.num_key_value_heads, c.head_dim))
    fail("heads * head_dim overflows int64");
  const auto given = c.source.find("head_dim");
  if ((given == c.source.end() || given->is_null()) && c.head_dim * c.num_attention_heads != c.hidden_size)
    fail("head_dim was not given and is not hidden_size / num_attention_heads");
  if (c.rope_llama3 && !(c.rope_llama3->high_freq_factor > c.rope_llama3->low_freq_factor &&
                         c.rope_llama3->original_max_position_embeddings >= 1))
    fail("llama3 rope scaling with high_freq_factor <= low_freq_factor or no original length");
  if (c.qkv_bias != (c.model_type == "qwen2" || c.o_bias) || (c.model_type == "qwen2" && c.o_bias) ||
      c.qk_norm != (c.model_type == "qwen3") || (c.mlp_bias && c.model_type != "llama"))
    fail("bias or norm flags that the model_type does not have");
  if ((c.bos_token_id && *c.bos_token_id < 0) || (c.pad_token_id && *c.pad_token_id < 0))
    fail("a negative special token id");
  for (int64_t id : c.eos_token_ids)
    if (id < 0) fail("a negative eos_token_id");
}

bool same(const ModelConfig& a, const ModelConfig& b) {
  const auto rope = [](const ModelConfig& c) {
    const auto& s = *c.rope_llama3;
    return std::tuple(s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings);
  };
  return a.architecture == b.architecture && a.model_type == b.model_type && a.vocab_size == b.vocab_size &&
         a.hidden_size == b.hidden_size && a.intermediate_size == b.intermediate_size &&
         a.num_hidden_layers == b.num_hidden_layers && a.num_attention_heads == b.num_attention_heads &&
         a.num_key_value_heads == b.num_key_value_heads && a.head_dim == b.head_dim &&
         a.max_position_embeddings == b.max_position_embeddings && a.rms_norm_eps == b.rms_norm_eps &&
         a.rope_theta == b.rope_theta && a.rope_llama3.has_value() == b.rope_llama3.has_value() &&
         (!a.rope_llama3 || rope(a) == rope(b)) && a.tie_word_embeddings == b.tie_word_embeddings &&
         a.qkv_bias == b.qkv_bias && a.o_bias == b.o_bias && a.mlp_bias == b.mlp_bias && a.qk_norm == b.qk_norm &&
         a.bos_token_id == b.bos_token_id && a.eos_token_ids == b.eos_token_ids && a.pad_token_id == b.pad_token_id;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("config.json");
  static troupe::fuzz::MemFile saved("saved_config.json");
  ModelConfig c;
  try {
    c = ModelConfig::from_file(file.write(data, size));
  } catch (const troupe::Error&) {
    return 0;
  }
  check_accepted(c);
  // As save_hf_dir writes it and a later load reads it: through the text, where an infinite
  // number, say, is written as null.
  ModelConfig again;
  try {
    again = ModelConfig::from_file(saved.write(c.to_json().dump(2)));
  } catch (const troupe::Error& e) {
    fail(std::string("to_json wrote a config.json that does not load again: ") + e.what());
  }
  if (!same(again, c)) fail("the config reloaded from to_json differs from the one written");
  return 0;
}
