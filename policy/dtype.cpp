// auto is decided per device at run time; the CPU's answer comes from cpuid, not the build.
#include "policy/dtype.hpp"

#include "kernels/cpu_features.hpp"
#include "policy/error.hpp"

namespace troupe {

DtypeChoice choose_dtype(std::string_view name, const torch::Device& device, std::string_view key) {
  const std::string k(key);
  if (name != "auto" && name != "float32" && name != "bfloat16" && name != "float16" && name != "float64")
    throw Error(k + " '" + std::string(name) + "': expected auto, float32, bfloat16, float16 or float64");
  if (name == "float32") return {torch::kFloat32, "", false};
  if (name == "float64") return {torch::kFloat64, "", false};
  if (!device.is_cpu()) {
    if (name == "auto") return {torch::kBFloat16, k + " auto: bfloat16 on " + device.str(), false};
    return {name == "bfloat16" ? torch::kBFloat16 : torch::kFloat16, "", false};
  }
  const CpuBf16 cpu = cpu_bf16();
  if (name == "auto") {
    if (cpu.native) return {torch::kBFloat16, k + " auto: bfloat16 (this CPU computes it natively: " + cpu.reason + ")", false};
    return {torch::kFloat32, k + " auto: float32 (bfloat16 is not native on this CPU: " + cpu.reason +
                                 "; emulated bf16 matmuls run about 30x slower than float32)", false};
  }
  if (name == "float16")
    return {torch::kFloat16, "warning: " + k + " float16 on a CPU: matmuls are emulated and slow; float32 or auto is faster", true};
  if (cpu.native) return {torch::kBFloat16, "", false};
  return {torch::kBFloat16, "warning: " + k + " bfloat16 is not native on this CPU (" + cpu.reason +
                                "): bf16 matmuls run about 30x slower than float32; " + k + "=auto picks float32 here", true};
}

}  // namespace troupe
