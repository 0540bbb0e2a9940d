// One training group's model and optimizer: GRPO steps on rollout groups, SFT steps on packed
// or padded batches, DPO steps on preference pairs, with AdamW, warmup + cosine decay,
// clipping, accumulation and optional activation checkpointing; optimizer state to and from
// disk. The policy version counts optimizer steps.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "policy/transformer.hpp"
#include "trainer/dpo.hpp"
#include "trainer/grpo.hpp"
#include "trainer/optimizer.hpp"
#include "trainer/rollout.hpp"
#include "trainer/sft.hpp"

namespace troupe {

class DataParallel;  // trainer/data_parallel.hpp


struct TrainerConfig {
  OptimizerConfig optimizer;
  grpo::LossConfig loss;
  rl::Advantage advantage = rl::Advantage::group;          // how rewards become advantages
  grpo::ScaleRewards scale_rewards = grpo::ScaleRewards::group;  // group advantages: by the group's std, the batch's, or not
  rl::Overlong overlong;                    // completions cut at max_tokens: masked, penalised or neither
  int64_t num_iterations = 1;               // optimizer passes over each batch
  int64_t micro_batch = 0;                  // sequences per forward/backward; 0 = all at once
  int64_t logprob_chunk = 128;              // sequence positions per LM-head chunk
  dpo::LossConfig dpo;                      // dpo_step's beta and label smoothing
  // Keep only each decoder layer's input in the forward pass and recompute the layer in the
  // backward pass: activations kept drop to one [B, T, hidden] per layer plus one layer's
  // internals at a time, for about one more forward pass of compute. Training passes only.
  bool activation_checkpointing = false;
  int64_t dpo_micro_pairs = 0;              // pairs per forward/backward in dpo_step; 0 = all at once
  // model.batch_invariant: forward passes without autograd run the batch-invariant kernels, and
  // log pi_prox comes from such a pass (one more forward even at one pass): bit for bit what an
  // engine with the same weights recorded, so mismatch/kl is 0 at the same version.
  bool batch_invariant = false;
  // log pi_prox is the behaviour log-probs themselves, no recomputation: only where they are
  // exactly the trainer's (the config checks: eta 0, batch-invariant built-in engines in the
  // trainer's dtype, no LoRA). Saves the forward pass batch_invariant adds.
  bool reuse_behaviour_logprobs = false;
  // RL steps take log-probs of logits / temperature: the generators' sampling temperature (1 for
  // greedy), which their behaviour log-probs are of, so pi / mu compares like with like.
  double temperature = 1.0;
};

// What a GRPO step reports about the behaviour weights pi_prox / mu (trainer.loss.correction)
// over its counted tokens.
struct CorrectionMetrics {
  double masked_fraction = 0, truncated_fraction = 0;  // shares of tokens masked (weight 0) or capped
  std::array<double, 5> ratio_quantiles{};             // the raw ratio's min, 5%, median, 95% and max
  // The k3 KL between mu and pi_prox over the tokens of completions sampled wholly at the
  // trainer's current version (the same weights): the train/rollout numerical mismatch alone.
  double mismatch_kl = 0;
  int64_t mismatch_tokens = 0;  // the tokens it is taken over; 0 when every completion was older
};

struct StepMetrics {
  double loss = 0, kl = 0, clip_fraction = 0, behaviour_weight = 0, grad_norm = 0, lr = 0;
  double reward_mean = 0;
  int64_t tokens = 0, sequences = 0;
  std::optional<CorrectionMetrics> correction;  // grpo_step's; PPO reports none yet
  std::optional<double> overlong_penalty;        // the mean penalty added to the rewards (overlong: penalty)
  std::optional<double> teacher_kl;              // distillation: mean log mu - log pi_teacher over the tokens
};

struct SftMetrics {
  double loss = 0;       // mean token cross-entropy over the trained tokens of the whole step
  double grad_norm = 0, lr = 0;
  int64_t tokens = 0;    // trained tokens
  int64_t sequences = 0, rows = 0;
};

// TRL's DPO metrics (see dpo::LossOutput), means over the step's pairs.
struct DpoMetrics {
  double loss = 0;
  double reward_chosen = 0, reward_rejected = 0, accuracy = 0, margin = 0;
  double logps_chosen = 0, logps_rejected = 0;
  double grad_norm = 0, lr = 0;
  int64_t pairs = 0;
};

// A supervised example: the loss covers the completion tokens only.
struct SftExample {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> completion_ids;
};

// log pi(token) of every completion token of a group under `model`, of logits / temperature:
// [G][L_i]. Used by the reference actor (pi_ref, the teacher) and by tests; no gradient.
std::vector<std::vector<float>> completion_logprobs(TransformerImpl& model, const RolloutGroup& group,
                                                    int64_t chunk = 128, double temperature = 1.0);

class Trainer {
 public:
  Trainer(Transformer model, TrainerConfig config);
  // Optimizes only `params` (LoRA passes its adapters): every other parameter of the model is
  // frozen (requires_grad off), so no gradient is computed or kept for it.
  Trainer(Transformer model, TrainerConfig config, std::vector<torch::Tensor> params);
  ~Trainer();

