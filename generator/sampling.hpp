// Sampling parameters (vLLM's names), the plain next-token choice used by the reference
// generation loop (greedy, or temperature sampling with an explicit generator) and the
// engine's top-k / top-p / min-p truncation.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <torch/types.h>

#include "generator/sampling_params.hpp"

namespace troupe {

// logits [B, V] -> ids [B]; greedy when temperature == 0, else plain temperature sampling
// (the reference loop's sampler; the engine also applies top-k, top-p and min-p).
torch::Tensor sample_next(const torch::Tensor& logits, const SamplingParams& params, at::Generator& generator);

// Restricts one row of probabilities [V] to the tokens min-p, then top-k, then top-p keep
// (zeros elsewhere, not renormalized: the engine's sampler renormalizes). The log-prob the
// engine reports is taken before this truncation: it is log_softmax(logits / T), the quantity a
// trainer recomputes from the full vocabulary, so importance ratios compare like with like;
// truncation only decides which tokens can occur.
torch::Tensor truncate_probs(torch::Tensor probs, const SamplingParams& p);

}  // namespace troupe
