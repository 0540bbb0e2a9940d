// Flat per-block buffers, c10d collectives and AdamW on the shard. The formulas are the
// one-rank trainer's: gradients of a loss divided by global counts, summed over ranks; the
// global norm sqrt(sum over ranks of |g_shard|^2); clip coefficient max_norm / (norm + 1e-6)
// when below 1 (torch's clip_grad_norm_); AdamW elementwise, so a shard steps as the whole.
#include "trainer/data_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <tuple>
#include <unordered_set>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "policy/error.hpp"

namespace troupe {

struct DataParallel::Block {
  std::string name;                  // model.embed_tokens, model.layers.N, or rest
  std::vector<size_t> members;       // indices into params_
  std::vector<int64_t> offsets;      // each member's offset in the flat buffer
  int64_t numel = 0, padded = 0;     // elements, and rounded up to a multiple of the world size
  int64_t layer = -1;                // model.layers.N: N; else -1
  bool whole = true;                 // zero3: the parameters hold their values (else empty)
};

namespace {

constexpr std::string_view kShardingNames[] = {"none", "zero1", "zero2", "zero3"};  // in enum order
constexpr const char* kLayoutFormat = "troupe-sharded-optimizer";
constexpr int64_t kLayoutVersion = 1;

// Blocks in a fixed order: the embedding, each decoder layer by number, then the rest.
std::tuple<int, int64_t, std::string> block_of(const std::string& name) {
  const std::string layers = "model.layers.";
  if (name.rfind(layers, 0) == 0) {
    auto dot = name.find('.', layers.size());
    auto n = name.substr(layers.size(), dot - layers.size());
    return {1, std::stoll(n), layers + n};
  }
  if (name.rfind("model.embed_tokens", 0) == 0) return {0, 0, "model.embed_tokens"};
  return {2, 0, "rest"};
}

torch::optim::AdamWParamState& adam_state(torch::optim::AdamW& opt, const torch::Tensor& p) {
  auto& slot = opt.state()[p.unsafeGetTensorImpl()];
  if (!slot) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    slot = std::move(s);
  }
  return static_cast<torch::optim::AdamWParamState&>(*slot);
}

std::string rank_file(int r) { return "optimizer.rank" + std::to_string(r) + ".pt"; }

// Reductions and master weights in float32, or float64 for a float64 model (exactness checks).
at::ScalarType wide_of(const torch::Tensor& p) { return at::promote_types(p.scalar_type(), torch::kFloat32); }

}  // namespace

std::string_view name_of(Sharding mode) { return kShardingNames[static_cast<size_t>(mode)]; }

Sharding sharding_of(std::string_view name) {
  for (size_t i = 0; i < std::size(kShardingNames); ++i)
    if (kShardingNames[i] == name) return static_cast<Sharding>(i);
  throw Error("sharding '" + std::string(name) + "': expected none, zero1, zero2 or zero3");
}

std::pair<int64_t, int64_t> rank_share(int64_t n, int rank, int ranks) {
  const int64_t base = n / ranks, extra = n % ranks;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

void shard_trainer(Trainer& trainer, std::shared_ptr<ProcessGroup> group, Sharding mode, const OptimizerConfig& optimizer) {
  std::unordered_set<const void*> trained;
  for (const auto& t : trainer.parameters()) trained.insert(t.unsafeGetTensorImpl());
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : trainer.model()->named_parameters())
    if (trained.count(item.value().unsafeGetTensorImpl())) named.emplace_back(item.key(), item.value());
  trainer.set_data_parallel(std::make_shared<DataParallel>(std::move(group), mode, std::move(named), optimizer));
}

