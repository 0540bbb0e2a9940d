// runs/NAME/status.json: what a run is doing now, for the dashboard (apps/dashboard.hpp). Its
// state, step, and each actor's state and queue, rewritten whole (a temporary file, then a
// rename, so a reader never sees half of it) about once a second while the run goes on, and a
// last time when it ends. A run killed before it could write its end is told apart by its
// process: the reader checks that the pid written still lives (and is the same process).
// Plain files, no LibTorch, no CAF.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace troupe {

struct ActorStatus {
  std::string name;    // "generator 0", "reward", "trainer"
  std::string state;   // generating, loading weights, scoring, training, checkpointing, waiting, failed
  int64_t queue = 0;   // what waits on it: prompts (a generator), groups (the reward, the trainer)
  std::string detail;  // e.g. "weights v3", "in worker pid 1234", why it failed
};

class RunStatus {
 public:
  // `dir` empty: writes nothing.
  RunStatus(std::filesystem::path dir, std::string recipe, int64_t steps);
  // Running, `step` steps trained. Does nothing once the run's end was written (end_run_status).
  void running(int64_t step, const std::vector<ActorStatus>& actors);
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::string recipe_;
  int64_t steps_;
};

// The run's end: state finished, stopped or failed, with `error` saying why for the last two;
// `step` < 0 keeps the step last written.
// Only in a process that wrote the run's status (so a config refused before the run began does
// not overwrite an earlier run's end), once: every later call, and every later running(), leave
// it as it is (so a stop signal's last word stays).
void end_run_status(const std::filesystem::path& dir, const std::string& state, int64_t step, const std::string& error);

// status.json of run folder `dir` as the dashboard shows it: a run written as running whose
// process on this machine is gone is failed ("killed"); a folder without status.json (a run of
// an older troupe) is finished when it has metrics. Throws Error naming the file when it is not
// valid JSON.
nlohmann::json read_run_status(const std::filesystem::path& dir);

}  // namespace troupe
