// PPO's trainer side for LLMs (as OpenRLHF and TRL run it): a value head on the policy's own
// trunk, per-token KL-shaped rewards, GAE, the decoupled-PPO policy loss and a clipped value
// loss. No actors and no generation here; no separate critic model either (the trunk is shared).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include "policy/transformer.hpp"
#include "trainer/data_parallel.hpp"
#include "trainer/rollout.hpp"
#include "trainer/trainer.hpp"

namespace torch::optim { class AdamW; }

namespace troupe {

namespace ppo {

// All [B, L] tensors below are token-aligned: column t of row b is one action (a completion
// token), and `mask` is 1 where a token counts. Masked positions are skipped, not treated as
// steps, so left or right padding (or holes) never leak into the recursion.

// rewards, values, mask [B, L] -> advantages and returns [B, L] (0 where masked), with
//   delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lambda * A_next
// where "next" is the row's next counted position, and V_next = A_next = 0 after its last
// (the end of a completion is terminal, as in OpenRLHF and TRL). returns = A + V.
struct Gae {
  torch::Tensor advantages;
  torch::Tensor returns;
};
Gae gae(const torch::Tensor& rewards, const torch::Tensor& values, const torch::Tensor& mask, double gamma,
        double lambda);

// scores [B] (one scalar reward per sequence), mask [B, L] -> per-token rewards [B, L]:
//   r_t = -kl_coef * kl_t  +  (score on the row's last counted token)
// kl_t = log pi(token) - log pi_ref(token) ([B, L]); undefined, or kl_coef == 0, leaves it out.
torch::Tensor token_rewards(const torch::Tensor& scores, const torch::Tensor& mask, const torch::Tensor& kl,
                            double kl_coef);

// (x - mean) / sqrt(var + eps) over the counted tokens of the whole batch (var unbiased, as
// TRL's masked_whiten); 0 where masked.
torch::Tensor whiten(const torch::Tensor& x, const torch::Tensor& mask, double eps = 1e-8);

struct LossConfig {
  double epsilon = 0.2;        // lower clip of the policy ratio: ratio >= 1 - epsilon
  double epsilon_high = 0.2;   // upper clip: ratio <= 1 + epsilon_high
  rl::Correction correction;   // the behaviour weight pi_prox / mu (trainer/correction.hpp)
  double value_clip = 0.2;     // V stays within V_old +- value_clip in the clipped term; <= 0 disables
  double vf_coef = 0.1;        // weight of the value loss in the total
  rl::Objective objective = rl::Objective::grpo;  // the policy term (trainer/objective.hpp); grpo: PPO's clip
};

// Token-aligned inputs, all [B, L].
struct LossInputs {
  torch::Tensor logprobs;            // log pi_theta, with gradient
  torch::Tensor prox_logprobs;       // log pi_prox: the weights at the start of the step (no gradient)
  torch::Tensor behaviour_logprobs;  // log mu: recorded by the generator
  torch::Tensor advantages;          // per token (whitened or not), no gradient
  torch::Tensor values;              // V_theta, with gradient
  torch::Tensor old_values;          // V at the start of the step (no gradient)
  torch::Tensor returns;             // GAE returns (no gradient)
  torch::Tensor mask;                // 1 where the token counts
};

// Token means over the counted tokens of these inputs; `loss` = policy + vf_coef * value.
struct LossOutput {
  torch::Tensor loss;                // scalar, to backward
  double policy_loss = 0, value_loss = 0;
  double clip_fraction = 0;          // share of tokens whose policy ratio was clipped
  double value_clip_fraction = 0;    // share of tokens where the clipped value term was the larger
  double behaviour_weight = 0;       // mean corrected pi_prox / mu
  int64_t tokens = 0;
};

LossOutput loss(const LossInputs& in, const LossConfig& config);

}  // namespace ppo

struct PpoConfig {
  OptimizerConfig optimizer;   // one AdamW over the policy and the value head, Trainer's schedule
  double gamma = 1.0, lambda = 0.95;
  double kl_coef = 0.0;        // per-token KL penalty in the rewards; needs reference log-probs when > 0
  double value_clip = 0.2;
  double vf_coef = 0.1;
  double epsilon = 0.2, epsilon_high = 0.2;
  rl::Correction correction;
  rl::Objective objective = rl::Objective::grpo;
  bool whiten_advantages = true;            // over the batch's counted tokens
  rl::Overlong overlong;                    // completions cut at max_tokens: masked, penalised or neither
  int64_t num_iterations = 1;  // optimizer passes (PPO epochs) over each batch, each one step
  int64_t micro_batch = 0;     // sequences per forward/backward; 0 = all at once
  int64_t logprob_chunk = 128; // sequence positions per LM-head chunk
  double temperature = 1.0;    // log-probs of logits / temperature: the generators' (their behaviour log-probs' own)
};

// Means over the counted tokens of the step (sequences for reward_mean); loss terms, clip
// fractions and grad_norm are those of the last iteration; the rest is from the start of the step.
struct PpoMetrics {
  double loss = 0, policy_loss = 0, value_loss = 0;
  double kl = 0;                    // mean log pi_prox - log pi_ref (0 without reference log-probs)
  double clip_fraction = 0, value_clip_fraction = 0, behaviour_weight = 0;
  double explained_variance = 0;    // 1 - Var(R - V_old) / Var(R)
  double reward_mean = 0;           // mean sequence reward
  double returns_mean = 0, values_mean = 0, advantages_mean = 0;  // advantages before whitening
  double grad_norm = 0, lr = 0;
  int64_t tokens = 0, sequences = 0;
};

class PpoTrainer {
 public:
  // The value head is Linear(hidden, 1) in float32 on the policy's device, drawn from
  // N(0, 1 / (hidden + 1)) with `seed` (OpenRLHF's critic init), bias 0.
  PpoTrainer(Transformer policy, PpoConfig config, uint64_t seed = 0);
  ~PpoTrainer();

