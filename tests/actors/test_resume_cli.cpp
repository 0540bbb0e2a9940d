// Exact resume: a run killed with SIGKILL at a random step and continued with
// `resume=RUN_DIR` ends with the same weights and the same per-step metrics as a run that was
// never interrupted (deterministic mode). sft, lora (dropout on, so the RNG state matters),
// dpo, and async GRPO and PPO through the actor graph (eta = 1, so a checkpoint holds rollouts
// made by older weights); plus the errors for a checkpoint of another recipe or model.
#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/actors/run_util.hpp"
#include "tests/actors/tensorboard_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::test;

namespace {

// Runs the config straight through, then again killed with SIGKILL once `kill_at` steps are in
// metrics.jsonl and resumed; compares the final weights (`weights` inside the last checkpoint)
// and every step's `keys`.
void check_resume(const std::string& config, const std::string& data, const std::string& extra, int64_t steps,
                  const std::vector<std::string>& weights, const std::vector<std::string>& keys,
                  const std::string& tag = "") {
  auto task = fixtures() / "arithmetic";
  std::string common = "model.path=" + shell_quote((task / "model").string()) + " data.train.path=" +
                       shell_quote((task / data).string()) + " trainer.steps=" + std::to_string(steps) +
                       " run.checkpoint_every=5 run.deterministic=true " + extra;
  auto straight = fixtures() / ("resume_" + config + tag + "_straight");
  auto killed = fixtures() / ("resume_" + config + tag + "_killed");
  fs::remove_all(straight);
  fs::remove_all(killed);
  auto r = run_command(troupe_run(config, common + " run.dir=" + shell_quote(straight.string())) + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);

  std::mt19937 rng(std::random_device{}());
  const int64_t kill_at = 6 + static_cast<int64_t>(rng() % (steps - 10));
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::string cmd = troupe_run(config, common + " run.dir=" + shell_quote(killed.string())) + " > /dev/null 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int64_t seen = 0;
  for (int i = 0; i < 60000 && seen < kill_at; ++i) {
    seen = static_cast<int64_t>(steps_written(killed));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(pid, SIGKILL);  // `exec` made the shell the troupe process itself
  waitpid(pid, nullptr, 0);
  REQUIRE(seen >= kill_at);
  const auto killed_lines = metrics(killed).size();
  REQUIRE(killed_lines < static_cast<size_t>(steps));  // it really died mid-run

  r = run_command(troupe_run(config, common + " run.dir=" + shell_quote(killed.string()) +
                                         " resume=" + shell_quote(killed.string())) + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("resumed from") != std::string::npos);

  auto a = metrics(straight), b = metrics(killed);
  REQUIRE(a.size() == static_cast<size_t>(steps));
  REQUIRE(b.size() == static_cast<size_t>(steps));
  double worst_metric = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(b[i]["step"] == a[i]["step"]);
    CHECK(b[i].value("policy_version", -1) == a[i].value("policy_version", -1));
    for (const auto& key : keys)
      worst_metric = std::max(worst_metric, std::fabs(a[i][key].get<double>() - b[i][key].get<double>()));
  }
  auto last = "step_" + std::to_string(steps);
  double worst_weight = 0;
  for (const auto& w : weights)
    worst_weight = std::max(worst_weight, max_diff(straight / "checkpoints" / last / w, killed / "checkpoints" / last / w));
  MESSAGE(config << ": killed after " << killed_lines << " steps, resumed; max |weight diff| " << worst_weight
                 << ", max |metric diff| " << worst_metric);
  CHECK(worst_weight <= 1e-6);
  CHECK(worst_metric <= 1e-6);
  // The resumed run made tb/ again from the metrics.jsonl it kept: one file, equal to it.
  auto board = read_board(killed / "tb");
  CHECK(board["files"].size() == 1);
  check_board_matches(killed, board);
  // The graph recipes' samples.jsonl was cut back with metrics.jsonl: one line per step.
  if (fs::exists(killed / "samples.jsonl")) {
    int64_t lines = 0;
    std::ifstream in(killed / "samples.jsonl");
    for (std::string line; std::getline(in, line);) CHECK(nlohmann::json::parse(line)["step"] == ++lines);
    CHECK(lines == steps);
  }
}

}  // namespace

TEST_CASE("sft killed at a random step and resumed ends where an uninterrupted run ends") {
  check_resume("tiny_arithmetic_sft", "train.jsonl", "data.eval=null", 40, {"model.safetensors"}, {"loss"});
}

TEST_CASE("lora with dropout, killed and resumed: same adapter, same losses") {
  check_resume("tiny_arithmetic_lora", "train.jsonl", "data.eval=null lora.dropout=0.1", 30,
               {"adapter/adapter_model.safetensors"}, {"loss"});
}

TEST_CASE("dpo killed and resumed: same weights, same reward accuracies") {
  check_resume("tiny_arithmetic_dpo", "prefs.jsonl", "", 30, {"model.safetensors"}, {"rewards/margins", "rewards/accuracies"});
}