DataParallel::DataParallel(std::shared_ptr<ProcessGroup> group, Sharding mode,
                           std::vector<std::pair<std::string, at::Tensor>> named, const OptimizerConfig& config)
    : group_(std::move(group)), mode_(mode), config_(config) {
  if (named.empty()) throw Error("data parallel: no parameters to train");
  // Stable: within a block the trainer's own order, so every rank lays out the same buffer.
  std::vector<size_t> order(named.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    auto [ka, na, sa] = block_of(named[a].first);
    auto [kb, nb, sb] = block_of(named[b].first);
    return std::tie(ka, na) < std::tie(kb, nb);
  });
  const int64_t W = group_->size();
  for (size_t i : order) {
    auto [kind, n, block] = block_of(named[i].first);
    if (blocks_.empty() || blocks_.back().name != block)
      blocks_.push_back(Block{.name = block, .layer = kind == 1 ? n : -1});
    auto& b = blocks_.back();
    b.members.push_back(params_.size());
    b.offsets.push_back(b.numel);
    b.numel += named[i].second.numel();
    params_.push_back(named[i].second);
    trainer_index_.push_back(i);
    names_.push_back(named[i].first);
    shapes_.push_back(named[i].second.sizes().vec());
  }
  for (auto& b : blocks_) b.padded = (b.numel + W - 1) / W * W;
  for (auto& [name, p] : named) original_.push_back(p);
  if (W > 1) {
    // As DDP does: every rank starts from rank 0's values, whatever built each rank's copy
    // (a warm-up with nondeterministic kernels, say).
    torch::NoGradGuard no_grad;
    for (const auto& b : blocks_) {
      auto flat = flatten(b, /*grads=*/false);
      group_->broadcast(flat, 0);
      for (size_t k = 0; k < b.members.size(); ++k) {
        auto& p = params_[b.members[k]];
        p.copy_(flat.narrow(0, b.offsets[k], p.numel()).view_as(p));
      }
    }
  }
  if (mode_ == Sharding::none) {
    replicated_ = std::make_unique<Optimizer>(original_, config_);
  } else {
    torch::NoGradGuard no_grad;
    for (auto& b : blocks_) {
      auto flat = flatten(b, /*grads=*/false);
      masters_.push_back(flat.narrow(0, group_->rank() * (b.padded / W), b.padded / W).clone().requires_grad_(true));
    }
    optimizer_ = make_adamw(masters_, config_);
    if (mode_ == Sharding::zero3) release_all();  // from here each rank holds only its shards
  }
}

DataParallel::~DataParallel() = default;

torch::Tensor DataParallel::flatten(const Block& b, bool grads) const {
  auto flat = torch::zeros({b.padded}, params_[b.members[0]].options().dtype(wide_of(params_[b.members[0]])));
  for (size_t k = 0; k < b.members.size(); ++k) {
    const auto& p = params_[b.members[k]];
    const auto& src = grads ? p.grad() : p;
    if (src.defined()) flat.narrow(0, b.offsets[k], p.numel()).copy_(src.detach().reshape({-1}));
  }
  return flat;
}

double DataParallel::step(double lr) {
  double norm = mode_ == Sharding::none ? step_replicated(lr) : step_sharded(lr);
  for (auto& p : params_) p.mutable_grad().reset();
  for (auto& m : masters_) m.mutable_grad().reset();
  return norm;
}

double DataParallel::step_replicated(double lr) {
  torch::NoGradGuard no_grad;
  for (auto& b : blocks_) {
    auto flat = flatten(b, /*grads=*/true);
    if (group_->size() > 1) group_->all_reduce_sum(flat);
    for (size_t k = 0; k < b.members.size(); ++k) {
      auto& p = params_[b.members[k]];
      p.mutable_grad() = flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes()).to(p.dtype()).clone();
    }
  }
  // Every rank now holds the global gradient: the one-rank trainer's clip and step, over the
  // trainer's parameter order (so that one rank through this path is bit for bit the same).
  return replicated_->step(lr);
}

