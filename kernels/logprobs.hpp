// Per-token log-probabilities of target ids under the LM head, computed chunk by chunk over
// the sequence so that no [B, T, vocab] logits tensor exists, in the forward pass or the
// backward pass; with a plain full-logits reference it is tested against.
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace troupe::kernels {

// hidden [B, T, H], weight [V, H], targets [B, T] -> log p(targets) [B, T] in float32, where
// p = softmax(hidden @ weight^T / temperature). Differentiable in hidden and weight: the
// backward pass recomputes each chunk's logits instead of keeping them, so peak extra
// memory is one [B, chunk, V] slice in both directions.
torch::Tensor token_logprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                             const torch::Tensor& targets, double temperature = 1.0, int64_t chunk = 128);

// The same without autograd through the batch-invariant kernels (kernels/batch_invariant.hpp):
// each row's log-probs are bit for bit an engine's that sampled them with the same weights.
// CPU, float32 or float64.
torch::Tensor token_logprobs_invariant(const torch::Tensor& hidden, const torch::Tensor& weight,
                                       const torch::Tensor& targets, double temperature = 1.0, int64_t chunk = 128);

// The same through full logits and autograd: the reference.
torch::Tensor token_logprobs_reference(const torch::Tensor& hidden, const torch::Tensor& weight,
                                       const torch::Tensor& targets, double temperature = 1.0);

}  // namespace troupe::kernels