TEST_CASE("async grpo (eta = 1) killed and resumed: buffered rollouts survive; same weights, rewards and losses") {
  auto format = fixtures() / "arithmetic" / "format.jsonl";
  check_resume("tiny_arithmetic_grpo", "train.jsonl", "trainer.sft_warmup.path=" + shell_quote(format.string()), 30,
               {"model.safetensors"}, {"loss", "reward/mean", "kl", "staleness/mean"});
  // The checkpoint it continued from held the batch made by the previous policy version.
  auto dir = fixtures() / "resume_tiny_arithmetic_grpo_killed" / "checkpoints" / "step_5";
  auto state = nlohmann::json::parse(std::ifstream(dir / "trainer_state.json"));
  CHECK(state["rollout_batches"] == nlohmann::json::array({5, 6}));
  CHECK(fs::file_size(dir / "rollouts.msgpack") > 0);
}

TEST_CASE("async grpo with dynamic sampling killed and resumed: the refills drawn before the checkpoint are not drawn again") {
  auto format = fixtures() / "arithmetic" / "format.jsonl";
  // Groups of 4 tie often (all wrong early, all right later), so most batches draw refills.
  check_resume("tiny_arithmetic_grpo", "train.jsonl",
               "trainer.sft_warmup.path=" + shell_quote(format.string()) + " trainer.dynamic_sampling=true generator.group_size=4",
               30, {"model.safetensors"}, {"loss", "reward/mean", "rollouts/filtered", "dynamic_sampling/rounds"}, "_dynamic");
  int64_t filtered = 0;
  for (const auto& j : metrics(fixtures() / "resume_tiny_arithmetic_grpo_dynamic_straight")) {
    filtered += j["rollouts/filtered"].get<int64_t>();
    CHECK(j["rollouts/trained"].get<int64_t>() + j["rollouts/failed"].get<int64_t>() <= 16);
  }
  CHECK(filtered > 0);
  auto state = nlohmann::json::parse(
      std::ifstream(fixtures() / "resume_tiny_arithmetic_grpo_dynamic_killed" / "checkpoints" / "step_30" / "trainer_state.json"));
  CHECK(state["refilled"].get<int64_t>() > 0);
}

TEST_CASE("dynamic sampling with eta 2 and weights every 2nd step, killed and resumed, ends where an uninterrupted run ends") {
  auto format = fixtures() / "arithmetic" / "format.jsonl";
  check_resume("tiny_arithmetic_grpo", "train.jsonl",
               "trainer.sft_warmup.path=" + shell_quote(format.string()) +
                   " trainer.dynamic_sampling=true generator.group_size=4 async.max_staleness=2 async.sync_every=2"
                   " run.checkpoint_every=4",
               30, {"model.safetensors"}, {"loss", "reward/mean", "rollouts/filtered", "dynamic_sampling/rounds"},
               "_dynamic_sync2");
  auto state = nlohmann::json::parse(std::ifstream(fixtures() / "resume_tiny_arithmetic_grpo_dynamic_sync2_killed" /
                                                   "checkpoints" / "step_28" / "trainer_state.json"));
  CHECK(state["rollout_batches"] == nlohmann::json::array({28, 29}));
  CHECK(state["refilled"].get<int64_t>() > 0);
}

TEST_CASE("async ppo killed and resumed: the value head and its optimizer state come back too") {
  auto format = fixtures() / "arithmetic" / "format.jsonl";
  check_resume("tiny_arithmetic_ppo", "train.jsonl", "trainer.sft_warmup.path=" + shell_quote(format.string()), 30,
               {"model.safetensors", "value_head.safetensors"}, {"loss", "reward/mean", "value_loss", "explained_variance"});
}

TEST_CASE("resuming from a checkpoint of another recipe or model is an error naming the file") {
  auto task = fixtures() / "arithmetic";
  auto dir = fixtures() / "resume_tiny_arithmetic_sft_straight";  // left by the first case
  REQUIRE(fs::exists(dir / "checkpoints" / "step_40" / "trainer_state.json"));
  auto r = run_command(troupe_run("tiny_arithmetic_dpo", "model.path=" + shell_quote((task / "model").string()) +
                                                            " data.train.path=" + shell_quote((task / "prefs.jsonl").string()) +
                                                            " run.dir=" + shell_quote((fixtures() / "resume_wrong").string()) +
                                                            " resume=" + shell_quote(dir.string())) + " 2>&1");
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.out.find("step_40/trainer_state.json: the checkpoint is from recipe sft") != std::string::npos, r.out);
  r = run_command(troupe_run("tiny_arithmetic_sft", "model.path=" + shell_quote((fixtures() / "hf_models" / "llama3").string()) +
                                                        " data.train.path=" + shell_quote((task / "train.jsonl").string()) +
                                                        " data.eval=null run.dir=" + shell_quote((fixtures() / "resume_wrong").string()) +
                                                        " resume=" + shell_quote(dir.string())) + " 2>&1");
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.out.find("the checkpoint trained") != std::string::npos, r.out);
  r = run_command(troupe_run("tiny_arithmetic_grpo", "model.path=" + shell_quote((task / "model").string()) +
                                                         " data.train.path=" + shell_quote((task / "train.jsonl").string()) +
                                                         " trainer.sft_warmup.path=" + shell_quote((task / "format.jsonl").string()) +
                                                         " run.dir=" + shell_quote((fixtures() / "resume_wrong").string()) +
                                                         " resume=" + shell_quote(dir.string())) + " 2>&1");
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.out.find("step_40/trainer_state.json: the checkpoint is from recipe sft, this config runs grpo") !=
                    std::string::npos, r.out);
}
