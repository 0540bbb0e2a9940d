// Weight-only int8 and int4 GEMMs through ATen's CPU kernels, oneDNN, MKL or the few-row kernel,
// with the plain-ATen rounding rule they are tested against (tests/kernels/test_weight_only.cpp).
#include "kernels/weight_only.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/linear.h>

#include "kernels/avx2.hpp"
#include "kernels/packed_linear.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

// One pass's results: the codes (int8: [N, K] int8 in [-127, 127]; int4: [N, K] uint8 in
// [0, 15]), the weights they stand for when asked (float32 [N, K]), and the scales (int8: [N];
// int4: scale and zero [N, K / group]), float32.
struct Rounded {
  torch::Tensor codes, dequantized, scale, zero;
};

Rounded int8_rows_fast(const torch::Tensor& w, bool dequantize) {
  auto w32 = w.to(torch::kFloat32).contiguous();
  const int64_t N = w32.size(0), K = w32.size(1);
  Rounded out{torch::empty({N, K}, torch::kInt8), dequantize ? torch::empty({N, K}, torch::kFloat32) : torch::Tensor(),
              torch::empty({N}, torch::kFloat32), {}};
  const float* src = w32.data_ptr<float>();
  int8_t* codes = out.codes.data_ptr<int8_t>();
  float* dst = dequantize ? out.dequantized.data_ptr<float>() : nullptr;
  float* row_scale = out.scale.data_ptr<float>();
  each_row(N, K, [&](int64_t r) {
    const float* x = src + r * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
    const float scale = std::max(amax, static_cast<float>(1e-12)) / 127.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::clamp(round_half_even(std::clamp(x[k] / scale, -128.0f, 128.0f)), -127.0f, 127.0f);
      codes[r * K + k] = static_cast<int8_t>(v);
      if (dst) dst[r * K + k] = v * scale;
    }
    row_scale[r] = scale;
  });
  return out;
}

Rounded int4_groups_fast(const torch::Tensor& w, bool dequantize) {
  auto w32 = w.to(torch::kFloat32).contiguous();
  const int64_t N = w32.size(0), K = w32.size(1), G = K / kInt4Group;
  Rounded out{torch::empty({N, K}, torch::kUInt8), dequantize ? torch::empty({N, K}, torch::kFloat32) : torch::Tensor(),
              torch::empty({N, G}, torch::kFloat32), torch::empty({N, G}, torch::kFloat32)};
  const float* src = w32.data_ptr<float>();
  uint8_t* codes = out.codes.data_ptr<uint8_t>();
  float* dst = dequantize ? out.dequantized.data_ptr<float>() : nullptr;
  float* group_scale = out.scale.data_ptr<float>();
  float* group_zero = out.zero.data_ptr<float>();
  each_row(N, K, [&](int64_t r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = r * K + g * kInt4Group;
      const float* x = src + at;
      float lo = x[0], hi = x[0];
      for (int64_t k = 1; k < kInt4Group; ++k) {
        lo = std::min(lo, x[k]);
        hi = std::max(hi, x[k]);
      }
      const float scale = std::max((hi - lo) / 15.0f, static_cast<float>(1e-12));
      const float zero = lo + scale * 8.0f;
      for (int64_t k = 0; k < kInt4Group; ++k) {
        const float v = std::clamp(round_half_even(std::clamp((x[k] - lo) / scale, 0.0f, 16.0f)), 0.0f, 15.0f);
        codes[at + k] = static_cast<uint8_t>(v);
        if (dst) dst[at + k] = (v - 8.0f) * scale + zero;
      }
      group_scale[r * G + g] = scale;
      group_zero[r * G + g] = zero;
    }
  });
  return out;
}

// The few-row kernel: y[m, n] = sum over k of x[m, k] * (the weight code n, k stands for), for
// float32 x [M, K], each output row's sum in one fixed order whatever M and the threads.
// int4, per group g of 32 inputs: scale_g * (x . codes) + low_g * (sum of x over the group); the
// sums of x come once per call, in lanes. int8: scale_n * (x . codes). Rows of the weight go four at a
// time, so that each loaded piece of x serves four of them; blocks of rows spread over the threads.
struct FewRowsArgs {
  const float* x;     // [M, K]
  const float* xsum;  // int4: [M, G, 8], x's lane sums per group
  const void* codes;  // int4: [N, K / 2] uint8; int8: [N, K] int8
  const float* scale;
  const float* low;   // int4: [N, G]
  float* y;           // [M, N]
  int64_t M, N, K;
};

