// Batch-invariant CPU kernels: register-tiled lane dots in AVX-512, AVX2+FMA and portable C++
// that all perform the same float operations (see the header). No K splitting, no autograd.
#include "kernels/batch_invariant.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TROUPE_BI_X86 1
#include <immintrin.h>
#endif

// Every multiply-add below is an explicit fma (intrinsic or std::fma) and every other product
// stands alone, so there is no a * b + c the compiler could contract differently in two code
// paths; kernels/CMakeLists.txt also compiles this file with -ffp-contract=off.

namespace troupe::kernels {
namespace {

// Lanes of the lane dot: one 64-byte vector, 16 floats or 8 doubles, on every code path.
template <class T>
constexpr int kLanes = 64 / int(sizeof(T));

// The combine tree on a lane array: acc[l] += acc[l + w] for w = L/2, ..., 1.
template <class T>
T combine_lanes(T* acc) {
  for (int w = kLanes<T> / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];
  return acc[0];
}

// ---------------------------------------------------------------------------------------------
// The three primitives every kernel is built from, once per code path:
//   lane_dot(a, b, K)                        the lane dot of two length-K rows
//   dots(a, lda, m, b, ldb, n, K, c, ldc)    c[i, j] = lane_dot(a_i, b_j) for i < m, j < n
//   weighted_rows(w, idx, n, v, ldv, d, o)   o[c] = fma(w[t], v[idx[t], c], o[c]) from o = 0,
//                                            t = 0 .. n-1 in order
// ---------------------------------------------------------------------------------------------

// Any CPU. Without FMA hardware std::fma is a (correctly rounded) libm call: slow, same bits.
namespace portable {

template <class T>
T lane_dot(const T* a, const T* b, int64_t K) {
  constexpr int L = kLanes<T>;
  const int64_t KL = K - K % L;
  T acc[L] = {};
  for (int64_t k = 0; k < KL; k += L)
    for (int l = 0; l < L; ++l) acc[l] = std::fma(a[k + l], b[k + l], acc[l]);
  T s = combine_lanes(acc);
  for (int64_t k = KL; k < K; ++k) s = std::fma(a[k], b[k], s);
  return s;
}

template <class T>
void dots(const T* a, int64_t lda, int64_t m, const T* b, int64_t ldb, int64_t n, int64_t K, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = lane_dot(a + i * lda, b + j * ldb, K);
}

template <class T>
void weighted_rows(const T* w, const int64_t* idx, int64_t n, const T* v, int64_t ldv, int64_t d, T* o) {
  std::fill(o, o + d, T(0));
  for (int64_t t = 0; t < n; ++t) {
    const T* row = v + idx[t] * ldv;
    for (int64_t c = 0; c < d; ++c) o[c] = std::fma(w[t], row[c], o[c]);
  }
}

}  // namespace portable

#ifdef TROUPE_BI_X86
#define TROUPE_AVX2 __attribute__((target("avx2,fma")))
#define TROUPE_AVX512 __attribute__((target("avx512f,avx2,fma")))

// Tiles: each k-step loads MR rows of a and NR rows of b and issues MR * NR fmas, one
// accumulator per element. Leftover rows run one-row instances of the same tile template;
// leftover columns run the full tile with the missing columns pointed at the last real one and
// their results dropped. Either way an element gets the lane dot's fmas, combine and tail (the
// same on every path), so which tile it lands in never matters.

namespace avx2 {

// 16 float lanes are two __m256 (lanes 0-7, 8-15); 8 double lanes are two __m256d.
// (A struct, not std::conditional_t: vector types lose their attributes as template arguments.)
template <class T>
struct vec_of {
  using type = __m256;
};
template <>
struct vec_of<double> {
  using type = __m256d;
};
template <class T>
using vec = typename vec_of<T>::type;

TROUPE_AVX2 inline __m256 vzero(float) { return _mm256_setzero_ps(); }
TROUPE_AVX2 inline __m256d vzero(double) { return _mm256_setzero_pd(); }
TROUPE_AVX2 inline __m256 vset1(float x) { return _mm256_set1_ps(x); }
TROUPE_AVX2 inline __m256d vset1(double x) { return _mm256_set1_pd(x); }
TROUPE_AVX2 inline __m256 vload(const float* p) { return _mm256_loadu_ps(p); }
TROUPE_AVX2 inline __m256d vload(const double* p) { return _mm256_loadu_pd(p); }
TROUPE_AVX2 inline void vstore(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
TROUPE_AVX2 inline void vstore(double* p, __m256d x) { _mm256_storeu_pd(p, x); }
TROUPE_AVX2 inline __m256 vadd(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
TROUPE_AVX2 inline __m256d vadd(__m256d a, __m256d b) { return _mm256_add_pd(a, b); }
TROUPE_AVX2 inline __m256 vfma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
TROUPE_AVX2 inline __m256d vfma(__m256d a, __m256d b, __m256d c) { return _mm256_fmadd_pd(a, b, c); }

// The combine tree from 8 float lanes (after the l + l+8 step): l + l+4, l + l+2, l0 + l1.
TROUPE_AVX2 inline float combine_half(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
// From 4 double lanes (after l + l+4): l + l+2, l0 + l1.
TROUPE_AVX2 inline double combine_half(__m256d x) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
  s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
  return _mm_cvtsd_f64(s);
}

// c[r, j] (j < nr) = lane_dot(a[r], b[j], K); lo/hi hold lanes 0..L/2-1 and L/2..L-1.
template <class T, int MR, int NR>
TROUPE_AVX2 void tile(const T* const* a, const T* const* b, int64_t K, T* c, int64_t ldc, int nr) {
  constexpr int L = kLanes<T>, W = L / 2;
  const int64_t KL = K - K % L;
  vec<T> lo[MR][NR], hi[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) lo[r][j] = hi[r][j] = vzero(T{});
  for (int64_t k = 0; k < KL; k += L) {
    vec<T> av[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = vload(a[r] + k);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const vec<T> bv = vload(b[j] + k);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) lo[r][j] = vfma(av[r], bv, lo[r][j]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = vload(a[r] + k + W);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const vec<T> bv = vload(b[j] + k + W);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) hi[r][j] = vfma(av[r], bv, hi[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      if (j >= nr) continue;
      T s = combine_half(vadd(lo[r][j], hi[r][j]));  // first step: lane l + lane l+L/2
      for (int64_t k = KL; k < K; ++k) s = std::fma(a[r][k], b[j][k], s);
      c[r * ldc + j] = s;
    }
}

// R rows of a against the n rows of b, NR at a time.
template <class T, int R, int NR>
TROUPE_AVX2 void row_group(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t n, int64_t K, T* c, int64_t ldc) {
  const T* ap[R];
  for (int r = 0; r < R; ++r) ap[r] = a + r * lda;
  for (int64_t j0 = 0; j0 < n; j0 += NR) {
    const T* bp[NR];
    for (int j = 0; j < NR; ++j) bp[j] = b + std::min<int64_t>(j0 + j, n - 1) * ldb;
    tile<T, R, NR>(ap, bp, K, c + j0, ldc, int(std::min<int64_t>(NR, n - j0)));
  }
}

template <class T, int MR, int NR>
TROUPE_AVX2 void tiled_dots(const T* a, int64_t lda, int64_t m, const T* b, int64_t ldb, int64_t n, int64_t K, T* c,
                            int64_t ldc) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) row_group<T, MR, NR>(a + i * lda, lda, b, ldb, n, K, c + i * ldc, ldc);
  for (; i < m; ++i) row_group<T, 1, NR>(a + i * lda, lda, b, ldb, n, K, c + i * ldc, ldc);
}

// 2 x 3 tiles: 12 accumulators x 2 halves + 2 + 1 registers, within the 16 ymm.
template <class T>
TROUPE_AVX2 void dots(const T* a, int64_t lda, int64_t m, const T* b, int64_t ldb, int64_t n, int64_t K, T* c,
                      int64_t ldc) {
  tiled_dots<T, 2, 3>(a, lda, m, b, ldb, n, K, c, ldc);
}

template <class T>
TROUPE_AVX2 T lane_dot(const T* a, const T* b, int64_t K) {
  T s;
  tile<T, 1, 1>(&a, &b, K, &s, 1, 1);
  return s;
}

// One row of up to NV vectors of outputs at column c0, accumulated over t in registers.
template <class T, int NV>
TROUPE_AVX2 void weighted_cols(const T* w, const int64_t* idx, int64_t n, const T* v, int64_t ldv, int64_t c0, T* o) {
  constexpr int W = 32 / int(sizeof(T));
  vec<T> acc[NV];
#pragma GCC unroll 8
  for (int q = 0; q < NV; ++q) acc[q] = vzero(T{});
  for (int64_t t = 0; t < n; ++t) {
    const vec<T> p = vset1(w[t]);
    const T* row = v + idx[t] * ldv + c0;
#pragma GCC unroll 8
    for (int q = 0; q < NV; ++q) acc[q] = vfma(p, vload(row + q * W), acc[q]);
  }
#pragma GCC unroll 8
  for (int q = 0; q < NV; ++q) vstore(o + c0 + q * W, acc[q]);
}

template <class T>
TROUPE_AVX2 void weighted_rows(const T* w, const int64_t* idx, int64_t n, const T* v, int64_t ldv, int64_t d, T* o) {
  constexpr int W = 32 / int(sizeof(T));
  int64_t c0 = 0;
  for (; c0 + 8 * W <= d; c0 += 8 * W) weighted_cols<T, 8>(w, idx, n, v, ldv, c0, o);
  if (c0 + 4 * W <= d) {
    weighted_cols<T, 4>(w, idx, n, v, ldv, c0, o);
    c0 += 4 * W;
  }
  for (; c0 + W <= d; c0 += W) weighted_cols<T, 1>(w, idx, n, v, ldv, c0, o);
  for (int64_t c = c0; c < d; ++c) {
    T s = 0;
    for (int64_t t = 0; t < n; ++t) s = std::fma(w[t], v[idx[t] * ldv + c], s);
    o[c] = s;
  }
}

}  // namespace avx2

namespace avx512 {

template <class T>
struct vec_of {
  using type = __m512;
};
template <>
struct vec_of<double> {
  using type = __m512d;
};
template <class T>
using vec = typename vec_of<T>::type;

TROUPE_AVX512 inline __m512 vzero(float) { return _mm512_setzero_ps(); }
TROUPE_AVX512 inline __m512d vzero(double) { return _mm512_setzero_pd(); }
TROUPE_AVX512 inline __m512 vset1(float x) { return _mm512_set1_ps(x); }
TROUPE_AVX512 inline __m512d vset1(double x) { return _mm512_set1_pd(x); }
TROUPE_AVX512 inline __m512 vload(const float* p) { return _mm512_loadu_ps(p); }
TROUPE_AVX512 inline __m512d vload(const double* p) { return _mm512_loadu_pd(p); }
TROUPE_AVX512 inline void vstore(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
TROUPE_AVX512 inline void vstore(double* p, __m512d x) { _mm512_storeu_pd(p, x); }
TROUPE_AVX512 inline __m512 vfma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
TROUPE_AVX512 inline __m512d vfma(__m512d a, __m512d b, __m512d c) { return _mm512_fmadd_pd(a, b, c); }

// The whole combine tree: lane l + lane l+L/2 (the two 256-bit halves), then as in AVX2.
// (Halves via the zero-masked extract: GCC's plain one and the casts built on it fill an
// "undefined" register that -Wall reports as uninitialized once inlined here.)
TROUPE_AVX512 inline __m256d half(__m512d x, int upper) {
  return upper ? _mm512_maskz_extractf64x4_pd(0xff, x, 1) : _mm512_maskz_extractf64x4_pd(0xff, x, 0);
}
TROUPE_AVX512 inline float combine(__m512 x) {
  const __m512d xd = _mm512_castps_pd(x);
  return avx2::combine_half(_mm256_add_ps(_mm256_castpd_ps(half(xd, 0)), _mm256_castpd_ps(half(xd, 1))));
}
TROUPE_AVX512 inline double combine(__m512d x) { return avx2::combine_half(_mm256_add_pd(half(x, 0), half(x, 1))); }

template <class T, int MR, int NR>
TROUPE_AVX512 void tile(const T* const* a, const T* const* b, int64_t K, T* c, int64_t ldc, int nr) {
  constexpr int L = kLanes<T>;
  const int64_t KL = K - K % L;
  vec<T> acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[r][j] = vzero(T{});
  for (int64_t k = 0; k < KL; k += L) {
    vec<T> av[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = vload(a[r] + k);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const vec<T> bv = vload(b[j] + k);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][j] = vfma(av[r], bv, acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      if (j >= nr) continue;
      T s = combine(acc[r][j]);
      for (int64_t k = KL; k < K; ++k) s = std::fma(a[r][k], b[j][k], s);
      c[r * ldc + j] = s;
    }
}

// R rows of a against the n rows of b, NR at a time.
template <class T, int R, int NR>
TROUPE_AVX512 void row_group(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t n, int64_t K, T* c, int64_t ldc) {
  const T* ap[R];
  for (int r = 0; r < R; ++r) ap[r] = a + r * lda;
  for (int64_t j0 = 0; j0 < n; j0 += NR) {
    const T* bp[NR];
    for (int j = 0; j < NR; ++j) bp[j] = b + std::min<int64_t>(j0 + j, n - 1) * ldb;
    tile<T, R, NR>(ap, bp, K, c + j0, ldc, int(std::min<int64_t>(NR, n - j0)));
  }
}

template <class T, int MR, int NR>
TROUPE_AVX512 void tiled_dots(const T* a, int64_t lda, int64_t m, const T* b, int64_t ldb, int64_t n, int64_t K, T* c,
                              int64_t ldc) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) row_group<T, MR, NR>(a + i * lda, lda, b, ldb, n, K, c + i * ldc, ldc);
  for (; i < m; ++i) row_group<T, 1, NR>(a + i * lda, lda, b, ldb, n, K, c + i * ldc, ldc);
}

// 4 x 6 tiles: 24 accumulators + 4 + 1 of the 32 zmm registers.
template <class T>
TROUPE_AVX512 void dots(const T* a, int64_t lda, int64_t m, const T* b, int64_t ldb, int64_t n, int64_t K, T* c,
                        int64_t ldc) {
  tiled_dots<T, 4, 6>(a, lda, m, b, ldb, n, K, c, ldc);
}

template <class T>
TROUPE_AVX512 T lane_dot(const T* a, const T* b, int64_t K) {
  T s;
  tile<T, 1, 1>(&a, &b, K, &s, 1, 1);
  return s;
}

template <class T, int NV>
TROUPE_AVX512 void weighted_cols(const T* w, const int64_t* idx, int64_t n, const T* v, int64_t ldv, int64_t c0,
                                 T* o) {
  constexpr int W = kLanes<T>;
  vec<T> acc[NV];
#pragma GCC unroll 8
  for (int q = 0; q < NV; ++q) acc[q] = vzero(T{});
  for (int64_t t = 0; t < n; ++t) {
    const vec<T> p = vset1(w[t]);
    const T* row = v + idx[t] * ldv + c0;
#pragma GCC unroll 8
    for (int q = 0; q < NV; ++q) acc[q] = vfma(p, vload(row + q * W), acc[q]);
  }
#pragma GCC unroll 8
  for (int q = 0; q < NV; ++q) vstore(o + c0 + q * W, acc[q]);
}

template <class T>
TROUPE_AVX512 void weighted_rows(const T* w, const int64_t* idx, int64_t n, const T* v, int64_t ldv, int64_t d, T* o) {
  constexpr int W = kLanes<T>;
  int64_t c0 = 0;
  for (; c0 + 8 * W <= d; c0 += 8 * W) weighted_cols<T, 8>(w, idx, n, v, ldv, c0, o);
  if (c0 + 4 * W <= d) {
    weighted_cols<T, 4>(w, idx, n, v, ldv, c0, o);
    c0 += 4 * W;
  }
  for (; c0 + W <= d; c0 += W) weighted_cols<T, 1>(w, idx, n, v, ldv, c0, o);
  for (int64_t c = c0; c < d; ++c) {
    T s = 0;
    for (int64_t t = 0; t < n; ++t) s = std::fma(w[t], v[idx[t] * ldv + c], s);
    o[c] = s;
  }
}

}  // namespace avx512
#endif  // TROUPE_BI_X86

// ---------------------------------------------------------------------------------------------
// The code path, picked once per process. Results do not depend on it; speed does.
// ---------------------------------------------------------------------------------------------

enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

Isa pick_isa() {
  Isa best = Isa::portable;
#ifdef TROUPE_BI_X86
  // libgcc/compiler-rt check the OS-enabled register state (xgetbv) as well as cpuid.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    best = Isa::avx2;
    if (__builtin_cpu_supports("avx512f")) best = Isa::avx512;
  }
#endif
  const char* env = std::getenv("TROUPE_BI_ISA");
  if (!env || !*env) return best;
  const std::string want = env;
  Isa asked = Isa::portable;
  if (want == "avx2") {
    asked = Isa::avx2;
  } else if (want == "avx512") {
    asked = Isa::avx512;
  } else {
    TORCH_CHECK(want == "portable", "TROUPE_BI_ISA='", want, "': expected portable, avx2 or avx512; unset it to detect");
  }
  TORCH_CHECK(static_cast<int>(asked) <= static_cast<int>(best), "TROUPE_BI_ISA=", want,
              ": this CPU (or its OS) does not enable it; the best path here is ", isa_name(best));
  return asked;
}

Isa isa() {
  static const Isa chosen = pick_isa();
  return chosen;
}

template <class T>
T lane_dot(const T* a, const T* b, int64_t K) {
  switch (isa()) {
#ifdef TROUPE_BI_X86
    case Isa::avx512: return avx512::lane_dot(a, b, K);
    case Isa::avx2: return avx2::lane_dot(a, b, K);
#endif
    default: return portable::lane_dot(a, b, K);
  }
}

template <class T>
void dots(const T* a, int64_t lda, int64_t m, const T* b, int64_t ldb, int64_t n, int64_t K, T* c, int64_t ldc) {
  switch (isa()) {
#ifdef TROUPE_BI_X86
    case Isa::avx512: return avx512::dots(a, lda, m, b, ldb, n, K, c, ldc);
    case Isa::avx2: return avx2::dots(a, lda, m, b, ldb, n, K, c, ldc);
#endif
    default: return portable::dots(a, lda, m, b, ldb, n, K, c, ldc);
  }
}

template <class T>
void weighted_rows(const T* w, const int64_t* idx, int64_t n, const T* v, int64_t ldv, int64_t d, T* o) {
  switch (isa()) {
#ifdef TROUPE_BI_X86
    case Isa::avx512: return avx512::weighted_rows(w, idx, n, v, ldv, d, o);
    case Isa::avx2: return avx2::weighted_rows(w, idx, n, v, ldv, d, o);
#endif
    default: return portable::weighted_rows(w, idx, n, v, ldv, d, o);
  }
}

// ---------------------------------------------------------------------------------------------
// Argument checks and the ops.
// ---------------------------------------------------------------------------------------------

void check_input(const char* fn, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " is on ", t.device(),
              "; these kernels are CPU only (use the ATen ops on an accelerator)");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kFloat64, fn, ": ", name,
              " has dtype ", t.scalar_type(), "; only float32 and float64 are supported (cast bfloat16/half first)");
  TORCH_CHECK(!(c10::GradMode::is_enabled() && t.requires_grad()), fn, ": ", name,
              " requires grad while grad mode is on, and there is no backward; call it under torch::NoGradGuard");
}

void check_same_dtype(const char* fn, const char* name, const torch::Tensor& t, const torch::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), fn, ": ", name, " has dtype ", t.scalar_type(),
              " but the input has ", ref.scalar_type(), "; pass both in one dtype");
}

