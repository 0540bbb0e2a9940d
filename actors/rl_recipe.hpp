// An RL recipe: how one batch of rollout groups trains the policy. The trainer actor owns one
// and adds everything else (the buffer, the staleness bound, weight notices, checkpoints,
// reports), so a recipe is one short file in actors/recipes/ plus one line in the registry
// (actors/recipes/registry.cpp). grpo, ppo, online_dpo and reinforce are written that way.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "policy/transformer.hpp"
#include "trainer/rollout.hpp"
#include "trainer/trainer.hpp"

namespace troupe {

struct GraphSpec;  // actors/graph.hpp

struct RlUpdate {
  StepMetrics metrics;  // loss, kl, grad_norm, lr, reward_mean, ...: every recipe's common figures
  nlohmann::json extra = nlohmann::json::object();  // the recipe's own metrics, merged into the step's
};

class RlRecipe {
 public:
  virtual ~RlRecipe() = default;
  // One batch, in ticket order, without its failed groups (never empty). nullopt: nothing to
  // learn from (online DPO with every reward tied): no update, the version stays; `extra` may
  // still carry metrics, which the trainer reports.
  virtual std::optional<RlUpdate> train(const std::vector<RolloutGroup>& groups, nlohmann::json& extra) = 0;
  // The policy as generators should see it (LoRA adapters merged by the caller).
  virtual Transformer& model() = 0;
  // What a checkpoint needs besides the weights: optimizer state, PPO's value head.
  virtual void save_state(const std::filesystem::path& dir) = 0;
  virtual void load_state(const std::filesystem::path& dir) = 0;
  // The policy's sharding over the trainer ranks (GraphSpec::trainer_group), if any: the
  // trainer actor gathers zero3's parameters through it to publish and checkpoint them.
  virtual DataParallel* data_parallel() { return nullptr; }
};

using RlRecipeFactory = std::unique_ptr<RlRecipe> (*)(Transformer policy, const GraphSpec& spec);

// The recipe named `name`, built around `policy` (LoRA adapters attached when spec.lora);
// throws Error listing the registered names for an unknown one.
std::unique_ptr<RlRecipe> make_rl_recipe(const std::string& name, Transformer policy, const GraphSpec& spec);
bool is_rl_recipe(const std::string& name);

// The recipes' shared pieces: a Trainer over the policy, or over its LoRA adapters alone,
// sharded over spec.trainer_group when there is one (every rank is given the whole batch and
// trains its share of it: Trainer::grpo_step, and online DPO's pairs); and
// the GRPO recipe with any trainer settings (REINFORCE is GRPO's loss with other settings).
std::unique_ptr<Trainer> make_policy_trainer(Transformer policy, const GraphSpec& spec, TrainerConfig config);
std::unique_ptr<RlRecipe> make_grpo_with(Transformer policy, const GraphSpec& spec, TrainerConfig config);
double mean_reward(const std::vector<RolloutGroup>& groups);

}  // namespace troupe
