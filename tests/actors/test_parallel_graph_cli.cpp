// Trainer ranks in the RL actor graph, through the troupe binary: rank 0 runs the graph and
// trains its share of each batch, the other ranks follow it over c10d (Gloo on CPU). On the same
// rollouts, grpo at 2 ranks (none, zero3, and with LoRA) and at 4 (zero3), online_dpo (zero1)
// and ppo (zero2) at 2, torchrun's job, and a 2-rank job killed mid-way and resumed at 3 ranks
// end where one trainer ends (weights to kWeights, metrics to 1e-5). Tiny model, deterministic
// runs, one thread per rank.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/actors/cluster_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::test;

namespace {

// float32 weights after a dozen AdamW steps at lr 1e-3. Adam divides each gradient by the root of
// its running square, so where a gradient is near zero, rounding in another order (a rank's
// rows against the whole batch's) moves that weight by up to lr x its share of steps: measured
// 1.1e-6 (ppo 2.8e-6) on an AVX2 machine, 1.3e-5 (ppo 1.6e-5) on an AVX-512 one with AMX.
// In float64 the ranks follow one trainer to 1e-10 (test_parallel_cli): the gap is rounding.
constexpr double kWeights = 5e-5;

fs::path run_dir(const std::string& name) { return fixtures() / ("parallel_graph_" + name); }

void run_ok(const std::string& config, int64_t steps, const std::string& name, const std::string& args) {
  fs::remove_all(run_dir(name));
  auto res = run_command(bounded(600, troupe_run(config, task_args(steps) + " " + args + " run.dir=" +
                                                             shell_quote(run_dir(name).string()))) + " 2>&1");
  INFO(res.out);
  REQUIRE(res.status == 0);
}

fs::path last_weights(const std::string& name, int64_t steps) {
  return run_dir(name) / "checkpoints" / ("step_" + std::to_string(steps)) / "model.safetensors";
}

// The same rollouts (rewards and token counts equal: no sampled token came out otherwise),
// and how far the trained figures and the final weights are from the other run's.
struct Agreement {
  double weights = 0, metrics = 0;
};

Agreement compare(const std::string& a, const std::string& b, int64_t steps, const std::vector<std::string>& keys) {
  auto ma = metrics(run_dir(a)), mb = metrics(run_dir(b));
  REQUIRE(ma.size() == static_cast<size_t>(steps));
  REQUIRE(mb.size() == static_cast<size_t>(steps));
  Agreement out;
  for (size_t i = 0; i < ma.size(); ++i) {
    CAPTURE(i);
    REQUIRE(ma[i].contains("reward/mean"));
    REQUIRE(mb[i].contains("reward/mean"));
    CHECK(ma[i]["reward/mean"] == mb[i]["reward/mean"]);
    CHECK(ma[i]["completion_tokens"] == mb[i]["completion_tokens"]);
    CHECK(ma[i]["policy_version"] == mb[i]["policy_version"]);
    for (const auto& k : keys) {
      CAPTURE(k);
      REQUIRE(ma[i][k].is_number());
      REQUIRE(mb[i][k].is_number());
      out.metrics = std::max(out.metrics, std::fabs(ma[i][k].get<double>() - mb[i][k].get<double>()));
    }
  }
  out.weights = max_diff(last_weights(a, steps), last_weights(b, steps));
  return out;
}

// `config` run by one trainer (NAME_1) and at trainer ranks (NAME_2, `ranks` added), both with
// `args`; how far apart they end.
Agreement against_one_trainer(const std::string& config, int64_t steps, const std::string& name, const std::string& args,
                              const std::string& ranks, const std::vector<std::string>& keys) {
  run_ok(config, steps, name + "_1", args);
  run_ok(config, steps, name + "_2", args + " " + ranks);
  return compare(name + "_1", name + "_2", steps, keys);
}

const std::vector<std::string> kGrpoKeys{"loss", "grad_norm", "kl", "clip_fraction", "behaviour_weight/mean"};

}  // namespace

