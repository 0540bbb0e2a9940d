// Weight-only quantized linear layers for generation (generator.weights: int8 | int4): weights in
// 8 or 4 bits with float scales. With bfloat16 activations the GEMMs are ATen's own packed CPU
// kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu, as gpt-fast uses them), which read
// a quarter or an eighth of float32's bytes. Those kernels are scalar for float32 activations (7x
// slower than MKL here), so there the weight is kept dequantized in float32 and MKL multiplies:
// the same quantized policy, at float32's speed. No autograd: the copy is made from float weights
// (the trainer's, at every sync) and only read.
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

namespace troupe::kernels {

// Bits per weight: 8 is symmetric with one scale per output row; 4 is asymmetric, a scale and a
// zero point per group of kInt4Group inputs of a row (llama.cpp's Q4_1 layout, so a model read
// from a Q4_1 GGUF requantizes almost exactly). policy/weight_format.hpp names them for configs.
inline constexpr int64_t kInt4Group = 32;

// One [N, K] weight in a quantized format, laid out for its ATen kernel.
struct QuantizedWeight {
  int64_t bits = 0;  // 8 or 4; 0: none
  // bfloat16 activations: int8: [N, K] int8; int4: ATen's CPU int4 pack of [N', K] (uint8),
  // N' = N rounded up to 16. Scales: int8 [N]; int4 [K / group, N', 2] (scale, zero), bfloat16.
  torch::Tensor packed, scales;
  torch::Tensor dequantized;  // float32 activations: [N, K] float32, the weight the rounding gives
  int64_t out_features = 0, in_features = 0;

  bool defined() const { return packed.defined() || dequantized.defined(); }
  int64_t bytes() const;  // what one GEMM reads of the weight: packed plus scales
};

// Whether `bits` can hold a [N, K] weight here; the reason when not (a 4-bit K that is not a
// multiple of the group, a device without the kernel).
bool quantized_weight_fits(int64_t bits, int64_t out_features, int64_t in_features, torch::Device device,
                           std::string* why = nullptr);

// weight [N, K] float -> its quantized form for activations of `activations` dtype (float32 or
// bfloat16). Where quantized_weight_fits says no, a c10::Error with its reason.
QuantizedWeight quantize_weight(const torch::Tensor& weight, int64_t bits, torch::ScalarType activations);

// x [..., K] -> x W^T + bias [..., N] through the format's kernel.
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedWeight& weight, const torch::Tensor& bias);

// The reference: weight [N, K] -> the float weight the format's kernel multiplies by, computed with
// plain ATen ops from the same rounding rule (q = round(w / scale) ...), nothing packed.
torch::Tensor fake_quantize_reference(const torch::Tensor& weight, int64_t bits);

}  // namespace troupe::kernels
