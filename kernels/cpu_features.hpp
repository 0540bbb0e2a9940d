// What this CPU computes natively, read at run time (cpuid and the OS's enabled register
// state), never assumed from the build machine. No LibTorch: callers decide what to do with it.
#pragma once

#include <string>

namespace troupe {

// Whether bfloat16 matmuls run natively here: AVX-512 BF16 or AMX-BF16, enabled by the OS,
// and not ruled out by ONEDNN_MAX_CPU_ISA (which limits the kernels LibTorch's oneDNN uses).
// Without it a bf16 matmul is emulated, about 30x slower than float32.
// TROUPE_CPU_BF16=1 or 0 overrides the detection (tests simulate the other kind of CPU).
struct CpuBf16 {
  bool native = false;
  std::string reason;  // "AVX-512 BF16", "no AVX-512 BF16 or AMX-BF16", "TROUPE_CPU_BF16=0", ...
};
CpuBf16 cpu_bf16();

}  // namespace troupe
