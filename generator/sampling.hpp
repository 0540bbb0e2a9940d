// Choosing the next token from logits: greedy, or temperature sampling with an explicit
// generator so a seed reproduces a run. Top-p/top-k/min-p and batching come with the engine.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Generator.h>
#include <torch/types.h>

namespace troupe {

struct SamplingParams {
  double temperature = 0.0;  // 0 means greedy
  int64_t max_tokens = 128;
  uint64_t seed = 0;
};

// logits [B, V] -> ids [B]; greedy when temperature == 0.
torch::Tensor sample_next(const torch::Tensor& logits, const SamplingParams& params, at::Generator& generator);

}  // namespace troupe
