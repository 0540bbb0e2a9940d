#include "actors/trainer_state.hpp"

#include <fstream>

#include "policy/error.hpp"

namespace troupe {

namespace {

// An integer field: nlohmann's get<int64_t>() would cast a float silently (undefined behaviour
// past int64's range) and a large unsigned one to a negative number.
int64_t integer(const nlohmann::json& v, const std::string& key, const std::string& file) {
  if (v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))) return v.get<int64_t>();
  const std::string got = v.is_primitive() && !v.is_string() ? v.dump() : std::string("a ") + v.type_name();
  throw Error(file + ": " + key + " is " + got + ", expected an integer");
}

}  // namespace

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
    const std::string name = file.string();
    int64_t format = j.contains("format") ? integer(j["format"], "format", name) : TrainerState::kFormat;
    if (format != TrainerState::kFormat)
      throw Error(file.string() + ": trainer_state format " + std::to_string(format) + ", this troupe reads format " +
                  std::to_string(TrainerState::kFormat));
    j.at("recipe").get_to(s.recipe);
    s.model = j.value("model", "");
    s.step = integer(j.at("step"), "step", name);
    s.policy_version = integer(j.at("policy_version"), "policy_version", name);
    if (j.contains("cursor")) {
      // The data cursor of the trainer-alone recipes, {"epoch": e, "position": p}: written back
      // at the next checkpoint, and its counts read on resume.
      // Checked before it is copied: copies recurse once per level of nesting.
      const auto& cursor = j["cursor"];
      if (!cursor.is_object())
        throw Error(name + ": cursor is " + (cursor.is_array() ? "an " : "a ") + cursor.type_name() +
                    ", expected {\"epoch\": e, \"position\": p}");
      for (const auto& [key, v] : cursor.items())
        if (integer(v, "cursor." + key, name) < 0) throw Error(name + ": cursor." + key + " is negative");
      s.cursor = cursor;
    }
    if (j.contains("rollout_batches")) {
      const auto& batches = j["rollout_batches"];
      s.rollout_batches = {integer(batches.at(0), "rollout_batches[0]", name), integer(batches.at(1), "rollout_batches[1]", name)};
      j.at("rollouts").get_to(s.rollouts);
      // A file name inside the checkpoint folder: resume reads it from there, and nothing else.
      if (s.rollouts.empty() || s.rollouts == "." || s.rollouts == ".." || s.rollouts.find('/') != std::string::npos ||
          s.rollouts.find('\0') != std::string::npos)
        throw Error(name + ": rollouts is '" + s.rollouts + "', expected a file name in the checkpoint folder (rollouts.msgpack)");
      s.refilled = j.contains("refilled") ? integer(j["refilled"], "refilled", name) : 0;  // absent before dynamic sampling: none
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(file.string() + ": " + e.what() + expected);
  }
  return s;
}

}  // namespace troupe
