// Data-parallel training over c10d (Gloo on CPU), through the troupe binary: sft at 2 trainer
// ranks in every sharding mode and at 4 (zero2, zero3), lora at 2 (zero1) and dpo at 2 (zero2),
// both at 4 with zero3, end where one rank ends on the same global batch; one rank through the data-parallel path is bit for bit the plain trainer; torchrun
// starts the same job; a killed rank stops the job with an error naming it; a job killed mid-way
// resumes at 2 and at 3 ranks. Tiny model, float32, deterministic, one thread per rank.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "tests/actors/run_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::test;
using Clock = std::chrono::steady_clock;

namespace {

double max_metric_diff(const fs::path& a, const fs::path& b, const std::vector<std::string>& keys) {
  auto ma = metrics(a), mb = metrics(b);
  REQUIRE(ma.size() == mb.size());
  double worst = 0;
  for (size_t i = 0; i < ma.size(); ++i)
    for (const auto& k : keys) worst = std::max(worst, std::fabs(ma[i][k].get<double>() - mb[i][k].get<double>()));
  return worst;
}

struct Recipe {
  std::string config, data, extra;
  std::string weights;            // the file compared, inside the last checkpoint
  std::vector<std::string> keys;  // the metrics compared
};

const Recipe kSft{"tiny_arithmetic_sft", "train.jsonl", "data.eval=null", "model.safetensors", {"loss", "grad_norm"}};
// At the config's lr 1e-2, AdamW's normalised steps carry the ranks' different summation order
// (1e-7) up to 2e-5 in 20 steps; at 1e-3 the adapters agree to 2e-7. The comparison runs there.
const Recipe kLora{"tiny_arithmetic_lora", "train.jsonl", "data.eval=null trainer.lr=1.0e-3",
                   "adapter/adapter_model.safetensors", {"loss", "grad_norm"}};
const Recipe kDpo{"tiny_arithmetic_dpo", "prefs.jsonl", "", "model.safetensors", {"loss", "rewards/margins", "grad_norm"}};

std::string common(const Recipe& r, int steps) {
  auto task = fixtures() / "arithmetic";
  return "model.path=" + shell_quote((task / "model").string()) + " data.train.path=" + shell_quote((task / r.data).string()) +
         " trainer.steps=" + std::to_string(steps) + " trainer.warmup_steps=2 run.deterministic=true " + r.extra;
}

fs::path run_dir(const std::string& name) { return fixtures() / ("parallel_" + name); }

void run_ok(const Recipe& r, int steps, const std::string& name, const std::string& args, const std::string& env = "") {
  fs::remove_all(run_dir(name));
  auto res = run_command(env + troupe_run(r.config, common(r, steps) + " " + args + " run.dir=" +
                                                        shell_quote(run_dir(name).string())) + " 2>&1");
  INFO(res.out);
  REQUIRE(res.status == 0);
}

fs::path last_weights(const Recipe& r, const std::string& name, int steps) {
  return run_dir(name) / "checkpoints" / ("step_" + std::to_string(steps)) / r.weights;
}

// Rank counts and sharding modes: sft in every mode at 2 ranks and in the two that shard
// gradients (zero2, zero3) at 4; lora and dpo, whose data-parallel path differs from sft's only
// in what is reduced and how the loss is counted, in one mode at 2 ranks and zero3 at 4.
using Layouts = std::vector<std::pair<int, std::string>>;
const Layouts kSftLayouts{{2, "none"}, {2, "zero1"}, {2, "zero2"}, {2, "zero3"}, {4, "zero2"}, {4, "zero3"}};

void check_against_one_rank(const Recipe& r, const Layouts& layouts) {
  const int steps = 20;
  const std::string base = r.config + "_1";
  run_ok(r, steps, base, "");
  for (const auto& [ranks, mode] : layouts) {
    const std::string name = r.config + "_" + std::to_string(ranks) + "_" + mode;
    run_ok(r, steps, name, "parallel.trainer_ranks=" + std::to_string(ranks) + " parallel.sharding=" + mode);
    const double w = max_diff(last_weights(r, base, steps), last_weights(r, name, steps));
    const double m = max_metric_diff(run_dir(base), run_dir(name), r.keys);
    MESSAGE(r.config << " at " << ranks << " ranks, " << mode << ": max |weight diff| " << w << ", max |metric diff| " << m);
    CHECK(w <= 1e-5);
    CHECK(m <= 1e-5);
    if (ranks == 4 && mode == "zero3" && r.weights == "model.safetensors") {
      // The export is whole (gathered from every rank's shard) and transformers loads it.
      auto dir = last_weights(r, name, steps).parent_path();
      auto load = run_command(shell_quote((source() / ".venv" / "bin" / "python").string()) +
                              " -c 'import sys; from transformers import AutoModelForCausalLM; "
                              "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); print(\"params\", sum(p.numel() for p in m.parameters()))' " +
                              shell_quote(dir.string()) + " 2>&1");
      INFO(load.out);
      CHECK(load.status == 0);
      CHECK(load.out.find("params ") != std::string::npos);
    }
    auto last = metrics(run_dir(name)).back();
    REQUIRE(last.contains("memory/optimizer_bytes/per_rank"));
    CHECK(last["memory/optimizer_bytes/per_rank"].size() == static_cast<size_t>(ranks));
  }
}

}  // namespace

