// The run config: every shipped config loads and round-trips; overrides apply; each kind of bad
// input is an error naming the file, the line and the key. No actors run here.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "actors/config.hpp"
#include "policy/error.hpp"
#include "reward/registry.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;

namespace {

// A small valid config; line numbers below refer to it.
const std::string kBase =
    "recipe: grpo\n"                                     // 1
    "model:\n"                                           // 2
    "  path: models/m.gguf\n"                            // 3
    "data:\n"                                            // 4
    "  train: {path: data/train.jsonl, prompt: question}\n"  // 5
    "generator:\n"                                       // 6
    "  group_size: 8\n"                                  // 7
    "  temperature: 0.9\n"                               // 8
    "rewards:\n"                                         // 9
    "  - {name: correct, kind: math_answer}\n"           // 10
    "trainer:\n"                                         // 11
    "  lr: 1.0e-6\n"                                     // 12
    "  loss: {clip: [0.2, 0.28], beta: 0.0}\n"           // 13
    "async: {max_staleness: 1}\n";                       // 14

// The error parse_run_config throws for `yaml` (named configs/x.yaml), or "" when it loads.
std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_run_config(yaml, "configs/x.yaml", overrides);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// kBase with line `n` (1-based) replaced.
std::string with_line(int n, const std::string& line) {
  std::string out, cur;
  int i = 0;
  for (char c : kBase) {
    cur += c;
    if (c == '\n') {
      out += ++i == n ? line + "\n" : cur;
      cur.clear();
    }
  }
  return out;
}

std::vector<fs::path> shipped_configs() {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(test::source() / "configs"))
    if (e.path().extension() == ".yaml") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

fs::path write_temp(const std::string& name, const std::string& text) {
  auto p = fs::temp_directory_path() / name;
  std::ofstream(p) << text;
  return p;
}

}  // namespace

TEST_CASE("every config in configs/ loads and survives to_yaml") {
  auto files = shipped_configs();
  REQUIRE(files.size() >= 3);
  for (const auto& f : files) {
    CAPTURE(f);
    RunConfig c = load_run_config(f.string());
    if (c.recipe == Recipe::grpo || c.recipe == Recipe::ppo) {  // the actor graph's recipes
      CHECK(!c.rewards.empty());
      CHECK(c.generator.max_seq_len > c.generator.max_tokens);
    } else {
      CHECK(c.trainer.max_length >= 2);
    }
    if (c.recipe == Recipe::lora) CHECK(c.lora.has_value());
    CHECK(parse_run_config(to_yaml(c), "config.yaml") == c);
    for (const auto& spec : to_reward_specs(c)) CHECK_NOTHROW(spec.validate());
  }
}

