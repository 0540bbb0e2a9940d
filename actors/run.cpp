// Turns the typed run config into the graph's inputs. Deliberately thin: every decision about
// how a field behaves lives in the component that uses it (Engine, Trainer, rewards, prompts).
#include "actors/run.hpp"

#include "actors/actor_util.hpp"
#include "actors/recipe_run.hpp"
#include "actors/run_status.hpp"
#include "actors/trainer_ranks.hpp"

#include <fstream>
#include <iostream>
#include <mutex>

#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "reward/registry.hpp"
#include "policy/error.hpp"
#include "trainer/prompts.hpp"

namespace troupe {
namespace {

using recipe::dtype_of;
using recipe::trainer_config;

PromptSourceOptions prompt_options(const DatasetSection& d, const Tokenizer& tokenizer, const DataSection& data,
                                   const std::string& model_path) {
  PromptSourceOptions o;
  o.prompt_field = d.prompt;
  o.answer_field = d.answer;
  o.chat = d.chat_template;
  if (d.chat_template) {
    if (!tokenizer.chat_template())
      throw Error(model_path + ": data.train.chat_template is true but the model's tokenizer has no chat template");
    o.chat_template = ChatTemplate::detect(*tokenizer.chat_template(), model_path);
  }
  o.system = d.system.value_or("");
  o.limit = d.limit;
  o.shuffle = data.shuffle;
  o.seed = data.seed;
  return o;
}

// The supervised format stage: (prompt, completion) pairs from a JSONL file, prompts through
// the chat template when the training data uses it, completions closed with end-of-sequence.
std::map<std::string, torch::Tensor> sft_warmup(const RunConfig& c, const Tokenizer& tokenizer) {
  const auto& w = *c.trainer.sft_warmup;
  use_threads(c.trainer.threads);  // the trainer's kernels run here, on this thread, before its actor starts
  auto m = load_model(c.model.path, {.dtype = dtype_of(c.model.dtype), .device = torch::Device(c.model.device), .tokenizer = false});
  // The model's own end-of-sequence id: a tokenizer's can lie outside a small model's vocabulary.
  std::vector<int64_t> eos_ids = m.config.eos_token_ids;
  if (eos_ids.empty() && tokenizer.eos_id()) eos_ids.push_back(*tokenizer.eos_id());
  std::ifstream in(w.path);
  if (!in) throw Error(w.path + ": cannot open (trainer.sft_warmup.path)");
  std::optional<ChatTemplate> tmpl;
  if (c.data.train.chat_template && tokenizer.chat_template()) tmpl = ChatTemplate::detect(*tokenizer.chat_template(), c.model.path);
  std::vector<SftExample> examples;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    std::string where = w.path + ":" + std::to_string(n);
    if (j.is_discarded() || !j.is_object()) throw Error(where + ": not a JSON object");
    for (const auto& f : {w.prompt, w.completion})
      if (!j.contains(f) || !j[f].is_string()) throw Error(where + ": no string field '" + f + "'");
    std::string prompt = j[w.prompt].get<std::string>();
    if (tmpl) {
      std::vector<ChatMessage> msgs;
      if (c.data.train.system) msgs.push_back({"system", *c.data.train.system});
      msgs.push_back({"user", prompt});
      prompt = tmpl->render(msgs, true);
    }
    auto completion = tokenizer.encode(j[w.completion].get<std::string>());
    if (!eos_ids.empty()) completion.push_back(static_cast<int32_t>(eos_ids[0]));
    examples.push_back({tokenizer.encode(prompt), std::move(completion)});
  }
  if (examples.empty()) throw Error(w.path + ": no examples (trainer.sft_warmup.path)");
  auto config = trainer_config(c);
  config.optimizer.lr = w.lr > 0 ? w.lr : c.trainer.lr;
  config.optimizer.total_steps = 0;
  config.optimizer.warmup_steps = 0;
  Trainer trainer(m.model, config);
  const size_t batch = std::max<int64_t>(1, c.trainer.batch_groups * c.generator.group_size);
  size_t next = 0;
  for (int64_t step = 0; step < w.steps; ++step) {
    std::vector<SftExample> part;
    for (size_t i = 0; i < std::min(batch, examples.size()); ++i) part.push_back(examples[next++ % examples.size()]);
    double loss = trainer.sft_step(part);
    if (parallel_env().rank == 0) std::cout << "sft warmup step " << step + 1 << "/" << w.steps << "  loss " << loss << std::endl;
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : state_dict(*m.model)) out[name] = t.detach().clone();
  return out;
}

PpoConfig ppo_config(const RunConfig& c, const OptimizerConfig& optimizer) {
  const auto& l = c.trainer.loss;
  PpoConfig out{.optimizer = optimizer, .gamma = l.gamma, .lambda = l.lambda, .kl_coef = l.beta,
                .value_clip = l.value_clip, .vf_coef = l.vf_coef, .epsilon = l.epsilon, .epsilon_high = l.epsilon_high,
                .correction = l.correction, .objective = l.objective, .whiten_advantages = l.whiten_advantages,
                .num_iterations = c.trainer.num_iterations, .micro_batch = c.trainer.micro_batch,
                .logprob_chunk = c.trainer.logprob_chunk, .temperature = recipe::logprob_temperature(c)};
  out.overlong = c.trainer.overlong;
  out.overlong.max_tokens = c.generator.max_tokens;
  return out;
}

// The generators: what each one builds (model, tokenizer, engine, sampling), how many, where
// they run (this process, worker processes, a remote server), and their threads.
void set_generation(GraphSpec& spec, const RunConfig& c) {
  spec.tokenizer_path = c.model.path;
  spec.model_dtype = std::string(to_string(c.model.dtype));
  spec.generator_dtype = c.generator.dtype == ModelDtype::automatic ? spec.model_dtype : std::string(to_string(c.generator.dtype));
  spec.generator_device = c.model.device;
  spec.engine = {.max_batch = c.generator.max_batch, .max_seq_len = c.generator.max_seq_len,
                 .partial_rollouts = c.generator.partial_rollouts, .batch_invariant = c.model.batch_invariant,
                 .weights = c.generator.weights,
                 .seed = c.run.seed};
  spec.sampling = {.n = c.generator.group_size, .temperature = c.generator.temperature, .top_p = c.generator.top_p,
                   .top_k = c.generator.top_k, .min_p = c.generator.min_p, .max_tokens = c.generator.max_tokens,
                   .stop = c.generator.stop, .ignore_eos = c.generator.ignore_eos};
  spec.generators = c.cluster.generator_processes > 0 ? c.cluster.generator_processes : c.generator.count;
  spec.generator_processes = c.cluster.generator_processes;
  spec.worker_join_timeout_s = c.cluster.join_timeout_s;
  spec.worker_restarts = c.cluster.restarts;
  spec.reward_processes = c.cluster.reward_processes;
  spec.reference_processes = c.cluster.reference_processes;
  spec.reward_specs = to_reward_specs(c);
  spec.retry_lost_groups = c.cluster.lost_groups == "retry";
  spec.stage_answer_timeout_s = c.cluster.answer_timeout_s;
  spec.listen = c.cluster.listen;
  spec.weight_transport = c.cluster.weight_transport;
  spec.generator_threads = c.generator.threads;
  spec.trainer_threads = c.trainer.threads;
  if (c.generator.engine == EngineKind::remote) {
    spec.remote_url = c.generator.url;
    spec.remote.weight_transfer = c.generator.weight_transfer;
    spec.weights_dir = std::filesystem::path(c.run.dir) / "weights_for_server";
  }
}

// Steps, batches, staleness, the reference, the run folder and checkpoints, seeds and the recipe.
void set_schedule(GraphSpec& spec, const RunConfig& c) {
  spec.seed = c.run.seed;
  spec.batch_groups = c.trainer.batch_groups;
  spec.steps = c.trainer.steps;
  spec.max_staleness = c.async.max_staleness;
  spec.dynamic_sampling = c.trainer.dynamic_sampling;
  spec.dynamic_sampling_rounds = c.trainer.dynamic_sampling_rounds;
  spec.sync_every = c.async.sync_every;
  spec.reference = c.reference.enabled || c.trainer.loss.beta > 0 || c.teacher.has_value();
  spec.run_dir = c.run.dir;
  spec.keep_history = false;  // metrics.jsonl and the checkpoints hold it; a long run holds nothing per step
  spec.model_source = c.model.path;
  spec.checkpoint_every = c.run.checkpoint_every;
  spec.deterministic = c.run.deterministic;
  spec.recipe = std::string(to_string(c.recipe));
  set_generation(spec, c);
}

// The reference actor's model when it is not the starting policy: the teacher, whose tokenizer
// must be the student's (token ids are compared one for one), or another reference.path.
void set_reference(GraphSpec& spec, const RunConfig& c, const Tokenizer& student, const LoadOptions& load) {
  std::string key = "teacher.path", path;
  if (c.teacher) {
    path = c.teacher->path;
    auto teacher = Tokenizer::load(path);
    std::string why;
    if (teacher.vocab_size() != student.vocab_size())
      why = "a vocabulary of " + std::to_string(teacher.vocab_size()) + " tokens, the student's " +
            std::to_string(student.vocab_size());
    for (int32_t id = 0; why.empty() && id < student.vocab_size(); ++id)
      if (teacher.token(id) != student.token(id))
        why = "token " + std::to_string(id) + " is \"" + teacher.token(id) + "\" there and \"" + student.token(id) + "\" in the student's";
    if (!why.empty())
      throw Error(c.origin.at(key) + ": " + key + ": " + path + " has another tokenizer than model.path (" + why +
                  "): the teacher scores the student's token ids, so both need the same vocabulary");
  } else if (c.reference.enabled && c.reference.path != c.model.path) {
    path = c.reference.path;
  } else {
    return;
  }
  spec.reference_source = path;
  spec.make_reference = [path, load] { return load_model(path, load).model; };
}

// The graph from the config: the starting policy (also on resume: the reference and LoRA's base
// are made from it, and the warm-up is deterministic, so it is made again rather than stored),
// the prompts, the rewards, the trainer and the schedule.
GraphSpec graph_spec(const RunConfig& c, const Tokenizer& tokenizer, std::shared_ptr<PromptSource> source) {
  GraphSpec spec;
  spec.reward = std::make_shared<CombinedReward>(make_combined_reward(to_reward_specs(c)));  // plugins load here
  spec.model_config = load_config(c.model.path);  // the weights are loaded by make_policy, where they are used
  const LoadOptions load{.dtype = dtype_of(c.model.dtype), .device = torch::Device(c.model.device), .tokenizer = false};
  set_reference(spec, c, tokenizer, load);  // first: a teacher with another tokenizer fails before any training
  std::optional<std::map<std::string, torch::Tensor>> start;
  if (c.trainer.sft_warmup) start = sft_warmup(c, tokenizer);
  spec.make_policy = [path = c.model.path, load, start] {
    auto m = load_model(path, load);
    if (start) load_weights(*m.model, *start, "sft warmup");
    return m.model;
  };
  spec.tokenizer = tokenizer;
  spec.next_prompts = [source](int64_t n) {
    std::vector<PromptItem> out;
    for (auto& p : source->next(n)) out.push_back({p.id, 0, std::move(p.ids), std::move(p.text), p.metadata.dump()});
    return out;
  };
  spec.trainer = trainer_config(c);
  spec.lora = recipe::lora_config(c);
  if (c.recipe == Recipe::ppo) spec.ppo = ppo_config(c, spec.trainer.optimizer);
  set_schedule(spec, c);
  return spec;
}

}  // namespace