TEST_CASE("sft at 2 ranks in every sharding mode, and at 4 (zero2, zero3), ends where one rank ends") {
  check_against_one_rank(kSft, kSftLayouts);
}
TEST_CASE("lora at 2 and 4 ranks: only the adapters are reduced and sharded, same adapter as one rank") {
  check_against_one_rank(kLora, {{2, "zero1"}, {4, "zero3"}});
}
TEST_CASE("dpo at 2 and 4 ranks: the loss is a mean over every rank's pairs") { check_against_one_rank(kDpo, {{2, "zero2"}, {4, "zero3"}}); }

TEST_CASE("in float64, 2 ranks (none) and 4 (zero3) follow one rank's loss curve to 1e-10: the differences above are rounding") {
  const int steps = 20;
  run_ok(kSft, steps, "f64_1", "model.dtype=float64");
  for (const auto& [ranks, mode] : Layouts{{2, "none"}, {4, "zero3"}}) {
    const std::string name = "f64_" + std::to_string(ranks) + "_" + mode;
    run_ok(kSft, steps, name, "model.dtype=float64 parallel.trainer_ranks=" + std::to_string(ranks) + " parallel.sharding=" + mode);
    const double m = max_metric_diff(run_dir("f64_1"), run_dir(name), {"loss", "grad_norm"});
    MESSAGE("float64 sft at " << ranks << " ranks, " << mode << ": max |loss or grad-norm diff| over " << steps
                              << " steps " << m);
    CHECK(m <= 1e-10);
  }
}

TEST_CASE("one rank through the data-parallel path is bit for bit the plain trainer") {
  const int steps = 10;
  run_ok(kSft, steps, "plain", "");
  const std::string env = "export RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) + "; ";
  run_ok(kSft, steps, "world1", "", env);
  CHECK(max_diff(last_weights(kSft, "plain", steps), last_weights(kSft, "world1", steps)) == 0.0);
  CHECK(max_metric_diff(run_dir("plain"), run_dir("world1"), {"loss", "grad_norm"}) == 0.0);
  CHECK(fs::exists(run_dir("world1") / "checkpoints" / ("step_" + std::to_string(steps)) / "layout.json"));
}

TEST_CASE("zero3's prefetch of the next layer changes nothing: parallel.prefetch=always ends bit for bit as never") {
  const int steps = 10;
  run_ok(kSft, steps, "prefetch_on", "parallel.trainer_ranks=2 parallel.sharding=zero3 parallel.prefetch=always");
  run_ok(kSft, steps, "prefetch_off", "parallel.trainer_ranks=2 parallel.sharding=zero3 parallel.prefetch=never");
  CHECK(max_diff(last_weights(kSft, "prefetch_on", steps), last_weights(kSft, "prefetch_off", steps)) == 0.0);
  CHECK(max_metric_diff(run_dir("prefetch_on"), run_dir("prefetch_off"), {"loss", "grad_norm"}) == 0.0);
}

