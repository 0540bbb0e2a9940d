// One training group's model and optimizer: GRPO steps on rollout groups and supervised steps
// on (prompt, completion) pairs, with AdamW, warmup + cosine decay, clipping and accumulation.
// The policy version counts optimizer steps.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policy/transformer.hpp"
#include "trainer/grpo.hpp"
#include "trainer/rollout.hpp"

namespace torch::optim { class AdamW; }

namespace troupe {

struct OptimizerConfig {
  double lr = 1e-6;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  int64_t warmup_steps = 0;     // linear warmup from 0
  int64_t total_steps = 0;      // cosine decay to min_lr_ratio x lr by then; 0 keeps lr constant
  double min_lr_ratio = 0.0;
  double max_grad_norm = 1.0;   // 0 disables clipping
};

struct TrainerConfig {
  OptimizerConfig optimizer;
  grpo::LossConfig loss;
  grpo::ScaleRewards scale_rewards = grpo::ScaleRewards::group;
  bool mask_truncated_completions = false;  // truncated completions contribute no loss
  int64_t num_iterations = 1;               // optimizer passes over each batch
  int64_t micro_batch = 0;                  // sequences per forward/backward; 0 = all at once
  int64_t logprob_chunk = 128;              // sequence positions per LM-head chunk
};

struct StepMetrics {
  double loss = 0, kl = 0, clip_fraction = 0, behaviour_weight = 0, grad_norm = 0, lr = 0;
  double reward_mean = 0;
  int64_t tokens = 0, sequences = 0;
};

// A supervised example: the loss covers the completion tokens only.
struct SftExample {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> completion_ids;
};

// log pi(token) of every completion token of a group under `model`: [G][L_i]. Used by the
// reference actor (pi_ref) and by tests; no gradient.
std::vector<std::vector<float>> completion_logprobs(TransformerImpl& model, const RolloutGroup& group,
                                                    int64_t chunk = 128);

class Trainer {
 public:
  Trainer(Transformer model, TrainerConfig config);
  ~Trainer();

  // num_iterations optimizer steps on these groups; the version advances by that many.
  StepMetrics grpo_step(const std::vector<RolloutGroup>& groups);
  // One optimizer step of mean token cross-entropy on the completions; returns the loss.
  double sft_step(const std::vector<SftExample>& examples);

  int64_t version() const { return version_; }
  Transformer& model() { return model_; }
  double lr_at(int64_t step) const;

 private:
  double finish_step();  // clip, step, schedule; returns the gradient norm

  Transformer model_;
  TrainerConfig config_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  int64_t version_ = 0;
};

}  // namespace troupe
