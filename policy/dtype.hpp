// The floating-point type a model's weights and compute use, chosen from a name: float32,
// bfloat16, float16, float64 (exactness checks), or auto (bfloat16 only where the device computes it natively). One
// place for every command (troupe run's model.dtype, --dtype of generate, serve and eval).
#pragma once

#include <string>
#include <string_view>

#include <torch/types.h>

namespace troupe {

struct DtypeChoice {
  torch::Dtype dtype = torch::kFloat32;
  // One line for the log: what auto chose and why, or a warning that an explicit choice
  // will be slow here; empty when there is nothing to say (an explicit, native choice).
  std::string note;
  bool warning = false;  // `note` is a warning (bf16 or fp16 emulated on this CPU)
};

// `key` names the setting in errors and notes ("model.dtype", "--dtype"). Throws Error for
// a name that is none of the four. auto: bfloat16 on CUDA and on CPUs with AVX-512 BF16 or
// AMX (kernels/cpu_features.hpp), float32 elsewhere.
DtypeChoice choose_dtype(std::string_view name, const torch::Device& device, std::string_view key);

}  // namespace troupe
