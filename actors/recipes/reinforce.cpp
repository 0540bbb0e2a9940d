// REINFORCE with a mean baseline: each completion's advantage is its reward minus the mean of
// its group (no division by the std), and the loss is -A log pi summed over the completion's
// tokens, over a constant length (Dr. GRPO's normaliser), with no clipping. On-policy samples
// make the ratio 1, so this is the plain policy gradient; older ones keep the behaviour weight.
// GRPO's loss computes exactly that with these settings, so the recipe is its configuration.
#include "actors/graph.hpp"
#include "actors/rl_recipe.hpp"

namespace troupe {

std::unique_ptr<RlRecipe> make_reinforce(Transformer policy, const GraphSpec& spec) {
  TrainerConfig config = spec.trainer;
  config.scale_rewards = grpo::ScaleRewards::none;        // A = r - mean(group)
  config.loss.epsilon = config.loss.epsilon_high = 1e9;   // no clipping
  config.loss.aggregation = grpo::Aggregation::dr_grpo;   // sum over tokens / constant length
  config.num_iterations = 1;                              // one pass: a plain gradient step
  if (config.loss.max_completion_length <= 0) config.loss.max_completion_length = spec.sampling.max_tokens;
  return make_grpo_with(std::move(policy), spec, std::move(config));
}

}  // namespace troupe
