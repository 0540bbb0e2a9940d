// Every RL recipe by name: adding one is a file in this folder and one line here.
#include <array>
#include <utility>

#include "actors/graph.hpp"
#include "actors/rl_recipe.hpp"
#include "policy/error.hpp"
#include "policy/lora.hpp"

namespace troupe {

std::unique_ptr<RlRecipe> make_grpo(Transformer policy, const GraphSpec& spec);
std::unique_ptr<RlRecipe> make_ppo(Transformer policy, const GraphSpec& spec);
std::unique_ptr<RlRecipe> make_online_dpo(Transformer policy, const GraphSpec& spec);
std::unique_ptr<RlRecipe> make_reinforce(Transformer policy, const GraphSpec& spec);
std::unique_ptr<RlRecipe> make_distill(Transformer policy, const GraphSpec& spec);

namespace {

constexpr std::array<std::pair<const char*, RlRecipeFactory>, 5> kRecipes = {{
    {"grpo", make_grpo},
    {"ppo", make_ppo},
    {"online_dpo", make_online_dpo},
    {"reinforce", make_reinforce},
    {"distill", make_distill},
}};

}  // namespace

bool is_rl_recipe(const std::string& name) {
  for (const auto& [n, f] : kRecipes)
    if (name == n) return true;
  return false;
}

std::unique_ptr<RlRecipe> make_rl_recipe(const std::string& name, Transformer policy, const GraphSpec& spec) {
  std::string known;
  for (const auto& [n, make] : kRecipes) {
    if (name == n) return make(std::move(policy), spec);
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  throw Error("unknown RL recipe '" + name + "' (known: " + known + ")");
}

std::unique_ptr<Trainer> make_policy_trainer(Transformer policy, const GraphSpec& spec, TrainerConfig config) {
  const OptimizerConfig optimizer = config.optimizer;
  std::unique_ptr<Trainer> trainer;
  if (spec.lora) {
    attach_lora(*policy, *spec.lora, spec.seed);
    trainer = std::make_unique<Trainer>(policy, std::move(config), lora_parameters(*policy));
  } else {
    trainer = std::make_unique<Trainer>(policy, std::move(config));
  }
  if (spec.trainer_group) {
    shard_trainer(*trainer, spec.trainer_group, spec.sharding, optimizer);
    trainer->data_parallel()->set_prefetch(spec.prefetch);
  }
  return trainer;
}

double mean_reward(const std::vector<RolloutGroup>& groups) {
  double sum = 0;
  int64_t n = 0;
  for (const auto& g : groups)
    for (double r : g.reward) {
      sum += r;
      ++n;
    }
  return n ? sum / n : 0.0;
}

}  // namespace troupe