TEST_CASE("memory per rank at 4 ranks against one rank: zero2 shards gradients and optimizer, zero3 parameters too") {
  const int steps = 2;
  run_ok(kSft, steps, "memory_1", "parallel.sharding=none", "export RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                                                               std::to_string(free_port()) + "; ");
  auto one = metrics(run_dir("memory_1")).back();
  for (std::string mode : {"zero2", "zero3"}) {
    run_ok(kSft, steps, "memory_4_" + mode, "parallel.trainer_ranks=4 parallel.sharding=" + mode);
    auto four = metrics(run_dir("memory_4_" + mode)).back();
    for (std::string key : {"memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes"}) {
      for (const auto& b : four[key + "/per_rank"]) {
        const double ratio = b.get<double>() / one[key].get<double>();
        MESSAGE(mode << " " << key << " at 4 ranks: " << b.get<int64_t>() << " bytes, " << ratio << " x one rank's "
                     << one[key].get<int64_t>());
        if (mode == "zero2" && key == "memory/params_bytes") CHECK(ratio == doctest::Approx(1.0));  // whole parameters
        else if (mode == "zero2" && key == "memory/optimizer_bytes") CHECK(ratio <= 0.38);  // fp32 master + 2 moments, a quarter each
        else CHECK(ratio <= 0.3);
      }
    }
  }
}

TEST_CASE("torchrun --no-python starts the same job as parallel.trainer_ranks=2") {
  const int steps = 10;
  run_ok(kSft, steps, "launcher_troupe", "parallel.trainer_ranks=2 parallel.sharding=zero1");
  auto torchrun = source() / ".venv" / "bin" / "torchrun";
  REQUIRE_MESSAGE(fs::exists(torchrun), torchrun.string() << " is missing: make setup installs torch");
  fs::remove_all(run_dir("launcher_torchrun"));
  std::string cmd = "cd " + shell_quote(source().string()) + " && OMP_NUM_THREADS=1 timeout 300 " +
                    shell_quote(torchrun.string()) + " --no-python --nproc-per-node 2 --master-port " +
                    std::to_string(free_port()) + " " + shell_quote(env_dir("TROUPE_BIN").string()) +
                    " run configs/tiny_arithmetic_sft.yaml " + common(kSft, steps) +
                    " parallel.sharding=zero1 run.dir=" + shell_quote(run_dir("launcher_torchrun").string()) + " 2>&1";
  auto res = run_command(cmd);
  INFO(res.out);
  REQUIRE(res.status == 0);
  CHECK(res.out.find("2 trainer ranks (torchrun, gloo)") != std::string::npos);
  CHECK(max_diff(last_weights(kSft, "launcher_troupe", steps), last_weights(kSft, "launcher_torchrun", steps)) == 0.0);
}

// The launcher's children, from /proc: pid -> RANK.
std::map<pid_t, int> ranks_of(pid_t launcher) {
  std::map<pid_t, int> out;
  std::ifstream children("/proc/" + std::to_string(launcher) + "/task/" + std::to_string(launcher) + "/children");
  for (pid_t pid; children >> pid;) {
    std::ifstream env("/proc/" + std::to_string(pid) + "/environ");
    std::string all((std::istreambuf_iterator<char>(env)), std::istreambuf_iterator<char>());
    for (size_t at = 0; at < all.size();) {
      std::string var = all.c_str() + at;
      if (var.rfind("RANK=", 0) == 0) out[pid] = std::stoi(var.substr(5));
      at += var.size() + 1;
    }
  }
  return out;
}

pid_t start_background(const std::string& cmd, const fs::path& log) {
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::string line = cmd + " > " + shell_quote(log.string()) + " 2>&1";
    execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Waits at most `limit` for `job` to exit; a job still running then is killed (false).
bool wait_exit(pid_t job, std::chrono::seconds limit, int* status) {
  for (auto t0 = Clock::now(); Clock::now() - t0 < limit;) {
    if (waitpid(job, status, WNOHANG) == job) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(job, SIGKILL);
  waitpid(job, nullptr, 0);
  return false;
}

std::string read_log(const fs::path& log) {
  std::ifstream in(log);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool wait_steps(const fs::path& dir, size_t n) {
  auto until = Clock::now() + std::chrono::minutes(2);
  while (Clock::now() < until) {
    if (steps_written(dir) >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

TEST_CASE("a rank killed with SIGKILL stops the job within 60 s, naming the rank") {
  auto dir = run_dir("killed_rank");
  fs::remove_all(dir);
  auto log = fixtures() / "parallel_killed_rank.log";
  pid_t job = start_background(troupe_run("tiny_arithmetic_sft", common(kSft, 100000) +
                                                                    " parallel.trainer_ranks=2 run.dir=" + shell_quote(dir.string())),
                               log);
  REQUIRE(wait_steps(dir, 3));
  auto ranks = ranks_of(job);
  pid_t victim = 0;
  for (auto [pid, r] : ranks)
    if (r == 1) victim = pid;
  REQUIRE_MESSAGE(victim > 0, "rank 1 not found among the launcher's children");
  kill(victim, SIGKILL);
  auto t0 = Clock::now();
  int status = 0;
  const bool ended = wait_exit(job, std::chrono::seconds(60), &status);
  const std::string out = read_log(log);
  REQUIRE_MESSAGE(ended, out);
  MESSAGE("the job stopped " << std::chrono::duration<double>(Clock::now() - t0).count() << " s after rank 1 was killed");
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) != 0);
  CHECK_MESSAGE(out.find("trainer rank 1 of 2") != std::string::npos, out);
  CHECK_MESSAGE(out.find("killed by signal 9") != std::string::npos, out);
}

TEST_CASE("a rank that hangs (SIGSTOP) stops the job once parallel.timeout_s has passed") {
  auto dir = run_dir("hung_rank");
  fs::remove_all(dir);
  auto log = fixtures() / "parallel_hung_rank.log";
  pid_t job = start_background(troupe_run("tiny_arithmetic_sft", common(kSft, 100000) +
                                                                    " parallel.trainer_ranks=2 parallel.timeout_s=5 run.dir=" +
                                                                    shell_quote(dir.string())),
                               log);
  REQUIRE(wait_steps(dir, 3));
  pid_t victim = 0;
  for (auto [pid, r] : ranks_of(job))
    if (r == 1) victim = pid;
  REQUIRE(victim > 0);
  kill(victim, SIGSTOP);
  auto t0 = Clock::now();
  int status = 0;
  const bool ended = wait_exit(job, std::chrono::seconds(90), &status);
  kill(victim, SIGKILL);  // if it is still there
  const std::string out = read_log(log);
  REQUIRE_MESSAGE(ended, out);
  MESSAGE("the job stopped " << std::chrono::duration<double>(Clock::now() - t0).count() << " s after rank 1 hung");
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) != 0);
  CHECK_MESSAGE(out.find("trainer rank 0 of 2") != std::string::npos, out);       // the rank left waiting
  CHECK_MESSAGE(out.find("parallel.timeout_s = 5 s") != std::string::npos, out);  // and why it gave up
}

TEST_CASE("a job killed mid-way resumes at 2 ranks and at 3 ranks (as zero3), ending where an uninterrupted run ends") {
  const int steps = 30;
  const std::string args = "parallel.trainer_ranks=2 parallel.sharding=zero2 run.checkpoint_every=5";
  run_ok(kSft, steps, "resume_straight", args);
  std::mt19937 rng(std::random_device{}());
  const size_t kill_at = 6 + rng() % 18;
  auto dir = run_dir("resume_killed");
  fs::remove_all(dir);
  pid_t job = start_background(troupe_run("tiny_arithmetic_sft", common(kSft, steps) + " " + args + " run.dir=" +
                                                                    shell_quote(dir.string())),
                               fixtures() / "parallel_resume_killed.log");
  REQUIRE(wait_steps(dir, kill_at));
  kill(job, SIGKILL);  // the launcher: its ranks follow it (PR_SET_PDEATHSIG)
  waitpid(job, nullptr, 0);
  const auto killed_after = metrics(dir).size();
  REQUIRE(killed_after < static_cast<size_t>(steps));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  fs::remove_all(run_dir("resume_killed_3"));
  fs::copy(dir, run_dir("resume_killed_3"), fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  // At 3 ranks the zero2 checkpoint also changes mode: zero3 reshards parameters as well.
  for (auto [name, ranks, mode] : {std::tuple{std::string("resume_killed"), 2, std::string("zero2")},
                                   std::tuple{std::string("resume_killed_3"), 3, std::string("zero3")}}) {
    auto res = run_command(troupe_run("tiny_arithmetic_sft", common(kSft, steps) + " parallel.trainer_ranks=" +
                                                                 std::to_string(ranks) + " parallel.sharding=" + mode +
                                                                 " run.checkpoint_every=5 run.dir=" +
                                                                 shell_quote(run_dir(name).string()) + " resume=" +
                                                                 shell_quote(run_dir(name).string())) + " 2>&1");
    INFO(res.out);
    REQUIRE(res.status == 0);
    CHECK(res.out.find("resumed from") != std::string::npos);
    const double w = max_diff(last_weights(kSft, "resume_straight", steps), last_weights(kSft, name, steps));
    const double m = max_metric_diff(run_dir("resume_straight"), run_dir(name), {"loss"});
    MESSAGE("killed after " << killed_after << " steps, resumed at " << ranks << " ranks (" << mode << "): max |weight diff| " << w
                            << ", max |loss diff| " << m);
    CHECK(w <= 1e-5);
    CHECK(m <= 1e-5);
  }
}

TEST_CASE("bad input: a sharded checkpoint of another recipe, and more ranks than examples per batch") {
  // A sharded checkpoint of another recipe is named, not loaded.
  auto other = run_dir("tiny_arithmetic_sft_2_zero1") / "checkpoints" / "step_20";
  REQUIRE(fs::exists(other / "layout.json"));  // left by the first case
  auto res = run_command(troupe_run("tiny_arithmetic_lora", common(kLora, 20) + " parallel.trainer_ranks=2 run.dir=" +
                                                                shell_quote(run_dir("wrong_resume").string()) +
                                                                " resume=" + shell_quote(other.string())) + " 2>&1");
  CHECK(res.status != 0);
  CHECK_MESSAGE(res.out.find("the checkpoint is from recipe sft") != std::string::npos, res.out);
  res = run_command(troupe_run("tiny_arithmetic_sft", common(kSft, 2) + " trainer.batch_size=2 parallel.trainer_ranks=3") + " 2>&1");
  CHECK(res.status == 1);
  CHECK_MESSAGE(res.out.find("parallel.trainer_ranks: must be <= trainer.batch_size = 2") != std::string::npos, res.out);
}
