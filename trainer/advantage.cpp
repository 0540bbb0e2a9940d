// Advantage estimators, each a few lines over [N, G] rewards; verl's compute_*_outcome_advantage
// are the reference (tests/trainer/test_objectives.cpp).
#include "trainer/advantage.hpp"

#include <torch/torch.h>

namespace troupe::advantage {

namespace {
void check(const Inputs& in) {
  TORCH_CHECK(in.rewards.dim() == 2, "advantages: rewards must be [groups, G], got ", in.rewards.sizes());
  TORCH_CHECK(in.lengths.sizes() == in.rewards.sizes(), "advantages: lengths ", in.lengths.sizes(),
              " must be shaped like the rewards ", in.rewards.sizes());
}

// x whitened over tokens: every completion's value counted once per token of it,
//   mean = sum n_i x_i / sum n_i,   var = sum n_i (x_i - mean)^2 / (sum n_i - 1)
//   x'   = (x - mean) / sqrt(var + 1e-8)
// verl's masked_whiten over the response mask, with one value per completion.
torch::Tensor token_whitened(const torch::Tensor& x, const torch::Tensor& lengths) {
  auto n = lengths.to(x.scalar_type());
  auto tokens = n.sum();
  if (tokens.item<double>() <= 1) return torch::zeros_like(x);
  auto mean = (n * x).sum() / tokens;
  auto var = (n * (x - mean).pow(2)).sum() / (tokens - 1);
  return (x - mean) * (var + 1e-8).rsqrt();
}
}  // namespace

torch::Tensor group(const Inputs& in) {
  auto r = in.rewards.to(torch::kFloat64);
  auto centred = r - r.mean(1, /*keepdim=*/true);
  // A group (or batch) whose rewards are all equal carries no signal: its advantages are 0.
  auto scaled = [&](const torch::Tensor& std) {
    return torch::where(std > 0, centred / (std + in.eps), torch::zeros_like(centred));
  };
  switch (in.scale) {
    case rl::ScaleRewards::group: return scaled(r.std(1, /*unbiased=*/true, /*keepdim=*/true).nan_to_num(0));
    case rl::ScaleRewards::batch: return scaled(r.numel() > 1 ? r.std() : torch::zeros({}, r.options()));
    case rl::ScaleRewards::none: return centred;
  }
  return centred;
}

torch::Tensor rloo(const Inputs& in) {
  auto r = in.rewards.to(torch::kFloat64);
  const int64_t G = r.size(1);
  if (G < 2) return torch::zeros_like(r);  // no other completion to compare with
  return (r - r.mean(1, /*keepdim=*/true)) * (static_cast<double>(G) / (G - 1));
}

torch::Tensor reinforce_pp(const Inputs& in) { return token_whitened(in.rewards.to(torch::kFloat64), in.lengths); }

torch::Tensor reinforce_pp_baseline(const Inputs& in) {
  auto r = in.rewards.to(torch::kFloat64);
  return token_whitened(r - r.mean(1, /*keepdim=*/true), in.lengths);
}

torch::Tensor overlong_penalty(const torch::Tensor& lengths, const rl::Overlong& c) {
  auto L = lengths.to(torch::kFloat64);
  if (c.mode != rl::OverlongMode::penalty) return torch::zeros_like(L);
  TORCH_CHECK(c.buffer > 0 && c.buffer <= c.max_tokens, "overlong penalty: buffer ", c.buffer, " must be in [1, max_tokens = ",
              c.max_tokens, "]");
  const double expected = static_cast<double>(c.max_tokens - c.buffer);
  return ((L - expected) / static_cast<double>(c.buffer) * -c.factor).clamp_max(0.0);
}

torch::Tensor compute(rl::Advantage which, const Inputs& in) {
  check(in);
  switch (which) {
    case rl::Advantage::group: return group(in);
    case rl::Advantage::rloo: return rloo(in);
    case rl::Advantage::reinforce_pp: return reinforce_pp(in);
    case rl::Advantage::reinforce_pp_baseline: return reinforce_pp_baseline(in);
    case rl::Advantage::none: return torch::zeros_like(in.rewards, torch::kFloat64);
  }
  TORCH_CHECK(false, "advantages: unknown estimator");
}

}  // namespace troupe::advantage