// Calls f(float{}) or f(double{}) for a tensor already checked to be one of them.
template <class F>
void with_dtype(torch::ScalarType t, F&& f) {
  if (t == torch::kFloat32)
    f(float{});
  else
    f(double{});
}

int64_t leading_rows(const torch::Tensor& t) {
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) rows *= t.size(i);
  return rows;
}

// Rows per parallel task so that one task holds about 64k elements of work.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(width, 1)); }

// out [M, N] = x [M, K] w^T [N, K] + bias, in tasks of MB rows x NB columns. The NB weight rows
// of a task (~220 KB at K = 576) stay in L2 while its rows stream past; consecutive task ids
// share a column block. The split decides only who computes an element, never how.
template <class T>
void linear_rows(const T* x, const T* w, const T* bias, T* out, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t MB = 240, NB = 96;  // multiples of every tile (4 x 6, 2 x 3)
  const int64_t nrb = (M + MB - 1) / MB, ncb = (N + NB - 1) / NB;
  at::parallel_for(0, nrb * ncb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = (t % nrb) * MB, c0 = (t / nrb) * NB;
      const int64_t rows = std::min(MB, M - r0), cols = std::min(NB, N - c0);
      T* o = out + r0 * N + c0;
      dots(x + r0 * K, K, rows, w + c0 * K, K, cols, K, o, N);
      if (bias == nullptr) continue;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) o[i * N + j] = o[i * N + j] + bias[c0 + j];
    }
  });
}

}  // namespace

