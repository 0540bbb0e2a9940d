#include "actors/weight_plane.hpp"

#include <chrono>
#include <cerrno>
#include <csignal>
#include <unistd.h>

#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"

namespace troupe {
namespace fs = std::filesystem;

namespace {

// A folder of its own under `root`, named by process and a counter (several runs in one process).
fs::path fresh_dir(const fs::path& root) {
  static std::atomic<int64_t> counter{0};
  auto dir = root / ("troupe-weights-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Folders left by runs that were killed (SIGKILL, a crash) hold a whole model each: a folder
// whose process is gone is removed.
void sweep_stale(const fs::path& root) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, fs::directory_options::skip_permission_denied, ec)) {
    const auto name = e.path().filename().string();
    const std::string prefix = "troupe-weights-";
    if (name.rfind(prefix, 0) != 0) continue;
    const auto pid = std::atoll(name.c_str() + prefix.size());
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) fs::remove_all(e.path(), ec);
  }
}

}  // namespace

WeightStore::WeightStore(fs::path fallback, int64_t bytes_hint) {
  sweep_stale("/dev/shm");
  // Two versions may be on disk at once (the newest and one a slow generator still loads).
  std::error_code ec;
  auto shm = fs::space("/dev/shm", ec);
  if (!ec && fs::is_directory("/dev/shm") && shm.available > static_cast<uintmax_t>(3 * bytes_hint)) {
    dir_ = fresh_dir("/dev/shm");
  } else {
    dir_ = fresh_dir(fallback.empty() ? fs::temp_directory_path() : fallback);
  }
}

WeightStore::~WeightStore() {
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

WeightsReady WeightStore::write(const std::map<std::string, torch::Tensor>& weights, int64_t version) {
  auto start = std::chrono::steady_clock::now();
  auto file = dir_ / ("v" + std::to_string(version) + ".safetensors");
  int64_t bytes = write_safetensors(file, weights);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return WeightsReady{version, file.string(), bytes, s};
}

std::map<std::string, torch::Tensor> read_weights(const WeightsReady& notice) {
  return read_safetensors_file(notice.path);
}

void free_weights(const WeightsReady& notice) {
  std::error_code ec;
  fs::remove(notice.path, ec);
}

}  // namespace troupe
