// The pieces the trainer-alone recipes share; see recipe_run.hpp.
#include "actors/recipe_run.hpp"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <random>

#include <torch/torch.h>

#include "actors/tensorboard.hpp"
#include "actors/trainer_state.hpp"
#include "policy/dtype.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "policy/seed.hpp"
#include "trainer/data_parallel.hpp"

namespace troupe::recipe {

torch::Dtype dtype_of(ModelDtype d) {
  TORCH_CHECK(d != ModelDtype::automatic, "model.dtype auto reached dtype_of unresolved: call resolve_model_dtype first");
  return d == ModelDtype::bfloat16 ? torch::kBFloat16 : d == ModelDtype::float64 ? torch::kFloat64 : torch::kFloat32;
}

ModelDtype resolve_model_dtype(const ModelSection& m) {
  auto choice = choose_dtype(to_string(m.dtype), torch::Device(m.device), "model.dtype");
  if (!choice.note.empty() && parallel_env().rank == 0)
    (choice.warning ? std::cerr : std::cout) << "troupe run: " << choice.note << std::endl;
  if (choice.dtype == torch::kFloat64) return ModelDtype::float64;
  return choice.dtype == torch::kBFloat16 ? ModelDtype::bfloat16 : ModelDtype::float32;
}

double logprob_temperature(const RunConfig& c) {
  const bool policy_gradient = c.recipe == Recipe::grpo || c.recipe == Recipe::reinforce || c.recipe == Recipe::ppo ||
                               c.recipe == Recipe::distill;
  return policy_gradient && c.generator.temperature > 0 ? c.generator.temperature : 1.0;
}

TrainerConfig trainer_config(const RunConfig& c) {
  const auto& t = c.trainer;
  TrainerConfig out;
  // Each step takes num_iterations optimizer steps (GRPO's and PPO's epochs over a batch).
  out.optimizer = {.lr = t.lr, .weight_decay = t.weight_decay, .warmup_steps = t.warmup_steps * t.num_iterations,
                   .total_steps = t.steps * t.num_iterations, .min_lr_ratio = t.min_lr_ratio,
                   .max_grad_norm = t.max_grad_norm};
  out.loss = t.loss;  // trainer.loss's policy-gradient part, as read
  out.loss.max_completion_length = c.generator.max_tokens;
  out.advantage = t.advantage;
  out.scale_rewards = t.scale_rewards;
  out.overlong = t.overlong;
  out.overlong.max_tokens = c.generator.max_tokens;
  out.num_iterations = t.num_iterations;
  out.micro_batch = t.micro_batch;
  out.logprob_chunk = t.logprob_chunk;
  out.dpo = {.beta = t.loss.beta, .label_smoothing = t.loss.label_smoothing};
  out.activation_checkpointing = t.activation_checkpointing;
  out.dpo_micro_pairs = t.micro_batch;
  out.batch_invariant = c.model.batch_invariant;
  out.reuse_behaviour_logprobs = t.reuse_behaviour_logprobs;
  out.temperature = logprob_temperature(c);
  return out;
}

std::optional<LoraConfig> lora_config(const RunConfig& c) {
  if (!c.lora) return std::nullopt;
  LoraConfig l;
  l.rank = c.lora->rank;
  l.alpha = c.lora->alpha;
  l.dropout = c.lora->dropout;
  l.target_modules = c.lora->target_modules;
  return l;
}

std::optional<int32_t> model_eos(const ModelConfig& config, const Tokenizer& tokenizer) {
  auto eos = tokenizer.eos_id();
  if (eos && *eos < config.vocab_size) return eos;
  if (!config.eos_token_ids.empty()) return static_cast<int32_t>(config.eos_token_ids[0]);
  return eos;
}

bool prefetches(const ParallelSection& p, const ProcessGroup& group) {
  return p.prefetch == PrefetchMode::always || (p.prefetch == PrefetchMode::automatic && group.backend() == "nccl");
}

std::shared_ptr<ProcessGroup> trainer_group(const RunConfig& c, int64_t batch, const std::string& batch_key) {
  ParallelEnv env = parallel_env();
  if (env.launcher == "none") env.master_port = 0;  // one rank, sharded: a store on any free port
  if (env.distributed() && c.parallel.trainer_ranks > 1 && env.world_size != c.parallel.trainer_ranks)
    throw Error(c.origin.at("parallel.trainer_ranks") + ": parallel.trainer_ranks is " + std::to_string(c.parallel.trainer_ranks) +
                " but the launcher (" + env.launcher + ") started " + std::to_string(env.world_size) +
                " ranks; leave it at 1 under an outside launcher");
  if (!env.distributed() && c.parallel.trainer_ranks > 1)
    throw Error("parallel.trainer_ranks = " + std::to_string(c.parallel.trainer_ranks) +
                ": this process is not one of the ranks (run it with `troupe run`, which starts them)");
  if (env.distributed() && env.world_size > batch)
    throw Error(c.origin.at(batch_key) + ": " + batch_key + " " + std::to_string(batch) + " is smaller than the " +
                std::to_string(env.world_size) + " trainer ranks: every rank needs a part of each batch");
  // Under a launcher even one rank goes through the data-parallel path (bit for bit the plain
  // trainer with sharding none); alone, only when a sharding mode asks for it.
  if (env.launcher == "none" && c.parallel.sharding == ShardingMode::none) return nullptr;
  auto group = ProcessGroup::connect(env, torch::Device(c.model.device),
                                     std::chrono::milliseconds(static_cast<int64_t>(c.parallel.timeout_s * 1000)));
  if (group->rank() == 0)
    std::cout << "troupe run: " << group->size() << " trainer ranks (" << env.launcher << ", " << group->backend()
              << "), sharding " << to_string(c.parallel.sharding) << std::endl;
  return group;
}

Policy load_policy(const RunConfig& c, TrainerConfig trainer) {
  // One seed for everything drawn from LibTorch's generator (LoRA dropout); deterministic
  // mode also refuses kernels without a deterministic implementation.
  torch::manual_seed(c.run.seed);
  if (c.run.deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  Policy p;
  p.model = load_model(c.model.path, {.dtype = dtype_of(c.model.dtype), .device = torch::Device(c.model.device)});
  p.lora = lora_config(c);
  if (p.lora) {
    attach_lora(*p.model.model, *p.lora, c.run.seed);
    p.trainer = std::make_unique<Trainer>(p.model.model, trainer, lora_parameters(*p.model.model));
  } else {
    p.trainer = std::make_unique<Trainer>(p.model.model, trainer);
  }
  if (c.trainer.threads > 0) at::set_num_threads(static_cast<int>(c.trainer.threads));
  if (auto group = trainer_group(c, c.trainer.batch_size, "trainer.batch_size")) {
    p.rank = group->rank();
    p.ranks = group->size();
    const bool prefetch = prefetches(c.parallel, *group);
    shard_trainer(*p.trainer, std::move(group), sharding_of(to_string(c.parallel.sharding)), trainer.optimizer);
    p.trainer->data_parallel()->set_prefetch(prefetch);
  }
  return p;
}

std::pair<int64_t, int64_t> Policy::share(int64_t n) const { return rank_share(n, rank, ranks); }

DataOrder::DataOrder(int64_t n, bool shuffle, uint64_t seed) : n_(n), shuffle_(shuffle), seed_(seed) {
  if (n_ < 1) throw Error("no examples to train on");
  reshuffle();
}

void DataOrder::seek(int64_t epoch, int64_t position) {
  if (position < 0 || position > n_) throw Error("data cursor position " + std::to_string(position) + " outside [0, " + std::to_string(n_) + "]: the checkpoint was made on other data");
  epoch_ = epoch;
  position_ = position;
  reshuffle();
}

void DataOrder::reshuffle() {
  order_.resize(n_);
  std::iota(order_.begin(), order_.end(), 0);
  if (shuffle_) std::shuffle(order_.begin(), order_.end(), std::mt19937_64(mix_seed(seed_, epoch_)));
}

std::vector<int64_t> DataOrder::next(int64_t k) {
  std::vector<int64_t> out;
  while (static_cast<int64_t>(out.size()) < k) {
    if (position_ == n_) {
      ++epoch_;
      position_ = 0;
      reshuffle();
    }
    out.push_back(order_[position_++]);
  }
  return out;
}

void keep_steps_up_to(const std::filesystem::path& file, int64_t step) {
  if (!std::filesystem::exists(file)) return;
  std::vector<std::string> kept;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("step") && j["step"].is_number() && j["step"].get<int64_t>() <= step)
      kept.push_back(line);
  }
  std::ofstream out(file, std::ios::trunc);
  for (const auto& line : kept) out << line << "\n";
}