torch::Tensor bi_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  check_input("bi_linear", "x", x);
  check_input("bi_linear", "weight", weight);
  check_same_dtype("bi_linear", "weight", weight, x);
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && weight.size(1) == x.size(-1), "bi_linear: x ", x.sizes(),
              " and weight ", weight.sizes(), " must be [..., K] and [N, K]");
  const int64_t K = x.size(-1), N = weight.size(0), M = leading_rows(x);
  if (bias.defined()) {
    check_input("bi_linear", "bias", bias);
    check_same_dtype("bi_linear", "bias", bias, x);
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "bi_linear: bias ", bias.sizes(), " must be [N] with N = ", N);
  }
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto bc = bias.defined() ? bias.contiguous() : bias;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty(sizes, x.options());  // [..., N]
  if (M == 0 || N == 0) return out;
  with_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    linear_rows<T>(xc.data_ptr<T>(), wc.data_ptr<T>(), bc.defined() ? bc.data_ptr<T>() : nullptr, out.data_ptr<T>(),
                   M, N, K);
  });
  return out;
}

torch::Tensor bi_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_input("bi_rms_norm", "x", x);
  check_input("bi_rms_norm", "weight", weight);
  check_same_dtype("bi_rms_norm", "weight", weight, x);
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "bi_rms_norm: x ", x.sizes(),
              " and weight ", weight.sizes(), " must be [..., D] and [D]");
  const int64_t D = x.size(-1), R = leading_rows(x);
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty(x.sizes(), x.options());  // [..., D]
  if (R == 0 || D == 0) return out;
  with_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    const T* wp = wc.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const T e = static_cast<T>(eps);  // as Hugging Face's `variance + eps` in the input dtype
    at::parallel_for(0, R, row_grain(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * D;
        const T var = lane_dot(xr, xr, D) / static_cast<T>(D);
        const T inv = T(1) / std::sqrt(var + e);  // torch.rsqrt is 1 / sqrt on CPU
        for (int64_t c = 0; c < D; ++c) op[r * D + c] = wp[c] * (xr[c] * inv);
      }
    });
  });
  return out;
}