double DataParallel::step_sharded(double lr) {
  for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  torch::NoGradGuard no_grad;
  drop_prefetch();  // gathered from the masters this step changes
  const int64_t W = group_->size(), r = group_->rank();
  double local = 0;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    auto& b = blocks_[i];
    const int64_t n = b.padded / W;
    if (mode_ == Sharding::zero3 && b.layer >= 0) {
      // Reduce-scattered layer by layer in the backward pass already.
      if (!masters_[i].grad().defined()) masters_[i].mutable_grad() = torch::zeros({n}, masters_[i].options());
      local += masters_[i].grad().to(torch::kFloat64).pow(2).sum().item<double>();
      continue;
    }
    auto flat = flatten(b, /*grads=*/true);
    for (size_t k : b.members) params_[k].mutable_grad().reset();  // zero2 keeps only the shard from here
    torch::Tensor shard;
    if (mode_ == Sharding::zero1 && W > 1) {
      group_->all_reduce_sum(flat);
      shard = flat.narrow(0, r * n, n).clone();
    } else {
      shard = torch::empty({n}, flat.options());
      if (W > 1) group_->reduce_scatter_sum(shard, flat); else shard.copy_(flat);
    }
    local += shard.to(torch::kFloat64).pow(2).sum().item<double>();
    masters_[i].mutable_grad() = shard;
  }
  const double norm = std::sqrt(W > 1 ? group_->sum(local) : local);
  if (config_.max_grad_norm > 0) {
    const double coef = config_.max_grad_norm / (norm + 1e-6);
    if (coef < 1)
      for (auto& m : masters_) m.mutable_grad().mul_(coef);
  }
  optimizer_->step();
  if (mode_ == Sharding::zero3) {
    release_all();  // the shards are the parameters; each use gathers them
    return norm;
  }
  for (size_t i = 0; i < blocks_.size(); ++i) {
    auto& b = blocks_[i];
    auto full = torch::empty({b.padded}, masters_[i].options().requires_grad(false));
    if (W > 1) group_->all_gather(full, masters_[i].detach()); else full.copy_(masters_[i].detach());
    for (size_t k = 0; k < b.members.size(); ++k) {
      auto& p = params_[b.members[k]];
      p.detach().copy_(full.narrow(0, b.offsets[k], p.numel()).view(p.sizes()));
    }
  }
  return norm;
}

MemoryBytes DataParallel::memory() const {
  MemoryBytes m;
  const int64_t W = group_->size();
  for (size_t k = 0; k < params_.size(); ++k)
    m.params += c10::multiply_integers(shapes_[k]) * params_[k].element_size();
  if (mode_ == Sharding::zero3) {
    // At rest between steps: the fp32 shard is the parameter; moments beside it.
    int64_t shard = 0;
    for (const auto& b : blocks_) shard += b.padded / W;
    const int64_t e = masters_[0].element_size();
    m.params = shard * e;
    m.grads = shard * e;
    m.optimizer = 2 * shard * e;
    return m;
  }
  if (mode_ == Sharding::none) {
    m.grads = m.params;
    // exp_avg and exp_avg_sq in float32, and float32 masters of bf16 and fp16 parameters
    for (size_t k = 0; k < params_.size(); ++k) {
      const int64_t n = params_[k].numel();
      m.optimizer += (params_[k].element_size() < 4 ? 3 : 2) * n * std::max<int64_t>(4, params_[k].element_size());
    }
  } else {
    int64_t shard = 0;
    for (const auto& b : blocks_) shard += b.padded / W;
    const int64_t e = masters_[0].element_size();
    m.grads = mode_ == Sharding::zero1 ? m.params : shard * e;
    m.optimizer = 3 * shard * e;  // fp32 master, exp_avg, exp_avg_sq
  }
  return m;
}

void DataParallel::gather_block(size_t i) {
  auto& b = blocks_[i];
  if (b.whole) return;
  torch::NoGradGuard no_grad;
  torch::Tensor full;
  if (prefetch_.wait && prefetch_.block == i) {
    prefetch_.wait();
    full = prefetch_.full;
    prefetch_ = {};
  } else {
    full = torch::empty({b.padded}, masters_[i].options().requires_grad(false));
    if (group_->size() > 1) group_->all_gather(full, masters_[i].detach()); else full.copy_(masters_[i].detach());
  }
  for (size_t k = 0; k < b.members.size(); ++k) {
    auto& p = params_[b.members[k]];
    const auto& shape = shapes_[b.members[k]];
    p.set_data(full.narrow(0, b.offsets[k], c10::multiply_integers(shape)).view(shape).to(p.dtype()));
  }
  b.whole = true;
}

