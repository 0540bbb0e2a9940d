// An RL run's checkpoint: the weights (merged, plus the PEFT adapter with LoRA), the recipe's
// state (optimizer, PPO's value head), LibTorch's RNG, and the rollout groups that were
// buffered or in flight, so a resumed run trains exactly what the interrupted one would have.
// trainer_state.json (actors/trainer_state.hpp) comes last, once those groups are all in.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/rollout_io.hpp"
#include "trainer/rollout.hpp"

namespace troupe {

struct GraphResume;
struct GraphSpec;
class RlRecipe;

// Batches released before step `step` reported and not trained by then: [step, end). With
// sync_every k the controller keeps eta - k + 2 batches out (see the credits there).
int64_t outstanding_end(const GraphSpec& spec, int64_t step);

// runs/NAME/checkpoints/step_N
std::filesystem::path checkpoint_dir(const GraphSpec& spec, int64_t step);

// Every trainer rank's own part of a checkpoint in `dir`: the recipe's state (with trainer ranks,
// each rank its optimizer shard and rank 0 the layout) and LibTorch's random state (rng.pt, or
// rng.rankR.pt on rank R > 0); then, with trainer ranks, a barrier, so a checkpoint is complete
// only once every shard is on disk.
void save_rank_state(RlRecipe& recipe, const std::filesystem::path& dir);

// The checkpoint's weights (or LoRA adapter), the recipe's state and this rank's random state
// into `recipe`, on every trainer rank (zero3 reshards the loaded parameters).
void restore_recipe(RlRecipe& recipe, const GraphSpec& spec, const GraphResume& resume);

// Checkpoints whose weights are written but whose outstanding rollouts are still arriving.
class PendingCheckpoints {
 public:
  explicit PendingCheckpoints(const GraphSpec& spec) : spec_(spec) {}
  // Writes what can be written now and waits for batches [step, outstanding_end) from `buffer`
  // and from later arrivals. `refilled`: prompts drawn so far to replace filtered groups (dynamic
  // sampling). Those were all for batches before `step`, so the prompts drawn before this
  // checkpoint are outstanding_end * batch_groups + refilled, and the groups it keeps are the
  // ones with a lower ticket: refills the next batch asks for later are generated anew on resume.
  void start(RlRecipe& recipe, int64_t step, int64_t policy_version,
             const std::map<int64_t, std::vector<RolloutGroup>>& buffer, int64_t refilled);
  // A group that arrived; finishes every checkpoint that now has all its groups.
  void add(const RolloutGroup& g);
  // The steps whose checkpoints were completed since the last call.
  std::vector<int64_t> take_finished() { return std::exchange(finished_, {}); }

 private:
  struct Pending {
    std::filesystem::path dir;
    int64_t step = 0, policy_version = 0;
    int64_t begin = 0, end = 0;
    int64_t refilled = 0, ticket_end = 0;  // groups with a ticket below ticket_end belong to it
    std::vector<RolloutGroup> groups;
    bool holds(const RolloutGroup& g) const { return g.batch >= begin && g.batch < end && g.ticket < ticket_end; }
  };
  void finish_complete();
  const GraphSpec& spec_;
  std::vector<Pending> pending_;
  std::vector<int64_t> finished_;
};

}  // namespace troupe