RunFolder::RunFolder(const RunConfig& c, int64_t resumed_step, bool writer)
    : c_(c), writer_(writer), dir_(c.run.dir), status_(writer ? dir_ : std::filesystem::path(), std::string(to_string(c.recipe)), c.trainer.steps) {
  std::filesystem::create_directories(dir_);
  if (!writer_) return;
  status_.running(resumed_step, {{.name = "trainer", .state = "training"}});
  std::ofstream(dir_ / "config.yaml") << to_yaml(c);
  if (resumed_step > 0) keep_steps_up_to(dir_ / "metrics.jsonl", resumed_step);
  metrics_.open(dir_ / "metrics.jsonl", std::ios::app);
  if (!metrics_) throw Error((dir_ / "metrics.jsonl").string() + ": cannot open for writing (run.dir)");
  board_ = std::make_unique<RunBoard>(dir_);
}

RunFolder::~RunFolder() = default;

void RunFolder::step(int64_t step, nlohmann::json j, int64_t tokens, GraphResult& result) {
  auto now = std::chrono::steady_clock::now();
  double seconds = std::chrono::duration<double>(now - last_).count();
  last_ = now;
  j["step"] = step;
  j["time/step_s"] = seconds;
  j["tokens_per_s"] = tokens / std::max(seconds, 1e-9);
  result.steps = step;
  if (!writer_) return;
  metrics_ << j.dump() << "\n" << std::flush;
  board_->metrics(j);
  status_.running(step, {{.name = "trainer", .state = "training", .detail = "step " + std::to_string(step) + " of " +
                                                                      std::to_string(c_.trainer.steps)}});
  const std::string pace = pace_.tick(step);  // every step, logged or not: Pace counts from the first
  if (step % c_.run.log_every == 0 || step == c_.trainer.steps) {
    const bool colour = colour_terminal();
    std::string line = std::string(colour ? "\033[1m" : "") + "step " + std::to_string(step) + "/" +
                       std::to_string(c_.trainer.steps) + (colour ? "\033[0m" : "");
    for (const char* key : {"loss", "eval/loss", "rewards/accuracies", "rewards/margins", "grad_norm", "lr", "tokens_per_s"}) {
      if (!j.contains(key) || !j[key].is_number()) continue;
      char buf[64];
      std::snprintf(buf, sizeof buf, "  %s %.4g", key, j[key].get<double>());
      line += buf;
    }
    if (!pace.empty()) line += std::string("  ") + (colour ? "\033[2m" : "") + pace + (colour ? "\033[0m" : "");
    std::cout << line << std::endl;
  }
  // Not kept in `result`: metrics.jsonl holds every step, and a long run holds nothing per step.
}