void DataParallel::release_block(size_t i) {
  auto& b = blocks_[i];
  if (!b.whole) return;
  torch::NoGradGuard no_grad;
  for (size_t k : b.members) params_[k].set_data(torch::empty({0}, params_[k].options()));
  b.whole = false;
}

size_t DataParallel::block_of_layer(int64_t layer) const {
  for (size_t i = 0; i < blocks_.size(); ++i)
    if (blocks_[i].layer == layer) return i;
  return blocks_.size();  // a layer without trained parameters
}

void DataParallel::begin_step() {
  if (mode_ != Sharding::zero3) return;
  for (size_t i = 0; i < blocks_.size(); ++i)
    if (blocks_[i].layer < 0) gather_block(i);
}

void DataParallel::gather_layer(int64_t layer) {
  if (auto i = block_of_layer(layer); mode_ == Sharding::zero3 && i < blocks_.size()) {
    gather_block(i);
    prefetch_after(layer);
  }
}

// A forward pass walks the layers up, the backward pass's recomputation down from the last:
// the same layer twice in a row turns the walk around. Every rank calls gather_layer in the
// same order, so every rank starts the same prefetches.
void DataParallel::prefetch_after(int64_t layer) {
  direction_ = layer == last_layer_ ? -direction_ : layer > last_layer_ ? 1 : -1;
  last_layer_ = layer;
  const size_t next = block_of_layer(layer + direction_);
  if (!prefetch_on_ || group_->size() == 1 || next == blocks_.size() || blocks_[next].whole || prefetch_.block == next) return;
  drop_prefetch();
  torch::NoGradGuard no_grad;
  prefetch_.block = next;
  prefetch_.full = torch::empty({blocks_[next].padded}, masters_[next].options().requires_grad(false));
  prefetch_.wait = group_->start_all_gather(prefetch_.full, masters_[next].detach());
}

void DataParallel::drop_prefetch() {
  if (prefetch_.wait) prefetch_.wait();
  prefetch_ = {};
}

void DataParallel::release_layer(int64_t layer) {
  if (auto i = block_of_layer(layer); mode_ == Sharding::zero3 && i < blocks_.size()) release_block(i);
}

void DataParallel::reduce_layer_grads(int64_t layer, const std::vector<at::Tensor>& params,
                                      const std::vector<at::Tensor>& grads) {
  const size_t i = block_of_layer(layer);
  if (mode_ != Sharding::zero3 || i == blocks_.size()) return;
  torch::NoGradGuard no_grad;
  const auto& b = blocks_[i];
  const int64_t W = group_->size(), n = b.padded / W;
  auto flat = torch::zeros({b.padded}, masters_[i].options().requires_grad(false));
  for (size_t j = 0; j < params.size(); ++j) {
    if (!grads[j].defined()) continue;
    for (size_t k = 0; k < b.members.size(); ++k)
      if (params_[b.members[k]].unsafeGetTensorImpl() == params[j].unsafeGetTensorImpl())
        flat.narrow(0, b.offsets[k], grads[j].numel()).add_(grads[j].detach().reshape({-1}).to(flat.scalar_type()));
  }
  auto shard = torch::empty({n}, flat.options());
  if (W > 1) group_->reduce_scatter_sum(shard, flat); else shard.copy_(flat);
  auto& g = masters_[i].mutable_grad();
  if (g.defined()) g.add_(shard); else g = shard;
}

int64_t DataParallel::max_passes(int64_t local) {
  return group_->size() > 1 ? static_cast<int64_t>(group_->max(static_cast<double>(local))) : local;
}

void DataParallel::gather_all() {
  if (mode_ != Sharding::zero3) return;
  for (size_t i = 0; i < blocks_.size(); ++i) gather_block(i);
}

void DataParallel::release_all() {
  if (mode_ != Sharding::zero3) return;
  drop_prefetch();
  for (size_t i = 0; i < blocks_.size(); ++i) release_block(i);
}

void DataParallel::reshard() {
  if (mode_ == Sharding::none) return;
  drop_prefetch();
  torch::NoGradGuard no_grad;
  const int64_t W = group_->size(), r = group_->rank();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const int64_t n = blocks_[i].padded / W;
    masters_[i].detach().copy_(flatten(blocks_[i], false).narrow(0, r * n, n));
  }
}

