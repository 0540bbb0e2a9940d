// The GRPO objective with decoupled PPO (AReaL): the policy ratio is taken against the
// proximal policy and each token is weighted by the truncated behaviour ratio, so stale
// rollouts from the generators (mu) are corrected for without a second clip.
#include "trainer/grpo.hpp"

#include <torch/torch.h>

namespace troupe::grpo {

torch::Tensor advantages(const torch::Tensor& rewards, ScaleRewards scale, double eps) {
  TORCH_CHECK(rewards.dim() == 2, "advantages: rewards must be [groups, G], got ", rewards.sizes());
  auto r = rewards.to(torch::kFloat32);
  auto centred = r - r.mean(1, /*keepdim=*/true);
  // A group (or batch) whose rewards are all equal carries no signal: its advantages are 0.
  auto scaled = [&](const torch::Tensor& std) {
    return torch::where(std > 0, centred / (std + eps), torch::zeros_like(centred));
  };
  switch (scale) {
    case ScaleRewards::group: return scaled(r.std(1, /*unbiased=*/true, /*keepdim=*/true).nan_to_num(0));
    case ScaleRewards::batch: return scaled(r.numel() > 1 ? r.std() : torch::zeros({}));
    case ScaleRewards::none: return centred;
  }
  return centred;
}

// Per token, with r = pi_theta / pi_prox and w = min(pi_prox / mu, cap):
//   loss_t = -w * min(r * A, clip(r, 1 - eps, 1 + eps_high) * A) + beta * k3_t
//   k3_t   = exp(ref - logp) - (ref - logp) - 1        (an unbiased, non-negative KL estimate)
// then aggregated over counted tokens: dapo = sum / tokens in the batch; grpo = mean over each
// sequence's tokens, then over sequences; dr_grpo = sum / (sequences x max_completion_length).
LossOutput loss(const LossInputs& in, const LossConfig& c) {
  TORCH_CHECK(in.logprobs.sizes() == in.mask.sizes() && in.prox_logprobs.sizes() == in.mask.sizes() &&
                  in.behaviour_logprobs.sizes() == in.mask.sizes(),
              "grpo loss: logprobs ", in.logprobs.sizes(), ", prox ", in.prox_logprobs.sizes(), ", behaviour ",
              in.behaviour_logprobs.sizes(), " and mask ", in.mask.sizes(), " must all be [B, L]");
  TORCH_CHECK(in.advantages.dim() == 1 && in.advantages.size(0) == in.mask.size(0), "grpo loss: advantages ",
              in.advantages.sizes(), " must be [B] with B = ", in.mask.size(0));
  const auto mask = in.mask.to(torch::kFloat32);
  const auto prox = in.prox_logprobs.detach();
  auto ratio = (in.logprobs - prox).exp();
  auto adv = in.advantages.to(torch::kFloat32).unsqueeze(1);  // (B, 1)
  auto clipped = ratio.clamp(1 - c.epsilon, 1 + c.epsilon_high);
  auto surrogate = torch::min(ratio * adv, clipped * adv);
  auto weight = (prox - in.behaviour_logprobs).exp().clamp_max(c.behaviour_cap).detach();
  auto per_token = -weight * surrogate;

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
  auto was_clipped = (ratio.detach() != clipped.detach()).logical_and(counted);
  out.tokens = counted.sum().item<int64_t>();
  out.clip_fraction = out.tokens ? was_clipped.sum().item<double>() / out.tokens : 0.0;
  out.behaviour_weight = out.tokens ? (weight * mask).sum().item<double>() / out.tokens : 0.0;
  return out;
}

}  // namespace troupe::grpo