torch::Tensor bi_silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  check_input("bi_silu_mul", "gate", gate);
  check_input("bi_silu_mul", "up", up);
  check_same_dtype("bi_silu_mul", "up", up, gate);
  TORCH_CHECK(gate.sizes() == up.sizes(), "bi_silu_mul: gate ", gate.sizes(), " and up ", up.sizes(),
              " must have the same shape");
  auto gc = gate.contiguous();
  auto uc = up.contiguous();
  auto out = torch::empty(gate.sizes(), gate.options());
  with_dtype(gate.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* g = gc.data_ptr<T>();
    const T* u = uc.data_ptr<T>();
    T* o = out.data_ptr<T>();
    // Scalar std::exp only: a vectorized exp would round differently from its scalar tail.
    at::parallel_for(0, gate.numel(), 16384, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = (g[i] / (T(1) + std::exp(-g[i]))) * u[i];
    });
  });
  return out;
}

std::pair<torch::Tensor, torch::Tensor> bi_rope_cos_sin(const torch::Tensor& positions, const torch::Tensor& inv_freq,
                                                        torch::ScalarType dtype) {
  TORCH_CHECK(positions.defined() && inv_freq.defined(), "bi_rope_cos_sin: positions and inv_freq must be defined");
  TORCH_CHECK(positions.device().is_cpu() && inv_freq.device().is_cpu(), "bi_rope_cos_sin: positions (on ",
              positions.device(), ") and inv_freq (on ", inv_freq.device(), ") must be CPU tensors");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 2, "bi_rope_cos_sin: positions ",
              positions.sizes(), " ", positions.scalar_type(), " must be [B, T] int64");
  TORCH_CHECK(inv_freq.scalar_type() == torch::kFloat32 && inv_freq.dim() == 1, "bi_rope_cos_sin: inv_freq ",
              inv_freq.sizes(), " ", inv_freq.scalar_type(), " must be [hd/2] float32, as Hugging Face keeps it");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kFloat64, "bi_rope_cos_sin: dtype ", dtype,
              " is not supported; only float32 and float64");
  const int64_t B = positions.size(0), T = positions.size(1), half = inv_freq.size(0), hd = 2 * half;
  auto pc = positions.contiguous();
  auto fc = inv_freq.contiguous();
  auto cos = torch::empty({B, T, hd}, torch::kFloat32);  // float32 math as in HF, then cast
  auto sin = torch::empty({B, T, hd}, torch::kFloat32);
  const int64_t* pos = pc.data_ptr<int64_t>();
  const float* inv = fc.data_ptr<float>();
  float* cp = cos.data_ptr<float>();
  float* sp = sin.data_ptr<float>();
  at::parallel_for(0, B * T, row_grain(hd * 8), [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const float p = static_cast<float>(pos[bt]);
      for (int64_t i = 0; i < half; ++i) {
        const float f = inv[i] * p;  // HF: inv_freq [hd/2, 1] @ position [1, T], one product each
        const float c = std::cos(f), s = std::sin(f);
        cp[bt * hd + i] = cp[bt * hd + half + i] = c;  // emb = cat(freqs, freqs)
        sp[bt * hd + i] = sp[bt * hd + half + i] = s;
      }
    }
  });
  if (dtype == torch::kFloat32) return {cos, sin};
  return {cos.to(dtype), sin.to(dtype)};
}

