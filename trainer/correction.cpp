// Importance correction between the trainer's weights at the start of a step (pi_prox) and the
// policy that sampled (mu): staleness and any train/rollout numerical mismatch both show here.
#include "trainer/correction.hpp"

#include <torch/torch.h>

namespace troupe::correction {

// With log r_t = log pi_prox(t) - log mu(t), and for sequence modes
//   log r_i = (1 / |y_i|) sum_t log r_t      (the geometric mean over the counted tokens)
// token_truncate:    w_t = min(r_t, high)
// token_mask:        w_t = r_t if low <= r_t <= high, else 0
// sequence_truncate: w_t = min(r_i, high)
// sequence_mask:     w_t = r_i if low <= r_i <= high, else 0
// none:              w_t = 1
// Log ratios are bounded to [-20, 20] before exp (verl's safety bound): a weight of e^20 is
// capped or masked either way.
Weights weights(const torch::Tensor& prox, const torch::Tensor& behaviour, const torch::Tensor& mask,
                const rl::Correction& c) {
  TORCH_CHECK(prox.sizes() == mask.sizes() && behaviour.sizes() == mask.sizes(), "correction: prox ", prox.sizes(),
              ", behaviour ", behaviour.sizes(), " and mask ", mask.sizes(), " must all be [B, L]");
  TORCH_CHECK(c.low <= c.high, "correction: low ", c.low, " > high ", c.high);
  const auto counted = mask > 0;
  const auto m = mask.to(prox.scalar_type());
  auto log_r = (prox.detach() - behaviour.detach()) * m;  // (B, L), 0 past the end
  Weights out;
  out.ratio = log_r.clamp(-20, 20).exp();
  const bool sequence = c.mode == rl::CorrectionMode::sequence_truncate || c.mode == rl::CorrectionMode::sequence_mask;
  auto r = out.ratio;
  if (sequence) {
    auto log_seq = log_r.sum(1, /*keepdim=*/true) / m.sum(1, true).clamp_min(1);  // (B, 1)
    r = log_seq.clamp(-20, 20).exp().expand_as(log_r);
  }
  if (c.mode == rl::CorrectionMode::none) {
    out.weight = torch::ones_like(r);
    out.truncated = out.masked = torch::zeros_like(counted);
  } else if (c.mode == rl::CorrectionMode::token_truncate || c.mode == rl::CorrectionMode::sequence_truncate) {
    out.weight = r.clamp_max(c.high);
    out.truncated = (r > c.high).logical_and(counted);
    out.masked = torch::zeros_like(counted);
  } else {
    auto keep = (r >= c.low).logical_and(r <= c.high);
    out.weight = torch::where(keep, r, torch::zeros_like(r));
    out.masked = keep.logical_not().logical_and(counted);
    out.truncated = torch::zeros_like(counted);
  }
  out.weight = out.weight.contiguous();
  return out;
}

torch::Tensor k3_sum(const torch::Tensor& prox, const torch::Tensor& behaviour, const torch::Tensor& mask) {
  auto log_r = (prox.detach() - behaviour.detach()).to(torch::kFloat64);
  auto k3 = log_r.exp() - 1 - log_r;
  return (k3 * mask.to(torch::kFloat64)).sum();
}

}  // namespace troupe::correction
