// Reads a run config's YAML tree into RunConfig: every section through its field table
// (config_tables.hpp), then what relates keys to each other, each error naming file, line and key.
#include "actors/config_parse.hpp"

#include <utility>

#include "actors/config_tables.hpp"

namespace troupe::cfg {

namespace {

void read_dataset(Map m, DatasetSection& c) {
  read_table(m, c);
  m.check(!c.system || c.chat_template, "system", "a system message needs chat_template: true");
}

// Returns whether the file gave data.seed (else run.seed applies).
bool read_data(Map m, DataSection& c) {
  read_table(m, c, {"train", "eval"});
  read_dataset(m.map("train"), c.train);
  if (m.given("eval")) read_dataset(m.map("eval"), c.eval.emplace());
  return m.has("seed");
}

void read_generator(Map m, GeneratorSection& c) {
  read_table(m, c);
  if (c.engine == EngineKind::remote) {
    if (!m.has("url") || c.url.empty())
      m.fail(m.has("url") ? "url" : "engine", m.has("url") ? "must not be empty with engine: remote"
                                                          : "engine: remote needs url: http://host:port of a vLLM-compatible server");
    m.check(c.url.starts_with("http://") || c.url.starts_with("https://"), "url",
            "expected http://host:port or https://..., got " + quote(c.url));
    m.check(c.count == 1, "count", "must be 1 with engine: remote (one client drives the server, which batches "
                                   "the requests itself)" + got(c.count));
  } else {
    m.check(c.url.empty(), "url", "only used with engine: remote (the built-in engine runs in-process)");
  }
  m.check(c.max_seq_len > c.max_tokens, m.has("max_seq_len") ? "max_seq_len" : "max_tokens",
          "generator.max_seq_len (" + fmt(c.max_seq_len) + ") must exceed generator.max_tokens (" + fmt(c.max_tokens) +
              "): it holds the prompt too");
  for (const auto& s : c.stop) m.check(!s.empty(), "stop", "stop strings must not be empty");
}

void read_reward(Map m, RewardSection& c) {
  read_table(m, c);
  const std::vector<std::string_view> kinds(kRewardKindNames.begin(), kRewardKindNames.end());
  if (c.kind.empty()) {
    // The same inference as RewardSpec::resolved_kind, stored resolved.
    if (!c.plugin.empty() && !c.url.empty()) m.fail("kind", "both plugin and url are set: give kind, or keep one");
    if (!c.plugin.empty()) c.kind = "plugin";
    else if (!c.url.empty()) c.kind = "http";
    else m.fail("kind", "required (one of " + join(kinds) + "), or give plugin: PATH or url: URL");
  }
  if (std::find(kinds.begin(), kinds.end(), c.kind) == kinds.end())
    m.fail("kind", "expected one of " + join(kinds) + ", got " + quote(c.kind) + did_you_mean(c.kind, kinds));
  if (c.kind == "plugin") m.check(!c.plugin.empty(), "plugin", "kind plugin needs plugin: PATH of a shared library");
  else m.check(c.plugin.empty(), "plugin", "only used with kind: plugin");
  if (c.kind == "http") {
    m.check(!c.url.empty(), "url", "kind http needs url: http://host:port/path");
    m.check(c.url.starts_with("http://") || c.url.starts_with("https://"), "url",
            "expected http://... or https://..., got " + quote(c.url));
  } else {
    m.check(c.url.empty(), "url", "only used with kind: http");
  }
  if (c.kind == "math_answer") m.check(!c.answer_key.empty(), "answer_key", "must name the metadata field holding the answer");
}

void read_rewards(const Source& s, Map& top, std::vector<RewardSection>& out) {
  YAML::Node n = top.node("rewards");
  if (!n.IsDefined() || n.IsNull()) return;
  if (!n.IsSequence()) top.fail("rewards", "expected a list of rewards ({name, kind, weight, ...}), got " + describe(n));
  for (size_t i = 0; i < n.size(); ++i) {
    std::string path = "rewards." + std::to_string(i);
    RewardSection r;
    read_reward(Map(s, path, n[i], n[i].Mark()), r);
    const YAML::Node item = n[i];
    for (const auto& prev : out)
      if (prev.name == r.name) s.fail(path + ".name", std::as_const(item)["name"].Mark(), "duplicate reward name " + quote(r.name));
    out.push_back(std::move(r));
  }
}

// clip: [epsilon, epsilon_high], or the two keys (epsilon_high defaults to epsilon, as in TRL).
void read_clip(Map& m, LossSection& c) {
  YAML::Node clip = m.node("clip");
  if (clip.IsDefined() && !clip.IsNull()) {
    if (m.has("epsilon") || m.has("epsilon_high")) m.fail("clip", "give clip: [low, high] or epsilon/epsilon_high, not both");
    if (!clip.IsSequence() || clip.size() != 2)
      m.fail("clip", "expected [epsilon, epsilon_high], two numbers, got " + describe(clip));
    read(m.source(), m.child("clip") + ".0", clip[0], m.mark("clip"), c.epsilon);
    read(m.source(), m.child("clip") + ".1", clip[1], m.mark("clip"), c.epsilon_high);
    m.check(c.epsilon > 0 && c.epsilon < 1, "clip", "epsilon (the first value) must be in (0, 1)" + got(c.epsilon));
    m.check(c.epsilon_high > 0 && c.epsilon_high < 1, "clip",
            "epsilon_high (the second value) must be in (0, 1)" + got(c.epsilon_high));
  }
  if (m.get("epsilon", c.epsilon) && !m.has("epsilon_high")) c.epsilon_high = c.epsilon;
  m.get("epsilon_high", c.epsilon_high);
  m.check(c.epsilon > 0 && c.epsilon < 1, "epsilon", "must be in (0, 1)" + got(c.epsilon));
  m.check(c.epsilon_high > 0 && c.epsilon_high < 1, "epsilon_high", "must be in (0, 1)" + got(c.epsilon_high));
}

void read_loss(Map m, LossSection& c, Recipe recipe) {
  read_table(m, c, {"clip", "epsilon", "epsilon_high", "correction"});
  read_clip(m, c);
  if (m.given("correction")) read_table(m.map("correction"), c.correction);
  // dpo: the loss is DPO's and beta its strength (TRL's default 0.1); the reference is the
  // frozen starting model unless reference.path names another.
  if (recipe == Recipe::dpo || recipe == Recipe::online_dpo) {
    m.check(!m.has("kind") || c.kind == LossKind::dpo, "kind", "recipe " + std::string(to_string(recipe)) + " takes kind: dpo");
    c.kind = LossKind::dpo;
    if (!m.has("beta")) c.beta = 0.1;
    m.check(c.beta > 0, "beta", "must be > 0 for dpo" + got(c.beta));
    // (to_yaml writes the defaults back, so only another value is refused)
    const std::string none = "recipe " + std::string(to_string(recipe)) + " has no policy-gradient objective";
    m.check(c.objective == rl::Objective::grpo, "objective", none);
    m.check(c.correction == rl::Correction{}, "correction", none);
  } else if (recipe == Recipe::distill) {
    // distill: the teacher's term is the objective; 1 unless given.
    if (!m.has("distill")) c.distill = 1.0;
    m.check(c.distill > 0, "distill", "must be > 0 for recipe distill" + got(c.distill));
  } else if (recipe == Recipe::ppo) {
    m.check(!m.has("kind") || c.kind == LossKind::ppo, "kind", "recipe ppo takes kind: ppo");
    c.kind = LossKind::ppo;
  } else {
    m.check(c.kind != LossKind::dpo, "kind", "kind: dpo needs recipe: dpo or online_dpo");
    m.check(c.kind != LossKind::ppo, "kind", "kind: ppo needs recipe: ppo");
  }
}

void read_overlong(Map m, rl::Overlong& c, int64_t max_tokens) {
  read_table(m, c);
  if (c.mode == rl::OverlongMode::penalty)
    m.check(c.buffer <= max_tokens, "buffer", "must be <= generator.max_tokens = " + fmt(max_tokens) + got(c.buffer));
}

void read_trainer(Map m, TrainerSection& c, Recipe recipe, int64_t max_tokens) {
  read_table(m, c, {"loss", "sft_warmup", "overlong"});
  if (m.given("overlong")) read_overlong(m.map("overlong"), c.overlong, max_tokens);
  m.check(c.advantage == rl::Advantage::group || recipe == Recipe::grpo || recipe == Recipe::reinforce ||
              recipe == Recipe::distill,
          "advantage",
          "recipe " + std::string(to_string(recipe)) + " takes no advantage estimator" +
              (recipe == Recipe::ppo ? " (ppo's advantages are GAE's)" : ""));
  m.check(!c.dynamic_sampling || recipe == Recipe::grpo || recipe == Recipe::reinforce, "dynamic_sampling",
          "recipe " + std::string(to_string(recipe)) + " does not filter groups (only grpo and reinforce do: a group " +
              "whose rewards tie has no advantage there)");
  m.check(!c.dynamic_sampling || (c.advantage != rl::Advantage::reinforce_pp && c.advantage != rl::Advantage::none),
          "advantage",
          "advantage " + std::string(to_string(c.advantage)) + " gives a group whose rewards tie an advantage all the same: "
              "trainer.dynamic_sampling needs a group baseline (group, rloo or reinforce_pp_baseline)");
  read_loss(m.map("loss"), c.loss, recipe);
  if (m.given("sft_warmup")) {
    auto& w = c.sft_warmup.emplace();
    w.lr = c.lr;
    read_table(m.map("sft_warmup"), w);
  }
}

void read_lora(Map m, LoraSection& c) {
  read_table(m, c);
  m.check(!c.target_modules.empty(), "target_modules",
          "must name at least one projection (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
  for (const auto& t : c.target_modules)
    m.check(one_of(t, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}), "target_modules",
            "unknown projection " + quote(t) + " (one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
}

void read_reference(Map m, RunConfig& c) {
  c.reference.enabled = c.trainer.loss.beta > 0;
  c.reference.path = c.model.path;
  read_table(m, c.reference);
  m.check(c.reference.enabled || c.trainer.loss.beta == 0, "enabled",
          "must be true when trainer.loss.beta > 0 (the KL term needs reference log-probs); set beta: 0 or enabled: true");
}

bool is_graph(Recipe r) {
  return r == Recipe::grpo || r == Recipe::ppo || r == Recipe::online_dpo || r == Recipe::reinforce || r == Recipe::distill;
}

// The teacher sits in the reference actor: it is given exactly when something reads it, and then
// no KL to another reference is asked for.
void check_teacher(Map& top, const RunConfig& c) {
  const bool wanted = c.trainer.loss.distill > 0;
  if (!c.teacher && wanted)
    top.fail("teacher", "required: {path: ...} for " + std::string(c.recipe == Recipe::distill ? "recipe distill"
                                                                                             : "trainer.loss.distill > 0"));
  if (c.teacher && !wanted)
    top.fail("teacher", "only used by recipe distill or trainer.loss.distill > 0");
  if (c.teacher && c.trainer.loss.beta > 0)
    top.fail("teacher", "needs trainer.loss.beta = 0 (the reference actor holds the teacher, so there is no other "
                        "reference to take a KL to), got " + short_num(c.trainer.loss.beta));
}

// Where processes go: trainer ranks for the trainer-alone recipes, worker processes for the graph.
void check_placement(Map& top, RunConfig& c) {
  const bool graph = is_graph(c.recipe);
  const std::string recipe(to_string(c.recipe));
  if (c.recipe == Recipe::ppo)
    top.map("parallel").check(c.parallel.sharding != ShardingMode::zero3, "sharding",
                              "recipe ppo takes none, zero1 or zero2 (its two heads' forward pass does not gather "
                              "zero3's layers), got zero3");
  if (graph)
    top.map("parallel").check(c.trainer.batch_groups >= c.parallel.trainer_ranks, "trainer_ranks",
                              "must be <= trainer.batch_groups = " + fmt(c.trainer.batch_groups) +
                                  " (every rank trains a part of each batch's groups)" + got(c.parallel.trainer_ranks));
  else
    top.map("parallel").check(c.trainer.batch_size >= c.parallel.trainer_ranks, "trainer_ranks",
                              "must be <= trainer.batch_size = " + fmt(c.trainer.batch_size) +
                                  " (every rank trains a part of each batch)" + got(c.parallel.trainer_ranks));
  Map cluster = top.map("cluster");
  if (c.cluster.generator_processes > 0) {
    cluster.check(graph, "generator_processes",
                  "only the RL recipes (grpo, ppo, online_dpo, reinforce) have generators" + got(c.cluster.generator_processes));
    cluster.check(c.generator.engine == EngineKind::builtin, "generator_processes",
                  "runs built-in engines; generator.engine remote drives its server from the run's process");
    top.map("generator").check(c.generator.count == 1 || c.generator.count == c.cluster.generator_processes, "count",
                               "must be 1 or cluster.generator_processes = " + fmt(c.cluster.generator_processes) +
                                   " (each worker process runs one generator)" + got(c.generator.count));
    c.generator.count = c.cluster.generator_processes;
  }
  cluster.check(graph || c.cluster.reward_processes == 0, "reward_processes",
                "only the RL recipes (grpo, ppo, online_dpo, reinforce) have a reward actor");
  cluster.check(c.cluster.reference_processes == 0 || (graph && c.reference.enabled), "reference_processes",
                "needs the RL graph's reference actor (reference.enabled, or trainer.loss.beta > 0)");
}

// The behaviour log-probs stand for log pi_prox only where they are exactly what the trainer
// would compute: the same weights (eta 0), kernels, dtype and unmerged weights.
void check_reuse(Map& top, const RunConfig& c) {
  if (!c.trainer.reuse_behaviour_logprobs) return;
  Map t = top.map("trainer");
  const std::string key = "reuse_behaviour_logprobs";
  t.check(c.recipe == Recipe::grpo || c.recipe == Recipe::reinforce, key, "only grpo and reinforce recompute log pi_prox");
  t.check(c.async.max_staleness == 0, key,
          "needs async.max_staleness: 0 (older rollouts were sampled by other weights than the trainer's)");
  t.check(c.model.batch_invariant, key,
          "needs model.batch_invariant: true (otherwise the engines' log-probs differ from the trainer's by float rounding)");
  t.check(c.generator.engine == EngineKind::builtin, key, "needs generator.engine: builtin (a server's kernels are its own)");
  t.check(c.generator.dtype == ModelDtype::automatic || c.generator.dtype == c.model.dtype, key,
          "needs the engines in model.dtype (generator.dtype auto)");
  t.check(c.model.dtype != ModelDtype::float64, key,
          "needs model.dtype float32 (engines record float32 log-probs, a float64 trainer computes float64 ones)");
  t.check(!c.lora, key, "not with LoRA (generators hold the merged weights, which round otherwise than the adapters)");
}

// Between sections: seeds, checkpoints against syncs, what each recipe needs.
void check_across(Map& top, RunConfig& c, bool data_seeded) {
  const bool graph = is_graph(c.recipe);
  // An RL checkpoint is resumable only where the generators hold its weights: after a sync.
  if (graph)
    top.map("run").check(c.run.checkpoint_every % c.async.sync_every == 0, "checkpoint_every",
                         "must be a multiple of async.sync_every = " + fmt(c.async.sync_every) + got(c.run.checkpoint_every));
  if (!data_seeded) c.data.seed = c.run.seed;
  // online_dpo pairs each prompt's best and worst completion: it needs two of them.
  if (c.recipe == Recipe::online_dpo)
    top.map("generator").check(c.generator.group_size >= 2, "group_size",
                               "must be >= 2 for recipe online_dpo (a pair per prompt)" + got(c.generator.group_size));
  if (c.model.batch_invariant)
    top.map("model").check(c.model.device == "cpu" && c.model.dtype != ModelDtype::bfloat16, "batch_invariant",
                           "needs model.device cpu and model.dtype float32, float64 or auto (the batch-invariant kernels "
                           "are CPU float32/float64), got device " + c.model.device + ", dtype " +
                               std::string(to_string(c.model.dtype)));
  // Weight-only quantized engines: ATen's int8/int4 GEMMs are CPU kernels over float32 or bfloat16
  // activations, and the batch-invariant kernels take float weights.
  if (c.generator.weights != WeightFormat::full) {
    Map g = top.map("generator");
    const auto dtype = c.generator.dtype == ModelDtype::automatic ? c.model.dtype : c.generator.dtype;
    g.check(c.model.device == "cpu", "weights", "int8 and int4 engines run on the CPU, got model.device " + c.model.device);
    g.check(dtype != ModelDtype::float64, "weights",
            "int8 and int4 engines take float32 or bfloat16 activations, got " + std::string(to_string(dtype)));
    g.check(!c.model.batch_invariant, "weights",
            "not with model.batch_invariant (its kernels take float weights): use generator.weights full");
  }
  check_reuse(top, c);
  // Dynamic sampling drops groups whose rewards tie, which one completion always does.
  if (c.trainer.dynamic_sampling)
    top.map("generator").check(c.generator.group_size >= 2, "group_size",
                               "must be >= 2 with trainer.dynamic_sampling (one completion always ties with itself)" +
                                   got(c.generator.group_size));
  check_placement(top, c);
  check_teacher(top, c);
  if (graph && c.rewards.empty())
    top.fail("rewards", "required: at least one reward for recipe " + std::string(to_string(c.recipe)) +
                            " (e.g. - {name: correct, kind: math_answer})");
}

}  // namespace

RunConfig parse_root(const Source& s, const YAML::Node& root, const std::string& stem) {
  if (!root.IsDefined() || root.IsNull())
    throw Error(s.file + ": empty config (expected recipe, model, data, generator, rewards, trainer, async, run)");
  Map top(s, "", root, root.Mark());
  RunConfig c;
  read_table(top, c, {"model", "lora", "data", "generator", "rewards", "reference", "teacher", "trainer", "async",
                      "parallel", "cluster", "run"});
  read_table(top.map("model"), c.model);
  if (top.given("lora") || c.recipe == Recipe::lora) read_lora(top.map("lora"), c.lora.emplace());
  const bool data_seeded = read_data(top.map("data"), c.data);
  read_generator(top.map("generator"), c.generator);
  read_rewards(s, top, c.rewards);
  read_trainer(top.map("trainer"), c.trainer, c.recipe, c.generator.max_tokens);
  read_table(top.map("async"), c.async);
  read_table(top.map("parallel"), c.parallel);
  read_table(top.map("cluster"), c.cluster);
  c.run.dir = "runs/" + stem;
  read_table(top.map("run"), c.run);
  read_reference(top.map("reference"), c);
  if (top.given("teacher")) read_table(top.map("teacher"), c.teacher.emplace());
  check_across(top, c, data_seeded);
  return c;
}

}  // namespace troupe::cfg