  // num_iterations optimizer steps on these groups; the version advances by that many.
  StepMetrics grpo_step(const std::vector<RolloutGroup>& groups);
  // One optimizer step of mean token cross-entropy on the completions; returns the loss.
  double sft_step(const std::vector<SftExample>& examples);
  // One optimizer step on these micro-batches (sft::micro_batches), packed or not: the mean
  // token cross-entropy over the trained tokens of all of them together. Each micro-batch's
  // summed loss is divided by the step's total token count, so the accumulated gradient is
  // the whole batch's.
  SftMetrics sft_step(std::span<const sft::Batch> micro_batches);
  // The same loss on held-out batches, in eval mode (no dropout), without gradients or a step.
  double sft_eval(std::span<const sft::Batch> batches);

  // One optimizer step of the DPO loss (config.dpo) on these pairs, whose reference log-probs
  // must be filled in (dpo::compute_reference); dpo_micro_pairs pairs per forward/backward.
  DpoMetrics dpo_step(std::span<const dpo::Pair> pairs);
  // The loss and metrics on held-out pairs, in eval mode, without gradients or a step.
  DpoMetrics dpo_eval(std::span<const dpo::Pair> pairs);

  // The AdamW state (moments and step counts of the optimized parameters) and the version,
  // with torch::serialize. The weights are not in it: they are saved as a model checkpoint.
  // load_state throws Error naming the file when it is not such a file or was saved for
  // another parameter list (count or shapes); the config's hyperparameters stay in force.
  void save_state(const std::filesystem::path& file) const;
  void load_state(const std::filesystem::path& file);

  // Data parallelism over trainer ranks, applied from outside: from then on this Trainer
  // computes its rank's part of each step (token and pair counts made global, so each rank's
  // loss is its share of the whole batch's), and `dp` reduces, clips, steps and gathers.
  // save_state and load_state then write and read this rank's shard in the file's folder.
  // Evaluation (sft_eval, dpo_eval) stays local: each rank scores what it is given.
  void set_data_parallel(std::shared_ptr<DataParallel> dp);
  DataParallel* data_parallel() const { return dp_.get(); }

  int64_t version() const { return version_; }
  Transformer& model() { return model_; }
  const std::vector<torch::Tensor>& parameters() const { return params_; }  // those the optimizer updates
  double lr_at(int64_t step) const;

  struct Trunk;  // the model's layers, reached from outside for activation checkpointing

 private:
  double finish_step();  // clip, step, schedule; returns the gradient norm
  torch::Tensor target_logprobs(const sft::Batch& batch);  // (B, T-1) log pi(ids[t+1])
  DpoMetrics dpo_pass(std::span<const dpo::Pair> pairs, bool train);

  Transformer model_;
  TrainerConfig config_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<Optimizer> optimizer_;  // unset when data-parallel
  std::unique_ptr<Trunk> trunk_;  // set when activation_checkpointing
  std::shared_ptr<DataParallel> dp_;
  int64_t version_ = 0;
};

}  // namespace troupe
