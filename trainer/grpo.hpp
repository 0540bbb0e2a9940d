// GRPO's pieces as functions: group-relative advantages and the decoupled-PPO clipped loss
// with an optional k3 KL to a reference. No model, no optimizer: trainer.cpp wires them.
#pragma once

#include <torch/types.h>

namespace troupe::grpo {

enum class ScaleRewards { group, batch, none };
enum class Aggregation { grpo, dr_grpo, dapo };

// rewards [N, G] (N groups of G) -> advantages [N, G]: r - mean over the group, divided by
// the group's std (group), the whole batch's std (batch) or nothing (none; Dr. GRPO).
torch::Tensor advantages(const torch::Tensor& rewards, ScaleRewards scale, double eps = 1e-4);

struct LossConfig {
  double epsilon = 0.2;        // lower clip: ratio >= 1 - epsilon
  double epsilon_high = 0.28;  // upper clip: ratio <= 1 + epsilon_high (DAPO's clip-higher)
  double beta = 0.0;           // weight of the k3 KL to the reference
  double behaviour_cap = 5.0;  // truncation of pi_prox / mu
  Aggregation aggregation = Aggregation::dapo;
  int64_t max_completion_length = 0;  // Dr. GRPO's constant normaliser (tokens per sequence)
};

// Token-aligned inputs, all [B, L] over completion positions (padding masked out).
struct LossInputs {
  torch::Tensor logprobs;        // log pi_theta, with gradient
  torch::Tensor prox_logprobs;   // log pi_prox: the weights at the start of this step (no gradient)
  torch::Tensor behaviour_logprobs;  // log mu: recorded by the generator
  torch::Tensor ref_logprobs;    // log pi_ref; undefined when beta == 0
  torch::Tensor advantages;      // [B] one per sequence
  torch::Tensor mask;            // [B, L] 1 where the token counts
};

struct LossOutput {
  torch::Tensor loss;       // scalar, to backward
  double kl = 0;            // mean k3 KL over counted tokens (0 without a reference)
  double clip_fraction = 0; // share of counted tokens whose ratio was clipped
  double behaviour_weight = 0;  // mean truncated pi_prox / mu
  int64_t tokens = 0;
};

LossOutput loss(const LossInputs& in, const LossConfig& config);

}  // namespace troupe::grpo