TEST_CASE("the shipped GSM8K config says what the issue asks for") {
  auto c = load_run_config((test::source() / "configs" / "smollm2_gsm8k_async_grpo.yaml").string());
  CHECK(c.model.path == "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  CHECK(c.data.train.path == "../shared/data/gsm8k/train.jsonl");
  CHECK(c.generator.group_size == 8);
  CHECK(c.generator.max_tokens == 256);
  CHECK(c.async.max_staleness == 1);
  REQUIRE(c.rewards.size() == 2);
  CHECK(c.rewards[0].kind == "math_answer");
  CHECK(c.rewards[1].kind == "format");
}

TEST_CASE("defaults: reference follows beta, run.dir the file name, data.seed run.seed") {
  auto c = parse_run_config(kBase, "configs/my_run.yaml");
  CHECK(c.reference.enabled == false);
  CHECK(c.reference.path == "models/m.gguf");
  CHECK(c.run.dir == "runs/my_run");
  CHECK(c.trainer.loss.aggregation == LossAggregation::dapo);
  CHECK(c.trainer.loss.epsilon == 0.2);
  CHECK(c.trainer.loss.epsilon_high == 0.28);
  CHECK(c.data.train.prompt == "question");
  CHECK(c.data.train.answer == "answer");
  CHECK(c.generator.temperature == 0.9);
  CHECK(c.origin.at("generator.temperature") == "configs/my_run.yaml:8");
  CHECK(c.origin.at("trainer.loss.beta") == "configs/my_run.yaml:13");
  CHECK(c.origin.at("trainer.steps") == "configs/my_run.yaml:11");  // absent: its section

  auto kl = parse_run_config(kBase, "x.yaml", {"trainer.loss.beta=0.04", "run.seed=7"});
  CHECK(kl.reference.enabled == true);
  CHECK(kl.reference.path == "models/m.gguf");
  CHECK(kl.data.seed == 7);

  // TRL's rule: epsilon alone sets both bounds.
  auto eps = parse_run_config(with_line(13, "  loss: {epsilon: 0.1}"), "x.yaml");
  CHECK(eps.trainer.loss.epsilon == 0.1);
  CHECK(eps.trainer.loss.epsilon_high == 0.1);
}

TEST_CASE("overrides apply before validation") {
  auto c = parse_run_config(kBase, "configs/x.yaml",
                            {"trainer.lr=3e-6", "generator.group_size=4", "trainer.loss.clip=[0.1, 0.3]",
                             "rewards.0.weight=2", "rewards.1={name: fmt, kind: format}", "data.eval.path=data/test.jsonl",
                             "generator.stop=[\"\\n\\n\", END]", "model.dtype=bfloat16", "run.deterministic=true"});
  CHECK(c.trainer.lr == 3e-6);
  CHECK(c.generator.group_size == 4);
  CHECK(c.trainer.loss.epsilon == 0.1);
  CHECK(c.trainer.loss.epsilon_high == 0.3);
  REQUIRE(c.rewards.size() == 2);
  CHECK(c.rewards[0].weight == 2.0);
  CHECK(c.rewards[1].kind == "format");
  REQUIRE(c.data.eval.has_value());
  CHECK(c.data.eval->path == "data/test.jsonl");
  CHECK(c.data.eval->prompt == "prompt");
  CHECK(c.generator.stop == std::vector<std::string>{"\n\n", "END"});
  CHECK(c.model.dtype == ModelDtype::bfloat16);
  CHECK(c.run.deterministic);
  // auto is kept as written (each machine decides it when the run starts) and reads back.
  auto automatic = parse_run_config(kBase, "configs/x.yaml", {"model.dtype=auto"});
  CHECK(automatic.model.dtype == ModelDtype::automatic);
  CHECK(parse_run_config(to_yaml(automatic), "configs/x.yaml").model.dtype == ModelDtype::automatic);
  CHECK(c.origin.at("trainer.lr") == "configs/x.yaml, override 'trainer.lr=3e-6'");
  CHECK(parse_run_config(to_yaml(c), "y.yaml") == c);

  // The later of two overrides wins; a value with '=' and ':' in it stays whole.
  auto url = parse_run_config(kBase, "x.yaml",
                              {"generator.engine=remote", "generator.url=http://h:1/v1?a=b", "trainer.lr=1", "trainer.lr=2"});
  CHECK(url.generator.url == "http://h:1/v1?a=b");
  CHECK(url.trainer.lr == 2.0);
}

TEST_CASE("bad overrides name the override and the key") {
  CHECK(error_of(kBase, {"generator.temprature=0.7"}) ==
        "configs/x.yaml, override 'generator.temprature=0.7': generator.temprature: unknown key (did you mean temperature?)");
  CHECK(error_of(kBase, {"trainer.lr=-1"}) == "configs/x.yaml, override 'trainer.lr=-1': trainer.lr: must be > 0, got -1");
  CHECK(error_of(kBase, {"generator.group_size=eight"}) ==
        "configs/x.yaml, override 'generator.group_size=eight': generator.group_size: expected an integer, got \"eight\"");
  CHECK(error_of(kBase, {"nonsense"}) == "configs/x.yaml, override 'nonsense': expected key.path=value (e.g. trainer.lr=1e-6)");
  CHECK(error_of(kBase, {"trainer..lr=1"}).find("empty key name") != std::string::npos);
  CHECK(error_of(kBase, {"rewards.5.weight=1"}) ==
        "configs/x.yaml, override 'rewards.5.weight=1': rewards.5: expected a list index in [0, 1]");
  CHECK(error_of(kBase, {"trainer.lr.x=1"}) ==
        "configs/x.yaml, override 'trainer.lr.x=1': trainer.lr.x: trainer.lr is a single value, not a section");
  CHECK(error_of(kBase, {"trainer.loss.clip=[0.2"}).find("the value is not valid YAML") != std::string::npos);
  CHECK(error_of(kBase, {"trainr.lr=1"}) ==
        "configs/x.yaml, override 'trainr.lr=1': trainr: unknown key (did you mean trainer?)");
}

TEST_CASE("each kind of bad input names file, line and key") {
  // Unknown keys, with the nearest known one.
  CHECK(error_of(with_line(8, "  temprature: 0.9")) ==
        "configs/x.yaml:8: generator.temprature: unknown key (did you mean temperature?)");
  CHECK(error_of(with_line(3, "  pth: models/m.gguf")) == "configs/x.yaml:3: model.pth: unknown key (did you mean path?)");
  CHECK(error_of(kBase + "optimiser: {}\n") ==
        "configs/x.yaml:15: optimiser: unknown key (expected one of: recipe, resume, model, lora, data, generator, rewards, reference, "
        "teacher, trainer, async, parallel, cluster, run)");
  // Wrong types.
  CHECK(error_of(with_line(7, "  group_size: eight")) ==
        "configs/x.yaml:7: generator.group_size: expected an integer, got \"eight\"");
  CHECK(error_of(with_line(7, "  group_size: 8.5")) == "configs/x.yaml:7: generator.group_size: expected an integer, got \"8.5\"");
  CHECK(error_of(with_line(7, "  group_size: \"8\"")) ==
        "configs/x.yaml:7: generator.group_size: expected an integer, got the quoted string \"8\"");
  CHECK(error_of(with_line(7, "  group_size: [8]")) == "configs/x.yaml:7: generator.group_size: expected an integer, got a list");
  CHECK(error_of(with_line(12, "  lr:")) == "configs/x.yaml:12: trainer.lr: expected a number, got nothing (an empty value)");
  CHECK(error_of(with_line(12, "  lr: .nan")) == "configs/x.yaml:12: trainer.lr: expected a number, got \".nan\"");
  CHECK(error_of(with_line(3, "  path: {a: 1}")) == "configs/x.yaml:3: model.path: expected a string, got a map");
  CHECK(error_of(with_line(14, "async: 3")) == "configs/x.yaml:14: async: expected a map of keys, got \"3\"");
  CHECK(error_of(kBase + "run: {deterministic: maybe}\n") ==
        "configs/x.yaml:15: run.deterministic: expected true or false, got \"maybe\"");
  CHECK(error_of(kBase + "run: {seed: -1}\n") == "configs/x.yaml:15: run.seed: expected a non-negative integer, got \"-1\"");
  // Out of range.
  CHECK(error_of(with_line(12, "  lr: -1")) == "configs/x.yaml:12: trainer.lr: must be > 0, got -1");
  CHECK(error_of(kBase, {"async.max_staleness=2", "async.sync_every=2", "run.checkpoint_every=5"}) ==
        "configs/x.yaml, override 'run.checkpoint_every=5': run.checkpoint_every: must be a multiple of async.sync_every = 2, got 5");
  CHECK(error_of(kBase, {"recipe=online_dpo", "trainer.loss.beta=0.1", "generator.group_size=1"}) ==
        "configs/x.yaml, override 'generator.group_size=1': generator.group_size: must be >= 2 for recipe online_dpo (a pair per prompt), got 1");
  CHECK(error_of(with_line(7, "  group_size: 0")) == "configs/x.yaml:7: generator.group_size: must be >= 1, got 0");
  CHECK(error_of(with_line(8, "  top_p: 1.5")) == "configs/x.yaml:8: generator.top_p: must be in (0, 1], got 1.5");
  CHECK(error_of(with_line(13, "  loss: {clip: [0.2, 1.5]}")) ==
        "configs/x.yaml:13: trainer.loss.clip: epsilon_high (the second value) must be in (0, 1), got 1.5");
  CHECK(error_of(with_line(13, "  loss: {clip: [0.2]}")) ==
        "configs/x.yaml:13: trainer.loss.clip: expected [epsilon, epsilon_high], two numbers, got a list");
  CHECK(error_of(with_line(13, "  loss: {clip: [0.2, 0.3], epsilon: 0.2}")) ==
        "configs/x.yaml:13: trainer.loss.clip: give clip: [low, high] or epsilon/epsilon_high, not both");
  CHECK(error_of(with_line(14, "async: {max_staleness: 0, sync_every: 2}")) ==
        "configs/x.yaml:14: async.sync_every: must be <= async.max_staleness + 1 = 1 (generators would fall further "
        "behind than max_staleness allows), got 2");
  CHECK(error_of(with_line(14, "async: {max_staleness: -1}")) ==
        "configs/x.yaml:14: async.max_staleness: must be >= 0 (0: synchronous, on-policy), got -1");
  // Missing required keys: at the line of the section that should hold them.
  CHECK(error_of(with_line(3, "  dtype: float32")) ==
        "configs/x.yaml:2: model.path: required: the model to train: a Hugging Face folder or a .gguf file");
  CHECK(error_of(with_line(10, "  - {kind: math_answer}")) ==
        "configs/x.yaml:10: rewards.0.name: required: a unique name (metrics report reward/<name>/mean)");
  CHECK(error_of(with_line(1, "# no recipe")) == "configs/x.yaml:2: recipe: required: one of grpo, sft, lora, dpo, ppo, online_dpo, reinforce, distill");
  CHECK(error_of(with_line(10, "  []")).find("configs/x.yaml:9: rewards: required: at least one reward") == 0);
  // Wrong names.
  CHECK(error_of(with_line(1, "recipe: grpo2")) ==
        "configs/x.yaml:1: recipe: expected one of grpo, sft, lora, dpo, ppo, online_dpo, reinforce, distill, got \"grpo2\" (did you mean grpo?)");
  CHECK(error_of(with_line(3, "  path: m\n  dtype: fp16")) ==
        "configs/x.yaml:4: model.dtype: expected one of auto, float32, bfloat16, float64, got \"fp16\"");
  CHECK(error_of(with_line(10, "  - {name: c, kind: math_anser}")) ==
        "configs/x.yaml:10: rewards.0.kind: expected one of math_answer, format, plugin, http, got \"math_anser\" (did you "
        "mean math_answer?)");
  // Cross-field rules.
  CHECK(error_of(kBase + "generator: {engine: remote}\n").find("duplicate key") != std::string::npos);
  CHECK(error_of(with_line(7, "  engine: remote")) ==
        "configs/x.yaml:7: generator.engine: engine: remote needs url: http://host:port of a vLLM-compatible server");
  CHECK(error_of(with_line(7, "  url: http://localhost:8000")) ==
        "configs/x.yaml:7: generator.url: only used with engine: remote (the built-in engine runs in-process)");
  CHECK(error_of(kBase + "reference: {enabled: false}\n", {"trainer.loss.beta=0.1"}) ==
        "configs/x.yaml:15: reference.enabled: must be true when trainer.loss.beta > 0 (the KL term needs reference "
        "log-probs); set beta: 0 or enabled: true");
  CHECK(error_of(with_line(10, "  - {name: a, kind: format}\n  - {name: a, kind: math_answer}")) ==
        "configs/x.yaml:11: rewards.1.name: duplicate reward name \"a\"");
  CHECK(error_of(with_line(10, "  - {name: p, kind: plugin}")) ==
        "configs/x.yaml:10: rewards.0.plugin: kind plugin needs plugin: PATH of a shared library");
  CHECK(error_of(with_line(7, "  max_tokens: 4096")) ==
        "configs/x.yaml:7: generator.max_tokens: generator.max_seq_len (2048) must exceed generator.max_tokens (4096): it "
        "holds the prompt too");
  CHECK(error_of(with_line(3, "  path: m\n  path: n")) == "configs/x.yaml:4: model.path: duplicate key (first given on line 3)");
}

TEST_CASE("parallel: trainer ranks and sharding for the trainer-alone recipes, errors naming the key") {
  const std::string sft = "recipe: sft\nmodel: {path: m}\ndata: {train: {path: t.jsonl}}\ntrainer: {batch_size: 4}\n";
  auto c = parse_run_config(sft, "configs/x.yaml", {"parallel.trainer_ranks=2", "parallel.sharding=zero2"});
  CHECK(c.parallel.trainer_ranks == 2);
  CHECK(c.parallel.sharding == ShardingMode::zero2);
  CHECK(c.parallel.timeout_s == 300.0);
  CHECK(parse_run_config(to_yaml(c), "configs/x.yaml") == c);
  CHECK(parse_run_config(sft, "configs/x.yaml").parallel.sharding == ShardingMode::none);
  CHECK(error_of(sft, {"parallel.trainer_ranks=0"}) ==
        "configs/x.yaml, override 'parallel.trainer_ranks=0': parallel.trainer_ranks: must be >= 1 (1: one process), got 0");
  CHECK(error_of(sft, {"parallel.sharding=zero9"}) ==
        "configs/x.yaml, override 'parallel.sharding=zero9': parallel.sharding: expected one of none, zero1, zero2, zero3, got \"zero9\" "
        "(did you mean zero1?)");
  CHECK(error_of(sft, {"parallel.trainer_ranks=5"}) ==
        "configs/x.yaml, override 'parallel.trainer_ranks=5': parallel.trainer_ranks: must be <= trainer.batch_size = 4 "
        "(every rank trains a part of each batch), got 5");
  CHECK(error_of(sft, {"parallel.timeout_s=0"}).find("parallel.timeout_s: must be > 0") != std::string::npos);
  // The actor-graph recipes split each batch's groups between the ranks; ppo has no zero3.
  const auto grpo = parse_run_config(kBase, "configs/x.yaml", {"parallel.trainer_ranks=2", "parallel.sharding=zero3"});
  CHECK(grpo.parallel.trainer_ranks == 2);
  CHECK(grpo.parallel.sharding == ShardingMode::zero3);
  CHECK(error_of(kBase, {"trainer.batch_groups=2", "parallel.trainer_ranks=3"}) ==
        "configs/x.yaml, override 'parallel.trainer_ranks=3': parallel.trainer_ranks: must be <= trainer.batch_groups = 2 "
        "(every rank trains a part of each batch's groups), got 3");
  CHECK(parse_run_config(kBase, "configs/x.yaml", {"recipe=ppo", "parallel.trainer_ranks=2"}).parallel.trainer_ranks == 2);
  CHECK(error_of(kBase, {"recipe=ppo", "parallel.trainer_ranks=2", "parallel.sharding=zero3"})
            .find("parallel.sharding: recipe ppo takes none, zero1 or zero2") != std::string::npos);
}

TEST_CASE("the RL objective, advantage and correction keys: read, written back, and bad values naming the key") {
  auto c = parse_run_config(kBase, "configs/x.yaml",
                            {"trainer.loss.objective=gspo", "trainer.advantage=rloo",
                             "trainer.loss.correction={mode: sequence_mask, low: 0.5, high: 2}"});
  CHECK(c.trainer.loss.objective == rl::Objective::gspo);
  CHECK(c.trainer.advantage == rl::Advantage::rloo);
  CHECK(c.trainer.loss.correction == rl::Correction{.mode = rl::CorrectionMode::sequence_mask, .low = 0.5, .high = 2});
  CHECK(parse_run_config(to_yaml(c), "runs/x/config.yaml") == c);
  // Defaults: GRPO's clipped ratio, group advantages, today's cap of 5 on pi_prox / mu.
  auto d = parse_run_config(kBase, "configs/x.yaml");
  CHECK(d.trainer.loss.objective == rl::Objective::grpo);
  CHECK(d.trainer.loss.correction == rl::Correction{.mode = rl::CorrectionMode::token_truncate, .high = 5});

  CHECK(error_of(kBase, {"trainer.loss.objective=gspoo"}) ==
        "configs/x.yaml, override 'trainer.loss.objective=gspoo': trainer.loss.objective: expected one of grpo, gspo, "
        "cispo, got \"gspoo\" (did you mean gspo?)");
  CHECK(error_of(kBase, {"trainer.advantage=reinforce++"}) ==
        "configs/x.yaml, override 'trainer.advantage=reinforce++': trainer.advantage: expected one of group, rloo, "
        "reinforce_pp, reinforce_pp_baseline, none, got \"reinforce++\" (did you mean reinforce_pp?)");
  CHECK(error_of(kBase, {"trainer.loss.correction={mode: token_mask, low: 0.9, high: 0.5}"}) ==
        "configs/x.yaml, override 'trainer.loss.correction={mode: token_mask, low: 0.9, high: 0.5}': "
        "trainer.loss.correction.high: must be >= 1 (a bound below 1 would down-weight or drop on-policy tokens), got 0.5");
  CHECK(error_of(kBase, {"trainer.loss.correction={mode: token_mask, low: 3, high: 2}"}) ==
        "configs/x.yaml, override 'trainer.loss.correction={mode: token_mask, low: 3, high: 2}': "
        "trainer.loss.correction.low: must be in [0, 1] (a ratio of 1 is on-policy and always kept), got 3");
  CHECK(error_of(kBase, {"trainer.loss.correction={mode: token_truncate, low: 0.5}"}) ==
        "configs/x.yaml, override 'trainer.loss.correction={mode: token_truncate, low: 0.5}': "
        "trainer.loss.correction.low: only used with mode token_mask or sequence_mask (the others only cap)");
  CHECK(error_of(kBase, {"trainer.advantage=rloo", "trainer.scale_rewards=batch"}) ==
        "configs/x.yaml, override 'trainer.scale_rewards=batch': trainer.scale_rewards: only used with advantage: group");
  CHECK(error_of(kBase, {"recipe=ppo", "trainer.advantage=reinforce_pp"}) ==
        "configs/x.yaml, override 'trainer.advantage=reinforce_pp': trainer.advantage: recipe ppo takes no advantage "
        "estimator (ppo's advantages are GAE's)");
  auto o = parse_run_config(kBase, "configs/x.yaml", {"trainer.overlong={mode: penalty, buffer: 2, factor: 0.5}"});
  CHECK(o.trainer.overlong == rl::Overlong{.mode = rl::OverlongMode::penalty, .buffer = 2, .factor = 0.5});
  CHECK(parse_run_config(to_yaml(o), "runs/x/config.yaml") == o);
  CHECK(error_of(kBase, {"trainer.overlong={mode: penalty}"}) ==
        "configs/x.yaml, override 'trainer.overlong={mode: penalty}': trainer.overlong.buffer: required: the tokens "
        "before max_tokens over which the penalty ramps up");
  CHECK(error_of(kBase, {"trainer.overlong={mode: mask, buffer: 4}"}) ==
        "configs/x.yaml, override 'trainer.overlong={mode: mask, buffer: 4}': trainer.overlong.buffer: only used with "
        "mode: penalty");
  CHECK(error_of(kBase, {"trainer.overlong={mode: penalty, buffer: 4096}"}).ends_with(
        "trainer.overlong.buffer: must be <= generator.max_tokens = 256, got 4096"));
  // The engines' dtype apart from the trainer's (the mismatch the corrections are for).
  CHECK(parse_run_config(kBase, "configs/x.yaml", {"generator.dtype=bfloat16"}).generator.dtype == ModelDtype::bfloat16);
  CHECK(parse_run_config(kBase, "configs/x.yaml").generator.dtype == ModelDtype::automatic);
  CHECK(error_of(kBase, {"generator.engine=remote", "generator.url=http://h:1", "generator.dtype=bfloat16"}) ==
        "configs/x.yaml, override 'generator.dtype=bfloat16': generator.dtype: only used with engine: builtin (a server "
        "keeps its own)");
  // Distillation: the teacher is given exactly when something reads it.
  auto t = parse_run_config(kBase, "configs/x.yaml", {"recipe=distill", "teacher={path: runs/teacher}"});
  CHECK(t.trainer.loss.distill == 1.0);
  CHECK(t.teacher->path == "runs/teacher");
  CHECK(parse_run_config(to_yaml(t), "runs/x/config.yaml") == t);
  CHECK(error_of(kBase, {"recipe=distill"}) == "configs/x.yaml:1: teacher: required: {path: ...} for recipe distill");
  CHECK(error_of(kBase, {"teacher={path: runs/teacher}"}) ==
        "configs/x.yaml, override 'teacher={path: runs/teacher}': teacher: only used by recipe distill or "
        "trainer.loss.distill > 0");
  CHECK(error_of(kBase, {"trainer.loss.distill=0.5"}) ==
        "configs/x.yaml:1: teacher: required: {path: ...} for trainer.loss.distill > 0");
  CHECK(error_of(kBase, {"recipe=online_dpo", "trainer.loss.beta=0.1", "trainer.loss.objective=cispo"}) ==
        "configs/x.yaml, override 'trainer.loss.objective=cispo': trainer.loss.objective: recipe online_dpo has no "
        "policy-gradient objective");
  // Dynamic sampling: grpo and reinforce only, groups of two or more, rounds only with it on.
  auto ds = parse_run_config(kBase, "configs/x.yaml", {"trainer.dynamic_sampling=true", "trainer.dynamic_sampling_rounds=3"});
  CHECK(ds.trainer.dynamic_sampling);
  CHECK(ds.trainer.dynamic_sampling_rounds == 3);
  CHECK(parse_run_config(to_yaml(ds), "runs/x/config.yaml") == ds);
  CHECK(error_of(kBase, {"recipe=ppo", "trainer.dynamic_sampling=true"}) ==
        "configs/x.yaml, override 'trainer.dynamic_sampling=true': trainer.dynamic_sampling: recipe ppo does not filter "
        "groups (only grpo and reinforce do: a group whose rewards tie has no advantage there)");
  CHECK(error_of(kBase, {"trainer.dynamic_sampling=true", "generator.group_size=1"}) ==
        "configs/x.yaml, override 'generator.group_size=1': generator.group_size: must be >= 2 with "
        "trainer.dynamic_sampling (one completion always ties with itself), got 1");
  CHECK(error_of(kBase, {"trainer.dynamic_sampling_rounds=3"}) ==
        "configs/x.yaml, override 'trainer.dynamic_sampling_rounds=3': trainer.dynamic_sampling_rounds: only used "
        "with dynamic_sampling: true");
  CHECK(error_of(kBase, {"trainer.dynamic_sampling=true", "trainer.dynamic_sampling_rounds=0"}).ends_with(
        "trainer.dynamic_sampling_rounds: must be >= 1, got 0"));
  // Batch-invariant kernels, and the behaviour log-probs as log pi_prox only where they are exact.
  const std::vector<std::string> reuse = {"model.batch_invariant=true", "async.max_staleness=0", "generator.temperature=1",
                                          "trainer.reuse_behaviour_logprobs=true"};
  auto bi = parse_run_config(kBase, "configs/x.yaml", reuse);
  CHECK(bi.model.batch_invariant);
  CHECK(bi.trainer.reuse_behaviour_logprobs);
  CHECK(parse_run_config(to_yaml(bi), "runs/x/config.yaml") == bi);
  CHECK(error_of(kBase, {"model.batch_invariant=true", "model.dtype=bfloat16"}).ends_with(
        "model.batch_invariant: needs model.device cpu and model.dtype float32, float64 or auto (the batch-invariant "
        "kernels are CPU float32/float64), got device cpu, dtype bfloat16"));
  CHECK(error_of(kBase, {"model.batch_invariant=true", "trainer.reuse_behaviour_logprobs=true"}).ends_with(
        "trainer.reuse_behaviour_logprobs: needs async.max_staleness: 0 (older rollouts were sampled by other weights than "
        "the trainer's)"));
  CHECK(error_of(kBase, {"async.max_staleness=0", "trainer.reuse_behaviour_logprobs=true"}).ends_with(
        "trainer.reuse_behaviour_logprobs: needs model.batch_invariant: true (otherwise the engines' log-probs differ from "
        "the trainer's by float rounding)"));
  auto with = [&](std::string extra) {
    auto o = reuse;
    o.push_back(std::move(extra));
    return error_of(kBase, o);
  };
  CHECK(with("generator.dtype=bfloat16").ends_with("trainer.reuse_behaviour_logprobs: needs the engines in model.dtype (generator.dtype auto)"));
  CHECK(with("model.dtype=float64").ends_with("trainer.reuse_behaviour_logprobs: needs model.dtype float32 (engines record "
                                              "float32 log-probs, a float64 trainer computes float64 ones)"));
  CHECK(with("generator.temperature=0.7").empty());  // the trainer takes its log-probs at the same temperature
  CHECK(error_of(kBase, {"trainer.dynamic_sampling=true", "trainer.advantage=reinforce_pp"}).ends_with(
        "trainer.advantage: advantage reinforce_pp gives a group whose rewards tie an advantage all the same: "
        "trainer.dynamic_sampling needs a group baseline (group, rloo or reinforce_pp_baseline)"));
  // Partial rollouts: continue by default; finish and abort by name; built-in engines only.
  CHECK(parse_run_config(kBase, "configs/x.yaml").generator.partial_rollouts == PartialRollouts::continue_);
  auto pr = parse_run_config(kBase, "configs/x.yaml", {"generator.partial_rollouts=finish"});
  CHECK(pr.generator.partial_rollouts == PartialRollouts::finish);
  CHECK(parse_run_config(to_yaml(pr), "runs/x/config.yaml") == pr);
  CHECK(error_of(kBase, {"generator.partial_rollouts=resume"}) ==
        "configs/x.yaml, override 'generator.partial_rollouts=resume': generator.partial_rollouts: expected one of "
        "continue, finish, abort, got \"resume\"");
  CHECK(error_of(kBase, {"generator.engine=remote", "generator.url=http://h:1", "generator.partial_rollouts=abort"}) ==
        "configs/x.yaml, override 'generator.partial_rollouts=abort': generator.partial_rollouts: only used with engine: "
        "builtin (a server's batch takes new weights once it is done)");
  // Quantized engines: full by default; int8 and int4 by name; CPU, float activations, float kernels.
  CHECK(parse_run_config(kBase, "configs/x.yaml").generator.weights == WeightFormat::full);
  auto q = parse_run_config(kBase, "configs/x.yaml", {"generator.weights=int4"});
  CHECK(q.generator.weights == WeightFormat::int4);
  CHECK(parse_run_config(to_yaml(q), "runs/x/config.yaml") == q);
  CHECK(error_of(kBase, {"generator.weights=int3"}) ==
        "configs/x.yaml, override 'generator.weights=int3': generator.weights: expected one of full, int8, int4, got "
        "\"int3\" (did you mean int8?)");
  CHECK(error_of(kBase, {"generator.weights=int8", "model.batch_invariant=true"}).ends_with(
        "generator.weights: not with model.batch_invariant (its kernels take float weights): use generator.weights full"));
  CHECK(error_of(kBase, {"generator.weights=int8", "model.dtype=float64"}).ends_with(
        "generator.weights: int8 and int4 engines take float32 or bfloat16 activations, got float64"));
  CHECK(error_of(kBase, {"generator.weights=int8", "model.device=cuda"}).ends_with(
        "generator.weights: int8 and int4 engines run on the CPU, got model.device cuda"));
}

TEST_CASE("malformed YAML is a troupe::Error with file and line") {
  CHECK(error_of(with_line(8, "  temperature: [0.9")).starts_with("configs/x.yaml:"));
  std::string e = error_of(with_line(5, "  train: {path: data/train.jsonl"));
  CHECK(e.starts_with("configs/x.yaml:"));
  CHECK(e.find("invalid YAML") != std::string::npos);
  CHECK(error_of(with_line(3, "\tpath: x")).find("invalid YAML") != std::string::npos);
  CHECK(error_of("") == "configs/x.yaml: empty config (expected recipe, model, data, generator, rewards, trainer, async, run)");
  CHECK(error_of("- a\n- b\n") == "configs/x.yaml:1: (top level): expected a map of keys, got a list");

  auto bad = write_temp("troupe_test_config_bad.yaml", "recipe: grpo\nmodel: {path: x\n");
  try {
    load_run_config(bad.string());
    FAIL("no error");
  } catch (const Error& err) {
    CHECK(std::string(err.what()).starts_with(bad.string() + ":"));
  }
  CHECK_THROWS_WITH_AS(load_run_config("configs/does_not_exist.yaml"), "configs/does_not_exist.yaml: no such config file",
                       Error);
}

TEST_CASE("to_yaml round-trips every field, optional ones included") {
  auto c = parse_run_config(kBase, "configs/x.yaml",
                            {"data.eval={path: e.jsonl, system: \"Be \\\"brief\\\"\\n\", limit: 5}", "data.shuffle=false",
                             "generator.stop=[\"###\", \"\\t\"]", "generator.top_k=40", "generator.min_p=0.05",
                             "rewards.1={name: mine, plugin: lib/x.so, weight: -0.5}",
                             "rewards.2={name: svc, url: \"https://h:9/score\", timeout_s: 2.5, retries: 0, max_batch: 16}",
                             "trainer.loss.beta=0.04", "trainer.scale_rewards=none", "trainer.loss.aggregation=dr_grpo",
                             "trainer.sft_warmup={path: s.jsonl, steps: 3}", "run.seed=18446744073709551615",
                             "trainer.lr=0.1", "model.device=cuda:1"});
  CHECK(c.rewards[1].kind == "plugin");
  CHECK(c.rewards[2].kind == "http");
  CHECK(c.trainer.sft_warmup->lr == 0.1);
  CHECK(c.data.eval->system == "Be \"brief\"\n");
  std::string yaml = to_yaml(c);
  CAPTURE(yaml);
  CHECK(parse_run_config(yaml, "runs/x/config.yaml") == c);
  CHECK(yaml.find("lr: 0.1\n") != std::string::npos);
  CHECK(yaml.find("clip: [0.2, 0.28]") != std::string::npos);

  auto f = write_temp("troupe_test_config_roundtrip.yaml", yaml);
  CHECK(load_run_config(f.string()) == c);
}

TEST_CASE("reward kinds cover reward/'s built-ins; specs carry every field") {
  for (const auto& k : builtin_reward_kinds())
    CHECK(std::find(kRewardKindNames.begin(), kRewardKindNames.end(), k) != kRewardKindNames.end());
  auto c = parse_run_config(kBase, "x.yaml", {"rewards.1={name: svc, url: \"http://h:9\", timeout_s: 2, retries: 4, backoff_s: 0.1, max_batch: 3}"});
  auto specs = to_reward_specs(c);
  REQUIRE(specs.size() == 2);
  CHECK(specs[0].resolved_kind() == "math_answer");
  CHECK(specs[1].resolved_kind() == "http");
  CHECK(specs[1].timeout_s == 2.0);
  CHECK(specs[1].retries == 4);
  CHECK(specs[1].backoff_s == 0.1);
  CHECK(specs[1].max_batch == 3);
}

TEST_CASE("validate_paths names the key and its line") {
  auto dir = fs::temp_directory_path() / "troupe_test_config_paths";
  fs::create_directories(dir);
  std::ofstream(dir / "train.jsonl") << "{}\n";
  auto c = parse_run_config(kBase, "configs/x.yaml",
                            {"model.path=" + dir.string(), "data.train.path=" + (dir / "train.jsonl").string()});
  CHECK_NOTHROW(validate_paths(c));

  auto missing = parse_run_config(kBase, "configs/x.yaml", {"model.path=" + dir.string()});
  CHECK_THROWS_WITH_AS(validate_paths(missing),
                       doctest::Contains("configs/x.yaml:5: data.train.path: data/train.jsonl does not exist (paths are "
                                         "relative to the current folder"),
                       Error);
  auto folder = parse_run_config(kBase, "configs/x.yaml", {"model.path=" + dir.string(), "data.train.path=" + dir.string()});
  CHECK_THROWS_WITH_AS(validate_paths(folder), doctest::Contains("is a folder, expected a file"), Error);
}

// Found by tests/fuzz/ under AddressSanitizer: Map kept a reference to yaml-cpp's `it->first`, which
// lives in a proxy destroyed at the end of its statement (stack-use-after-scope on every key of
// every config). Builds without ASan read the dead proxy by luck, so this case only guards it in a
// sanitizer build; the fuzz test fuzz_config replays the same file under ASan in every `make test`.
TEST_CASE("the keys of a map are read from live nodes (regressions/config/map_key_use_after_scope.yaml)") {
  const auto path = (test::source() / "tests/fuzz/regressions/config/map_key_use_after_scope.yaml").string();
  CHECK_THROWS_WITH_AS(load_run_config(path), doctest::Contains((path + ":1: model.path: required").c_str()), Error);
}
