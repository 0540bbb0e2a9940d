// On-policy distillation: the student samples, the teacher (in the reference actor) scores the
// student's tokens, and each token's advantage is the teacher's reverse KL estimate there,
//   A_t = distill x (log pi_teacher(t) - log mu(t)),
// trained with GRPO's loss (ratio, clip and behaviour weight as configured). Rewards are still
// computed and reported, but do not train. GRPO with trainer.loss.distill > 0 adds the same term
// to its group advantages instead.
#include "actors/graph.hpp"
#include "actors/rl_recipe.hpp"

namespace troupe {

std::unique_ptr<RlRecipe> make_distill(Transformer policy, const GraphSpec& spec) {
  TrainerConfig config = spec.trainer;
  config.advantage = rl::Advantage::none;  // the teacher's term alone
  return make_grpo_with(std::move(policy), spec, std::move(config));
}

}  // namespace troupe
