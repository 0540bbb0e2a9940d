// The behaviour weight of decoupled PPO, w = pi_prox / mu per token, corrected as
// trainer.loss.correction says (rl_options.hpp): truncated or masked, per token or per
// sequence. Also what the metrics report about it. No model, no optimizer.
#pragma once

#include <torch/types.h>

#include "trainer/rl_options.hpp"

namespace troupe::correction {

struct Weights {
  torch::Tensor weight;     // [B, L] the weight each token's loss takes (no gradient; 0 where masked)
  torch::Tensor ratio;      // [B, L] the raw token ratio pi_prox / mu, before any correction
  torch::Tensor masked;     // [B, L] bool: a counted token whose weight was set to 0
  torch::Tensor truncated;  // [B, L] bool: a counted token whose weight was capped
};

// prox, behaviour and mask [B, L]: log pi_prox, log mu and 1 where the token counts.
Weights weights(const torch::Tensor& prox, const torch::Tensor& behaviour, const torch::Tensor& mask,
                const rl::Correction& config);

// The k3 estimate of KL(mu || pi_prox) over the counted tokens, from samples of mu:
//   k3_t = r_t - 1 - log r_t,  r_t = pi_prox / mu.
// Summed (not averaged), so that micro-batches and ranks add up.
torch::Tensor k3_sum(const torch::Tensor& prox, const torch::Tensor& behaviour, const torch::Tensor& mask);

}  // namespace troupe::correction
