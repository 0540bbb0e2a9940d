// What `troupe run` prints while it runs and when it ends: the line per step (actor graph and
// trainer-alone recipes), its pace (steps per minute, time left) and the list of what was
// written where. Text only: the numbers come from the step's metrics.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

namespace troupe {

// Steps per minute and the time left, from the steps this process has made (a resumed run
// counts from its first new step). The first step's pace includes loading and warm-up.
class Pace {
 public:
  explicit Pace(int64_t total_steps);
  // "1.8 steps/min  ETA 9m12s" after step `step`; "done" at the last one. Called after every step
  // of this process, printed or not: the first call marks the step this process started after.
  std::string tick(int64_t step);

 private:
  using Clock = std::chrono::steady_clock;
  int64_t total_;
  Clock::time_point start_ = Clock::now();
  int64_t first_step_ = -1;  // the step before this process's first one
};

// Colour only when standard output is a terminal that takes it (and NO_COLOR is not set).
bool colour_terminal();

// One step of the actor graph: reward, loss, KL, staleness, where the time went (generating,
// training, waiting for rollouts), tokens/s, and `pace`; `colour` adds ANSI colours.
std::string progress_line(const nlohmann::json& metrics, int64_t steps, const std::string& pace = "", bool colour = false);

// What a run folder holds, one line per entry that exists (config, metrics, TensorBoard events,
// samples, failures, checkpoints), for the end of `troupe run`.
std::string run_folder_summary(const std::filesystem::path& dir);

}  // namespace troupe
