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
    auto bytes = rollouts_to_msgpack(c.groups);
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
  r.groups = rollouts_from_msgpack(bytes, rollouts.string());
  for (size_t i = 0; i < r.groups.size(); ++i) {
    if (r.groups[i].batch < r.step || r.groups[i].batch >= r.first_new_batch)
      throw Error(rollouts.string() + ": group " + std::to_string(i) + " belongs to batch " +
                  std::to_string(r.groups[i].batch) + ", outside the checkpoint's rollout_batches");
  }
  return r;
}

}  // namespace troupe
