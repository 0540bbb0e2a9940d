// What the AVX2 + FMA loops of kernels/ share (weight_only.cpp, decode_attention.cpp,
// gumbel_max.cpp): the run-time check for the instructions, a horizontal sum, and SLEEF's exp and
// log. Each function is compiled for AVX2 + FMA by its own attribute, so files built for the
// baseline ISA call them only after the check. Not for callers outside kernels/.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
// SLEEF's exp and log over 8 floats (1 ulp), which the torch wheel's libtorch_cpu exports: ATen's
// AVX2 kernels call them (ATen/cpu/vec/vec256/vec256_float.h). Declared here rather than through
// sleef.h, which declares its AVX2 functions only in files compiled for AVX2.
extern "C" __attribute__((target("avx2,fma"))) __m256 Sleef_expf8_u10avx2(__m256);
extern "C" __attribute__((target("avx2,fma"))) __m256 Sleef_logf8_u10avx2(__m256);
#endif

namespace troupe::kernels::avx2 {

// Whether this CPU has AVX2 and FMA (read once).
inline bool supported() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

#if defined(__x86_64__)
// The sum of v's 8 lanes.
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace troupe::kernels::avx2
