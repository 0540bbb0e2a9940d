// LoRA on the transformer's projections, in PEFT's format: attach adapters, hand their
// parameters to the optimizer, merge them into the base weights, save and load adapter folders
// (adapter_config.json + adapter_model.safetensors) that peft.PeftModel.from_pretrained loads.
// Plain LoRA on q/k/v/o and gate/up/down only: no DoRA, no per-module rank or alpha patterns,
// no LoRA on embeddings or lm_head, one adapter per model.
//
// The adapters live in the module tree under their projection, so named_parameters() shows
// `model.layers.0.self_attn.q_proj.lora_A.weight`, PEFT's file key less `base_model.model.`.
// state_dict() (policy/checkpoint.hpp) holds Hugging Face weights only and refuses a model with
// adapters attached, so that no caller ships base weights believing they carry the adapter:
// merged_state_dict() is what generators and save_hf_dir-style exports take.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <torch/types.h>

#include "policy/lora_config.hpp"
#include "policy/transformer.hpp"

namespace troupe {

// True for the adapter parameters' names (`...q_proj.lora_A.weight`, `...lora_B.weight`).
bool is_lora_parameter(std::string_view name);

// Adds an adapter to every projection the config targets and freezes every other parameter
// (requires_grad false), as PEFT's get_peft_model does. A is drawn as PEFT draws it
// (kaiming_uniform_ with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) from a generator seeded with
// `seed`, so the global RNG is left alone; B is zero, so the model's output is unchanged.
// Adapters take the base weights' dtype and device. Throws Error if adapters are attached.
void attach_lora(TransformerImpl& model, const LoraConfig& config, uint64_t seed);

bool has_lora(const TransformerImpl& model);

// A then B of each adapted projection, in module order: what the optimizer should get.
std::vector<torch::Tensor> lora_parameters(TransformerImpl& model);

// The adapters as name -> the live parameter (`model.layers.0.self_attn.q_proj.lora_A.weight`);
// copy_ into them under NoGradGuard to set an adapter explicitly.
std::map<std::string, torch::Tensor> lora_state_dict(const TransformerImpl& model);

// Folds B A * scale into each adapted base weight (in float32 or wider, rounded once to the
// weight's dtype) and removes the adapters: a plain model again, state_dict() works. The base
// parameters stay frozen.
void merge_lora(TransformerImpl& model);

// The Hugging Face weights with the adapters folded in, leaving the model as it is: adapted
// weights are fresh tensors, the others the (detached) parameters themselves. Same names as
// state_dict() (tied lm_head left out); equals state_dict() for a model without adapters.
std::map<std::string, torch::Tensor> merged_state_dict(const TransformerImpl& model);

// Writes dir/adapter_config.json (PEFT's LoraConfig fields) and dir/adapter_model.safetensors
// (keys `base_model.model.<module>.lora_A.weight`, in the adapters' dtype) as PeftModel's
// save_pretrained does. `config` must be the one the adapters were attached with (checked
// against their rank, scale and modules). An empty base_model_name_or_path is written as null.
void save_peft_adapter(const TransformerImpl& model, const LoraConfig& config, const std::filesystem::path& dir,
                       const std::string& base_model_name_or_path = "");

// Reads a PEFT LoRA adapter folder into the model: attaches its adapters when the model has
// none, or overwrites adapters attached with the same modules and rank. Checks everything
// before changing the model; errors name the file: missing files, peft_type other than LORA,
// unsupported options (DoRA, rank_pattern, bias, ...), tensors for modules the model lacks or
// the config does not target, missing tensors, rank or shape mismatches. Returns the config.
LoraConfig load_peft_adapter(TransformerImpl& model, const std::filesystem::path& dir);

}  // namespace troupe