namespace {

GraphResult run_recipe(const RunConfig& given, const std::atomic<bool>* stop_requested) {
  RunConfig c = given;
  c.model.dtype = recipe::resolve_model_dtype(c.model);  // runs/NAME/config.yaml records what auto chose
  if (c.model.batch_invariant && c.model.dtype == ModelDtype::bfloat16)
    throw Error("model.batch_invariant: model.dtype auto chose bfloat16 on this machine, and the batch-invariant kernels "
                "run float32 or float64: set model.dtype: float32");
  switch (c.recipe) {
    case Recipe::sft:
    case Recipe::lora: return run_sft(c, stop_requested);
    case Recipe::dpo: return run_dpo(c, stop_requested);
    case Recipe::ppo:
    case Recipe::online_dpo:
    case Recipe::reinforce:
    case Recipe::distill:
    case Recipe::grpo: break;
  }
  // First: a wrong checkpoint fails before any loading.
  std::optional<GraphResume> resume;
  if (auto found = recipe::find_resume(c)) resume = read_graph_checkpoint(found->dir);
  // One seed for LibTorch's generator (LoRA dropout); deterministic mode also refuses kernels
  // without a deterministic implementation.
  torch::manual_seed(c.run.seed);
  if (c.run.deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);

  // Trainer ranks: rank 0 runs the graph below, the others follow its trainer.
  auto group = recipe::trainer_group(c, c.trainer.batch_groups, "trainer.batch_groups");
  auto tokenizer = Tokenizer::load(c.model.path);
  auto source = std::make_shared<PromptSource>(c.data.train.path, tokenizer,
                                               prompt_options(c.data.train, tokenizer, c.data, c.model.path));
  GraphSpec spec = graph_spec(c, tokenizer, source);
  spec.stop_requested = stop_requested;
  spec.trainer_group = group;
  spec.sharding = sharding_of(to_string(c.parallel.sharding));
  spec.prefetch = group && recipe::prefetches(c.parallel, *group);
  if (group && group->rank() > 0) {
    spec.resume = std::move(resume);
    follow_trainer(spec);
    return GraphResult{.ok = true};  // rank 0 reports the run
  }
  std::filesystem::create_directories(spec.run_dir);
  std::ofstream(spec.run_dir / "config.yaml") << to_yaml(c);
  if (resume) {
    // The prompts of every batch released before the checkpoint are behind the data cursor.
    source->next(resume->first_new_batch * spec.batch_groups + resume->refilled);
    recipe::keep_steps_up_to(spec.run_dir / "metrics.jsonl", resume->step);
    recipe::keep_steps_up_to(spec.run_dir / "failures.jsonl", resume->step);
    std::cout << "troupe run: resumed from " << resume->dir.string() << " (step " << resume->step << ", "
              << resume->groups.size() << " buffered rollout groups)" << std::endl;
    spec.resume = std::move(resume);
  }
  return run_graph(spec);
}

}  // namespace

GraphResult run_config(const RunConfig& given, const std::atomic<bool>* stop_requested) {
  // runs/NAME/status.json ends with the run, however it ends (rank 0's; the dashboard reads it).
  const bool writer = parallel_env().rank == 0;
  try {
    auto result = run_recipe(given, stop_requested);
    const bool stopped = stop_requested && stop_requested->load();
    if (writer) end_run_status(given.run.dir, result.ok ? "finished" : stopped ? "stopped" : "failed", result.steps, result.error);
    return result;
  } catch (const std::exception& e) {
    if (writer) end_run_status(given.run.dir, "failed", -1, e.what());
    throw;
  }
}

}  // namespace troupe
