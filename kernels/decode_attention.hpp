// One decode step's attention on a CPU, over a KV cache in per-row mode (the engine's decode step):
// each batch row writes its new key and value into its own slot, then its query heads attend over
// the keys of its group's shared prefix, if it has one, and over its own keys so far, in one pass.
// Replaces ATen's path for this step: an index_put_ per cache, an additive float mask, CPU flash
// attention over each row's keys, the same again over each group's prefix, and the merge of the
// two by their log-sum-exps. Those were a dozen ops and two parallel regions per layer, whose
// small MKL GEMMs (3 query rows by 64) cost more in calls than in arithmetic.
#pragma once

#include <vector>

#include <torch/types.h>

namespace troupe::kernels {

// One shared prefix: its keys and values [1, nkv, P, hd], and the batch rows [G] (long) that
// start with it.
struct PrefixPart {
  torch::Tensor k, v, rows;
};

// Whether decode_attention takes queries of this dtype and device: float32 or bfloat16 on a CPU.
bool decode_attention_supports(const torch::Tensor& q);

// q [B, nh, 1, hd]: one query position per row; nh = nkv * g, the g query heads of key/value head
// h being h * g .. h * g + g - 1 (grouped-query attention). k_new, v_new [B, nkv, 1, hd]: the new
// token's key and value. cache_k, cache_v [>= B, nkv, capacity, hd]: row r's keys are
// cache_k[r, :, 0 .. write[r]]; write [B] long. All of q's dtype, the last dimension contiguous.
// Writes k_new and v_new at position write[r] of row r's slot, then returns [B, nh, 1, hd] in q's
// dtype: softmax(q k^T * scale) v over the row's prefix keys (if a part holds the row) followed
// by its keys [0, write[r]]. The parts' rows must be disjoint.
// Each (row, key/value head) is one task, spread over ATen's threads; a task reads each key once
// for its g query heads, and keeps a running maximum and sum (online softmax) in float32. With
// AVX2 and FMA, and hd a multiple of 8, vector loops and SLEEF's exp (as ATen's kernels have
// them); else plain loops.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                               const torch::Tensor& cache_k, const torch::Tensor& cache_v, const torch::Tensor& write,
                               const std::vector<PrefixPart>& prefixes, double scale);

}  // namespace troupe::kernels