constexpr int64_t kRowBlock = 4;

// The plain loop, for CPUs without AVX2 + FMA and for the rows past the last block of four.
void few_rows_plain(const FewRowsArgs& a, int bits, int64_t n0, int64_t n1) {
  const int64_t G = a.K / kInt4Group;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * a.K;
      float total = 0.0f;
      if (bits == 8) {
        const int8_t* q = static_cast<const int8_t*>(a.codes) + n * a.K;
        for (int64_t k = 0; k < a.K; ++k) total += x[k] * static_cast<float>(q[k]);
        total *= a.scale[n];
      } else {
        const uint8_t* q = static_cast<const uint8_t*>(a.codes) + n * (a.K / 2);
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.0f, xs = 0.0f;
          for (int64_t j = 0; j < kInt4Group / 2; ++j) {
            const uint8_t b = q[g * 16 + j];
            dot += x[g * kInt4Group + j] * static_cast<float>(b & 15) +
                   x[g * kInt4Group + j + 16] * static_cast<float>(b >> 4);
          }
          for (int64_t j = 0; j < 8; ++j) xs += a.xsum[(m * G + g) * 8 + j];
          total += dot * a.scale[n * G + g] + a.low[n * G + g] * xs;
        }
      }
      a.y[m * a.N + n] = total;
    }
}

#if defined(__x86_64__)
using avx2::hsum;

// 8 bytes at p -> 8 floats.
__attribute__((target("avx2,fma"))) inline __m256 int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// One group: the 8 partial sums of x . codes, the 32 codes in 16 bytes at q (see QuantizedWeight).
// Each 8 bytes widen to 8 dwords once, and both nibbles come out of them with an and and a shift:
// two widening shuffles a group instead of four (1.3 to 1.6x the kernel's speed on Zen 3).
__attribute__((target("avx2,fma"))) inline __m256 group_dot(const uint8_t* q, __m256 x0, __m256 x1, __m256 x2,
                                                            __m256 x3) {
  const __m256i nibble = _mm256_set1_epi32(15);
  // Bytes 0..7: codes 0..7 in the low nibbles, 16..23 in the high ones; bytes 8..15: 8..15 and 24..31.
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
  __m256 d = _mm256_mul_ps(x0, _mm256_cvtepi32_ps(_mm256_and_si256(a, nibble)));
  d = _mm256_fmadd_ps(x2, _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), d);
  __m256 e = _mm256_mul_ps(x1, _mm256_cvtepi32_ps(_mm256_and_si256(b, nibble)));
  e = _mm256_fmadd_ps(x3, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), e);
  return _mm256_add_ps(d, e);
}

