// The model hyperparameters troupe needs, read from a Hugging Face config.json (the
// transformers 4 and 5 spellings of RoPE settings both). Architectures outside the
// decoder-only Llama/Qwen2/Qwen3 family are rejected by name rather than half-supported.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace troupe {

// rope_type "llama3": low frequencies slowed by `factor`, a smooth ramp between.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
  std::string model_type;    // "llama", "qwen2", "qwen3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // explicit in Qwen3 (may differ from hidden_size / heads)
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<Llama3RopeScaling> rope_llama3;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2 always; Llama and Qwen3 when attention_bias
  bool o_bias = false;    // Llama and Qwen3 when attention_bias
  bool mlp_bias = false;  // Llama's mlp_bias
  bool qk_norm = false;   // Qwen3: RMSNorm over each head of q and k before RoPE
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // config.json allows one id or a list
  std::optional<int64_t> pad_token_id;

  nlohmann::json source;  // the JSON this came from, written back on save

  // `origin` names the file in errors: "<origin>: key 'hidden_size' ...".
  static ModelConfig from_json(const nlohmann::json& json, std::string_view origin);
  static ModelConfig from_file(const std::filesystem::path& config_json);
  nlohmann::json to_json() const;  // config.json content for save_pretrained-style output
};

}  // namespace troupe
