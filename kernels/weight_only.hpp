// Weight-only quantized linear layers for generation (generator.weights: int8 | int4): weights in
// 8 or 4 bits with float scales. With bfloat16 activations the GEMMs are ATen's own packed CPU
// kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu, as gpt-fast uses them), which read
// a quarter or an eighth of float32's bytes. Those kernels are scalar for float32 activations (7x
// slower than MKL here), so for float32 two copies are kept: the weight dequantized in float32,
// which oneDNN (packed) or MKL multiplies when x has many rows (prefill, batched decoding:
// compute-bound), and the codes themselves, which a few-row kernel of ours multiplies (decoding
// one or a few sequences: bound by the bytes read, an eighth or a quarter of float32's). It is an
// AVX2 + FMA loop, chosen at run time, and a plain loop elsewhere; ATen has no int4 kernel for
// float32 activations that is not scalar, and its bfloat16 one runs at a fifth of the memory
// bandwidth on AVX2. Both copies hold the same quantized policy. No autograd: the copies are made from float weights (the
// trainer's, at every sync) and only read.
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
  // float32 activations: [N, K] float32, the weight the rounding gives; packed in oneDNN's layout
  // (an opaque MKLDNN tensor: is_mkldnn(), to_dense()) where that pays (kernels/packed_linear.hpp).
  torch::Tensor dequantized;
  // float32 activations, the few-row kernel's codes: int8: [N, K] int8 with `code_scale` [N];
  // int4: [N, K / 2] uint8, each group's 32 codes in 16 bytes (byte j: code j in the low nibble,
  // code j + 16 in the high one), `code_scale` and `code_low` [N, K / group]: a weight is
  // code * scale + low, low being the rule's zero - 8 * scale. All float32.
  torch::Tensor codes, code_scale, code_low;
  int64_t out_features = 0, in_features = 0;

  bool defined() const { return packed.defined() || dequantized.defined(); }
  // What one GEMM over `rows` rows of x reads of the weight: the codes (or packed) and scales, or
  // for many rows of float32 the dequantized weight.
  int64_t bytes(int64_t rows = 1) const;
};

// float32 activations with at most this many rows go through the few-row kernel.
inline constexpr int64_t kFewRows = 4;

// Whether `bits` can hold a [N, K] weight here; the reason when not (a 4-bit K that is not a
// multiple of the group, a device without the kernel).
bool quantized_weight_fits(int64_t bits, int64_t out_features, int64_t in_features, torch::Device device,
                           std::string* why = nullptr);

// weight [N, K] float -> its quantized form for activations of `activations` dtype (float32 or
// bfloat16). Where quantized_weight_fits says no, a c10::Error with its reason.
QuantizedWeight quantize_weight(const torch::Tensor& weight, int64_t bits, torch::ScalarType activations);

// x [..., K] -> x W^T + bias [..., N] through the format's kernel.
// float32: at most kFewRows rows through the few-row kernel, more through MKL; `few_rows` picks
// the kernel whatever the number of rows (the tests compare the two).
enum class FewRows { automatic, always, never };
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedWeight& weight, const torch::Tensor& bias,
                               FewRows few_rows = FewRows::automatic);

// Whether the few-row kernel runs its AVX2 + FMA loop on this CPU (else the plain loop).
// force_few_rows_plain(true): the plain loop whatever the CPU (tests run both loops).
bool few_rows_vectorized();
void force_few_rows_plain(bool on);

// The reference: weight [N, K] -> the float weight the format's kernel multiplies by, computed with
// plain ATen ops from the same rounding rule (q = round(w / scale) ...), nothing packed.
torch::Tensor fake_quantize_reference(const torch::Tensor& weight, int64_t bits);

}  // namespace troupe::kernels