namespace {

// Query rows per task: their scores against keys [0, jmax) come from one tiled dots call.
constexpr int64_t kQueryBlock = 16;

template <class T>
void attention_rows(const T* q, const T* k, const T* v, const bool* mask, int64_t mask_bstride, T* out, int64_t B,
                    int64_t H, int64_t Hkv, int64_t Tq, int64_t S, int64_t d, double scale) {
  const int64_t nqb = (Tq + kQueryBlock - 1) / kQueryBlock, group = H / Hkv;
  const T sc = static_cast<T>(scale);
  at::parallel_for(0, B * H * nqb, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores, p;
    std::vector<int64_t> idx;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (H * nqb), h = (t / nqb) % H, i0 = (t % nqb) * kQueryBlock;
      const int64_t rows = std::min(kQueryBlock, Tq - i0);
      const T* qh = q + ((b * H + h) * Tq + i0) * d;  // [rows, d]
      const T* kh = k + (b * Hkv + h / group) * S * d;  // [S, d]
      const T* vh = v + (b * Hkv + h / group) * S * d;  // [S, d]
      const bool* mb = mask ? mask + b * mask_bstride + i0 * S : nullptr;  // [rows, S]
      // Keys [0, jmax) hold every allowed key of these rows; later ones are never touched.
      int64_t jmax = 0;
      if (!mb) {
        jmax = std::clamp<int64_t>(i0 + rows + S - Tq, 0, S);
      } else {
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = S - 1; j >= jmax; --j)
            if (mb[r * S + j]) {
              jmax = j + 1;
              break;
            }
      }
      scores.resize(rows * jmax);  // [rows, jmax]
      if (jmax > 0) dots(qh, d, rows, kh, d, jmax, d, scores.data(), jmax);
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out + ((b * H + h) * Tq + i0 + r) * d;
        const int64_t last = i0 + r + S - Tq;  // causal: keys j <= last
        idx.clear();
        p.clear();
        for (int64_t j = 0; j < jmax; ++j) {
          if (mb ? !mb[r * S + j] : j > last) continue;
          idx.push_back(j);
          p.push_back(sc * scores[r * jmax + j]);
        }
        if (idx.empty()) {
          std::fill(o, o + d, T(0));
          continue;
        }
        T m = p[0];
        for (T s : p) m = std::max(m, s);
        T den = 0;
        for (T& s : p) {
          s = std::exp(s - m);
          den = den + s;
        }
        weighted_rows(p.data(), idx.data(), static_cast<int64_t>(idx.size()), vh, d, d, o);
        for (int64_t c = 0; c < d; ++c) o[c] = o[c] / den;
      }
    }
  });
}

}  // namespace

