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

#include "tests/actors/cluster_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::test;

namespace {

// `workers_args`: more for the worker run (e.g. weights over HTTP instead of shared memory).
void check_placement(const std::string& config, int64_t steps, const std::string& workers_args = "") {
  auto in_process = fixtures() / ("cluster_" + config + "_in_process");
  auto workers = fixtures() / ("cluster_" + config + "_workers");
  fs::remove_all(in_process);
  fs::remove_all(workers);
  auto r = run_command(bounded(600, troupe_run(config, task_args(steps) + " generator.count=2 run.dir=" +
                                                             shell_quote(in_process.string()))) + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  auto w = run_command(bounded(600, troupe_run(config, task_args(steps) + workers_args + " cluster.generator_processes=2 run.dir=" +
                                                             shell_quote(workers.string()))) + " 2>&1");
  INFO(w.out);
  REQUIRE(w.status == 0);
  CHECK(w.out.find("generator 0 joined from another process") != std::string::npos);
  CHECK(w.out.find("generator 1 joined from another process") != std::string::npos);
  if (!workers_args.empty()) CHECK(w.out.find("takes weights over HTTP from http://127.0.0.1:") != std::string::npos);
  check_same_run(in_process, workers, steps);
}

}  // namespace

TEST_CASE("grpo: generators in two worker processes, weights over HTTP, end bit-identical to two in-process generators") {
  check_placement("tiny_arithmetic_grpo", 12, " cluster.weight_transport=http");
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
                                                              " trainer.sft_warmup.path=" +
                                                              shell_quote((task / "format.jsonl").string()) +
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

TEST_CASE("a generator worker killed with SIGKILL at 3 different steps: every run finishes, nothing lost or doubled") {
  // Kills in steps 2..12 of 26, so the replacement (a new process loading its model) has time to join.
  const int64_t steps = 26;
  std::mt19937 rng(std::random_device{}());
  std::set<int64_t> kill_steps;
  while (kill_steps.size() < 3) kill_steps.insert(2 + static_cast<int64_t>(rng() % 11));
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
