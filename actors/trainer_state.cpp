#include "actors/trainer_state.hpp"

#include <fstream>

#include "policy/error.hpp"

namespace troupe {

void write_trainer_state(const std::filesystem::path& dir, const TrainerState& s) {
  nlohmann::json j{{"format", TrainerState::kFormat}, {"recipe", s.recipe}, {"model", s.model}, {"step", s.step},
                   {"policy_version", s.policy_version}};
  if (s.rollout_batches) {
    j["rollout_batches"] = {s.rollout_batches->first, s.rollout_batches->second};
    j["rollouts"] = s.rollouts;
    j["refilled"] = s.refilled;
  } else {
    j["cursor"] = s.cursor;
  }
  std::ofstream(dir / "trainer_state.json.part") << j.dump(2) << "\n";
  std::filesystem::rename(dir / "trainer_state.json.part", dir / "trainer_state.json");
}

TrainerState read_trainer_state(const std::filesystem::path& dir) {
  auto file = dir / "trainer_state.json";
  std::ifstream in(file);
  if (!in) throw Error(file.string() + ": cannot open (not a complete troupe checkpoint)");
  auto j = nlohmann::json::parse(in, nullptr, false);
  const std::string expected = " (expected format, recipe, model, step, policy_version)";
  if (j.is_discarded() || !j.is_object()) throw Error(file.string() + ": not a JSON object" + expected);
  TrainerState s;
  try {
    // Checkpoints written before the format field have the same fields: they read as format 1.
    int64_t format = j.value("format", TrainerState::kFormat);
    if (format != TrainerState::kFormat)
      throw Error(file.string() + ": trainer_state format " + std::to_string(format) + ", this troupe reads format " +
                  std::to_string(TrainerState::kFormat));
    j.at("recipe").get_to(s.recipe);
    s.model = j.value("model", "");
    j.at("step").get_to(s.step);
    j.at("policy_version").get_to(s.policy_version);
    if (j.contains("cursor")) s.cursor = j["cursor"];
    if (j.contains("rollout_batches")) {
      s.rollout_batches = {j["rollout_batches"].at(0).get<int64_t>(), j["rollout_batches"].at(1).get<int64_t>()};
      j.at("rollouts").get_to(s.rollouts);
      s.refilled = j.value("refilled", int64_t{0});  // absent before dynamic sampling: none
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(file.string() + ": " + e.what() + expected);
  }
  return s;
}

}  // namespace troupe
