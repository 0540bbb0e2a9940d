// GRPO's loss as a function: the objective of trainer.loss.objective (trainer/objective.hpp)
// per token, the behaviour weight of trainer.loss.correction (trainer/correction.hpp), an
// optional k3 KL to a reference, and the aggregation. No model, no optimizer: trainer.cpp wires
// them; the advantages come from trainer/advantage.hpp.
#pragma once

#include <torch/types.h>

#include "trainer/rl_options.hpp"

namespace troupe::grpo {

using Aggregation = rl::Aggregation;
using ScaleRewards = rl::ScaleRewards;
using LossConfig = rl::PolicyLoss;

// Token-aligned inputs, all [B, L] over completion positions (padding masked out).
struct LossInputs {
  torch::Tensor logprobs;        // log pi_theta, with gradient
  torch::Tensor prox_logprobs;   // log pi_prox: the weights at the start of this step (no gradient)
  torch::Tensor behaviour_logprobs;  // log mu: recorded by the generator
  torch::Tensor ref_logprobs;    // log pi_ref; undefined when beta == 0
  torch::Tensor advantages;      // [B] one per sequence, or [B, L] per token (distillation)
  torch::Tensor mask;            // [B, L] 1 where the token counts
};

struct LossOutput {
  torch::Tensor loss;       // scalar, to backward
  double kl = 0;            // mean k3 KL over counted tokens (0 without a reference)
  double clip_fraction = 0; // share of counted tokens whose ratio was clipped
  double behaviour_weight = 0;    // mean corrected pi_prox / mu
  double masked_fraction = 0;     // share of counted tokens the correction set to weight 0
  double truncated_fraction = 0;  // share of counted tokens whose weight was capped
  torch::Tensor ratio;      // [B, L] the raw pi_prox / mu, for the step's quantiles (no gradient)
  int64_t tokens = 0;
};

LossOutput loss(const LossInputs& in, const LossConfig& config);

}  // namespace troupe::grpo
