// AdamW as the trainers step it: its hyperparameters, the learning-rate schedule, and its
// state to and from disk. Sharding the state is DataParallel's (trainer/data_parallel.hpp).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

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

// AdamW over `params` with the config's hyperparameters, and the learning rate at optimizer
// step `step`: linear warmup, then cosine down to min_lr_ratio x lr at total_steps. Shared by
// Trainer and PpoTrainer.
std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<at::Tensor>& params, const OptimizerConfig& config);
double scheduled_lr(const OptimizerConfig& config, int64_t step);

// An AdamW state (moments and step counts of `params`) and a version, with torch::serialize;
// what Trainer::save_state and PpoTrainer::save_state write. load_optimizer_state returns the
// version and throws Error naming the file when it is not such a file or was saved for another
// parameter list (count or shapes); `config`'s hyperparameters stay in force.
void save_optimizer_state(const std::filesystem::path& file, torch::optim::AdamW& optimizer,
                          const std::vector<at::Tensor>& params, int64_t version);
int64_t load_optimizer_state(const std::filesystem::path& file, torch::optim::AdamW& optimizer,
                             const std::vector<at::Tensor>& params, const OptimizerConfig& config);

}  // namespace troupe
