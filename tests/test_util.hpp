// Small helpers shared by the tests: where fixtures and shared data live.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
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

struct CommandResult {
  int status;       // the exit code, or -1 when the command did not exit normally
  std::string out;  // what it wrote to stdout (and stderr, where the command line redirects it)
};

// 'text' for a POSIX shell.
inline std::string shell_quote(const std::string& text) {
  std::string q = "'";
  for (char c : text) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs a shell command line and collects its output; the tests that drive the troupe binary use it.
inline CommandResult run_command(const std::string& command_line) {
  FILE* pipe = popen(command_line.c_str(), "r");
  if (!pipe) throw std::runtime_error("cannot run: " + command_line);
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
  int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace troupe::test
