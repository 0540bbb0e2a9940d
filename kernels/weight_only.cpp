// Weight-only int8 and int4 GEMMs through ATen's CPU kernels, with the plain-ATen rounding rule
// they are tested against (tests/kernels/test_weight_only.cpp).
#include "kernels/weight_only.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/linear.h>

namespace troupe::kernels {
namespace {

// w [N, K] float -> (q [N, K] int8 in [-127, 127], scales [N] float32): symmetric per row.
std::pair<torch::Tensor, torch::Tensor> int8_rows(const torch::Tensor& w) {
  auto w32 = w.to(torch::kFloat32);
  auto scales = w32.abs().amax(1).clamp_min(1e-12) / 127.0;  // (N)
  auto q = (w32 / scales.unsqueeze(1)).round().clamp(-127, 127);
  return {q, scales};
}

// w [N, K] float -> (q [N, K] in [0, 15], scale, zero [N, K / group]) float32: per group of the
// row, w ~ (q - 8) * scale + zero with zero = min + 8 * scale (gpt-fast's asymmetric rule).
struct Int4Groups {
  torch::Tensor q, scale, zero;
};
Int4Groups int4_groups(const torch::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  auto g = w.to(torch::kFloat32).reshape({N, K / kInt4Group, kInt4Group});  // (N, G, group)
  auto lo = g.amin(-1), hi = g.amax(-1);                                    // (N, G)
  auto scale = ((hi - lo) / 15.0).clamp_min(1e-12);
  auto zero = lo + scale * 8.0;
  auto q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15);  // (N, G, group)
  return {q.reshape({N, K}), scale, zero};
}

// The same two rules in one pass over each row, the rows spread over the intra-op threads: what
// an engine runs at every weight sync. As the chain of whole-tensor passes above, requantizing
// SmolLM2 took 1.5 to 2 s on one thread; this is 3 to 6 times faster (the two, timed side by side).
// The same float32 operations in the same order as the reference (kernels/CMakeLists.txt builds
// this file with -ffp-contract=off), so the same bits: test_weight_only checks them equal.
// `dequantize`: each q is replaced by the weight it stands for, as fake_quantize_reference has it.

// Rounds to nearest, ties to even, as std::nearbyint does in the default rounding mode, for
// |v| <= 2^22 (callers clamp first): adding 1.5 * 2^23 leaves no fraction bits, and subtracting
// it again is exact. nearbyint is a libm call per element on x86-64's baseline ISA, and took
// most of the time.
inline float round_half_even(float v) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return (v + kShift) - kShift;
}

template <typename RowFn>
void each_row(int64_t N, int64_t K, const RowFn& row) {
  at::parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 16) / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(r);
  });
}

std::pair<torch::Tensor, torch::Tensor> int8_rows_fast(const torch::Tensor& w, bool dequantize) {
  auto w32 = w.to(torch::kFloat32).contiguous();
  const int64_t N = w32.size(0), K = w32.size(1);
  auto q = torch::empty({N, K}, torch::kFloat32), scales = torch::empty({N}, torch::kFloat32);
  const float* src = w32.data_ptr<float>();
  float* dst = q.data_ptr<float>();
  float* row_scale = scales.data_ptr<float>();
  each_row(N, K, [&](int64_t r) {
    const float* x = src + r * K;
    float* y = dst + r * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
    const float scale = std::max(amax, static_cast<float>(1e-12)) / 127.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::clamp(round_half_even(std::clamp(x[k] / scale, -128.0f, 128.0f)), -127.0f, 127.0f);
      y[k] = dequantize ? v * scale : v;
    }
    row_scale[r] = scale;
  });
  return {q, scales};
}

Int4Groups int4_groups_fast(const torch::Tensor& w, bool dequantize) {
  auto w32 = w.to(torch::kFloat32).contiguous();
  const int64_t N = w32.size(0), K = w32.size(1), G = K / kInt4Group;
  Int4Groups out{torch::empty({N, K}, torch::kFloat32), torch::empty({N, G}, torch::kFloat32),
                 torch::empty({N, G}, torch::kFloat32)};
  const float* src = w32.data_ptr<float>();
  float* dst = out.q.data_ptr<float>();
  float* group_scale = out.scale.data_ptr<float>();
  float* group_zero = out.zero.data_ptr<float>();
  each_row(N, K, [&](int64_t r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* x = src + r * K + g * kInt4Group;
      float* y = dst + r * K + g * kInt4Group;
      float lo = x[0], hi = x[0];
      for (int64_t k = 1; k < kInt4Group; ++k) {
        lo = std::min(lo, x[k]);
        hi = std::max(hi, x[k]);
      }
      const float scale = std::max((hi - lo) / 15.0f, static_cast<float>(1e-12));
      const float zero = lo + scale * 8.0f;
      for (int64_t k = 0; k < kInt4Group; ++k) {
        const float v = std::clamp(round_half_even(std::clamp((x[k] - lo) / scale, 0.0f, 16.0f)), 0.0f, 15.0f);
        y[k] = dequantize ? (v - 8.0f) * scale + zero : v;
      }
      group_scale[r * G + g] = scale;
      group_zero[r * G + g] = zero;
    }
  });
  return out;
}

}  // namespace

