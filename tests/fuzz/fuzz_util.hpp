// What the harnesses share: a file in memory for parsers that take a path, and the split of one
// input into the parts a harness feeds to its parser. libFuzzer calls LLVMFuzzerTestOneInput.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::fuzz {

// A folder of this process's own, for parsers that read several files of a folder: in memory
// where there is a tmpfs, removed at exit (libFuzzer ends with exit()). One per harness.
inline const std::filesystem::path& scratch_dir(const char* name) {
  namespace fs = std::filesystem;
  static const fs::path d = [name] {
    const fs::path tmp = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    fs::path p = tmp / (std::string("troupe_fuzz_") + name + "." + std::to_string(getpid()));
    fs::create_directories(p);
    return p;
  }();
  // Registered once d is made, so that it runs before d is destroyed.
  static const bool cleanup = std::atexit([] {
    std::error_code ec;
    fs::remove_all(d, ec);
  }) == 0;
  (void)cleanup;
  return d;
}

// A memfd with a path (/proc/self/fd/N) that open() and mmap() take like a file on disk, rewritten
// for every input: no disk writes, no files left behind.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(memfd_create(name, MFD_CLOEXEC)) {
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  const std::string& write(const void* data, size_t size) {
    if (ftruncate(fd_, 0) != 0) std::abort();
    const auto* p = static_cast<const char*>(data);
    for (size_t done = 0; done < size;) {
      const ssize_t n = pwrite(fd_, p + done, size - done, static_cast<off_t>(done));
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
    return path_;
  }
  const std::string& write(std::string_view s) { return write(s.data(), s.size()); }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

// The input cut at NUL bytes: text formats (JSON, YAML, JSONL) cannot hold one, so a harness that
// needs several parts (a document, then the text to encode) reads them this way.
inline std::vector<std::string_view> split_nul(const uint8_t* data, size_t size, size_t max_parts) {
  std::vector<std::string_view> parts;
  std::string_view s(reinterpret_cast<const char*>(data), size);
  while (parts.size() + 1 < max_parts) {
    const size_t nul = s.find('\0');
    if (nul == std::string_view::npos) break;
    parts.push_back(s.substr(0, nul));
    s.remove_prefix(nul + 1);
  }
  parts.push_back(s);
  return parts;
}

// A broken promise of the parser under test (not a rejected input): report it and stop, so
// libFuzzer saves the input as a crash.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz harness: %s\n", what.c_str());
  std::abort();
}

}  // namespace troupe::fuzz
