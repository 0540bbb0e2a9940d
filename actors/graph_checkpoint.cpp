#include "actors/graph_checkpoint.hpp"

#include <algorithm>
#include <fstream>

#include <torch/torch.h>

#include "actors/graph.hpp"
#include "actors/rl_recipe.hpp"
#include "actors/trainer_ranks.hpp"
#include "actors/trainer_state.hpp"
#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/lora.hpp"
#include "policy/safetensors.hpp"
#include "trainer/data_parallel.hpp"

namespace troupe {

int64_t outstanding_end(const GraphSpec& spec, int64_t step) {
  return std::min(spec.steps, step + spec.max_staleness - spec.sync_every + 1);
}

// Rollout groups as msgpack (doubles hold floats exactly).
nlohmann::json to_json(const RolloutGroup& g) {
  return {{"prompt_id", g.prompt_id}, {"batch", g.batch}, {"prompt_ids", g.prompt_ids},
          {"completion_ids", g.completion_ids}, {"behaviour_logprobs", g.behaviour_logprobs},
          {"reference_logprobs", g.reference_logprobs}, {"min_version", g.min_version},
          {"max_version", g.max_version}, {"truncated", g.truncated}, {"rewards", g.rewards},
          {"reward", g.reward}, {"metadata", g.metadata}, {"ticket", g.ticket}, {"error", g.error},
          {"generate_s", g.generate_s}};
}

RolloutGroup group_from_json(const nlohmann::json& j) {
  RolloutGroup g;
  j.at("prompt_id").get_to(g.prompt_id);
  j.at("batch").get_to(g.batch);
  j.at("prompt_ids").get_to(g.prompt_ids);
  j.at("completion_ids").get_to(g.completion_ids);
  j.at("behaviour_logprobs").get_to(g.behaviour_logprobs);
  j.at("reference_logprobs").get_to(g.reference_logprobs);
  j.at("min_version").get_to(g.min_version);
  j.at("max_version").get_to(g.max_version);
  j.at("truncated").get_to(g.truncated);
  j.at("rewards").get_to(g.rewards);
  j.at("reward").get_to(g.reward);
  j.at("metadata").get_to(g.metadata);
  j.at("ticket").get_to(g.ticket);
  j.at("error").get_to(g.error);
  g.generate_s = j.value("generate_s", 0.0);  // checkpoints of older builds have none
  if (g.behaviour_logprobs.size() != g.completion_ids.size() || g.min_version.size() != g.completion_ids.size())
    throw Error("a rollout group's per-completion fields disagree in length");
  return g;
}

std::filesystem::path checkpoint_dir(const GraphSpec& spec, int64_t step) {
  return spec.run_dir / "checkpoints" / ("step_" + std::to_string(step));
}

void save_rank_state(RlRecipe& recipe, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  recipe.save_state(dir);
  DataParallel* dp = recipe.data_parallel();
  const int rank = dp ? dp->rank() : 0;
  torch::save(at::detail::getDefaultCPUGenerator().get_state(),
              (dir / (rank == 0 ? std::string("rng.pt") : "rng.rank" + std::to_string(rank) + ".pt")).string());
  if (rank == 0) {
    // Ranks beyond this world size, from a checkpoint of the same step rewritten at fewer ranks.
    const int ranks = dp ? dp->size() : 1;
    for (int r = ranks; std::filesystem::exists(dir / ("rng.rank" + std::to_string(r) + ".pt")); ++r)
      std::filesystem::remove(dir / ("rng.rank" + std::to_string(r) + ".pt"));
  }
  if (dp && dp->size() > 1) dp->barrier();
}

void restore_recipe(RlRecipe& recipe, const GraphSpec& spec, const GraphResume& r) {
  {
    WholeWeights whole(recipe.data_parallel());  // zero3: whole parameters to load into
    if (spec.lora) {
      load_peft_adapter(*recipe.model(), r.dir / "adapter");
    } else {
      load_weights(*recipe.model(), read_safetensors(safetensors::Checkpoint::open_dir(r.dir)), r.dir.string());
    }
    if (DataParallel* dp = recipe.data_parallel()) dp->reshard();
  }
  recipe.load_state(r.dir);
  // This rank's random state where the checkpoint has one (the same world size), else rank 0's.
  const DataParallel* dp = recipe.data_parallel();
  auto rng_file = r.dir / ("rng.rank" + std::to_string(dp ? dp->rank() : 0) + ".pt");
  if (!std::filesystem::exists(rng_file)) rng_file = r.dir / "rng.pt";
  torch::Tensor rng;
  torch::load(rng, rng_file.string());
  auto generator = at::detail::getDefaultCPUGenerator();  // a handle: set_state needs a non-const one
  generator.set_state(rng);
}

namespace {

// The part of a checkpoint that can be written at once; the other trainer ranks write their
// parts meanwhile (trainer_ranks.cpp).
void save_weights(const GraphSpec& spec, RlRecipe& recipe, const std::filesystem::path& dir) {
  {
    WholeWeights whole(recipe.data_parallel());  // zero3: the export needs whole parameters
    LoadedModel m{spec.model_config, recipe.model(), std::nullopt, nullptr, spec.model_source};
    if (spec.lora) {
      // The exported model has the adapters folded in; the PEFT adapter goes next to it.
      m.model = Transformer(spec.model_config);
      load_weights(*m.model, merged_state_dict(*recipe.model()), "merged LoRA weights");
      save_peft_adapter(*recipe.model(), *spec.lora, dir / "adapter", spec.model_source.string());
    }
    save_hf_dir(m, dir);
  }
  save_rank_state(recipe, dir);
}

}  // namespace

void PendingCheckpoints::start(RlRecipe& recipe, int64_t step, int64_t policy_version,
                               const std::map<int64_t, std::vector<RolloutGroup>>& buffer, int64_t refilled) {
  const int64_t end = outstanding_end(spec_, step);
  Pending c{.dir = checkpoint_dir(spec_, step), .step = step, .policy_version = policy_version, .begin = step, .end = end,
            .refilled = refilled, .ticket_end = end * spec_.batch_groups + refilled};
  // Over an older checkpoint of the same step (a run resumed from before it): it stops counting
  // as complete before anything of it is replaced.
  std::filesystem::remove(c.dir / "trainer_state.json");
  save_weights(spec_, recipe, c.dir);
  for (const auto& [batch, held] : buffer)
    for (const auto& g : held)
      if (c.holds(g)) c.groups.push_back(g);
  pending_.push_back(std::move(c));
  finish_complete();
}

void PendingCheckpoints::add(const RolloutGroup& g) {
  for (auto& c : pending_)
    if (c.holds(g)) c.groups.push_back(g);
  finish_complete();
}

void PendingCheckpoints::finish_complete() {
  std::erase_if(pending_, [&](Pending& c) {
    if (static_cast<int64_t>(c.groups.size()) < (c.end - c.begin) * spec_.batch_groups) return false;
    std::sort(c.groups.begin(), c.groups.end(), [](const auto& a, const auto& b) { return a.ticket < b.ticket; });
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& g : c.groups) groups.push_back(to_json(g));
    auto bytes = nlohmann::json::to_msgpack(groups);
    std::ofstream(c.dir / "rollouts.msgpack", std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    write_trainer_state(c.dir, {.recipe = spec_.recipe, .model = spec_.model_source.string(), .step = c.step,
                                .policy_version = c.policy_version, .rollout_batches = std::pair{c.begin, c.end},
                                .rollouts = "rollouts.msgpack", .refilled = c.refilled});
    finished_.push_back(c.step);
    return true;
  });
}

GraphResume read_graph_checkpoint(const std::filesystem::path& dir) {
  auto state = read_trainer_state(dir);
  auto file = dir / "trainer_state.json";
  if (!state.rollout_batches)
    throw Error(file.string() + ": not a checkpoint of the actor graph (expected rollout_batches and rollouts from an RL run's checkpoint)");
  GraphResume r;
  r.dir = dir;
  r.step = state.step;
  r.policy_version = state.policy_version;
  r.first_new_batch = state.rollout_batches->second;
  r.refilled = state.refilled;
  auto rollouts = dir / state.rollouts;
  std::ifstream in(rollouts, std::ios::binary);
  if (!in) throw Error(rollouts.string() + ": cannot open the checkpoint's buffered rollouts");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto groups = nlohmann::json::from_msgpack(bytes, true, false);
  if (groups.is_discarded() || !groups.is_array()) throw Error(rollouts.string() + ": not a msgpack array of rollout groups");
  for (size_t i = 0; i < groups.size(); ++i) {
    try {
      r.groups.push_back(group_from_json(groups[i]));
    } catch (const std::exception& e) {
      throw Error(rollouts.string() + ": group " + std::to_string(i) + ": " + e.what());
    }
    if (r.groups.back().batch < r.step || r.groups.back().batch >= r.first_new_batch)
      throw Error(rollouts.string() + ": group " + std::to_string(i) + " belongs to batch " +
                  std::to_string(r.groups.back().batch) + ", outside the checkpoint's rollout_batches");
  }
  return r;
}

}  // namespace troupe
