// The policy-gradient objectives of trainer.loss.objective, one file each (objective_*.cpp),
// found through one table in objective.cpp. Each turns token log-probs and advantages into a
// loss per token; the behaviour weight, the KL term and the aggregation are applied around it
// (grpo::loss), the same for all of them.
#pragma once

#include <torch/types.h>

#include "trainer/rl_options.hpp"

namespace troupe::objective {

// All [B, L] over completion positions, except `advantages`: [B, 1] (one per sequence) or
// [B, L] (per token, PPO's GAE).
struct Inputs {
  const torch::Tensor& logprobs;    // log pi_theta, with gradient
  const torch::Tensor& prox;        // log pi_prox: the weights at the start of the step (no gradient)
  const torch::Tensor& advantages;  // A
  const torch::Tensor& mask;        // 1 where the token counts (float)
  double epsilon = 0.2;             // clip below: 1 - epsilon
  double epsilon_high = 0.28;       // clip above: 1 + epsilon_high
};

struct Terms {
  torch::Tensor per_token;  // [B, L] loss per token, before the behaviour weight
  torch::Tensor clipped;    // [B, L] bool: the token's ratio was clipped
};

// PPO's clipped surrogate on the token ratio (GRPO, DAPO).
Terms grpo(const Inputs& in);
// GSPO: the same clip on one length-normalised ratio per sequence.
Terms gspo(const Inputs& in);
// CISPO: the clipped ratio as a stop-gradient weight on -A log pi.
Terms cispo(const Inputs& in);

// The objective `which` names.
Terms compute(rl::Objective which, const Inputs& in);

}  // namespace troupe::objective