void add_memory_metrics(const Policy& p, nlohmann::json& j) {
  const DataParallel* dp = p.trainer->data_parallel();
  if (!dp) return;
  // Every rank's figures, gathered by a sum over a table where each rank fills its own row.
  auto table = torch::zeros({p.ranks, 3}, torch::kFloat64);
  auto m = dp->memory();
  table[p.rank] = torch::tensor({static_cast<double>(m.params), static_cast<double>(m.grads), static_cast<double>(m.optimizer)},
                                torch::kFloat64);
  p.trainer->data_parallel()->all_reduce_sum(table);
  const char* names[] = {"memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes"};
  for (int k = 0; k < 3; ++k) {
    j[names[k]] = static_cast<int64_t>(table[0][k].item<double>());
    auto per_rank = nlohmann::json::array();
    for (int r = 0; r < p.ranks; ++r) per_rank.push_back(static_cast<int64_t>(table[r][k].item<double>()));
    j[std::string(names[k]) + "/per_rank"] = per_rank;
  }
}

void RunFolder::checkpoint(const Policy& p, int64_t step, const nlohmann::json& cursor) {
  auto dir = dir_ / "checkpoints" / ("step_" + std::to_string(step));
  DataParallel* dp = p.trainer->data_parallel();
  if (dp) dp->gather_all();  // zero3: the export needs whole parameters (every rank takes part)
  if (p.ranks > 1) {
    // Every rank its optimizer shard and random state; then rank 0 the rest, trainer_state.json
    // last and only once every shard is on disk.
    p.trainer->save_state(dir / "optimizer.pt");
    torch::save(at::detail::getDefaultCPUGenerator().get_state(), (dir / ("rng.rank" + std::to_string(p.rank) + ".pt")).string());
    dp->barrier();
    if (!p.writer()) {
      dp->release_all();
      return;
    }
  }
  LoadedModel merged = p.model;
  if (p.lora) {
    // The exported model carries the adapters folded in; the adapter goes next to it as well.
    merged.model = Transformer(p.model.config);
    load_weights(*merged.model, merged_state_dict(*p.model.model), "merged LoRA weights");
    save_peft_adapter(*p.model.model, *p.lora, dir / "adapter", c_.model.path);
  }
  save_hf_dir(merged, dir);
  if (p.ranks == 1) {
    p.trainer->save_state(dir / "optimizer.pt");
    torch::save(at::detail::getDefaultCPUGenerator().get_state(), (dir / "rng.pt").string());
  }
  // One optimizer step per step here, so the version the trainer counts is the updates made.
  write_trainer_state(dir, {.recipe = std::string(to_string(c_.recipe)), .model = c_.model.path, .step = step,
                            .policy_version = p.trainer->version(), .cursor = cursor});
  if (dp) dp->release_all();
}

