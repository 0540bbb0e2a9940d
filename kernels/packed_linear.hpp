// Linear layers of forward passes without autograd on a CPU, bfloat16 or float32, through oneDNN
// with the weight reordered once into oneDNN's own blocked layout: the pair of ops PyTorch's
// inductor uses when it freezes a CPU model (mkldnn::_reorder_linear_weight,
// mkldnn::_linear_pointwise).
// - bfloat16: F::linear on a plain bf16 weight reorders it inside every call; at one row
//   (single-sequence decode) that reorder costs as much as the GEMV, so a kept packed copy runs
//   the projections of SmolLM2 1.7 to 2.3x faster at M = 1 (1.1 to 1.3x at M = 8 to 64).
// - float32: F::linear goes to MKL's sgemm, which copies the weight into its own panels inside
//   every call too (sgemm_scopy_right16: 13% of the time of a 128-row decode). Packed, the GEMMs
//   of a SmolLM2 decode step took 1.35 to 2.5x less time at M = 1 to 128 on a Zen 4 EPYC, and
//   1.2 to 1.6x less with oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA), the LM head most.
// The copy costs the weight's bytes once more, so only engines and evaluation keep one (the
// trainer's forward passes never do), and bf16 only where bf16 is native
// (kernels/cpu_features.hpp).
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace troupe::kernels {

// Whether a packed copy pays here: a float32 weight and float32 activations, or bf16 and bf16 on
// a CPU whose bf16 is native, with oneDNN in this LibTorch and packing not turned off
// (set_packed_linear).
bool packed_linear_pays(const torch::Tensor& weight, torch::ScalarType activations);

// Process-wide switch, on by default: benchmarks time the plain path beside the packed one.
void set_packed_linear(bool on);

// weight [N, K] float32 or bfloat16 -> oneDNN's blocked layout of it (an opaque MKLDNN tensor).
torch::Tensor pack_linear_weight(const torch::Tensor& weight);

// x [..., K] in the packed weight's dtype -> x W^T + bias [..., N], W the packed weight of
// out_features rows.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias,
                            int64_t out_features);

}  // namespace troupe::kernels
