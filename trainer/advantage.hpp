// The advantage estimators of trainer.advantage: rewards of N groups of G completions become
// one advantage per completion. Outcome rewards only (one scalar per completion, gamma = 1),
// so an advantage holds for every token of its completion.
#pragma once

#include <torch/types.h>

#include "trainer/rl_options.hpp"

namespace troupe::advantage {

struct Inputs {
  const torch::Tensor& rewards;  // [N, G]
  const torch::Tensor& lengths;  // [N, G] counted tokens per completion (REINFORCE++'s token-weighted whitening)
  rl::ScaleRewards scale = rl::ScaleRewards::group;  // group only
  double eps = 1e-4;                                 // group only: added to the std
};

// -> [N, G], float64
torch::Tensor compute(rl::Advantage which, const Inputs& in);

// DAPO's soft overlong punishment (rl_options.hpp, Overlong) of completions of `lengths`
// tokens (any shape), float64; zeros unless config.mode is penalty.
torch::Tensor overlong_penalty(const torch::Tensor& lengths, const rl::Overlong& config);

// GRPO: A = (r - mean(group)) / (std + eps), std the group's (unbiased), the batch's, or 1
// (scale none, Dr. GRPO). A group whose rewards all tie (std 0) gets 0.
torch::Tensor group(const Inputs& in);
// RLOO: A_i = r_i - mean of the other G - 1 rewards = G / (G - 1) (r_i - mean(group)).
torch::Tensor rloo(const Inputs& in);
// REINFORCE++: the rewards whitened over the batch's tokens (no group baseline).
torch::Tensor reinforce_pp(const Inputs& in);
// REINFORCE++ with a baseline: r - mean(group), then whitened over the batch's tokens.
torch::Tensor reinforce_pp_baseline(const Inputs& in);

}  // namespace troupe::advantage
