// The actor graph across processes, through the binary: with cluster.generator_processes = 2
// the generators run in two `troupe worker` processes, connected over CAF's network layer on
// loopback, and the run ends bit-identical (final weights, every metric but timings) to the same
// run with both generators in-process; for grpo, ppo and online_dpo. A worker of another build
// and random bytes on the controller's port are refused, and the run goes on. The smallest
// recipe, reinforce (one file and one registry line), learns the tiny task.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "tests/actors/run_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::test;

namespace {

// A command line bounded in time: a hang fails the test instead of stalling it.
std::string bounded(int seconds, const std::string& command) {
  return "timeout " + std::to_string(seconds) + " sh -c " + shell_quote(command);
}

std::string task_args(int64_t steps) {
  auto task = fixtures() / "arithmetic";
  return "model.path=" + shell_quote((task / "model").string()) + " data.train.path=" +
         shell_quote((task / "train.jsonl").string()) + " trainer.steps=" + std::to_string(steps) +
         " run.deterministic=true async.max_staleness=1 generator.threads=1 trainer.threads=1";
}

// Every metric of every step, without the timings (and the figures derived from them) and
// the controller's bookkeeping of which generator got how many prompts when.
bool is_timing(const std::string& key) {
  return key.rfind("time/", 0) == 0 || key == "tokens_per_s" || key.rfind("generators/", 0) == 0;
}

void check_same_run(const fs::path& a, const fs::path& b, int64_t steps) {
  auto ma = metrics(a), mb = metrics(b);
  REQUIRE(ma.size() == static_cast<size_t>(steps));
  REQUIRE(mb.size() == static_cast<size_t>(steps));
  int64_t compared = 0;
  for (size_t i = 0; i < ma.size(); ++i) {
    for (const auto& [key, value] : ma[i].items()) {
      if (is_timing(key)) continue;
      CAPTURE(i);
      CAPTURE(key);
      REQUIRE(mb[i].contains(key));
      CHECK(mb[i][key] == value);  // JSON equality: doubles bit for bit
      ++compared;
    }
    CHECK(mb[i].size() == ma[i].size());
  }
  auto last = "step_" + std::to_string(steps);
  double diff = max_diff(a / "checkpoints" / last / "model.safetensors", b / "checkpoints" / last / "model.safetensors");
  MESSAGE(a.filename().string() << " vs " << b.filename().string() << ": " << compared
                                << " metric values compared, max |weight diff| " << diff);
  CHECK(diff == 0);
}

void check_placement(const std::string& config, int64_t steps) {
  auto in_process = fixtures() / ("cluster_" + config + "_in_process");
  auto workers = fixtures() / ("cluster_" + config + "_workers");
  fs::remove_all(in_process);
  fs::remove_all(workers);
  auto r = run_command(bounded(600, troupe_run(config, task_args(steps) + " generator.count=2 run.dir=" +
                                                             shell_quote(in_process.string()))) + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  auto w = run_command(bounded(600, troupe_run(config, task_args(steps) + " cluster.generator_processes=2 run.dir=" +
                                                             shell_quote(workers.string()))) + " 2>&1");
  INFO(w.out);
  REQUIRE(w.status == 0);
  CHECK(w.out.find("generator 0 joined from another process") != std::string::npos);
  CHECK(w.out.find("generator 1 joined from another process") != std::string::npos);
  check_same_run(in_process, workers, steps);
}

// A background `troupe run`, its output in a file; the port its controller listens on.
struct Background {
  pid_t pid = -1;
  fs::path log;
  int port = -1;
};

Background start_run(const std::string& config, const std::string& args, const fs::path& log) {
  Background b{-1, log};
  fs::remove(log);
  b.pid = fork();
  REQUIRE(b.pid >= 0);
  if (b.pid == 0) {
    std::string cmd = bounded(600, troupe_run(config, args)) + " > " + shell_quote(log.string()) + " 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const std::regex listening("generator workers join at 127\\.0\\.0\\.1:([0-9]+)");
  for (int i = 0; i < 6000 && b.port < 0; ++i) {  // 60 s at most
    std::ifstream in(log);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::smatch m;
    if (std::regex_search(text, m, listening)) b.port = std::stoi(m[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(b.port > 0);
  return b;
}

int wait_for(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Waits (60 s at most) until DIR/metrics.jsonl has `steps` lines.
void wait_for_steps(const fs::path& dir, size_t steps) {
  for (int i = 0; i < 6000 && metrics(dir).size() < steps; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(metrics(dir).size() >= steps);
}

// The pids of the worker processes whose generators joined, from the run's log.
std::vector<pid_t> worker_pids(const fs::path& log) {
  const std::regex joined("generator [0-9]+ joined \\(pid ([0-9]+)\\)");
  auto text = read_file(log);
  std::vector<pid_t> out;
  for (std::sregex_iterator it(text.begin(), text.end(), joined), end; it != end; ++it) out.push_back(std::stoi((*it)[1]));
  return out;
}

bool gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = s.rfind(')');
  return close == std::string::npos || s.substr(close + 2, 1) == "Z";  // a zombie has exited
}

// Every step trained a full batch (trained + failed = batch_groups: each ticket once, none lost,
// none doubled), kept the staleness bound, and advanced the version by one.
void check_steps(const std::vector<nlohmann::json>& m, int64_t batch_groups, int64_t eta) {
  for (size_t i = 0; i < m.size(); ++i) {
    CAPTURE(i);
    CHECK(m[i]["step"].get<size_t>() == i + 1);
    CHECK(m[i]["rollouts/trained"].get<int64_t>() + m[i]["rollouts/failed"].get<int64_t>() == batch_groups);
    CHECK(m[i]["staleness/max"].get<int64_t>() <= eta);
    CHECK(m[i]["policy_version"].get<size_t>() == i + 1);
  }
}

}  // namespace

TEST_CASE("grpo: generators in two worker processes end bit-identical to two in-process generators") {
  check_placement("tiny_arithmetic_grpo", 12);
}

TEST_CASE("ppo: the same across processes") { check_placement("tiny_arithmetic_ppo", 8); }

TEST_CASE("online_dpo: the same across processes") { check_placement("tiny_arithmetic_online_dpo", 8); }

TEST_CASE("a worker of another troupe build and random bytes on the port are refused; the run goes on") {
  auto dir = fixtures() / "cluster_refusals";
  fs::remove_all(dir);
  // Enough steps that the run is still going while the intruders knock.
  auto run = start_run("tiny_arithmetic_grpo", task_args(60) + " cluster.generator_processes=1 run.dir=" +
                                                   shell_quote(dir.string()),
                       fixtures() / "cluster_refusals.log");
  // Random bytes: the controller's network layer drops the connection.
  std::mt19937 rng(7);
  for (int k = 0; k < 20; ++k) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(run.port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      std::vector<char> junk(1 + rng() % 200);
      for (auto& c : junk) c = static_cast<char>(rng());
      (void)!write(fd, junk.data(), junk.size());
    }
    close(fd);
  }
  // A worker of another build: refused at CAF's handshake, with a line that says so.
  auto other = run_command("export TROUPE_APP_ID=troupe-0.0.0-other; timeout 60 " +
                           shell_quote(env_dir("TROUPE_BIN").string()) + " worker --connect 127.0.0.1:" +
                           std::to_string(run.port) + " --timeout 5 2>&1");
  INFO(other.out);
  CHECK(other.status == 1);
  CHECK(other.out.find("cannot join the run at 127.0.0.1:" + std::to_string(run.port)) != std::string::npos);
  CHECK(other.out.find("another troupe build") != std::string::npos);
  int status = wait_for(run.pid);
  auto log = read_file(run.log);
  INFO(log);
  CHECK(status == 0);
  CHECK(metrics(dir).size() == 60);
}

TEST_CASE("reinforce, the smallest recipe, learns the tiny task") {
  auto dir = fixtures() / "cluster_reinforce";
  fs::remove_all(dir);
  auto task = fixtures() / "arithmetic";
  auto r = run_command(bounded(900, troupe_run("tiny_arithmetic_grpo", "recipe=reinforce model.path=" +
                                                              shell_quote((task / "model").string()) + " data.train.path=" +
                                                              shell_quote((task / "train.jsonl").string()) +
                                                              " trainer.steps=120 run.dir=" + shell_quote(dir.string()))) +
                       " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  auto m = metrics(dir);
  REQUIRE(m.size() == 120);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += m[i]["reward/mean"].get<double>() / 10;
  for (int i = 110; i < 120; ++i) last += m[i]["reward/mean"].get<double>() / 10;
  MESSAGE("reinforce: reward/mean first 10 steps " << first << ", last 10 " << last);
  CHECK(last > first + 0.3);
}

TEST_CASE("a generator worker killed with SIGKILL at 5 different steps: every run finishes, nothing lost or doubled") {
  // Kills in steps 2..12 of 26, so the replacement (a new process loading its model) has time to join.
  const int64_t steps = 26;
  std::mt19937 rng(std::random_device{}());
  std::set<int64_t> kill_steps;
  while (kill_steps.size() < 5) kill_steps.insert(2 + static_cast<int64_t>(rng() % 11));
  for (int64_t kill_at : kill_steps) {
    CAPTURE(kill_at);
    auto dir = fixtures() / ("cluster_kill_" + std::to_string(kill_at));
    fs::remove_all(dir);
    auto log = fixtures() / ("cluster_kill_" + std::to_string(kill_at) + ".log");
    auto run = start_run("tiny_arithmetic_grpo", task_args(steps) + " cluster.generator_processes=2 run.dir=" +
                                                     shell_quote(dir.string()),
                         log);
    wait_for_steps(dir, kill_at);
    auto pids = worker_pids(log);
    REQUIRE(pids.size() == 2);
    const pid_t victim = pids[rng() % 2];
    REQUIRE(::kill(victim, SIGKILL) == 0);
    int status = wait_for(run.pid);
    auto text = read_file(log);
    INFO(text);
    REQUIRE(status == 0);
    auto m = metrics(dir);
    REQUIRE(m.size() == static_cast<size_t>(steps));
    check_steps(m, 16, 1);
    CHECK(text.find("went away") != std::string::npos);
    // The replacement joined and was sent the weights current at that point, not version 0.
    const std::regex rejoined("generator [0-9]+ joined from another process \\([0-9]+ live, sent weights v([0-9]+)\\)");
    int64_t joins = 0, newest = -1;
    for (std::sregex_iterator it(text.begin(), text.end(), rejoined), end; it != end; ++it, ++joins)
      newest = std::max<int64_t>(newest, std::stoll((*it)[1]));
    CHECK(joins == 3);
    CHECK(newest >= kill_at);
    MESSAGE("killed worker " << victim << " after step " << kill_at << "; the replacement joined at weights v" << newest);
  }
}

TEST_CASE("elastic: a worker that joins mid-run takes prompts within a step; it leaves when the run ends") {
  auto dir = fixtures() / "cluster_elastic";
  fs::remove_all(dir);
  auto run = start_run("tiny_arithmetic_grpo", task_args(60) + " cluster.generator_processes=1 run.dir=" +
                                                   shell_quote(dir.string()),
                       fixtures() / "cluster_elastic.log");
  wait_for_steps(dir, 3);
  auto extra_log = fixtures() / "cluster_elastic_extra.log";
  auto extra = run_command("(" + bounded(600, shell_quote(env_dir("TROUPE_BIN").string()) + " worker --connect 127.0.0.1:" +
                                                  std::to_string(run.port)) +
                           " > " + shell_quote(extra_log.string()) + " 2>&1; echo $? >> " +
                           shell_quote(extra_log.string()) + ") & echo started");
  REQUIRE(extra.status == 0);
  CHECK(wait_for(run.pid) == 0);
  auto text = read_file(run.log);
  INFO(text);
  CHECK(text.find("generator 1 joined from another process (2 live") != std::string::npos);
  auto m = metrics(dir);
  REQUIRE(m.size() == 60);
  check_steps(m, 16, 1);
  // The first step that reports two live generators, and the prompts each got per step.
  size_t joined_at = m.size();
  for (size_t i = 0; i < m.size() && joined_at == m.size(); ++i)
    if (m[i]["generators/live"].get<int64_t>() == 2) joined_at = i;
  REQUIRE(joined_at < m.size());
  int64_t taken = 0;
  for (size_t i = joined_at; i < std::min(m.size(), joined_at + 2); ++i)
    if (m[i]["generators/prompts"].size() > 1) taken += m[i]["generators/prompts"][1].get<int64_t>();
  MESSAGE("the extra worker joined before step " << joined_at + 1 << " and took " << taken << " prompts in the next two steps");
  CHECK(taken > 0);
  // The extra worker's exit status is the last line of its log once it has exited (20 s at most).
  const std::regex exited("\\n([0-9]+)\\n$");
  std::smatch status;
  std::string out;
  for (int i = 0; i < 1000; ++i) {
    out = read_file(extra_log);
    if (std::regex_search(out, status, exited)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  INFO(out);
  CHECK(out.find("joined") != std::string::npos);
  REQUIRE(std::regex_search(out, status, exited));
  CHECK(status[1] == "0");  // the extra worker exited cleanly with the run
}

TEST_CASE("the controller killed with SIGKILL: its workers exit, and resume= continues the run") {
  auto dir = fixtures() / "cluster_controller_killed";
  fs::remove_all(dir);
  const std::string args = task_args(16) + " run.checkpoint_every=2 cluster.generator_processes=2 run.dir=" +
                           shell_quote(dir.string());
  auto run = start_run("tiny_arithmetic_grpo", args, fixtures() / "cluster_controller_killed.log");
  wait_for_steps(dir, 5);
  auto pids = worker_pids(run.log);
  REQUIRE(pids.size() == 2);
  // The workers' parent is the troupe run process itself.
  std::ifstream stat("/proc/" + std::to_string(pids[0]) + "/stat");
  std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  std::istringstream fields(s.substr(s.rfind(')') + 2));
  std::string state;
  pid_t controller = 0;
  fields >> state >> controller;
  REQUIRE(controller > 1);
  REQUIRE(::kill(controller, SIGKILL) == 0);
  wait_for(run.pid);
  for (int i = 0; i < 1500 && !(gone(pids[0]) && gone(pids[1])); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(gone(pids[0]));
  CHECK(gone(pids[1]));
  auto done = metrics(dir).size();
  REQUIRE(done < 16);
  auto r = run_command(bounded(600, troupe_run("tiny_arithmetic_grpo", args + " resume=" + shell_quote(dir.string()))) + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("resumed from") != std::string::npos);
  auto m = metrics(dir);
  REQUIRE(m.size() == 16);
  check_steps(m, 16, 1);
  MESSAGE("controller killed after " << done << " steps; both workers exited; resumed to step 16");
  // And it ends where a run that was never interrupted ends: same prompts, same weights.
  auto straight = fixtures() / "cluster_controller_straight";
  fs::remove_all(straight);
  auto again = run_command(bounded(600, troupe_run("tiny_arithmetic_grpo", task_args(16) + " run.checkpoint_every=2 " +
                                                                          "cluster.generator_processes=2 run.dir=" +
                                                                          shell_quote(straight.string()))) + " 2>&1");
  INFO(again.out);
  REQUIRE(again.status == 0);
  check_same_run(straight, dir, 16);
}
