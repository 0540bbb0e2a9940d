// CISPO (MiniMax-M1, arXiv 2506.13585): the importance ratio is clipped and detached, and
// weights the REINFORCE term -A log pi. Unlike PPO's clip, no token's gradient is zeroed:
// clipping bounds its weight instead. verl: compute_policy_loss_cispo.
#include <torch/torch.h>

#include "trainer/objective.hpp"

namespace troupe::objective {

// r_t = pi_theta / pi_prox
// loss_t = -sg(clip(r_t, 1 - eps, 1 + eps_high)) A log pi_theta(t)
Terms cispo(const Inputs& in) {
  auto ratio = (in.logprobs.detach() - in.prox.detach()).exp();  // (B, L), no gradient
  auto clipped = ratio.clamp(1 - in.epsilon, 1 + in.epsilon_high);
  auto per_token = -clipped * in.advantages * in.logprobs;
  return {per_token, ratio != clipped};
}

}  // namespace troupe::objective
