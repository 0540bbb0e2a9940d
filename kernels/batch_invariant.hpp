// Batch-invariant CPU kernels: each output element (or row) is one fixed sequence of float
// operations that depends only on its own inputs and the reduction length, never on the batch.
// No autograd, no CUDA, no bfloat16: for no-grad log-prob recomputation that must equal decoding.
#pragma once

#include <utility>

#include <torch/types.h>

namespace troupe::kernels {

// Why: MKL/oneDNN GEMMs, SDPA and ATen reductions pick accumulation orders by shape, so a row
// decoded alone (KV cache, M = batch) and the same row inside a full forward pass (M = B * T)
// differ in the last bits. Here the order is a function of the reduction length only, the same
// for every row count, row position, thread count and tile, so the two agree bit for bit.
//
// Common contract: CPU tensors of float32 or float64 (all of one dtype), any leading batch
// dims, any strides (made contiguous inside). There is no backward: callers run these under
// torch::NoGradGuard; an input that requires grad while grad mode is on is refused.
//
// The dot product used by bi_linear, bi_rms_norm and bi_attention ("the lane dot"), for
// length K and L = 16 lanes (float32) or 8 lanes (float64):
//   acc[l] = 0; for k < K - K % L, in steps of L: acc[l] = fma(a[k + l], b[k + l], acc[l]);
//   combine: for w = L/2, L/4, ..., 1: acc[l] = acc[l] + acc[l + w] (l < w); s = acc[0];
//   tail: for k = K - K % L .. K-1 in order: s = fma(a[k], b[k], s).
// AVX-512, AVX2+FMA and portable code compute exactly this (the path is picked once per
// process from cpuid; TROUPE_BI_ISA=portable|avx2|avx512 forces a lower one, for tests).

// x [..., K], weight [N, K] (nn::Linear layout), bias [N] or undefined -> [..., N].
// out[m, n] = lane_dot(x[m, :], weight[n, :], K) + bias[n] (one rounding for the add).
torch::Tensor bi_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

// x [..., D], weight [D] -> [..., D], Hugging Face LlamaRMSNorm in x's dtype:
// var = lane_dot(x, x, D) / D; r = 1 / sqrt(var + eps); out = weight * (x * r).
torch::Tensor bi_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// gate, up [...] (same shape) -> silu(gate) * up, silu(g) = g / (1 + exp(-g)) with scalar
// std::exp for every element.
torch::Tensor bi_silu_mul(const torch::Tensor& gate, const torch::Tensor& up);

// positions [B, T] int64, inv_freq [hd/2] float32 -> (cos, sin), each [B, T, hd] in dtype
// (float32 or float64). Hugging Face's construction: freqs = float(position) * inv_freq in
// float32, emb = cat(freqs, freqs), cos/sin of emb in float32 (scalar std::cos/std::sin),
// then cast to dtype.
std::pair<torch::Tensor, torch::Tensor> bi_rope_cos_sin(const torch::Tensor& positions, const torch::Tensor& inv_freq,
                                                        torch::ScalarType dtype);

// q [B, H, Tq, d], k, v [B, Hkv, S, d] with H a multiple of Hkv (head h reads kv head
// h / (H / Hkv)), mask [B, 1, Tq, S] bool (true = may attend; B may be 1) or undefined for
// causal with the queries at the last Tq positions (query i sees keys j <= i + S - Tq).
// -> [B, H, Tq, d]. Per (b, h, i), over the allowed keys only, in increasing j:
//   s_j = scale * lane_dot(q_i, k_j, d); m = max s_j; p_j = exp(s_j - m);
//   den = p_0 + p_1 + ... (in order); o[c] = fma(p_j, v_j[c], o[c]) from o = 0; out = o / den.
// Disallowed keys are never read into the result (they may hold garbage, even NaN); a query
// with no allowed key gives zeros.
torch::Tensor bi_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& mask, double scale);

// logits [..., V], temperature [R] (R = rows of logits) or [1], any floating dtype -> [..., V]
// in logits' dtype. x = logits / T (T cast to logits' dtype), m = max x,
// sum = lane sum of exp(x - m) (L lanes of plain adds, the combine tree, then the tail in
// order), out = (x - m) - log(sum).
torch::Tensor bi_log_softmax(const torch::Tensor& logits, const torch::Tensor& temperature);

}  // namespace troupe::kernels
