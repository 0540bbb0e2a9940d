// The weight data plane: the trainer writes each version it sends once, as a safetensors file
// in shared memory (/dev/shm, when it has room; else the run folder), and the control plane
// carries only the notice (WeightsReady). Generators in this process and in worker processes on
// this host map the same file. The controller frees a version once every generator has loaded it
// or a later one, and never the newest, which a joining generator takes first.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "actors/protocol.hpp"

namespace at { class Tensor; }

namespace troupe {

class WeightStore {
 public:
  // `fallback`: where files go when shared memory is missing or too small (a run folder).
  WeightStore(std::filesystem::path fallback, int64_t bytes_hint);
  ~WeightStore();  // removes the folder
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  WeightsReady write(const std::map<std::string, at::Tensor>& weights, int64_t version);
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
};

// The tensors a notice points at, copied out of the mapped file; throws Error naming the file.
std::map<std::string, at::Tensor> read_weights(const WeightsReady& notice);

// Removes the file of a version no generator needs any more (a missing file is not an error).
void free_weights(const WeightsReady& notice);

}  // namespace troupe