// zero1 and zero2 run below (online_dpo, ppo, and here the killed job); sft covers every mode at
// 2 and 4 ranks, float64, and torchrun's environment (test_parallel_cli).
TEST_CASE("grpo at 2 ranks (none, zero3) and at 4 (zero3) ends where one trainer ends; so do torchrun's job, and a "
          "2-rank job killed mid-way and resumed at 3 ranks") {
  const int64_t steps = 12;
  run_ok("tiny_arithmetic_grpo", steps, "grpo_1", "");
  // At 4 ranks with the prefetch on (auto leaves it off with Gloo), so it runs in the graph too.
  struct Layout {
    int ranks;
    std::string mode, extra;
  };
  for (const auto& [ranks, mode, extra] :
       {Layout{2, "none", ""}, Layout{2, "zero3", ""}, Layout{4, "zero3", " parallel.prefetch=always"}}) {
    const std::string name = "grpo_" + std::to_string(ranks) + "_" + mode;
    run_ok("tiny_arithmetic_grpo", steps, name,
           "parallel.trainer_ranks=" + std::to_string(ranks) + " parallel.sharding=" + mode + extra);
    auto d = compare("grpo_1", name, steps, kGrpoKeys);
    MESSAGE("grpo at " << ranks << " ranks, " << mode << ": max |weight diff| " << d.weights << ", max |metric diff| " << d.metrics);
    CHECK(d.weights < kWeights);
    CHECK(d.metrics < 1e-5);
  }
  // The same graph under torchrun's agent (RANK, WORLD_SIZE, its own store): rank 0 runs it.
  auto torchrun = source() / ".venv" / "bin" / "torchrun";
  REQUIRE_MESSAGE(fs::exists(torchrun), torchrun.string() << " is missing: make setup installs torch");
  fs::remove_all(run_dir("torchrun"));
  std::string cmd = "cd " + shell_quote(source().string()) + " && OMP_NUM_THREADS=1 timeout 300 " +
                    shell_quote(torchrun.string()) + " --no-python --nproc-per-node 2 --master-port " +
                    std::to_string(free_port()) + " " + shell_quote(env_dir("TROUPE_BIN").string()) +
                    " run configs/tiny_arithmetic_grpo.yaml " + task_args(steps) +
                    " parallel.sharding=zero3 run.dir=" + shell_quote(run_dir("torchrun").string()) + " 2>&1";
  auto res = run_command(cmd);
  REQUIRE_MESSAGE(res.status == 0, res.out);
  CHECK_MESSAGE(res.out.find("2 trainer ranks (torchrun, gloo)") != std::string::npos, res.out);
  CHECK(max_diff(last_weights("grpo_2_zero3", steps), last_weights("torchrun", steps)) == 0.0);

  // A job of 2 ranks (zero2) SIGKILLed mid-way resumes at 3 ranks (zero3), ending where one
  // trainer ends.
  const std::string args = "parallel.trainer_ranks=2 parallel.sharding=zero2 run.checkpoint_every=4";
  std::mt19937 rng(std::random_device{}());
  const size_t kill_at = 5 + rng() % 6;
  const auto dir = run_dir("killed");
  fs::remove_all(dir);
  const pid_t job = fork();
  REQUIRE(job >= 0);
  if (job == 0) {  // sh execs the launcher itself, so the SIGKILL below reaches it (its ranks follow)
    std::string line = troupe_run("tiny_arithmetic_grpo", task_args(steps) + " " + args + " run.dir=" + shell_quote(dir.string())) +
                       " > " + shell_quote((fixtures() / "parallel_graph_killed.log").string()) + " 2>&1";
    execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  struct KillOnExit {  // the job ends with this scope, even when the wait below fails
    pid_t pid;
    ~KillOnExit() {
      if (pid > 0 && kill(pid, SIGKILL) == 0) waitpid(pid, nullptr, 0);
    }
  } guard{job};
  wait_for_steps(dir, kill_at);
  kill(job, SIGKILL);
  wait_for(job);
  guard.pid = -1;  // reaped
  const auto killed_after = metrics(dir).size();
  REQUIRE(killed_after < static_cast<size_t>(steps));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the ranks' own ends (PR_SET_PDEATHSIG)
  res = run_command(bounded(600, troupe_run("tiny_arithmetic_grpo",
                                            task_args(steps) + " parallel.trainer_ranks=3 parallel.sharding=zero3"
                                                               " run.checkpoint_every=4 run.dir=" + shell_quote(dir.string()) +
                                                               " resume=" + shell_quote(dir.string()))) +
                    " 2>&1");
  REQUIRE_MESSAGE(res.status == 0, res.out);
  CHECK_MESSAGE(res.out.find("resumed from") != std::string::npos, res.out);
  const auto d = compare("grpo_1", "killed", steps, kGrpoKeys);
  MESSAGE("killed after " << killed_after << " steps, resumed at 3 ranks (zero3): max |weight diff| " << d.weights
                          << ", max |metric diff| " << d.metrics);
  CHECK(d.weights < kWeights);
  CHECK(d.metrics < 1e-5);
}

TEST_CASE("grpo with LoRA at 2 ranks (zero3): only the adapters are reduced and sharded, the same adapter as one trainer") {
  const int64_t steps = 8;
  auto d = against_one_trainer("tiny_arithmetic_grpo", steps, "lora", "lora.rank=8 lora.alpha=16",
                               "parallel.trainer_ranks=2 parallel.sharding=zero3", kGrpoKeys);
  const auto adapter = [&](const std::string& name) {
    return run_dir(name) / "checkpoints" / ("step_" + std::to_string(steps)) / "adapter" / "adapter_model.safetensors";
  };
  const double a = max_diff(adapter("lora_1"), adapter("lora_2"));
  MESSAGE("grpo with LoRA at 2 ranks, zero3: max |adapter diff| " << a << ", merged weights " << d.weights
                                                                  << ", max |metric diff| " << d.metrics);
  CHECK(a < 1e-5);
  CHECK(d.weights < kWeights);
  CHECK(d.metrics < 1e-5);
}

TEST_CASE("online_dpo at 2 ranks (zero1) ends where one trainer ends: each rank trains its share of the pairs") {
  const int64_t steps = 8;
  auto d = against_one_trainer("tiny_arithmetic_online_dpo", steps, "odpo", "", "parallel.trainer_ranks=2 parallel.sharding=zero1",
                               {"loss", "grad_norm", "rewards/margins", "rewards/accuracies"});
  MESSAGE("online_dpo at 2 ranks, zero1: max |weight diff| " << d.weights << ", max |metric diff| " << d.metrics);
  CHECK(d.weights < kWeights);
  CHECK(d.metrics < 1e-5);
  CHECK(metrics(run_dir("odpo_1")).back()["pairs"] == metrics(run_dir("odpo_2")).back()["pairs"]);
}

TEST_CASE("ppo at 2 ranks (zero2), value head included, ends where one trainer ends") {
  const int64_t steps = 8;
  auto d = against_one_trainer("tiny_arithmetic_ppo", steps, "ppo", "", "parallel.trainer_ranks=2 parallel.sharding=zero2",
                               {"loss", "grad_norm", "value_loss", "explained_variance", "returns/mean"});
  const auto head = [&](const std::string& name) {
    return run_dir(name) / "checkpoints" / ("step_" + std::to_string(steps)) / "value_head.safetensors";
  };
  const double h = max_diff(head("ppo_1"), head("ppo_2"));
  MESSAGE("ppo at 2 ranks, zero2: max |weight diff| " << d.weights << ", value head " << h << ", max |metric diff| " << d.metrics);
  CHECK(d.weights < kWeights);
  CHECK(h < 1e-5);
  CHECK(d.metrics < 1e-5);
}

TEST_CASE("bad input: ppo with zero3, and more ranks than groups per batch, name the key") {
  auto res = run_command(bounded(120, troupe_run("tiny_arithmetic_ppo", task_args(2) + " parallel.trainer_ranks=2 parallel.sharding=zero3")) +
                         " 2>&1");
  CHECK(res.status != 0);
  CHECK_MESSAGE(res.out.find("parallel.sharding: recipe ppo takes none, zero1 or zero2") != std::string::npos, res.out);
  res = run_command(bounded(120, troupe_run("tiny_arithmetic_grpo", task_args(2) + " trainer.batch_groups=2 parallel.trainer_ranks=3")) +
                    " 2>&1");
  CHECK(res.status != 0);
  CHECK_MESSAGE(res.out.find("parallel.trainer_ranks: must be <= trainer.batch_groups = 2") != std::string::npos, res.out);
}
