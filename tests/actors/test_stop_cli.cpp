// Stopping a run, and model.dtype auto, through the troupe binary. A first Ctrl-C stops after
// the step in progress (with a checkpoint); a second one, or a SIGTERM, stops at once with
// 128 + the signal, leaving metrics.jsonl whole. auto is decided per CPU; TROUPE_CPU_BF16
// simulates either kind of CPU, so the same checks run on every machine.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/actors/run_util.hpp"

namespace fs = std::filesystem;
using namespace troupe::test;
using Clock = std::chrono::steady_clock;

namespace {

std::string task_args(const std::string& data) {
  auto task = fixtures() / "arithmetic";
  return "model.path=" + shell_quote((task / "model").string()) + " data.train.path=" + shell_quote((task / data).string());
}

// tiny_arithmetic_grpo's task, its format stage's data too: the config's own paths name the
// default build folder, which another build (make test-sanitize's) does not fill.
std::string graph_task_args() {
  return task_args("train.jsonl") + " trainer.sft_warmup.path=" + shell_quote((fixtures() / "arithmetic" / "format.jsonl").string());
}

std::string read(const fs::path& file) {
  std::ifstream in(file);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Running {
  pid_t pid = -1;
  fs::path dir, log;
};

// Starts `troupe run` in the background (output to dir.log) and waits until `steps` lines are in
// its metrics.jsonl (at most two minutes).
Running start(const std::string& config, const std::string& args, const std::string& name, int steps) {
  Running r{.dir = fixtures() / name, .log = fixtures() / (name + ".log")};
  fs::remove_all(r.dir);
  std::string cmd = troupe_run(config, args + " run.dir=" + shell_quote(r.dir.string())) + " > " +
                    shell_quote(r.log.string()) + " 2>&1";
  r.pid = fork();
  REQUIRE(r.pid >= 0);
  if (r.pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  auto until = Clock::now() + std::chrono::minutes(2);
  while (Clock::now() < until && static_cast<int>(steps_written(r.dir)) < steps)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (static_cast<int>(steps_written(r.dir)) < steps) {
    kill(r.pid, SIGKILL);
    waitpid(r.pid, nullptr, 0);
    FAIL("the run wrote fewer than " << steps << " steps in two minutes:\n" << read(r.log));
  }
  return r;
}

// The exit status once the process ends (-1: killed by a signal), waiting at most `limit`;
// a process still running then is killed and the check fails.
int wait_exit(const Running& r, std::chrono::milliseconds limit, double* seconds) {
  auto t0 = Clock::now();
  int status = 0;
  while (Clock::now() - t0 < limit) {
    if (waitpid(r.pid, &status, WNOHANG) == r.pid) {
      *seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(r.pid, SIGKILL);
  waitpid(r.pid, nullptr, 0);
  FAIL("the run did not stop within " << limit.count() << " ms:\n" << read(r.log));
  return -2;
}

}  // namespace

TEST_CASE("SIGTERM stops an actor-graph run at once, metrics intact") {
  auto r = start("tiny_arithmetic_grpo", graph_task_args() + " trainer.steps=100000 run.checkpoint_every=0", "stop_sigterm", 3);
  kill(r.pid, SIGTERM);
  double seconds = 0;
  int status = wait_exit(r, std::chrono::seconds(5), &seconds);
  MESSAGE("SIGTERM: exited " << status << " after " << seconds << " s");
  CHECK(status == 128 + SIGTERM);
  auto log = read(r.log);
  CHECK_MESSAGE(log.find("SIGTERM: stopping now") != std::string::npos, log);
  auto lines = metrics(r.dir);  // every line parses: nothing half-written
  CHECK(lines.size() >= 3);
  for (size_t i = 0; i < lines.size(); ++i) CHECK(lines[i]["step"] == static_cast<int64_t>(i + 1));
}

// Waits (at most a minute) until the run's output holds `text`.
bool wait_for_log(const Running& r, const std::string& text) {
  auto until = Clock::now() + std::chrono::minutes(1);
  while (Clock::now() < until) {
    if (read(r.log).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

TEST_CASE("a second Ctrl-C stops a trainer-alone run at once; the first asks for a stop after the step") {
  // SmolLM2-135M, 4 x 512 tokens a step: a step takes seconds, so "at once" is told apart
  // from "after the step" (which the first Ctrl-C asks for, and which would checkpoint).
  auto r = start("smollm2_gsm8k_sft",
                 "model.dtype=float32 data.eval=null trainer.batch_size=4 trainer.max_length=512 trainer.steps=1000",
                 "stop_sigint", 1);
  kill(r.pid, SIGINT);
  REQUIRE_MESSAGE(wait_for_log(r, "Ctrl-C: stopping after this step"), read(r.log));
  kill(r.pid, SIGINT);  // separately: two pending SIGINTs would merge into one
  double seconds = 0;
  int status = wait_exit(r, std::chrono::seconds(5), &seconds);
  MESSAGE("two SIGINTs: exited " << status << " after " << seconds << " s");
  CHECK(status == 128 + SIGINT);
  auto log = read(r.log);
  CHECK_MESSAGE(log.find("second Ctrl-C: stopping now") != std::string::npos, log);
  CHECK(metrics(r.dir).size() >= 1);
  CHECK_FALSE(fs::exists(r.dir / "checkpoints"));  // it did not wait for the step to end and checkpoint

  // One Ctrl-C alone: the step in progress ends, a checkpoint is written, and the run says so.
  r = start("tiny_arithmetic_sft", task_args("train.jsonl") + " data.eval=null trainer.steps=100000", "stop_sigint_once", 2);
  kill(r.pid, SIGINT);
  status = wait_exit(r, std::chrono::seconds(60), &seconds);
  CHECK(status == 1);
  log = read(r.log);
  CHECK_MESSAGE(log.find("stopped on request after step") != std::string::npos, log);
  auto steps = metrics(r.dir).size();
  CHECK(fs::exists(r.dir / "checkpoints" / ("step_" + std::to_string(steps)) / "trainer_state.json"));
}

TEST_CASE("one Ctrl-C stops an actor-graph run after the step in progress, with a checkpoint resume= continues") {
  const std::string args = graph_task_args() + " trainer.steps=100000 run.checkpoint_every=0";
  auto r = start("tiny_arithmetic_grpo", args, "stop_graph_sigint", 3);
  kill(r.pid, SIGINT);
  double seconds = 0;
  int status = wait_exit(r, std::chrono::seconds(60), &seconds);
  CHECK(status == 1);
  auto log = read(r.log);
  INFO(log);
  CHECK(log.find("stopped on request after step") != std::string::npos);
  // The trainer trained no step past the checkpoint's, and the checkpoint is complete.
  const auto steps = static_cast<int64_t>(metrics(r.dir).size());
  MESSAGE("one Ctrl-C: stopped after step " << steps << ", " << seconds << " s after the signal");
  const auto checkpoint = r.dir / "checkpoints" / ("step_" + std::to_string(steps));
  REQUIRE(fs::exists(checkpoint / "trainer_state.json"));
  auto resumed = run_command("timeout 300 sh -c " + shell_quote(troupe_run("tiny_arithmetic_grpo",
                                                                     graph_task_args() + " run.checkpoint_every=0" +
                                                                         " trainer.steps=" + std::to_string(steps + 2) +
                                                                         " run.dir=" + shell_quote(r.dir.string()) +
                                                                         " resume=" + shell_quote(r.dir.string()))) +
                             " 2>&1");
  INFO(resumed.out);
  CHECK(resumed.status == 0);
  CHECK(resumed.out.find("resumed from " + checkpoint.string()) != std::string::npos);
  CHECK(metrics(r.dir).size() == static_cast<size_t>(steps + 2));
}

TEST_CASE("model.dtype auto: float32 on a CPU without native bf16, bfloat16 on one with it") {
  auto run_dir = fixtures() / "dtype_auto";
  auto args = task_args("train.jsonl") + " data.eval=null trainer.steps=2 trainer.warmup_steps=0 run.dir=" + shell_quote(run_dir.string());
  fs::remove_all(run_dir);
  auto r = run_command("export TROUPE_CPU_BF16=0; " + troupe_run("tiny_arithmetic_sft", args + " model.dtype=auto") + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("model.dtype auto: float32 (bfloat16 is not native on this CPU: TROUPE_CPU_BF16=0") != std::string::npos);
  CHECK(read(run_dir / "config.yaml").find("  dtype: float32\n") != std::string::npos);  // what auto chose is recorded

  fs::remove_all(run_dir);
  r = run_command("export TROUPE_CPU_BF16=1; " + troupe_run("tiny_arithmetic_sft", args + " model.dtype=auto") + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("model.dtype auto: bfloat16 (this CPU computes it natively: TROUPE_CPU_BF16=1)") != std::string::npos);
  CHECK(read(run_dir / "config.yaml").find("  dtype: bfloat16\n") != std::string::npos);

  // oneDNN limited below bf16, as on an AVX2-only CPU: auto falls back whatever this CPU has.
  fs::remove_all(run_dir);
  r = run_command("export ONEDNN_MAX_CPU_ISA=AVX2; " + troupe_run("tiny_arithmetic_sft", args + " model.dtype=auto") + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("model.dtype auto: float32") != std::string::npos);

  // An explicit bfloat16 where it is emulated runs, with a warning on stderr.
  fs::remove_all(run_dir);
  r = run_command("export TROUPE_CPU_BF16=0; " + troupe_run("tiny_arithmetic_sft", args + " model.dtype=bfloat16") + " 2>&1 >/dev/null");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("warning: model.dtype bfloat16 is not native on this CPU") != std::string::npos);
}
