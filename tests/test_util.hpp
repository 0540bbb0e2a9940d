// Small helpers shared by the tests: where fixtures and shared data live.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace troupe::test {

// A directory named by an environment variable that CTest sets (see tests/CMakeLists.txt).
inline std::filesystem::path env_dir(const char* var) {
  const char* v = std::getenv(var);
  if (!v || !*v) throw std::runtime_error(std::string(var) + " is not set: run the tests through ctest (make test)");
  return v;
}
inline std::filesystem::path fixtures() { return env_dir("TROUPE_FIXTURES"); }
inline std::filesystem::path source() { return env_dir("TROUPE_SOURCE"); }
inline std::filesystem::path data() { return env_dir("TROUPE_DATA"); }
inline std::filesystem::path smollm2_gguf() {
  return source() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace troupe::test
