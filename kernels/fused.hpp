// Fused kernels for the transformer's hot elementwise and row-reduction ops, each beside the
// plain-ATen reference it is tested against. CUDA kernels for all of them; CPU kernels for the
// RMSNorm and the rotary embedding (fused_cpu.cpp), where the plain ops' dispatch costs more than
// their arithmetic in a decode step. swiglu and the token log-probs run on CUDA tensors only: on
// a CPU, ATen's silu is one vectorized op, which a loop of ours (a scalar exp) would not beat.
#pragma once

#include <cstdint>
#include <utility>

#include <torch/types.h>

namespace troupe::kernels {

// Whether this build compiled kernels/fused_cuda.cu (a CUDA toolkit matching the torch wheel
// at configure time). When false, every fused entry point below throws "built without CUDA" for
// a tensor that is not on the CPU; the _reference functions always work.
bool fused_cuda_built();

// Common contract of the fused functions: tensors on one device, of one dtype among float32,
// bfloat16 and float16 (index tensors int64); on CUDA contiguous, on the CPU any strides (the
// rotary's x read as it is, the rest made contiguous first); statistics and products in float32,
// rounded to the input dtype where Hugging Face's PyTorch code rounds. No autograd: an input
// that requires grad while grad mode is on is refused (except by target_logprobs). The
// _reference functions take any device, any dtype and any strides, with autograd.

// x, residual [..., H], weight [H] -> (out, sum), both [..., H] in x's dtype. Hugging Face
// LlamaRMSNorm applied to the residual stream: sum = x + residual, rounded to the dtype as
// PyTorch adds it; s = float(sum); out = weight * (s * rsqrt(mean(s^2) + eps)).to(dtype), the
// last product in the dtype. residual undefined: plain RMSNorm, and sum is x itself.
std::pair<torch::Tensor, torch::Tensor> rms_norm_residual(const torch::Tensor& x, const torch::Tensor& residual,
                                                          const torch::Tensor& weight, double eps);
std::pair<torch::Tensor, torch::Tensor> rms_norm_residual_reference(const torch::Tensor& x,
                                                                    const torch::Tensor& residual,
                                                                    const torch::Tensor& weight, double eps);

// x [B, heads, T, D] (D even), cos, sin [B or 1, T, D] -> [B, heads, T, D], Hugging Face
// apply_rotary_pos_emb: x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1) over
// the halves of D; each product and the sum rounded to the dtype, as PyTorch computes it.
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor rotary_reference(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// gate, up [...] (same shape) -> silu(gate) * up, Hugging Face LlamaMLP's act_fn(gate) * up:
// silu(g) = g / (1 + exp(-g)) in float32, rounded to the dtype, then the product in the dtype.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor swiglu_reference(const torch::Tensor& gate, const torch::Tensor& up);

// logits [N, V], targets [N] int64 in [0, V) -> [N] float32, row n's log_softmax(z)[targets[n]]
// with z = float(logits) / temperature. Differentiable in logits: the backward pass is
// target_logprobs_backward, which reads the logits again instead of keeping the softmax.
torch::Tensor target_logprobs(const torch::Tensor& logits, const torch::Tensor& targets, double temperature = 1.0);

// The forward kernel alone, without autograd: one pass over each row (online max and sum of
// exponentials), one block per row. A target outside [0, V) stops the kernel with a device assert.
torch::Tensor target_logprobs_forward(const torch::Tensor& logits, const torch::Tensor& targets,
                                      double temperature = 1.0);

// logits [N, V], targets [N], grad [N] float32 (the upstream gradient of target_logprobs) ->
// [N, V] in logits' dtype: grad[n] * (onehot(targets[n]) - softmax(z)[n]) / temperature.
torch::Tensor target_logprobs_backward(const torch::Tensor& logits, const torch::Tensor& targets,
                                       const torch::Tensor& grad, double temperature = 1.0);

// The references: log_softmax and gather in float32 (float64 for float64 logits), and the
// backward formula above written with softmax and scatter_add.
torch::Tensor target_logprobs_reference(const torch::Tensor& logits, const torch::Tensor& targets,
                                        double temperature = 1.0);
torch::Tensor target_logprobs_backward_reference(const torch::Tensor& logits, const torch::Tensor& targets,
                                                 const torch::Tensor& grad, double temperature = 1.0);

}  // namespace troupe::kernels
