// Loading a model from a Hugging Face folder or a GGUF file, and saving a Hugging Face folder
// that transformers loads. Parameters match name for name; GGUF is the one place names and
// layouts are translated (policy/gguf.hpp).
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "policy/model_config.hpp"
#include "policy/tokenizer.hpp"
#include "policy/transformer.hpp"

namespace troupe {

namespace safetensors { class Checkpoint; }

struct LoadOptions {
  torch::Dtype dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  bool tokenizer = true;  // also load the tokenizer (and its chat template)
};

struct LoadedModel {
  ModelConfig config;
  Transformer model{nullptr};
  std::optional<Tokenizer> tokenizer;
  nlohmann::json generation_config;  // generation_config.json, or null
  std::filesystem::path source;      // the folder or .gguf file it came from
};

// A Hugging Face folder (config.json, safetensors weights, tokenizer files) or a .gguf file.
// Errors name the file and what is wrong (missing or unexpected tensors, shape mismatches).
LoadedModel load_model(const std::filesystem::path& path, const LoadOptions& options = {});
// The same source's config alone (config.json, or the GGUF's metadata), without its weights.
ModelConfig load_config(const std::filesystem::path& path);

// Copies every parameter from `weights` name for name (converting dtype); throws Error
// listing missing, unexpected or mis-shaped tensors. `origin` names the source in errors.
// LoRA adapters are left as they are: only the Hugging Face weights under them are loaded.
void load_weights(TransformerImpl& model, const std::map<std::string, torch::Tensor>& weights,
                  const std::string& origin);
std::map<std::string, torch::Tensor> read_safetensors(const safetensors::Checkpoint& checkpoint);
// One .safetensors file of named tensors, each in its own dtype; returns the data bytes written.
int64_t write_safetensors(const std::filesystem::path& file, const std::map<std::string, torch::Tensor>& tensors);
std::map<std::string, torch::Tensor> read_safetensors_file(const std::filesystem::path& file);

struct SaveOptions {
  torch::Dtype dtype = torch::kFloat32;  // float32, bfloat16 or float16 on disk
  size_t max_shard_bytes = size_t{5} << 30;
};

// Writes config.json, generation_config.json (when known), model.safetensors (or shards)
// and the tokenizer files, as save_pretrained does.
void save_hf_dir(const LoadedModel& model, const std::filesystem::path& dir, const SaveOptions& options = {});

// The parameters as name -> tensor, with HF names (tied lm_head left out, as HF saves it).
// Throws Error for a model with LoRA adapters attached rather than hand out base weights
// that silently lack them: see merged_state_dict() and lora_state_dict() in policy/lora.hpp.
std::map<std::string, torch::Tensor> state_dict(const TransformerImpl& model);

}  // namespace troupe
