// trainer_state.json: the one file that marks a checkpoint complete, for every recipe. It is
// written last (to a side file, then renamed), so a checkpoint cut short by a kill has none.
//
//   format          1
//   recipe, model   what trained, checked on resume
//   step            steps completed
//   policy_version  weight updates made: one per step that changed the weights, whatever the
//                   optimizer steps inside it (GRPO's num_iterations); what generators see and
//                   what max_staleness counts in. A step that trains nothing (every group
//                   failed) leaves it where it was.
//   cursor          trainer-alone recipes (sft, lora, dpo): {"epoch", "position"} of the data
//   rollout_batches RL recipes: the batches [begin, end) released but not trained at `step`,
//   rollouts        and the file holding their groups (rollouts.msgpack)
//   refilled        RL recipes: prompts drawn to replace filtered groups (dynamic sampling) so
//                   far; the data source resumes at end * batch_groups + refilled prompts
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace troupe {

struct TrainerState {
  static constexpr int64_t kFormat = 1;
  std::string recipe, model;
  int64_t step = 0;
  int64_t policy_version = 0;
  nlohmann::json cursor = nlohmann::json::object();
  std::optional<std::pair<int64_t, int64_t>> rollout_batches;
  std::string rollouts;
  int64_t refilled = 0;
};

void write_trainer_state(const std::filesystem::path& dir, const TrainerState& state);
// Throws Error naming the file when it is missing, not JSON, of another format or lacks a field.
TrainerState read_trainer_state(const std::filesystem::path& dir);

}  // namespace troupe