// The state as flat fp32 buffers per block: [block] {master (or params), exp_avg, exp_avg_sq}
// of this rank's slice [r * padded / W, (r + 1) * padded / W).
void DataParallel::save_state(const std::filesystem::path& dir, int64_t version) const {
  torch::NoGradGuard no_grad;
  const int64_t W = group_->size(), r = group_->rank();
  std::filesystem::create_directories(dir);
  torch::serialize::OutputArchive archive;
  int64_t step = 0;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const auto& b = blocks_[i];
    const int64_t n = b.padded / W;
    torch::Tensor master, avg, avg_sq;
    if (mode_ == Sharding::none) {
      auto full_master = torch::zeros({b.padded}, torch::kFloat32), full_avg = torch::zeros({b.padded}, torch::kFloat32),
           full_sq = torch::zeros({b.padded}, torch::kFloat32);
      for (size_t k = 0; k < b.members.size(); ++k) {
        const size_t t = trainer_index_[b.members[k]];
        const int64_t numel = params_[b.members[k]].numel();
        auto& s = replicated_->state(t);
        full_master.narrow(0, b.offsets[k], numel).copy_(replicated_->master(t).detach().reshape({-1}));
        full_avg.narrow(0, b.offsets[k], numel).copy_(s.exp_avg().reshape({-1}));
        full_sq.narrow(0, b.offsets[k], numel).copy_(s.exp_avg_sq().reshape({-1}));
        step = s.step();
      }
      master = full_master.narrow(0, r * n, n).clone();
      avg = full_avg.narrow(0, r * n, n).clone();
      avg_sq = full_sq.narrow(0, r * n, n).clone();
    } else {
      master = masters_[i].detach().clone();
      auto it = optimizer_->state().find(masters_[i].unsafeGetTensorImpl());
      if (it != optimizer_->state().end()) {
        auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
        avg = s.exp_avg().clone();
        avg_sq = s.exp_avg_sq().clone();
        step = s.step();
      } else {
        avg = torch::zeros({n}, masters_[i].scalar_type());
        avg_sq = torch::zeros({n}, masters_[i].scalar_type());
      }
    }
    archive.write("master/" + std::to_string(i), master.cpu());
    archive.write("exp_avg/" + std::to_string(i), avg.cpu());
    archive.write("exp_avg_sq/" + std::to_string(i), avg_sq.cpu());
  }
  archive.write("step", torch::tensor(step));
  archive.write("rank", torch::tensor(r));
  try {
    archive.save_to((dir / rank_file(r)).string());
  } catch (const c10::Error& e) {
    throw Error((dir / rank_file(r)).string() + ": cannot write the optimizer shard (" + e.what_without_backtrace() + ")");
  }
  if (r == 0) {
    nlohmann::json blocks = nlohmann::json::array();
    for (const auto& b : blocks_) {
      nlohmann::json params = nlohmann::json::array();
      for (size_t k : b.members) params.push_back({{"name", names_[k]}, {"shape", params_[k].sizes().vec()}});
      blocks.push_back({{"name", b.name}, {"numel", b.numel}, {"padded", b.padded}, {"params", params}});
    }
    nlohmann::json layout{{"format", kLayoutFormat}, {"format_version", kLayoutVersion},
                          {"sharding", std::string(name_of(mode_))}, {"world_size", W},
                          {"version", version}, {"files", nullptr}, {"blocks", blocks}};
    nlohmann::json files = nlohmann::json::array();
    for (int64_t k = 0; k < W; ++k) files.push_back(rank_file(static_cast<int>(k)));
    layout["files"] = files;
    std::ofstream(dir / "layout.json") << layout.dump(2) << "\n";
  }
}