namespace {

int64_t step_of(const std::filesystem::path& dir) {
  auto name = dir.filename().string();
  if (name.rfind("step_", 0) != 0) return -1;
  try {
    return std::stoll(name.substr(5));
  } catch (...) {
    return -1;
  }
}

}  // namespace

std::optional<Resume> find_resume(const RunConfig& c) {
  if (c.resume.empty()) return std::nullopt;
  namespace fs = std::filesystem;
  fs::path dir = c.resume;
  if (!fs::exists(dir)) throw Error(c.origin.at("resume") + ": resume: " + c.resume + " does not exist");
  if (!fs::exists(dir / "trainer_state.json")) {
    fs::path best;
    for (const auto& e : fs::directory_iterator(dir / "checkpoints", fs::directory_options::skip_permission_denied))
      if (fs::exists(e.path() / "trainer_state.json") && step_of(e.path()) > step_of(best)) best = e.path();
    if (best.empty())
      throw Error(c.origin.at("resume") + ": resume: " + c.resume + " holds no complete checkpoint (checkpoints/step_N/trainer_state.json)");
    dir = best;
  }
  auto file = dir / "trainer_state.json";
  auto state = read_trainer_state(dir);
  if (state.recipe != to_string(c.recipe))
    throw Error(file.string() + ": the checkpoint is from recipe " + state.recipe + ", this config runs " +
                std::string(to_string(c.recipe)) + " (recipe, resume)");
  if (state.model != c.model.path)
    throw Error(file.string() + ": the checkpoint trained " + state.model + ", this config's model.path is " + c.model.path);
  return Resume{dir, state.step, state.cursor};
}

void restore(Policy& p, const Resume& r) {
  DataParallel* dp = p.trainer->data_parallel();
  if (dp) dp->gather_all();  // zero3: whole parameters to load into, then sharded again
  if (p.lora) {
    load_peft_adapter(*p.model.model, r.dir / "adapter");
  } else {
    load_weights(*p.model.model, read_safetensors(safetensors::Checkpoint::open_dir(r.dir)), r.dir.string());
  }
  if (dp) {
    dp->reshard();
    dp->release_all();
  }
  p.trainer->load_state(r.dir / "optimizer.pt");
  // Each rank's own random state where the checkpoint has one (same world size), else rank 0's.
  auto rng_file = r.dir / ("rng.rank" + std::to_string(p.rank) + ".pt");
  if (!std::filesystem::exists(rng_file)) rng_file = r.dir / "rng.rank0.pt";
  if (!std::filesystem::exists(rng_file)) rng_file = r.dir / "rng.pt";
  torch::Tensor rng;
  torch::load(rng, rng_file.string());
  auto generator = at::detail::getDefaultCPUGenerator();  // a handle: set_state needs a non-const one
  generator.set_state(rng);
}

}  // namespace troupe::recipe