// Rows [n0, n1), n1 - n0 a multiple of kRowBlock. The four rows' sums stay in registers.
// int4: each group's low * (sum of x) goes in as 8 lanes too, from x's lane sums (xsum holds
// [M, G, 8]), so no scalar chain is left but the last horizontal sum.
__attribute__((target("avx2,fma"))) void few_rows_avx2(const FewRowsArgs& a, int bits, int64_t n0, int64_t n1) {
  const int64_t G = a.K / kInt4Group;
  static_assert(kRowBlock == 4);
  for (int64_t n = n0; n < n1; n += kRowBlock)
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * a.K;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
      float* y = a.y + m * a.N + n;
      if (bits == 8) {
        const int8_t* q = static_cast<const int8_t*>(a.codes) + n * a.K;
        int64_t k = 0;
        for (; k + 8 <= a.K; k += 8) {
          const __m256 xv = _mm256_loadu_ps(x + k);
          acc0 = _mm256_fmadd_ps(xv, int8x8(q + k), acc0);
          acc1 = _mm256_fmadd_ps(xv, int8x8(q + a.K + k), acc1);
          acc2 = _mm256_fmadd_ps(xv, int8x8(q + 2 * a.K + k), acc2);
          acc3 = _mm256_fmadd_ps(xv, int8x8(q + 3 * a.K + k), acc3);
        }
        const __m256 acc[kRowBlock] = {acc0, acc1, acc2, acc3};
        for (int64_t r = 0; r < kRowBlock; ++r) {
          float total = hsum(acc[r]);
          for (int64_t j = k; j < a.K; ++j) total += x[j] * static_cast<float>(q[r * a.K + j]);
          y[r] = total * a.scale[n + r];
        }
      } else {
        const int64_t row = a.K / 2;
        const uint8_t* q = static_cast<const uint8_t*>(a.codes) + n * row;
        const float* scale = a.scale + n * G;
        const float* low = a.low + n * G;
        const float* xsum = a.xsum + m * G * 8;
        for (int64_t g = 0; g < G; ++g) {
          const float* xg = x + g * kInt4Group;
          const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8), x2 = _mm256_loadu_ps(xg + 16),
                       x3 = _mm256_loadu_ps(xg + 24), xs = _mm256_loadu_ps(xsum + g * 8);
          const uint8_t* qg = q + g * 16;
          // The codes of the block of rows two ahead, a line per group: all of it by the last group.
          _mm_prefetch(reinterpret_cast<const char*>(q + 2 * kRowBlock * row + g * 64), _MM_HINT_T0);
          acc0 = _mm256_fmadd_ps(group_dot(qg, x0, x1, x2, x3), _mm256_broadcast_ss(scale + g), acc0);
          acc1 = _mm256_fmadd_ps(group_dot(qg + row, x0, x1, x2, x3), _mm256_broadcast_ss(scale + G + g), acc1);
          acc2 = _mm256_fmadd_ps(group_dot(qg + 2 * row, x0, x1, x2, x3), _mm256_broadcast_ss(scale + 2 * G + g), acc2);
          acc3 = _mm256_fmadd_ps(group_dot(qg + 3 * row, x0, x1, x2, x3), _mm256_broadcast_ss(scale + 3 * G + g), acc3);
          acc0 = _mm256_fmadd_ps(xs, _mm256_broadcast_ss(low + g), acc0);
          acc1 = _mm256_fmadd_ps(xs, _mm256_broadcast_ss(low + G + g), acc1);
          acc2 = _mm256_fmadd_ps(xs, _mm256_broadcast_ss(low + 2 * G + g), acc2);
          acc3 = _mm256_fmadd_ps(xs, _mm256_broadcast_ss(low + 3 * G + g), acc3);
        }
        y[0] = hsum(acc0);
        y[1] = hsum(acc1);
        y[2] = hsum(acc2);
        y[3] = hsum(acc3);
      }
    }
}
#endif

std::atomic<bool> plain_forced{false};

bool avx2_fma() {
#if defined(__x86_64__)
  return avx2::supported() && !plain_forced.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

torch::Tensor few_rows(const torch::Tensor& rows, const QuantizedWeight& w) {
  const int64_t M = rows.size(0), N = w.out_features, K = w.in_features;
  auto x = rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() ? rows : rows.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, torch::kFloat32);
  // int4: x's sums over each group, in 8 lanes: [M, G, 8], lane j the sum of inputs j, j + 8,
  // j + 16 and j + 24 of the group. A loop, not ATen ops: a decode step makes ~120 of these.
  std::vector<float> xsum;
  if (w.bits == 4) {
    const float* xp = x.data_ptr<float>();
    xsum.assign(M * K / 4, 0.0f);
    for (int64_t i = 0; i < M * K; ++i) xsum[(i / kInt4Group) * 8 + i % 8] += xp[i];
  }
  const FewRowsArgs a{x.data_ptr<float>(), xsum.empty() ? nullptr : xsum.data(),
                      w.codes.data_ptr(), w.code_scale.data_ptr<float>(),
                      w.bits == 4 ? w.code_low.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K};
  const int bits = static_cast<int>(w.bits);
  const int64_t blocks = N / kRowBlock;
  // About 64 KB of codes per task: a few per thread for SmolLM2's smallest projection.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kRowBlock * K * bits / 8));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (avx2_fma()) return few_rows_avx2(a, bits, begin * kRowBlock, end * kRowBlock);
#endif
    few_rows_plain(a, bits, begin * kRowBlock, end * kRowBlock);
  });
  few_rows_plain(a, bits, blocks * kRowBlock, N);
  return y;
}

}  // namespace

