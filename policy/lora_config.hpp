// LoRA's settings and PEFT's adapter_config.json, apart from the adapters themselves
// (policy/lora.hpp) so that the config parser builds without LibTorch (the fuzz harnesses).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace troupe {

struct LoraConfig {
  int64_t rank = 8;      // r: more capacity, more memory
  double alpha = 16.0;   // lora_alpha: the adapter's term is scaled by alpha / r
  double dropout = 0.0;  // lora_dropout on the adapter's input, in training mode only
  // HF module names, matched as PEFT does: equal to a module's name or a dotted suffix of it
  // ("q_proj" matches model.layers.3.self_attn.q_proj). Each must match some projection.
  std::vector<std::string> target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  bool use_rslora = false;  // scale by alpha / sqrt(r) instead (rank-stabilised LoRA)

  double scale() const;   // alpha / r, or alpha / sqrt(r)
  void validate() const;  // throws Error naming the field and the value
};

// An adapter_config.json, as load_peft_adapter reads it: every problem is an Error naming the file
// (not a JSON object, peft_type other than LORA, options such as DoRA or rank_pattern, bad fields).
LoraConfig read_adapter_config(const std::filesystem::path& path);

}  // namespace troupe
