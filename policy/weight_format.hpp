// How forward passes without autograd hold the GEMM weights (generator.weights): the float
// parameters themselves, or a weight-only quantized copy made from them (kernels/weight_only.hpp).
// Names only, and the bits each format stands for. No LibTorch here.
#pragma once

#include <cstdint>
#include <span>

#include "policy/named.hpp"

namespace troupe {

// full: the float weights in the model's dtype (generator.dtype); int8 and int4: weight-only
// quantized, activations in that dtype. The behaviour log-probs an engine records are those of
// the format it samples with, so the trainer's importance correction sees the difference.
enum class WeightFormat { full, int8, int4 };

inline constexpr Named<WeightFormat> kWeightFormats[] = {
    {"full", WeightFormat::full}, {"int8", WeightFormat::int8}, {"int4", WeightFormat::int4}};
constexpr std::span<const Named<WeightFormat>> names_of(WeightFormat) { return kWeightFormats; }

constexpr int64_t weight_bits(WeightFormat f) { return f == WeightFormat::int8 ? 8 : f == WeightFormat::int4 ? 4 : 0; }

}  // namespace troupe
