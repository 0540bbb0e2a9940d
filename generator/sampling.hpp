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

// The same for a batch, each row [R, V] with its own parameters (params[r]), in a fixed number
// of whole-batch ops (one sort): no launch per row on an accelerator. Rows whose parameters cut
// nothing come back unchanged; so does the whole batch when no row cuts anything.
torch::Tensor truncate_rows(torch::Tensor probs, const std::vector<const SamplingParams*>& params);

// Gumbel noise [R, V] on `device`, -log(-log(u)), with row r's uniforms a function of
// (seeds[r], counters[r], token id) alone: a counter-based hash (two rounds of a 32-bit
// integer mixer keyed by the row's splitmix64(seed, counter), computed in int64 without
// overflow), so a row's draw depends on neither the batch around it nor the device, and the
// whole batch takes a fixed number of element-wise ops. u has 23 random bits, centred in
// (0, 1). The engine's sampler on accelerators; counters[r] is the sequence's token index.
torch::Tensor hashed_gumbel(const std::vector<uint64_t>& seeds, const std::vector<int64_t>& counters, int64_t vocab,
                            torch::Device device);

}  // namespace troupe
