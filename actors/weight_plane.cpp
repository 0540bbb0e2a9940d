#include "actors/weight_plane.hpp"

#include <chrono>
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

}  // namespace

WeightStore::WeightStore(fs::path fallback, int64_t bytes_hint) {
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
