// AdamW with float32 masters, its schedule and its state files (see optimizer.hpp).
#include "trainer/optimizer.hpp"

#include <cmath>
#include <numbers>
#include <string>

#include <torch/torch.h>

#include "policy/error.hpp"

namespace troupe {

std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<torch::Tensor>& params, const OptimizerConfig& o) {
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
}

double scheduled_lr(const OptimizerConfig& o, int64_t step) {
  if (o.warmup_steps > 0 && step < o.warmup_steps) return o.lr * (step + 1) / static_cast<double>(o.warmup_steps);
  if (o.total_steps <= o.warmup_steps) return o.lr;
  double progress = std::min(1.0, (step - o.warmup_steps) / static_cast<double>(o.total_steps - o.warmup_steps));
  double cosine = 0.5 * (1 + std::cos(std::numbers::pi * progress));
  return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cosine);
}

namespace {
constexpr const char* kStateFormat = "troupe-optimizer-state";
constexpr int64_t kStateVersion = 1;

std::string shape_string(torch::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
}  // namespace

void Optimizer::save(const std::filesystem::path& file, int64_t version) const {
  torch::serialize::OutputArchive archive;
  archive.write("troupe/format", c10::IValue(std::string(kStateFormat)));
  archive.write("troupe/format_version", torch::tensor(kStateVersion));
  archive.write("troupe/version", torch::tensor(version));
  archive.write("troupe/parameters", torch::tensor(static_cast<int64_t>(params_.size())));
  for (size_t i = 0; i < params_.size(); ++i) {
    archive.write("troupe/shape/" + std::to_string(i), torch::tensor(params_[i].sizes().vec()));
    if (!masters_[i].is_same(params_[i])) archive.write("troupe/master/" + std::to_string(i), masters_[i].detach());
  }
  torch::serialize::OutputArchive opt;
  adamw_->save(opt);
  archive.write("optimizer", opt);
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  try {
    archive.save_to(file.string());
  } catch (const c10::Error& e) {
    throw Error(file.string() + ": cannot write the optimizer state (" + e.what_without_backtrace() + ")");
  }
}

int64_t Optimizer::load(const std::filesystem::path& file) {
  const auto& params = params_;
  const auto& o = config_;
  const std::string name = file.string();
  if (!std::filesystem::exists(file)) throw Error(name + ": no such optimizer state file");
  const auto device = params[0].device();
  torch::serialize::InputArchive archive;
  c10::IValue format;
  torch::Tensor format_version, version, count;
  try {
    archive.load_from(name, device);
    archive.read("troupe/format", format);
    archive.read("troupe/format_version", format_version);
    archive.read("troupe/version", version);
    archive.read("troupe/parameters", count);
  } catch (const c10::Error& e) {
    throw Error(name + ": not a troupe optimizer state file (" + e.what_without_backtrace() + ")");
  }
  if (!format.isString() || format.toStringRef() != kStateFormat)
    throw Error(name + ": not a troupe optimizer state file");
  if (format_version.item<int64_t>() != kStateVersion)
    throw Error(name + ": optimizer state format " + std::to_string(format_version.item<int64_t>()) + ", this build reads " +
                std::to_string(kStateVersion));
  const int64_t n = count.item<int64_t>();
  if (n != static_cast<int64_t>(params.size()))
    throw Error(name + ": the optimizer state holds " + std::to_string(n) + " parameter tensors but this trainer optimizes " +
                std::to_string(params.size()) + " (saved from another model, or with another parameter list such as LoRA's?)");
  for (int64_t i = 0; i < n; ++i) {
    torch::Tensor shape;
    archive.read("troupe/shape/" + std::to_string(i), shape);
    auto saved = shape.to(torch::kCPU).contiguous();
    std::vector<int64_t> dims(saved.data_ptr<int64_t>(), saved.data_ptr<int64_t>() + saved.numel());
    if (torch::IntArrayRef(dims) != params[i].sizes())
      throw Error(name + ": parameter " + std::to_string(i) + " was " + shape_string(dims) + " when saved but is " +
                  shape_string(params[i].sizes()) + " here (saved from another model?)");
  }
  torch::serialize::InputArchive opt;
  archive.read("optimizer", opt);
  adamw_->load(opt);
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    if (masters_[i].is_same(params_[i])) continue;
    torch::Tensor saved;
    if (archive.try_read("troupe/master/" + std::to_string(i), saved)) {
      if (saved.sizes() != params_[i].sizes() || saved.scalar_type() != torch::kFloat32)
        throw Error(name + ": master weights " + std::to_string(i) + " are not float32 of the parameter's shape");
      set_master(i, saved);
    } else {
      masters_[i].detach().copy_(params_[i].detach());
      written_[i] = params_[i]._version();
    }
  }
  // The file's hyperparameters came along with the state; the config's are the ones in force.
  for (auto& group : adamw_->param_groups())
    static_cast<torch::optim::AdamWOptions&>(group.options())
        .lr(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
  return version.item<int64_t>();
}

namespace {
bool reduced_precision(const torch::Tensor& p) {
  return p.scalar_type() == torch::kBFloat16 || p.scalar_type() == torch::kHalf;
}
}  // namespace

Optimizer::Optimizer(std::vector<torch::Tensor> params, const OptimizerConfig& config)
    : config_(config), params_(std::move(params)) {
  torch::NoGradGuard no_grad;
  for (const auto& p : params_) {
    masters_.push_back(reduced_precision(p) ? p.detach().to(torch::kFloat32).requires_grad_(true) : p);
    written_.push_back(p._version());
  }
  adamw_ = make_adamw(masters_, config_);
}

Optimizer::~Optimizer() = default;

void Optimizer::follow_parameter(size_t i) {
  if (masters_[i].is_same(params_[i]) || params_[i]._version() == written_[i]) return;
  torch::NoGradGuard no_grad;
  masters_[i].detach().copy_(params_[i].detach());
  written_[i] = params_[i]._version();
}

double Optimizer::step(double lr) {
  for (size_t i = 0; i < params_.size(); ++i) follow_parameter(i);
  for (size_t i = 0; i < params_.size(); ++i)
    if (!masters_[i].is_same(params_[i]) && params_[i].grad().defined()) {
      masters_[i].mutable_grad() = params_[i].grad().to(torch::kFloat32);
      params_[i].mutable_grad().reset();
    }
  double norm = 0;
  if (config_.max_grad_norm > 0) {
    norm = torch::nn::utils::clip_grad_norm_(masters_, config_.max_grad_norm);
  } else {
    for (const auto& m : masters_)
      if (m.grad().defined()) norm += m.grad().pow(2).sum().item<double>();
    norm = std::sqrt(norm);
  }
  for (auto& group : adamw_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  adamw_->step();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    masters_[i].mutable_grad().reset();
    if (masters_[i].is_same(params_[i])) continue;
    params_[i].detach().copy_(masters_[i].detach());
    written_[i] = params_[i]._version();
  }
  return norm;
}

torch::Tensor Optimizer::master(size_t i) {
  if (i >= masters_.size()) throw Error("optimizer: no parameter " + std::to_string(i));
  follow_parameter(i);
  return masters_[i];
}

void Optimizer::set_master(size_t i, const torch::Tensor& values) {
  torch::NoGradGuard no_grad;
  masters_.at(i).detach().copy_(values);
  if (masters_[i].is_same(params_[i])) return;
  params_[i].detach().copy_(masters_[i].detach());
  written_[i] = params_[i]._version();
}

torch::optim::AdamWParamState& Optimizer::state(size_t i) {
  auto& slot = adamw_->state()[masters_.at(i).unsafeGetTensorImpl()];
  if (!slot) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->exp_avg(torch::zeros_like(masters_[i], torch::MemoryFormat::Preserve));
    s->exp_avg_sq(torch::zeros_like(masters_[i], torch::MemoryFormat::Preserve));
    slot = std::move(s);
  }
  return static_cast<torch::optim::AdamWParamState&>(*slot);
}

}  // namespace troupe
