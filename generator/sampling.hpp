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

namespace troupe {

// vLLM's sampling fields and meanings, where troupe supports them.
struct SamplingParams {
  int64_t n = 1;             // samples of the prompt; they share one prefill
  double temperature = 1.0;  // 0 means greedy
  double top_p = 1.0;        // nucleus: keep the smallest set of tokens with mass >= top_p
  int64_t top_k = -1;        // keep the k most likely tokens; -1 (or 0) keeps all
  double min_p = 0.0;        // drop tokens below min_p x the top token's probability
  int64_t max_tokens = 16;   // new tokens at most
  std::vector<int32_t> stop_token_ids;  // besides the model's end-of-sequence ids
  std::vector<std::string> stop;        // stop strings (need a tokenizer)
  bool include_stop_str_in_output = false;
  bool ignore_eos = false;              // do not stop at the model's end-of-sequence ids
  std::optional<uint64_t> seed;         // reproduces the samples whatever else is in the batch
};

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