torch::Tensor bi_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& mask, double scale) {
  check_input("bi_attention", "q", q);
  check_input("bi_attention", "k", k);
  check_input("bi_attention", "v", v);
  check_same_dtype("bi_attention", "k", k, q);
  check_same_dtype("bi_attention", "v", v, q);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "bi_attention: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " must be [B, H, Tq, d], [B, Hkv, S, d] and [B, Hkv, S, d] with H a multiple of Hkv");
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), d = q.size(3), Hkv = k.size(1), S = k.size(2);
  torch::Tensor mc;
  if (mask.defined()) {
    TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == torch::kBool, "bi_attention: mask must be a CPU bool "
                "tensor (true = may attend), got ", mask.scalar_type(), " on ", mask.device());
    TORCH_CHECK(mask.dim() == 4 && (mask.size(0) == B || mask.size(0) == 1) && mask.size(1) == 1 &&
                    mask.size(2) == Tq && mask.size(3) == S,
                "bi_attention: mask ", mask.sizes(), " must be [B, 1, Tq, S] = [", B, ", 1, ", Tq, ", ", S, "]");
    mc = mask.contiguous();
  }
  auto qc = q.contiguous();
  auto kc = k.contiguous();
  auto vc = v.contiguous();
  auto out = torch::empty({B, H, Tq, d}, q.options());
  if (out.numel() == 0) return out;
  with_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    attention_rows<T>(qc.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), mc.defined() ? mc.data_ptr<bool>() : nullptr,
                      mc.defined() && mc.size(0) == B ? Tq * S : 0, out.data_ptr<T>(), B, H, Hkv, Tq, S, d, scale);
  });
  return out;
}