  // num_iterations optimizer steps on these groups; the version advances by that many.
  PpoMetrics step(const std::vector<RolloutGroup>& groups);

  // V of every completion token's state (the position that predicts it): [G][L_i]. No gradient.
  std::vector<std::vector<float>> completion_values(const RolloutGroup& group);

  // The value head as {"v_head.weight": [1, hidden], "v_head.bias": [1]}, and to and from a
  // safetensors file. load_value_head throws Error naming the file for missing, unexpected
  // or mis-shaped tensors.
  std::map<std::string, torch::Tensor> value_head_state_dict() const;
  void save_value_head(const std::filesystem::path& file) const;
  void load_value_head(const std::filesystem::path& file);
  // The AdamW state over the policy and the head, and the version (Optimizer::save);
  // sharded: this rank's shard in the file's folder (DataParallel::save_state).
  void save_state(const std::filesystem::path& file) const;
  void load_state(const std::filesystem::path& file);

  // Data parallelism over trainer ranks, the value head included ("v_head.*", in the last
  // block). Every rank is then given the whole batch: each computes the step's starting
  // log-probs and values for its share of the groups, summed across ranks so that GAE,
  // whitening and the metrics see the whole batch, and trains its share. zero3 is refused:
  // the two heads' forward pass does not go through zero3's layer-by-layer trunk.
  void shard(std::shared_ptr<ProcessGroup> group, Sharding mode);
  DataParallel* data_parallel() const { return dp_.get(); }

  int64_t version() const { return version_; }
  Transformer& model() { return model_; }
  torch::nn::Linear& value_head() { return value_head_; }
  const std::vector<torch::Tensor>& parameters() const { return params_; }  // policy's, then the head's
  double lr_at(int64_t step) const;  // Trainer::lr_at's warmup + cosine

 private:
  Transformer model_;
  torch::nn::Linear value_head_{nullptr};
  PpoConfig config_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<Optimizer> optimizer_;
  std::shared_ptr<DataParallel> dp_;
  int64_t version_ = 0;
};

}  // namespace troupe
