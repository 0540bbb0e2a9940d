// GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sequence, the geometric
// mean of its token ratios, clipped per sequence, so that a sequence's tokens share one trust
// region. The gradient still flows per token (GSPO-token), as in verl's compute_policy_loss_gspo.
#include <torch/torch.h>

#include "trainer/objective.hpp"

namespace troupe::objective {

// log s_i    = (1 / |y_i|) sum_t (log pi_theta - log pi_prox)           over counted tokens
// log s_i,t  = sg(log s_i) + log pi_theta(t) - sg(log pi_theta(t))      (value s_i, gradient per token)
// loss_t     = -min(s_i,t A, clip(s_i,t, 1 - eps, 1 + eps_high) A)
// log s_i,t is capped at 10 (verl's bound) so that exp cannot overflow.
Terms gspo(const Inputs& in) {
  const auto mask = in.mask.to(in.logprobs.scalar_type());
  const auto lengths = mask.sum(1, /*keepdim=*/true).clamp_min(1);                            // (B, 1)
  const auto log_s = ((in.logprobs.detach() - in.prox.detach()) * mask).sum(1, true) / lengths;  // (B, 1)
  auto log_ratio = (in.logprobs - in.logprobs.detach() + log_s).clamp_max(10.0);              // (B, L)
  auto ratio = log_ratio.exp();
  auto clipped = ratio.clamp(1 - in.epsilon, 1 + in.epsilon_high);
  auto per_token = -torch::min(ratio * in.advantages, clipped * in.advantages);
  return {per_token, ratio.detach() != clipped.detach()};
}

}  // namespace troupe::objective