torch::Tensor bi_log_softmax(const torch::Tensor& logits, const torch::Tensor& temperature) {
  check_input("bi_log_softmax", "logits", logits);
  TORCH_CHECK(logits.dim() >= 1, "bi_log_softmax: logits must be [..., V], got a scalar");
  const int64_t V = logits.size(-1), R = leading_rows(logits);
  TORCH_CHECK(temperature.defined() && temperature.device().is_cpu() && temperature.is_floating_point(),
              "bi_log_softmax: temperature must be a floating CPU tensor of [R] or [1]");
  TORCH_CHECK(temperature.dim() == 1 && (temperature.size(0) == R || temperature.size(0) == 1),
              "bi_log_softmax: temperature ", temperature.sizes(), " must be [R] = [", R, "] or [1]");
  auto lc = logits.contiguous();
  auto tc = temperature.to(torch::kFloat64).contiguous();
  const int64_t tstride = temperature.size(0) == 1 ? 0 : 1;
  auto out = torch::empty(logits.sizes(), logits.options());  // [..., V]
  if (R == 0 || V == 0) return out;
  with_dtype(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int L = kLanes<T>;
    const T* lp = lc.data_ptr<T>();
    const double* temp = tc.data_ptr<double>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, R, row_grain(V * 4), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T tr = static_cast<T>(temp[r * tstride]);
        const T* l = lp + r * V;
        T* o = op + r * V;
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < V; ++j) {
          o[j] = l[j] / tr;  // x
          m = std::max(m, o[j]);
        }
        const int64_t VL = V - V % L;
        T acc[L] = {};
        for (int64_t j = 0; j < VL; j += L)
          for (int l2 = 0; l2 < L; ++l2) acc[l2] = acc[l2] + std::exp(o[j + l2] - m);
        T sum = combine_lanes(acc);
        for (int64_t j = VL; j < V; ++j) sum = sum + std::exp(o[j] - m);
        const T lse = std::log(sum);
        for (int64_t j = 0; j < V; ++j) o[j] = (o[j] - m) - lse;
      }
    });
  });
  return out;
}

}  // namespace troupe::kernels
