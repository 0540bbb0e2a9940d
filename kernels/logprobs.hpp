// Per-token log-probabilities of target ids under the LM head, computed chunk by chunk over
// the sequence so that no [B, T, vocab] logits tensor exists; with a plain reference version.
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace troupe::kernels {

// hidden [B, T, H], weight [V, H], targets [B, T] -> log p(targets) [B, T] in float32.
// `temperature` divides the logits first (the distribution a sampler drew from).
// Peak extra memory is one [B, chunk, V] slice.
torch::Tensor token_logprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                             const torch::Tensor& targets, double temperature = 1.0, int64_t chunk = 128);

// The same through full logits: the reference the chunked version is tested against.
torch::Tensor token_logprobs_reference(const torch::Tensor& hidden, const torch::Tensor& weight,
                                       const torch::Tensor& targets, double temperature = 1.0);

}  // namespace troupe::kernels
