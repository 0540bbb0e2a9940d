// AdamW as the trainers step it: float32 master weights for bf16 and fp16 parameters, clipping by
// the global norm, the learning-rate schedule, and the state to and from disk. Sharding the state
// is DataParallel's (trainer/data_parallel.hpp).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::optim {
class AdamW;
struct AdamWParamState;
}

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
// step `step`: linear warmup, then cosine down to min_lr_ratio x lr at total_steps.
std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<at::Tensor>& params, const OptimizerConfig& config);
double scheduled_lr(const OptimizerConfig& config, int64_t step);

// AdamW over a list of parameters, as Trainer and PpoTrainer step it. A bf16 or fp16 parameter is
// stepped through a float32 master copy, which torch.amp and FSDP's MixedPrecision keep too: an
// update smaller than half a bf16 step (a relative 2^-9, so lr 1e-6 on a weight of 0.01) would
// otherwise round away, and the model would not learn. float32 parameters are their own masters.
// The parameters stay the model's: a master follows a parameter that was written from outside
// (loaded weights, say) since its last step, by the parameter's version counter.
class Optimizer {
 public:
  Optimizer(std::vector<at::Tensor> params, const OptimizerConfig& config);
  ~Optimizer();

  // One step from the parameters' gradients: clipped to max_grad_norm by their global norm (in
  // float32), AdamW at `lr`, the masters' new values back into the parameters, gradients
  // cleared. Returns the norm before clipping.
  double step(double lr);

  // The AdamW state (moments and step counts), the masters of the reduced-precision parameters
  // (their bits beyond the parameter's), and a version, with torch::serialize. load returns the
  // version and throws Error naming the file when it is not such a file or was saved for another
  // parameter list (count or shapes); the config's hyperparameters stay in force. A file without
  // masters (from float32 training) takes them from the parameters.
  void save(const std::filesystem::path& file, int64_t version) const;
  int64_t load(const std::filesystem::path& file);

  const std::vector<at::Tensor>& parameters() const { return params_; }
  // Parameter i's master, brought up to date with the parameter, and its AdamW state (zero
  // moments before the first step): for DataParallel, which writes its own file format.
  at::Tensor master(size_t i);
  void set_master(size_t i, const at::Tensor& values);  // and the parameter, rounded to its dtype
  torch::optim::AdamWParamState& state(size_t i);

 private:
  void follow_parameter(size_t i);  // a parameter written from outside: its master takes its values

  OptimizerConfig config_;
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> masters_;    // [i] float32 copy, or params_[i] itself
  std::vector<int64_t> written_;       // [i] params_[i]'s version counter after the last write-back
  std::unique_ptr<torch::optim::AdamW> adamw_;  // over masters_
};

}  // namespace troupe