int64_t QuantizedWeight::bytes(int64_t rows) const {
  auto size = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : int64_t{0}; };
  if (dequantized.defined() && rows > kFewRows) return size(dequantized);
  return size(packed) + size(scales) + size(codes) + size(code_scale) + size(code_low);
}

bool few_rows_vectorized() { return avx2_fma(); }
void force_few_rows_plain(bool on) { plain_forced.store(on, std::memory_order_relaxed); }

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
    auto r = bits == 8 ? int8_rows_fast(weight, /*dequantize=*/true) : int4_groups_fast(weight, /*dequantize=*/true);
    // Packed for oneDNN where that pays (kernels/packed_linear.hpp): MKL would copy the plain
    // weight into its panels in every call. The plain copy is freed; the packed one replaces it.
    out.dequantized = packed_linear_pays(r.dequantized, torch::kFloat32) ? pack_linear_weight(r.dequantized)
                                                                        : r.dequantized;
    out.code_scale = r.scale;
    if (bits == 8) {
      out.codes = r.codes;
    } else {
      // Each group's codes [16 low nibbles | 16 high nibbles] into 16 bytes; low = zero - 8 * scale.
      auto halves = r.codes.view({N, K / kInt4Group, 2, kInt4Group / 2});
      out.codes = halves.select(2, 0).bitwise_or(halves.select(2, 1).bitwise_left_shift(4)).reshape({N, K / 2});
      out.code_low = r.zero - r.scale * 8.0f;
    }
  } else if (bits == 8) {
    auto r = int8_rows_fast(weight, /*dequantize=*/false);
    out.packed = r.codes;
    out.scales = r.scale.to(activations).contiguous();
  } else {
    // ATen's CPU pack takes [N, K] int32 values in [0, 15] with N a multiple of 16: rows of zeros
    // pad it, their outputs cut off again by quantized_linear. Scales and zeros: [K / group, N, 2].
    const int64_t padded = (N + 15) / 16 * 16;
    auto g = int4_groups_fast(padded == N ? weight : torch::cat({weight, weight.new_zeros({padded - N, K})}),
                              /*dequantize=*/false);
    out.packed = at::_convert_weight_to_int4pack_for_cpu(g.codes.to(torch::kInt32).contiguous(), /*innerKTiles=*/1);
    out.scales = torch::stack({g.scale, g.zero}, -1).transpose(0, 1).to(activations).contiguous();
  }
  return out;
}

torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedWeight& weight, const torch::Tensor& bias,
                               FewRows few_rows_kernel) {
  TORCH_CHECK(weight.defined(), "quantized_linear: no quantized weight");
  TORCH_CHECK(x.size(-1) == weight.in_features, "quantized_linear: x ", x.sizes(), " against a weight of ",
              weight.in_features, " inputs");
  const int64_t M = x.numel() / weight.in_features;
  const bool few = weight.codes.defined() && (few_rows_kernel == FewRows::always ||
                                              (few_rows_kernel == FewRows::automatic && M <= kFewRows));
  if (!few && weight.dequantized.defined()) {
    auto rows = x.to(torch::kFloat32);
    auto b = bias.defined() ? bias.to(torch::kFloat32) : bias;
    auto y = weight.dequantized.is_mkldnn() ? packed_linear(rows, weight.dequantized, b, weight.out_features)
                                            : torch::nn::functional::linear(rows, weight.dequantized, b);
    return y.to(x.scalar_type());
  }
  torch::Tensor y;  // (M, N)
  if (few) {
    y = few_rows(x.reshape({M, weight.in_features}), weight);
  } else {
    auto rows = x.reshape({M, weight.in_features}).to(weight.scales.scalar_type()).contiguous();  // (M, K)
    if (weight.bits == 8)
      y = at::_weight_int8pack_mm(rows, weight.packed, weight.scales);
    else
      y = at::_weight_int4pack_mm_for_cpu(rows, weight.packed, kInt4Group, weight.scales)
              .narrow(1, 0, weight.out_features);
  }
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
