// model.dtype auto and --dtype: bfloat16 only where the CPU computes it natively. The detection
// is checked against the kernel's own reading of the CPU (/proc/cpuinfo flags), and the two
// overrides (TROUPE_CPU_BF16 for tests, oneDNN's ONEDNN_MAX_CPU_ISA) simulate the other kind.
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include "kernels/cpu_features.hpp"
#include "policy/dtype.hpp"
#include "policy/error.hpp"

using namespace troupe;

namespace {

// Sets (or with nullptr, unsets) an environment variable for one scope, restoring it after.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> old;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
    if (value) setenv(n, value, 1); else unsetenv(n);
  }
  ~ScopedEnv() {
    if (old) setenv(name.c_str(), old->c_str(), 1); else unsetenv(name.c_str());
  }
};

std::set<std::string> cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::set<std::string> flags;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) flags.insert(w);
    break;
  }
  return flags;
}

// The dtype's name ("Float", "BFloat16", "Half"): doctest prints strings, not ScalarTypes.
std::string name(torch::Dtype d) { return c10::toString(d); }

}  // namespace

TEST_CASE("the detection agrees with the kernel's CPU flags") {
  ScopedEnv force("TROUPE_CPU_BF16", nullptr);
  ScopedEnv isa("ONEDNN_MAX_CPU_ISA", nullptr);
  auto flags = cpuinfo_flags();
  REQUIRE_MESSAGE(!flags.empty(), "/proc/cpuinfo has no flags line");
  // Linux lists a feature only when the OS enables its register state, as the detection requires.
  const bool expected = flags.count("avx512_bf16") || flags.count("amx_bf16");
  auto found = cpu_bf16();
  INFO("detected: ", found.reason);
  CHECK(found.native == expected);
  CHECK(!found.reason.empty());
}

TEST_CASE("auto picks float32 on a CPU without native bf16 and says why") {
  ScopedEnv force("TROUPE_CPU_BF16", "0");
  auto c = choose_dtype("auto", torch::kCPU, "model.dtype");
  CHECK(name(c.dtype) == "Float");
  CHECK(!c.warning);
  CHECK(c.note.find("model.dtype auto: float32") == 0);
  CHECK(c.note.find("TROUPE_CPU_BF16=0") != std::string::npos);
  CHECK(c.note.find("30x slower") != std::string::npos);

  auto explicit_bf16 = choose_dtype("bfloat16", torch::kCPU, "model.dtype");
  CHECK(name(explicit_bf16.dtype) == "BFloat16");  // asked for: kept, but warned about
  CHECK(explicit_bf16.warning);
  CHECK(explicit_bf16.note.find("warning: model.dtype bfloat16 is not native on this CPU") == 0);

  auto fp32 = choose_dtype("float32", torch::kCPU, "model.dtype");
  CHECK(name(fp32.dtype) == "Float");
  CHECK(fp32.note.empty());
}

TEST_CASE("auto picks bfloat16 where the CPU computes it natively") {
  ScopedEnv force("TROUPE_CPU_BF16", "1");
  auto c = choose_dtype("auto", torch::kCPU, "--dtype");
  CHECK(name(c.dtype) == "BFloat16");
  CHECK(c.note.find("--dtype auto: bfloat16 (this CPU computes it natively") == 0);
  auto explicit_bf16 = choose_dtype("bfloat16", torch::kCPU, "--dtype");
  CHECK(name(explicit_bf16.dtype) == "BFloat16");
  CHECK(explicit_bf16.note.empty());
  CHECK(!explicit_bf16.warning);
}

TEST_CASE("ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 rules native bf16 out") {
  ScopedEnv force("TROUPE_CPU_BF16", nullptr);
  {
    ScopedEnv isa("ONEDNN_MAX_CPU_ISA", "AVX2");
    auto found = cpu_bf16();
    CHECK(!found.native);
    CHECK(name(choose_dtype("auto", torch::kCPU, "model.dtype").dtype) == "Float");
  }
  {
    // A limit at or above bf16 changes nothing: the answer is the machine's.
    ScopedEnv isa("ONEDNN_MAX_CPU_ISA", "avx512_core_amx");
    auto flags = cpuinfo_flags();
    CHECK(cpu_bf16().native == (flags.count("avx512_bf16") || flags.count("amx_bf16")));
  }
}

TEST_CASE("auto on a GPU is bfloat16") {
  auto c = choose_dtype("auto", torch::Device("cuda:0"), "model.dtype");
  CHECK(name(c.dtype) == "BFloat16");
  CHECK(name(choose_dtype("float16", torch::Device("cuda"), "--dtype").dtype) == "Half");
}

TEST_CASE("bad names and bad overrides are errors that name the setting") {
  CHECK_THROWS_WITH_AS(choose_dtype("fp16", torch::kCPU, "--dtype"),
                       "--dtype 'fp16': expected auto, float32, bfloat16, float16 or float64", Error);
  ScopedEnv force("TROUPE_CPU_BF16", "yes");
  CHECK_THROWS_WITH(cpu_bf16(),
                    "TROUPE_CPU_BF16='yes': expected 1 (treat bf16 as native) or 0 (as emulated); unset it to detect");
}
