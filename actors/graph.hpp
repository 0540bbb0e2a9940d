// The async RL actor graph: data -> generators -> reward -> (reference) -> trainer, with weight
// notices flowing back after each step and prompt credits bounding staleness. The actors live
// one per file (actors/*_actor.cpp, controller.cpp) and speak the typed protocol of
// actors/protocol.hpp; how a batch trains is the recipe's (actors/recipes/). Everything a run
// needs arrives in GraphSpec, so tests and `troupe run` launch the same graph. Generators are
// built from plain data (GeneratorSpec), so they run in this process or in worker processes
// (cluster.generator_processes), with the same result.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/protocol.hpp"
#include "actors/generator_actor.hpp"
#include "generator/engine.hpp"
#include "generator/remote_engine.hpp"
#include "policy/lora.hpp"
#include "policy/tokenizer.hpp"
#include "policy/transformer.hpp"
#include "reward/registry.hpp"
#include "trainer/data_parallel.hpp"
#include "trainer/ppo.hpp"
#include "trainer/trainer.hpp"

namespace troupe {

// A graph checkpoint to continue from: runs/NAME/checkpoints/step_N with trainer_state.json.
struct GraphResume {
  std::filesystem::path dir;
  int64_t step = 0;            // steps trained; the next one trains batch `step`
  int64_t policy_version = 0;
  // The rollout groups that were buffered or in flight (batches [step, first_new_batch)),
  // made by weights older than the checkpoint's; every later batch is generated anew.
  std::vector<RolloutGroup> groups;
  int64_t first_new_batch = 0; // the data source resumes at first_new_batch * batch_groups + refilled prompts
  int64_t refilled = 0;        // prompts drawn before the checkpoint to replace filtered groups
};

struct GraphSpec {
  // The trainer and the reference each get their own copy of the starting policy. Generators
  // load model_source's architecture (in generator_dtype on generator_device) and then take the
  // trainer's weights, version 0 included, before any prompt.
  std::function<Transformer()> make_policy;
  // The reference actor's model where it is not the starting policy: reference.path, or the
  // teacher (distillation); reference_source is its folder or file, for reference workers.
  std::function<Transformer()> make_reference;
  std::filesystem::path reference_source;
  std::optional<Tokenizer> tokenizer;  // decodes completions for rewards
  std::filesystem::path tokenizer_path;  // the same tokenizer for generators (stop strings); empty: none
  std::string model_dtype = "float32";      // the trainer's and the reference's
  std::string generator_dtype = "float32";  // built-in engines' (generator.dtype)
  std::string generator_device = "cpu";
  // The data source: the next n prompts (ids, text, metadata). Called by the data actor only.
  std::function<std::vector<PromptItem>(int64_t n)> next_prompts;
  std::shared_ptr<const CombinedReward> reward;

  TrainerConfig trainer;
  // recipe ppo: the trainer is a PpoTrainer (value head on the trunk, GAE, clipped value loss)
  // instead of GRPO's; trainer.optimizer, micro_batch and logprob_chunk are taken from `trainer`.
  std::optional<PpoConfig> ppo;
  // LoRA: the trainer trains adapters only; generators receive the merged weights.
  std::optional<LoraConfig> lora;
  uint64_t seed = 0;  // the adapters' initialisation
  // Trainer ranks (parallel.trainer_ranks, or an outside launcher): this process is rank 0,
  // which runs the graph and trains its share of each batch; ranks 1..N-1 follow it
  // (actors/trainer_ranks.hpp). nullptr: one trainer, unsharded.
  std::shared_ptr<ProcessGroup> trainer_group;
  Sharding sharding = Sharding::none;
  bool prefetch = false;  // zero3: the next layer gathered while one computes (parallel.prefetch)
  int64_t batch_groups = 8;  // rollout groups per optimizer step
  int64_t steps = 10;        // optimizer steps in the run

