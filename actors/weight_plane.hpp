// The weight data plane: the trainer writes each version it sends once, as a safetensors file
// in shared memory (/dev/shm, when it has room; else the run folder), and the control plane
// carries only the notice (WeightsReady). Generators on the trainer's host map the same file;
// generators on other hosts (or with cluster.weight_transport: http) fetch it over HTTP from the
// trainer, which serves the folder whenever the run listens for workers. The controller frees a
// version once every generator has loaded it or a later one, and never the newest, which a
// joining generator takes first.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "actors/protocol.hpp"

namespace at { class Tensor; }

namespace troupe {

class WeightServer;

class WeightStore {
 public:
  // `fallback`: where files go when shared memory is missing or too small (a run folder).
  // `serve_on`: a host address to serve the files on over HTTP (any free port); empty: none.
  WeightStore(std::filesystem::path fallback, int64_t bytes_hint, const std::string& serve_on = "");
  ~WeightStore();  // stops serving and removes the folder
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  WeightsReady write(const std::map<std::string, at::Tensor>& weights, int64_t version);
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::unique_ptr<WeightServer> server_;
};

// This machine, as notices name it (its boot id): a notice from another host is fetched by URL.
const std::string& this_host();

// The tensors a notice points at: the file itself on the trainer's host, else (or with
// `over_http`) the notice's URL. Throws Error naming the file or URL.
std::map<std::string, at::Tensor> read_weights(const WeightsReady& notice, bool over_http = false);

// Removes the file of a version no generator needs any more (a missing file is not an error).
void free_weights(const WeightsReady& notice);

}  // namespace troupe
