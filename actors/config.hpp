// The run configuration: one YAML file (plus key.path=value overrides) parsed into typed
// structs, with errors naming file, line and key. No LibTorch, no CAF, and no file checks except validate_paths().
//
// Paths inside a config are relative to the current working directory of the process that
// reads it (run troupe from the repository root), not to the config file's folder: that is
// what the shipped configs assume and what `troupe run configs/x.yaml` users expect.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "generator/partial_rollouts.hpp"
#include "policy/weight_format.hpp"
#include "policy/named.hpp"
#include "trainer/rl_options.hpp"

namespace troupe {

struct RewardSpec;  // reward/registry.hpp; to_reward_specs() converts to it

// grpo and ppo run the actor graph; sft, lora (sft with LoRA adapters) and dpo run the trainer
// alone. Every recipe reads the same sections; each uses the keys it needs.
enum class Recipe { grpo, sft, lora, dpo, ppo, online_dpo, reinforce, distill };
enum class ModelDtype { automatic, float32, bfloat16, float64 };  // automatic: "auto", resolved per machine at run time
enum class EngineKind { builtin, remote };
using RewardScaling = rl::ScaleRewards;
using LossAggregation = rl::Aggregation;
enum class LossKind { grpo, dpo, ppo };
enum class ShardingMode { none, zero1, zero2, zero3 };
enum class PrefetchMode { automatic, always, never };  // automatic: "auto"

// Each enum's names as written in YAML (policy/named.hpp); trainer/rl_options.hpp holds the
// RL loss's own.
inline constexpr Named<Recipe> kRecipes[] = {{"grpo", Recipe::grpo}, {"sft", Recipe::sft}, {"lora", Recipe::lora},
                                             {"dpo", Recipe::dpo}, {"ppo", Recipe::ppo}, {"online_dpo", Recipe::online_dpo},
                                             {"reinforce", Recipe::reinforce}, {"distill", Recipe::distill}};
inline constexpr Named<ModelDtype> kModelDtypes[] = {{"auto", ModelDtype::automatic}, {"float32", ModelDtype::float32},
                                                     {"bfloat16", ModelDtype::bfloat16}, {"float64", ModelDtype::float64}};
inline constexpr Named<EngineKind> kEngineKinds[] = {{"builtin", EngineKind::builtin}, {"remote", EngineKind::remote}};
inline constexpr Named<LossKind> kLossKinds[] = {{"grpo", LossKind::grpo}, {"dpo", LossKind::dpo}, {"ppo", LossKind::ppo}};
inline constexpr Named<ShardingMode> kShardingModes[] = {{"none", ShardingMode::none}, {"zero1", ShardingMode::zero1},
                                                         {"zero2", ShardingMode::zero2}, {"zero3", ShardingMode::zero3}};
inline constexpr Named<PrefetchMode> kPrefetchModes[] = {
    {"auto", PrefetchMode::automatic}, {"always", PrefetchMode::always}, {"never", PrefetchMode::never}};
constexpr std::span<const Named<Recipe>> names_of(Recipe) { return kRecipes; }
constexpr std::span<const Named<ModelDtype>> names_of(ModelDtype) { return kModelDtypes; }
constexpr std::span<const Named<EngineKind>> names_of(EngineKind) { return kEngineKinds; }
constexpr std::span<const Named<LossKind>> names_of(LossKind) { return kLossKinds; }
constexpr std::span<const Named<ShardingMode>> names_of(ShardingMode) { return kShardingModes; }
constexpr std::span<const Named<PrefetchMode>> names_of(PrefetchMode) { return kPrefetchModes; }

// The reward kinds the config accepts; a test checks they cover reward/'s built-ins.
inline constexpr std::array<std::string_view, 4> kRewardKindNames = {"math_answer", "format", "plugin", "http"};

struct ModelSection {
  std::string path;                 // required: a Hugging Face folder or a .gguf file
  // Weights and compute, for the trainer and built-in generators. auto: bfloat16 on CUDA and on
  // CPUs that compute it natively (AVX-512 BF16, AMX), float32 elsewhere; absent: float32.
  // float64: for exactness checks (slow).
  ModelDtype dtype = ModelDtype::float32;
  std::string device = "cpu";       // cpu, cuda or cuda:N
  // Forward passes without autograd (built-in engines, the trainer's log pi_prox) through
  // batch-invariant kernels: an engine's log-probs are bit for bit the trainer's at the same
  // weights (CPU, float32 or float64; slower than MKL's GEMMs, see bench/).
  bool batch_invariant = false;
  bool operator==(const ModelSection&) const = default;
};

struct DatasetSection {
  std::string path;                   // required: JSONL, one prompt per line
  std::string prompt = "prompt";      // field holding the prompt text (GSM8K: question)
  std::string answer = "answer";      // field holding the reference answer (the rewards see the whole record
                                      // as metadata); every record must have it; "" for none
  std::optional<std::string> system;  // a system message before each prompt (chat_template only)
  std::string response;               // sft: the field holding the target response; "" reads chat
                                      // records from `messages` instead
  std::string messages = "messages";  // sft: the field holding [{role, content}, ...]
  std::string chosen = "chosen";      // dpo: the preferred response's field
  std::string rejected = "rejected";  // dpo: the other response's field
  bool chat_template = true;          // wrap the prompt as a user turn with the model's chat template
  int64_t limit = 0;                  // read only the first N records; 0: all
  bool operator==(const DatasetSection&) const = default;
};

struct DataSection {
  DatasetSection train;
  std::optional<DatasetSection> eval;  // held-out prompts; absent: no evaluation
  bool shuffle = true;                // reshuffle the prompts every epoch
  uint64_t seed = 0;                  // shuffling seed; absent in the file: run.seed
  bool operator==(const DataSection&) const = default;
};

struct GeneratorSection {
  int64_t count = 1;                       // generator actors (engines or remote servers' clients)
  EngineKind engine = EngineKind::builtin; // builtin: in-process Engine; remote: a vLLM-compatible server
  // builtin: the engines' weights and compute; auto: model.dtype's. bfloat16 under a float32
  // trainer gives the train/rollout mismatch that trainer.loss.correction is for.
  ModelDtype dtype = ModelDtype::automatic;
  // builtin: the GEMM weights engines decode with: full (generator.dtype), or weight-only int8 /
  // int4 (CPU), requantized at every sync; the behaviour log-probs are the quantized policy's.
  WeightFormat weights = WeightFormat::full;
  std::string url;                         // remote only: the server's base URL, http(s)://host:port
  // remote only: how new weights reach the server, in vLLM 0.33.0's routes. reload: a safetensors
  // folder and /collective_rpc reload_weights (any vLLM with VLLM_SERVER_DEV_MODE=1, and troupe
  // serve); disk: the weight-transfer protocol (init, start, update, finish) with the disk backend.
  std::string weight_transfer = "reload";
  int64_t group_size = 8;                  // G: completions per prompt (TRL's num_generations)
  int64_t max_tokens = 256;                // new tokens per completion (TRL's max_completion_length)
  double temperature = 1.0;                // 0 is greedy, which gives GRPO no signal
  double top_p = 1.0;                      // nucleus sampling, in (0, 1]
  int64_t top_k = -1;                      // -1 or 0 keep every token
  double min_p = 0.0;                      // drop tokens below min_p x the top token's probability
  int64_t max_batch = 32;                  // builtin: sequences decoded together
  int64_t max_seq_len = 2048;              // builtin: prompt + completion tokens per sequence
  // builtin: what new weights do to sequences being decoded: continue (under the new weights,
  // tokens tagged by version), finish (under the old ones, then load) or abort (start again).
  PartialRollouts partial_rollouts = PartialRollouts::continue_;
  std::vector<std::string> stop;           // stop strings, besides the model's end-of-turn tokens
  bool ignore_eos = false;                 // decode max_tokens every time (benchmarks: equal work on both sides)
  int64_t threads = 0;                     // CPU threads of each generator's kernels; 0: LibTorch's default
  bool operator==(const GeneratorSection&) const = default;
};

// Mirrors troupe::RewardSpec (reward/registry.hpp) field for field; to_reward_specs converts.
struct RewardSection {
  std::string name;                   // required, unique: metrics report reward/<name>/mean
  std::string kind;                   // math_answer, format, plugin or http; absent: plugin if `plugin`
                                      // is set, http if `url` is (stored resolved)
  double weight = 1.0;                // total reward = sum of weight x score (may be 0 or negative)
  std::string answer_key = "answer";  // math_answer: the metadata field holding the reference
  std::string plugin;                 // plugin: path of the shared library
  std::string url;                    // http: where to POST batches
  double timeout_s = 30.0;            // http: timeout per attempt
  int64_t retries = 2;                // http: extra attempts on connection errors, timeouts and 5xx
  double backoff_s = 0.5;             // http: first retry waits this long, then doubling
  int64_t max_batch = 0;              // http: samples per request (0: one request per batch)
  bool operator==(const RewardSection&) const = default;
};

// On-policy distillation: the teacher scores the student's own rollouts token by token, in the
// reference actor (recipe distill, or trainer.loss.distill > 0 under grpo and reinforce).
struct TeacherSection {
  std::string path;  // required: a Hugging Face folder or a .gguf file, with the student's tokenizer
  bool operator==(const TeacherSection&) const = default;
};

struct ReferenceSection {
  bool enabled = false;  // absent in the file: true exactly when trainer.loss.beta > 0
  std::string path;      // absent: model.path (the frozen starting policy)
  bool operator==(const ReferenceSection&) const = default;
};

// trainer.loss: the policy-gradient keys as the trainer takes them (rl::PolicyLoss: objective,
// aggregation, clip, beta, correction), and those of the other losses.
struct LossSection : rl::PolicyLoss {
  LossKind kind = LossKind::grpo;
  double label_smoothing = 0.0; // dpo: the chance a preference label is wrong (cDPO), in [0, 0.5)
  // ppo (beta is then the per-token KL penalty folded into the rewards):
  double gamma = 1.0;           // discount over completion tokens
  double lambda = 0.95;         // GAE's bias/variance trade-off
  double value_clip = 0.2;      // the value may move this far from its old estimate per step; 0: no clip
  double vf_coef = 0.1;         // weight of the value loss
  bool whiten_advantages = true;  // normalise advantages over the batch's tokens
  bool operator==(const LossSection&) const = default;
};

// A short supervised stage before RL, to teach the answer format.
struct SftWarmupSection {
  std::string path;                     // required: JSONL with prompt and completion fields
  std::string prompt = "prompt";        // field holding the prompt
  std::string completion = "completion";  // field holding the target completion
  int64_t steps = 0;                    // required, >= 1: optimizer steps
  double lr = 0;                        // absent: trainer.lr
  bool operator==(const SftWarmupSection&) const = default;
};

struct TrainerSection {
  int64_t batch_groups = 8;      // rollout groups (prompts x G completions) per optimizer step
  int64_t steps = 100;           // total optimizer steps of the run (also the cosine schedule's length)
  double lr = 1e-6;              // peak learning rate (AdamW)
  double weight_decay = 0.0;
  int64_t warmup_steps = 0;      // linear warmup from 0
  double min_lr_ratio = 0.0;     // cosine decays to min_lr_ratio x lr at `steps`
  double max_grad_norm = 1.0;    // 0 disables clipping
  int64_t micro_batch = 0;       // sequences per forward/backward (gradient accumulation); 0: all at once
  int64_t num_iterations = 1;    // optimizer passes over each batch (GRPO's mu)
  int64_t logprob_chunk = 128;   // sequence positions per LM-head chunk (memory vs speed)
  rl::Advantage advantage = rl::Advantage::group;      // group (GRPO), rloo, reinforce_pp, reinforce_pp_baseline
  RewardScaling scale_rewards = RewardScaling::group;  // advantage group: divide by the group's std, the batch's, or not
  rl::Overlong overlong;          // completions cut at max_tokens: mode none, mask (no loss) or penalty (DAPO's)
  // DAPO's dynamic sampling: a group whose rewards all tie is not trained; the batch is filled
  // up with new prompts, at most dynamic_sampling_rounds times, then trains with what it has.
  bool dynamic_sampling = false;
  int64_t dynamic_sampling_rounds = 8;
  // log pi_prox := the behaviour log-probs, no recomputation: only where they are exactly the
  // trainer's (async.max_staleness 0, model.batch_invariant, built-in engines in model.dtype, no LoRA).
  bool reuse_behaviour_logprobs = false;
  LossSection loss;
  std::optional<SftWarmupSection> sft_warmup;
  // sft, lora and dpo:
  int64_t batch_size = 8;        // sequences (sft) or preference pairs (dpo) per optimizer step
  int64_t max_length = 1024;     // tokens per example, and per packed row
  bool packing = true;           // sft: several examples per row, no attention across them
  bool activation_checkpointing = false;  // recompute each layer in backward: less memory, ~1 more forward
  int64_t eval_every = 0;        // steps between held-out evaluations (data.eval); 0: only at the end
  int64_t threads = 0;           // CPU threads of the trainer's (and reference's) kernels; 0: LibTorch's default
  bool operator==(const TrainerSection&) const = default;
};

struct AsyncSection {
  int64_t max_staleness = 1;  // eta: a group from policy version v trains at version t only if t - v <= eta; 0 is on-policy
  int64_t sync_every = 1;     // k: push weights to the generators every k optimizer steps (k <= eta + 1)
  bool operator==(const AsyncSection&) const = default;
};

// Trainer ranks: data-parallel training over c10d process groups (Gloo on CPU, NCCL on CUDA).
// Under torchrun, srun or mpirun the launcher's environment says how many ranks there are.
struct ParallelSection {
  int64_t trainer_ranks = 1;  // >1: troupe run starts this many rank processes on this machine
  ShardingMode sharding = ShardingMode::none;  // none: DDP; zero1: optimizer sharded; zero2: + gradients;
                                               // zero3: + parameters (each layer gathered where it computes)
  double timeout_s = 300;     // a collective waiting longer (a dead or hung rank) fails the job
  // zero3: gather the next layer while one computes (FSDP's prefetch). auto: with NCCL, whose
  // collectives run on their own CUDA stream; not with Gloo, whose thread takes a core from the
  // ranks' computation (SmolLM2 SFT at 2 ranks on 2 cores: 0.93x the speed without it).
  PrefetchMode prefetch = PrefetchMode::automatic;
  bool operator==(const ParallelSection&) const = default;
};

// Where the actor graph's generators run. Placement never changes the result.
struct ClusterSection {
  int64_t generator_processes = 0;  // >0: that many worker processes on this host, one generator each
                                    // (generator.count then follows it); 0: generators in this process
  double join_timeout_s = 120;      // workers not joined by then (at the start, or after the last one
                                    // went away) fail the run
  int64_t restarts = 3;             // replacement worker processes for ones that die, in all
  int64_t reward_processes = 0;     // >0: the reward in that many worker processes; 0: in this process
  int64_t reference_processes = 0;  // the same for the reference (when there is one)
  std::string lost_groups = "retry";  // groups a dead reward/reference worker held: retry elsewhere, or fail
  double answer_timeout_s = 600;    // a reward/reference worker that does not answer a group by then lost it
  std::string listen;               // HOST:PORT for workers from other hosts (`troupe worker --connect`);
                                    // empty: 127.0.0.1, any free port, only with worker processes
  std::string weight_transport = "auto";  // auto: the file on the trainer's host, HTTP from others; http: always HTTP
  bool operator==(const ClusterSection&) const = default;
};

struct RunSection {
  std::string dir;              // outputs (config.yaml, metrics.jsonl, checkpoints); absent: runs/<config file stem>
  int64_t checkpoint_every = 0; // optimizer steps between checkpoints; 0: only at the end
  int64_t log_every = 1;        // optimizer steps between progress lines
  uint64_t seed = 0;            // seeds sampling, shuffling (unless data.seed) and initialisation
  bool deterministic = false;   // deterministic kernels and ordering, for exact resume (slower)
  std::string dashboard;        // HOST:PORT to serve the live dashboard on (apps/dashboard.hpp); empty: none
  bool operator==(const RunSection&) const = default;
};

// Where each key came from, for later errors ("configs/x.yaml:4: model.path: ..."). Not part of
// the config's value: two configs that differ only in origin compare equal.
struct ConfigOrigin {
  std::string file;                               // the config path as given
  std::map<std::string, std::string> locations;   // key path -> "file:line" or "file: override k=v"
  // The most precise location known for `key` (itself, else its nearest parent, else the file).
  std::string at(const std::string& key) const;
  bool operator==(const ConfigOrigin&) const { return true; }
};

// LoRA adapters (PEFT's format) on the named projections; the base weights stay frozen.
struct LoraSection {
  int64_t rank = 8;              // r: higher adapts more, costs more memory
  double alpha = 16.0;           // the adapter's output is scaled by alpha / rank
  double dropout = 0.0;          // on the adapter's input, in training
  std::vector<std::string> target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  bool operator==(const LoraSection&) const = default;
};

struct RunConfig {
  Recipe recipe = Recipe::grpo;
  ModelSection model;
  std::optional<LoraSection> lora;     // present: train adapters only (required by recipe lora)
  DataSection data;
  GeneratorSection generator;
  std::vector<RewardSection> rewards;  // at least one for grpo and ppo
  ReferenceSection reference;
  std::optional<TeacherSection> teacher;  // recipe distill, or trainer.loss.distill > 0
  TrainerSection trainer;
  AsyncSection async;
  ParallelSection parallel;
  ClusterSection cluster;
  RunSection run;
  // A run folder (its newest complete checkpoint) or one checkpoint folder to continue from:
  // `troupe run CONFIG resume=runs/NAME`. Empty: start fresh. Every recipe.
  std::string resume;
  ConfigOrigin origin;
  bool operator==(const RunConfig&) const = default;
};

// "HOST:PORT" (cluster.listen) split; nullopt when it is not one (port 0: any free one).
std::optional<std::pair<std::string, uint16_t>> split_host_port(const std::string& address);

// Reads and checks `path`, after applying `overrides` ("key.path=value", the value parsed as
// YAML: 1e-6, true, [0.2, 0.28], text). List items are addressed by index: rewards.0.weight=2.
// Throws troupe::Error: "configs/x.yaml:12: trainer.lr: must be > 0, got -1".
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The same from YAML text; `source` names it in errors and gives run.dir's default stem.
RunConfig parse_run_config(const std::string& yaml, const std::string& source,
                           const std::vector<std::string>& overrides = {});

// Checks that the files and folders the config names exist (model, reference, data, reward
// plugins), relative to the current directory. Throws troupe::Error naming the key and line.
void validate_paths(const RunConfig& config);

// The resolved config as YAML (every field, defaults filled in): what runs/NAME/config.yaml
// holds, and load_run_config of it gives back an equal RunConfig.
std::string to_yaml(const RunConfig& config);

// One line for `troupe validate`: "recipe grpo, model ..., 1 builtin generator x G=8, ...".
std::string summary(const RunConfig& config);

// The rewards as reward/ specs, ready for make_combined_reward (defined in reward_specs.cpp,
// which links troupe_reward).
std::vector<RewardSpec> to_reward_specs(const RunConfig& config);

}  // namespace troupe