  EngineOptions engine;
  SamplingParams sampling;   // n is the group size G
  int64_t generators = 1;
  // Generators in worker processes on this host instead (`troupe worker`, started by the run and
  // connected over CAF's network layer on loopback): 0 keeps them all in this process.
  int64_t generator_processes = 0;
  std::filesystem::path worker_program;  // the troupe binary to start them with; empty: this one
  double worker_join_timeout_s = 120;    // workers not joined by then (at the start, or after the last
                                         // one went away) fail the run
  int64_t worker_restarts = 3;           // replacement processes for workers that die, in all
  // The reward and the reference in worker processes on this host instead (`troupe worker
  // --role reward|reference`), behind a stage router (actors/stage_router.hpp): 0 keeps them in
  // this process. A reward worker builds reward_specs; a reference worker takes the starting
  // policy from the weight plane.
  int64_t reward_processes = 0;
  int64_t reference_processes = 0;
  std::vector<RewardSpec> reward_specs;
  bool retry_lost_groups = true;       // groups a dead reward/reference worker held: scored again, or failed
  double stage_answer_timeout_s = 600;  // a group not answered by then counts as lost with its worker
  int64_t worker_processes() const { return generator_processes + reward_processes + reference_processes; }
  // HOST:PORT the controller listens on for workers, from this host or others (`troupe worker
  // --connect`); empty: 127.0.0.1 on any free port, and only when there are worker processes.
  std::string listen;
  // How generators in workers take weights: auto (the file on the trainer's host, HTTP from
  // elsewhere) or http (always over HTTP from the trainer).
  std::string weight_transport = "auto";
  bool listens() const { return worker_processes() > 0 || !listen.empty(); }
  std::pair<std::string, uint16_t> listen_address() const;  // throws Error for a malformed `listen`
  // Intra-op CPU threads per actor (0: LibTorch's default, every core). Set per thread, so a
  // generator and the trainer can split the cores instead of contending for all of them.
  int64_t generator_threads = 0;
  int64_t trainer_threads = 0;  // the trainer and the reference
  // A vLLM-compatible server instead of built-in engines (then generators must be 1). Its
  // weights arrive as safetensors folders under weights_dir, which the server must be able to read.
  std::string remote_url;
  RemoteOptions remote;
  std::filesystem::path weights_dir;

  // trainer.dynamic_sampling: a group whose rewards all tie is filtered (reported, not trained);
  // once every group handed out for the next batch is back, the trainer asks for as many new
  // prompts as the batch lacks, at most dynamic_sampling_rounds times, then trains what it has.
  bool dynamic_sampling = false;
  int64_t dynamic_sampling_rounds = 8;

  int64_t max_staleness = 1;  // eta: a group made by version v trains at t only if t - v <= eta
  int64_t sync_every = 1;     // weights go to the generators after every k-th step
  bool reference = false;     // spawn a reference actor (trainer.loss.beta > 0, online_dpo, a teacher)

  std::filesystem::path run_dir;       // metrics.jsonl and checkpoints; empty: write nothing
  std::filesystem::path model_source;  // copied tokenizer files come from here on checkpoint
  ModelConfig model_config;            // written as config.json on checkpoint
  int64_t checkpoint_every = 0;        // 0: only at the end (when run_dir is set)
  bool quiet = false;                  // no progress line per step
  // The result keeps every step's metrics and every ticket (callers that check the accounting
  // read them); troupe run turns it off, so a run of any length holds no state per step.
  bool keep_history = true;

  std::function<void(const nlohmann::json&)> on_step;  // sees every step's metrics
  const std::atomic<bool>* stop_requested = nullptr;   // e.g. set by SIGINT: shut down cleanly

  // run.deterministic: a generator takes new weights and new prompts only once it has finished
  // what it holds, so batch k is generated entirely by version max(0, k - eta) (with
  // sync_every 1), and groups train in ticket order: the run does not depend on timing.
  bool deterministic = false;
  // How a batch trains: a name in actors/recipes/registry.cpp (grpo, ppo, online_dpo, reinforce);
  // written into trainer_state.json, checked on resume.
  std::string recipe = "grpo";
  // Where to continue from. make_policy still builds the starting policy (the reference, and
  // LoRA's base); the trainer and generators then take the checkpoint's weights.
  std::optional<GraphResume> resume;
};

// Reads `dir`'s trainer_state.json and rollouts; throws Error naming the file when it is not a
// complete graph checkpoint.
GraphResume read_graph_checkpoint(const std::filesystem::path& dir);

struct GraphResult {
  bool ok = false;
  std::string error;  // the failing actor and why, when !ok
  int64_t steps = 0;  // optimizer steps completed
  std::vector<nlohmann::json> metrics;  // every step's; this and the tickets only with spec.keep_history
  // Rollout accounting, as tickets (PromptItem::ticket): every prompt handed out ends up in
  // trained, filtered or failed exactly once when the run finishes its steps.
  std::vector<int64_t> issued, trained, failed, filtered;
};

// Spawns the graph, runs it to `steps` optimizer steps (or a stop request, or a failed actor),
// shuts everything down and returns. Never throws for failures inside actors.
GraphResult run_graph(const GraphSpec& spec);

// The plain-data part of the spec a generator is built from (in this process or a worker).
GeneratorSpec generator_spec(const GraphSpec& spec);

}  // namespace troupe
