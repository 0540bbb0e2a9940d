// AdamW's construction, schedule and state files (see optimizer.hpp).
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

void save_optimizer_state(const std::filesystem::path& file, torch::optim::AdamW& optimizer,
                          const std::vector<torch::Tensor>& params, int64_t version) {
  torch::serialize::OutputArchive archive;
  archive.write("troupe/format", c10::IValue(std::string(kStateFormat)));
  archive.write("troupe/format_version", torch::tensor(kStateVersion));
  archive.write("troupe/version", torch::tensor(version));
  archive.write("troupe/parameters", torch::tensor(static_cast<int64_t>(params.size())));
  for (size_t i = 0; i < params.size(); ++i)
    archive.write("troupe/shape/" + std::to_string(i), torch::tensor(params[i].sizes().vec()));
  torch::serialize::OutputArchive opt;
  optimizer.save(opt);
  archive.write("optimizer", opt);
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  try {
    archive.save_to(file.string());
  } catch (const c10::Error& e) {
    throw Error(file.string() + ": cannot write the optimizer state (" + e.what_without_backtrace() + ")");
  }
}

int64_t load_optimizer_state(const std::filesystem::path& file, torch::optim::AdamW& optimizer,
                             const std::vector<torch::Tensor>& params, const OptimizerConfig& o) {
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
  optimizer.load(opt);
  // The file's hyperparameters came along with the state; the config's are the ones in force.
  for (auto& group : optimizer.param_groups())
    static_cast<torch::optim::AdamWOptions&>(group.options())
        .lr(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
  return version.item<int64_t>();
}

}  // namespace troupe
