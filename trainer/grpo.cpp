// The GRPO family's loss with decoupled PPO (AReaL): the objective's ratio is taken against the
// proximal policy and each token is weighted by the corrected behaviour ratio, so stale
// rollouts from the generators (mu) are corrected for without a second clip.
#include "trainer/grpo.hpp"

#include <torch/torch.h>

#include "trainer/correction.hpp"
#include "trainer/objective.hpp"

namespace troupe::grpo {

// Per token, with objective_t the chosen objective's term (objective_*.cpp; grpo's is
// -min(r A, clip(r, 1 - eps, 1 + eps_high) A), r = pi_theta / pi_prox) and w_t the corrected
// pi_prox / mu:
//   loss_t = w_t * objective_t + beta * k3_t
//   k3_t   = exp(ref - logp) - (ref - logp) - 1        (an unbiased, non-negative KL estimate)
// then aggregated over counted tokens: dapo = sum / tokens in the batch; grpo = mean over each
// sequence's tokens, then over sequences; dr_grpo = sum / (sequences x max_completion_length).
// A masked token (w = 0) still counts in these normalisers, as in verl.
LossOutput loss(const LossInputs& in, const LossConfig& c) {
  TORCH_CHECK(in.logprobs.sizes() == in.mask.sizes() && in.prox_logprobs.sizes() == in.mask.sizes() &&
                  in.behaviour_logprobs.sizes() == in.mask.sizes(),
              "grpo loss: logprobs ", in.logprobs.sizes(), ", prox ", in.prox_logprobs.sizes(), ", behaviour ",
              in.behaviour_logprobs.sizes(), " and mask ", in.mask.sizes(), " must all be [B, L]");
  TORCH_CHECK((in.advantages.dim() == 1 && in.advantages.size(0) == in.mask.size(0)) ||
                  in.advantages.sizes() == in.mask.sizes(),
              "grpo loss: advantages ", in.advantages.sizes(), " must be [B] or [B, L] with [B, L] = ", in.mask.sizes());
  const auto mask = in.mask.to(torch::kFloat32);
  const auto prox = in.prox_logprobs.detach();
  auto adv = in.advantages.to(in.logprobs.scalar_type());
  if (adv.dim() == 1) adv = adv.unsqueeze(1);  // (B, 1), or (B, L) per token
  auto terms = objective::compute(c.objective, {.logprobs = in.logprobs, .prox = prox, .advantages = adv, .mask = mask,
                                                .epsilon = c.epsilon, .epsilon_high = c.epsilon_high});
  auto w = correction::weights(prox, in.behaviour_logprobs, mask, c.correction);
  auto per_token = w.weight * terms.per_token;

  LossOutput out;
  if (c.beta > 0) {
    TORCH_CHECK(in.ref_logprobs.defined() && in.ref_logprobs.sizes() == in.mask.sizes(),
                "grpo loss: beta > 0 needs reference log-probs shaped like the mask");
    auto d = in.ref_logprobs - in.logprobs;
    auto k3 = d.exp() - d - 1;
    per_token = per_token + c.beta * k3;
    out.kl = ((k3.detach() * mask).sum() / mask.sum().clamp_min(1)).item<double>();
  }
  const auto tokens = mask.sum();
  switch (c.aggregation) {
    case Aggregation::dapo:
      out.loss = (per_token * mask).sum() / tokens.clamp_min(1);
      break;
    case Aggregation::grpo:
      out.loss = ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean();
      break;
    case Aggregation::dr_grpo:
      TORCH_CHECK(c.max_completion_length > 0, "grpo loss: dr_grpo needs max_completion_length");
      out.loss = (per_token * mask).sum() / static_cast<double>(mask.size(0) * c.max_completion_length);
      break;
  }
  auto counted = mask > 0;
  out.tokens = counted.sum().item<int64_t>();
  auto share = [&](const torch::Tensor& flags) {
    return out.tokens ? flags.logical_and(counted).sum().item<double>() / out.tokens : 0.0;
  };
  out.clip_fraction = share(terms.clipped);
  out.masked_fraction = share(w.masked);
  out.truncated_fraction = share(w.truncated);
  out.behaviour_weight = out.tokens ? (w.weight * mask).sum().item<double>() / out.tokens : 0.0;
  out.ratio = w.ratio;
  return out;
}

}  // namespace troupe::grpo
