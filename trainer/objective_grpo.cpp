// PPO's clipped surrogate per token, as GRPO and DAPO use it (clip-higher: the two bounds may
// differ). verl: compute_policy_loss_vanilla without its dual clip.
#include <torch/torch.h>

#include "trainer/objective.hpp"

namespace troupe::objective {

// r_t = pi_theta / pi_prox
// loss_t = -min(r_t A, clip(r_t, 1 - eps, 1 + eps_high) A)
Terms grpo(const Inputs& in) {
  auto ratio = (in.logprobs - in.prox.detach()).exp();                  // (B, L)
  auto clipped = ratio.clamp(1 - in.epsilon, 1 + in.epsilon_high);      // (B, L)
  auto per_token = -torch::min(ratio * in.advantages, clipped * in.advantages);
  return {per_token, ratio.detach() != clipped.detach()};
}

}  // namespace troupe::objective