int64_t DataParallel::load_state(const std::filesystem::path& dir) {
  torch::NoGradGuard no_grad;
  const auto layout_file = dir / "layout.json";
  const std::string where = layout_file.string();
  std::ifstream in(layout_file);
  if (!in) throw Error(where + ": no sharded optimizer layout (not a checkpoint of a data-parallel run?)");
  auto layout = nlohmann::json::parse(in, nullptr, false);
  if (layout.is_discarded() || !layout.is_object() || layout.value("format", "") != kLayoutFormat)
    throw Error(where + ": not a troupe sharded optimizer layout");
  if (layout.value("format_version", 0) != kLayoutVersion)
    throw Error(where + ": layout format " + layout["format_version"].dump() + ", this build reads " + std::to_string(kLayoutVersion));
  const auto& saved_blocks = layout["blocks"];
  if (!saved_blocks.is_array() || saved_blocks.size() != blocks_.size())
    throw Error(where + ": the checkpoint has " + std::to_string(saved_blocks.size()) + " parameter blocks, this model " +
                std::to_string(blocks_.size()) + " (a checkpoint of another model, or of another LoRA setup?)");
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const auto& s = saved_blocks[i];
    const auto& b = blocks_[i];
    if (s.value("name", "") != b.name || s.value("numel", int64_t{-1}) != b.numel || s["params"].size() != b.members.size())
      throw Error(where + ": block " + std::to_string(i) + " is " + s.value("name", "?") + " with " +
                  s["numel"].dump() + " elements in the checkpoint but " + b.name + " with " + std::to_string(b.numel) +
                  " here (a checkpoint of another model?)");
    for (size_t k = 0; k < b.members.size(); ++k)
      if (s["params"][k].value("name", "") != names_[b.members[k]])
        throw Error(where + ": parameter " + s["params"][k].value("name", "?") + " in the checkpoint where this model has " +
                    names_[b.members[k]]);
  }
  const int64_t saved_world = layout.value("world_size", int64_t{0});
  const bool saved_sharded = layout.value("sharding", "none") != "none";
  std::vector<torch::serialize::InputArchive> shards(saved_world);
  for (int64_t k = 0; k < saved_world; ++k) {
    auto file = dir / rank_file(static_cast<int>(k));
    try {
      shards[k].load_from(file.string());
    } catch (const c10::Error& e) {
      throw Error(file.string() + ": cannot read this optimizer shard (" + e.what_without_backtrace() + ")");
    }
  }
  torch::Tensor step_t;
  shards[0].read("step", step_t);
  const int64_t step = step_t.item<int64_t>();
  const int64_t W = group_->size(), r = group_->rank();
  // Each block's full state, from the saved ranks' slices, cut to its real length.
  auto full = [&](const std::string& key, size_t i) {
    std::vector<torch::Tensor> parts;
    for (auto& a : shards) {
      torch::Tensor t;
      a.read(key + "/" + std::to_string(i), t);
      parts.push_back(t);
    }
    return torch::cat(parts).narrow(0, 0, blocks_[i].numel);
  };
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const auto& b = blocks_[i];
    auto avg = full("exp_avg", i), avg_sq = full("exp_avg_sq", i);
    if (mode_ == Sharding::none) {
      auto master = full("master", i);
      for (size_t k = 0; k < b.members.size(); ++k) {
        const size_t t = trainer_index_[b.members[k]];
        const auto& p = params_[b.members[k]];
        auto slice = [&](const torch::Tensor& flat) { return flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes()); };
        replicated_->set_master(t, slice(master));
        auto& s = replicated_->state(t);
        s.step(step);
        s.exp_avg(slice(avg).to(s.exp_avg().options()).clone());
        s.exp_avg_sq(slice(avg_sq).to(s.exp_avg_sq().options()).clone());
      }
    } else {
      const int64_t n = b.padded / W;
      auto pad = [&](const torch::Tensor& t) {
        auto out = torch::zeros({b.padded}, masters_[i].scalar_type());
        out.narrow(0, 0, b.numel).copy_(t);
        return out.narrow(0, r * n, n).clone().to(masters_[i].device());
      };
      // fp32 masters come back from the shards (bf16 parameters would have rounded them).
      if (saved_sharded) masters_[i].detach().copy_(pad(full("master", i)));
      auto& s = adam_state(*optimizer_, masters_[i]);
      s.step(step);
      s.exp_avg(pad(avg));
      s.exp_avg_sq(pad(avg_sq));
    }
  }
  return layout.value("version", int64_t{0});
}

}  // namespace troupe
