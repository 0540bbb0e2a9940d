// cpuid leaf 7 for the instruction sets and xgetbv for the register state the kernel saves:
// a CPU that has AVX-512 BF16 under an OS (or hypervisor) that leaves ZMM state off cannot use it.
#include "kernels/cpu_features.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace troupe {
namespace {

std::string upper(std::string_view s) {
  std::string u(s);
  std::transform(u.begin(), u.end(), u.begin(), [](unsigned char c) { return std::toupper(c); });
  return u;
}

#if defined(__x86_64__) || defined(__i386__)
uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

CpuBf16 detect() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return {false, "the OS does not enable AVX state (no OSXSAVE)"};
  const uint64_t state = xcr0();
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return {false, "no AVX-512 BF16 or AMX-BF16 (cpuid has no leaf 7)"};
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx512f = b & (1u << 16);
  const bool amx_bf16 = d & (1u << 22);
  __cpuid_count(7, 1, a, b, c, d);
  const bool avx512_bf16 = avx512f && (a & (1u << 5));
  const bool zmm_state = (state & 0xe6) == 0xe6;         // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  const bool tile_state = (state & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  if (amx_bf16 && tile_state) return {true, "AMX-BF16"};
  if (avx512_bf16 && zmm_state) return {true, "AVX-512 BF16"};
  if (avx512_bf16) return {false, "AVX-512 BF16 present but its register state is disabled by the OS"};
  return {false, avx512f ? "AVX-512 without BF16" : "no AVX-512 BF16 or AMX-BF16"};
}
#else
CpuBf16 detect() { return {false, "not an x86-64 CPU (bf16 support is not detected here)"}; }
#endif

// oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) at or above AVX512_CORE_BF16; any other value
// keeps oneDNN's bf16 matmuls off the native path.
bool isa_limit_keeps_bf16(const std::string& isa) {
  static constexpr std::array<std::string_view, 10> kWithBf16 = {
      "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
      "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512_AMX_2"};
  return std::find(kWithBf16.begin(), kWithBf16.end(), isa) != kWithBf16.end();
}

}  // namespace

CpuBf16 cpu_bf16() {
  if (const char* force = std::getenv("TROUPE_CPU_BF16"); force && *force) {
    std::string v = force;
    if (v == "1") return {true, "TROUPE_CPU_BF16=1"};
    if (v == "0") return {false, "TROUPE_CPU_BF16=0"};
    throw std::invalid_argument("TROUPE_CPU_BF16='" + v + "': expected 1 (treat bf16 as native) or 0 (as emulated); unset it to detect");
  }
  CpuBf16 found = detect();
  if (const char* isa = std::getenv("ONEDNN_MAX_CPU_ISA"); found.native && isa && *isa) {
    std::string u = upper(isa);
    if (!isa_limit_keeps_bf16(u)) return {false, "ONEDNN_MAX_CPU_ISA=" + std::string(isa) + " keeps oneDNN below AVX512_CORE_BF16"};
  }
  return found;
}

}  // namespace troupe