int64_t QuantizedWeight::bytes() const {
  auto size = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : int64_t{0}; };
  return size(packed) + size(scales) + size(dequantized);
}

bool quantized_weight_fits(int64_t bits, int64_t out_features, int64_t in_features, torch::Device device,
                           std::string* why) {
  auto no = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return false;
  };
  if (bits != 8 && bits != 4) return no(std::to_string(bits) + "-bit weights: only 8 and 4 bits are implemented");
  if (!device.is_cpu()) return no("int" + std::to_string(bits) + " weights run on the CPU only (device " + device.str() + ")");
  if (bits == 4 && in_features % kInt4Group != 0)
    return no("int4 needs the input size to be a multiple of " + std::to_string(kInt4Group) + ", got " +
              std::to_string(in_features));
  if (out_features < 1 || in_features < 1) return no("empty weight");
  return true;
}

QuantizedWeight quantize_weight(const torch::Tensor& weight, int64_t bits, torch::ScalarType activations) {
  TORCH_CHECK(weight.dim() == 2, "quantize_weight: weight must be [N, K], got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  std::string why;
  TORCH_CHECK(quantized_weight_fits(bits, N, K, weight.device(), &why), "quantize_weight: weight ", weight.sizes(),
              " in ", bits, " bits: ", why);
  TORCH_CHECK(activations == torch::kFloat32 || activations == torch::kBFloat16,
              "quantized weights take float32 or bfloat16 activations, not ", activations);
  torch::NoGradGuard no_grad;
  QuantizedWeight out{.bits = bits, .out_features = N, .in_features = K};
  if (activations == torch::kFloat32) {
    out.dequantized = bits == 8 ? int8_rows_fast(weight, /*dequantize=*/true).first
                                : int4_groups_fast(weight, /*dequantize=*/true).q;
  } else if (bits == 8) {
    auto [q, scales] = int8_rows_fast(weight, /*dequantize=*/false);
    out.packed = q.to(torch::kInt8).contiguous();
    out.scales = scales.to(activations).contiguous();
  } else {
    // ATen's CPU pack takes [N, K] int32 values in [0, 15] with N a multiple of 16: rows of zeros
    // pad it, their outputs cut off again by quantized_linear. Scales and zeros: [K / group, N, 2].
    const int64_t padded = (N + 15) / 16 * 16;
    auto g = int4_groups_fast(padded == N ? weight : torch::cat({weight, weight.new_zeros({padded - N, K})}),
                              /*dequantize=*/false);
    out.packed = at::_convert_weight_to_int4pack_for_cpu(g.q.to(torch::kInt32).contiguous(), /*innerKTiles=*/1);
    out.scales = torch::stack({g.scale, g.zero}, -1).transpose(0, 1).to(activations).contiguous();
  }
  return out;
}

torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedWeight& weight, const torch::Tensor& bias) {
  TORCH_CHECK(weight.defined(), "quantized_linear: no quantized weight");
  TORCH_CHECK(x.size(-1) == weight.in_features, "quantized_linear: x ", x.sizes(), " against a weight of ",
              weight.in_features, " inputs");
  if (weight.dequantized.defined())
    return torch::nn::functional::linear(x.to(torch::kFloat32), weight.dequantized,
                                         bias.defined() ? bias.to(torch::kFloat32) : bias).to(x.scalar_type());
  auto rows = x.reshape({-1, weight.in_features}).to(weight.scales.scalar_type()).contiguous();  // (M, K)
  torch::Tensor y;                                                                                 // (M, N)
  if (weight.bits == 8)
    y = at::_weight_int8pack_mm(rows, weight.packed, weight.scales);
  else
    y = at::_weight_int4pack_mm_for_cpu(rows, weight.packed, kInt4Group, weight.scales).narrow(1, 0, weight.out_features);
  if (bias.defined()) y = y + bias.to(y.scalar_type());
  auto shape = x.sizes().vec();
  shape.back() = weight.out_features;
  return y.reshape(shape).to(x.scalar_type());
}

torch::Tensor fake_quantize_reference(const torch::Tensor& weight, int64_t bits) {
  torch::NoGradGuard no_grad;
  if (bits == 8) {
    auto [q, scales] = int8_rows(weight);
    return q * scales.unsqueeze(1);
  }
  if (bits == 4) {
    auto g = int4_groups(weight);
    const int64_t N = weight.size(0), K = weight.size(1);
    auto q = g.q.reshape({N, K / kInt4Group, kInt4Group});
    return ((q - 8.0) * g.scale.unsqueeze(-1) + g.zero.unsqueeze(-1)).reshape({N, K});
  }
  return weight.to(torch::kFloat32);
}

}  // namespace troupe::kernels
