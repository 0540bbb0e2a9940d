// Decode attention over key/value prefixes that groups of batch rows share (a GRPO group's
// prompt, held once): the prefix half of the engine's shared-prefix decode step, whose other
// half (each row's own keys) and log-sum-exp merge are in policy/transformer.cpp.
#pragma once

#include <utility>
#include <vector>

#include <torch/types.h>

namespace troupe::kernels {

// One shared prefix: its keys and values [1, nkv, P, hd], and the batch rows [G] (long) that
// start with it.
struct PrefixPart {
  torch::Tensor k, v, rows;
};

// q [B, nkv, g, hd]: each key/value head's g query heads (grouped-query attention), one query
// position per row. For each part, the query heads of all its rows go through the prefix's keys
// together, as one [1, nkv, G * g, hd] query (ATen's CPU flash attention), so each prefix is
// read once per step.
// Returns (out [B, nkv, g, hd], lse [B, nkv, g]), both float32: softmax(q k^T * scale) v over
// the row's prefix, and the log-sum-exp of its scores. Rows in no part: out 0, lse -inf. The
// parts' rows must be disjoint.
// The parts are spread over ATen's threads, each part's ops on one thread: one parallel region
// per call instead of one per op and part, whose barriers cost more than a part's arithmetic.
std::pair<torch::Tensor, torch::Tensor> prefix_attention(const torch::Tensor& q, const std::vector<PrefixPart>& parts,
                                                         double scale);

}  // namespace troupe::kernels
