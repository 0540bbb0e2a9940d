// What the trainer-alone recipes (sft, lora, dpo) share: the model with or without LoRA
// adapters, the run folder (metrics.jsonl, progress lines, checkpoints) and the data order.
// Each recipe itself reads top to bottom in its own file.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/config.hpp"
#include "actors/graph.hpp"
#include "actors/progress_line.hpp"
#include "actors/run_status.hpp"
#include "policy/checkpoint.hpp"
#include "policy/lora.hpp"
#include "trainer/trainer.hpp"

namespace troupe {

class RunBoard;  // actors/tensorboard.hpp

GraphResult run_sft(const RunConfig& config, const std::atomic<bool>* stop_requested);
GraphResult run_dpo(const RunConfig& config, const std::atomic<bool>* stop_requested);

namespace recipe {

// The torch dtype of a resolved model.dtype (float32 or bfloat16; auto must be resolved first).
torch::Dtype dtype_of(ModelDtype d);
// model.dtype with auto decided for this machine and device; prints what auto chose and why,
// and warns when an explicit bfloat16 is emulated (slow) on this CPU.
ModelDtype resolve_model_dtype(const ModelSection& m);
TrainerConfig trainer_config(const RunConfig& c);
// The temperature the RL recipes take log-probs at (policy and reference alike): the
// generators' sampling temperature, 1 for greedy; 1 for the recipes that compare no
// behaviour log-probs (sft, lora, dpo, online_dpo).
double logprob_temperature(const RunConfig& c);
std::optional<LoraConfig> lora_config(const RunConfig& c);
// The end-of-sequence id to train after plain-text responses: the tokenizer's, unless it lies
// outside the model's vocabulary (a small model with a borrowed tokenizer), then the model's own.
std::optional<int32_t> model_eos(const ModelConfig& model, const Tokenizer& tokenizer);

// The policy to train: the model, with adapters attached (and everything else frozen) when
// the config has a lora section; the Trainer then optimizes only the adapters.
// With several trainer ranks (parallel.trainer_ranks, or torchrun / srun / mpirun) every rank
// loads the same policy and its Trainer trains data-parallel (trainer/data_parallel.hpp): each
// rank takes its share of each batch, rank 0 alone writes metrics, progress and the Hugging Face
// export, and every rank writes its shard of the optimizer state.
struct Policy {
  LoadedModel model;
  std::optional<LoraConfig> lora;
  std::unique_ptr<Trainer> trainer;
  int rank = 0, ranks = 1;  // this process among the trainer ranks
  bool writer() const { return rank == 0; }
  // The part [begin, end) of a batch of n items this rank trains: contiguous, in rank order,
  // sizes differing by at most one (token counts are global, so uneven parts stay exact).
  std::pair<int64_t, int64_t> share(int64_t n) const;
};
Policy load_policy(const RunConfig& c, TrainerConfig trainer);
// The trainer ranks this process is one of (troupe's launcher, torchrun, Slurm, OpenMPI), or
// one rank alone when parallel.sharding asks for the sharded path; nullptr for a plain single
// trainer. Throws Error naming parallel.trainer_ranks when it disagrees with the launcher, or
// `batch_key` when its `batch` is smaller than the ranks.
std::shared_ptr<ProcessGroup> trainer_group(const RunConfig& c, int64_t batch, const std::string& batch_key);
// Whether zero3 prefetches the next layer in `group` (parallel.prefetch, auto resolved by backend).
bool prefetches(const ParallelSection& p, const ProcessGroup& group);

// A checkpoint to continue from (config.resume): its folder, step and data cursor.
struct Resume {
  std::filesystem::path dir;  // runs/NAME/checkpoints/step_N
  int64_t step = 0;
  nlohmann::json cursor;      // {"epoch", "position"}
};
// config.resume resolved: a checkpoint folder, or a run folder's newest complete checkpoint
// (trainer_state.json is written last, so a checkpoint cut short by a kill is skipped).
// Throws Error naming the file when it belongs to another recipe or model.
std::optional<Resume> find_resume(const RunConfig& c);
// Weights (or the LoRA adapter over the base), optimizer state and RNG state from `r`.
void restore(Policy& policy, const Resume& r);

// The order examples are seen in: epoch e is a permutation of [0, n) seeded by (seed, e), or
// the identity without shuffling. next(k) hands out the next k indices, across epochs.
class DataOrder {
 public:
  DataOrder(int64_t n, bool shuffle, uint64_t seed);
  std::vector<int64_t> next(int64_t k);
  void seek(int64_t epoch, int64_t position);  // where a checkpoint's cursor left off
  int64_t epoch() const { return epoch_; }
  int64_t position() const { return position_; }

 private:
  void reshuffle();
  int64_t n_;
  bool shuffle_;
  uint64_t seed_;
  int64_t epoch_ = 0, position_ = 0;
  std::vector<int64_t> order_;
};

// memory/params_bytes, memory/grads_bytes and memory/optimizer_bytes (rank 0's, and each
// rank's under .../per_rank) when the trainer is data parallel; nothing otherwise. Every rank calls it.
void add_memory_metrics(const Policy& p, nlohmann::json& j);

// Keeps the lines of a JSONL file (metrics.jsonl, failures.jsonl) whose "step" is at most
// `step` and drops the rest: steps an interrupted run made after its last checkpoint are made again.
void keep_steps_up_to(const std::filesystem::path& file, int64_t step);

// runs/NAME: the resolved config, metrics.jsonl (and the same in tb/ for TensorBoard), a progress
// line per log_every steps, and checkpoints (a Hugging Face folder of the merged weights, the PEFT
// adapter with LoRA, and the optimizer state) every checkpoint_every steps and at the end.
class RunFolder {
 public:
  // Resuming from step k keeps metrics.jsonl's lines up to k and drops the rest (steps the
  // interrupted run made after its last checkpoint are made again); tb/ is made again from them.
  // `writer`: this process writes the folder (rank 0); the others only write their checkpoint shards.
  RunFolder(const RunConfig& c, int64_t resumed_step = 0, bool writer = true);
  ~RunFolder();
  // Adds step, time and tokens_per_s to `metrics`, writes and prints it, counts it in result.steps.
  void step(int64_t step, nlohmann::json metrics, int64_t tokens, GraphResult& result);
  void checkpoint(const Policy& policy, int64_t step, const nlohmann::json& cursor);

 private:
  const RunConfig& c_;
  bool writer_;
  std::filesystem::path dir_;
  std::ofstream metrics_;
  std::unique_ptr<RunBoard> board_;  // rank 0's tb/
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
  Pace pace_{c_.trainer.steps};  // the progress line's steps/min and ETA
  RunStatus status_;             // status.json: the trainer alone, training
};

}  // namespace recipe
}  // namespace troupe
