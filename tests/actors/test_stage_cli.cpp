// The reward and reference stages in their own processes, through the binary: with
// cluster.reward_processes and cluster.reference_processes the run ends bit-identical to the
// same run with both in-process; a reward process killed with SIGKILL at 5 different steps costs
// nothing (the groups it held are scored again by its replacement), and with
// cluster.lost_groups=fail exactly the groups a hung reward process held fail, and it is replaced.
#include <doctest/doctest.h>

#include <random>
#include <set>

#include "tests/actors/cluster_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::test;

namespace {

// The pids of the reward workers that joined, in order, from the run's log.
std::vector<pid_t> reward_pids(const fs::path& log) {
  const std::regex joined("reward joined \\(pid ([0-9]+)\\)");
  auto text = read_file(log);
  std::vector<pid_t> out;
  for (std::sregex_iterator it(text.begin(), text.end(), joined), end; it != end; ++it) out.push_back(std::stoi((*it)[1]));
  return out;
}

// Waits (60 s at most) until `n` reward workers have joined; returns the newest one's pid.
pid_t wait_for_reward_worker(const fs::path& log, size_t n) {
  for (int i = 0; i < 6000 && reward_pids(log).size() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  auto pids = reward_pids(log);
  REQUIRE(pids.size() >= n);
  return pids.back();
}

int64_t count(const std::string& text, const std::string& what) {
  int64_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("grpo with a KL term: reward and reference in worker processes end bit-identical to both in-process") {
  const std::string args = task_args(8) + " trainer.loss.beta=0.05";
  auto in_process = fixtures() / "stage_in_process";
  auto workers = fixtures() / "stage_workers";
  fs::remove_all(in_process);
  fs::remove_all(workers);
  auto r = run_command(bounded(600, troupe_run("tiny_arithmetic_grpo", args + " run.dir=" + shell_quote(in_process.string()))) +
                       " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  auto w = run_command(bounded(600, troupe_run("tiny_arithmetic_grpo", args + " cluster.reward_processes=1 "
                                                                             "cluster.reference_processes=1 run.dir=" +
                                                                             shell_quote(workers.string()))) +
                       " 2>&1");
  INFO(w.out);
  REQUIRE(w.status == 0);
  CHECK(w.out.find("reward worker 0 joined from another process") != std::string::npos);
  CHECK(w.out.find("reference worker 0 joined from another process") != std::string::npos);
  // The KL term is live: the reference's log-probs differ from the policy's once it has moved.
  CHECK(metrics(workers).back()["kl"].get<double>() > 0);
  check_same_run(in_process, workers, 8);
}

TEST_CASE("the reward process killed with SIGKILL at 5 different steps: the run finishes, nothing lost or doubled") {
  const int64_t steps = 30;
  std::mt19937 rng(std::random_device{}());
  // Five steps in 2..25, at least 3 apart, so each replacement has joined before the next kill.
  std::set<int64_t> kill_steps;
  while (kill_steps.size() < 5) {
    kill_steps.clear();
    for (int64_t s = 2 + rng() % 3; s <= 25 && kill_steps.size() < 5; s += 3 + rng() % 3) kill_steps.insert(s);
  }
  auto dir = fixtures() / "stage_reward_kills";
  fs::remove_all(dir);
  auto run = start_run("tiny_arithmetic_grpo", task_args(steps) + " cluster.reward_processes=1 cluster.restarts=5 run.dir=" +
                                                   shell_quote(dir.string()),
                       fixtures() / "stage_reward_kills.log");
  size_t joined = 1;
  std::string killed;
  for (int64_t kill_at : kill_steps) {
    wait_for_steps(dir, kill_at);
    const pid_t victim = wait_for_reward_worker(run.log, joined);
    REQUIRE(::kill(victim, SIGKILL) == 0);
    killed += " " + std::to_string(kill_at);
    ++joined;
  }
  int status = wait_for(run.pid);
  auto text = read_file(run.log);
  INFO(text);
  REQUIRE(status == 0);
  auto m = metrics(dir);
  REQUIRE(m.size() == static_cast<size_t>(steps));
  check_steps(m, 16, 1);
  int64_t failed = 0;
  for (const auto& s : m) failed += s["rollouts/failed"].get<int64_t>();
  CHECK(failed == 0);  // every group a dead reward process held was scored again
  CHECK(count(text, "reward worker") >= 5);
  CHECK(count(text, "went away") == 5);
  CHECK(reward_pids(run.log).size() == 6);
  MESSAGE("killed the reward process after steps" << killed << "; 6 reward processes served the run, 0 groups failed");
}

TEST_CASE("lost_groups=fail: exactly the groups a hung reward process held fail; it is killed and replaced, the run goes on") {
  const int64_t steps = 12;
  auto dir = fixtures() / "stage_reward_fail";
  fs::remove_all(dir);
  auto run = start_run("tiny_arithmetic_grpo", task_args(steps) + " cluster.reward_processes=1 cluster.lost_groups=fail "
                                                                  "run.dir=" + shell_quote(dir.string()),
                       fixtures() / "stage_reward_fail.log");
  wait_for_steps(dir, 3);
  const pid_t victim = wait_for_reward_worker(run.log, 1);
  // Stopped, it takes groups and answers none, and its heartbeats stop: past the connection
  // timeout the run gives it up, kills it, and a replacement takes the groups that follow.
  REQUIRE(::kill(victim, SIGSTOP) == 0);
  int status = wait_for(run.pid);
  auto text = read_file(run.log);
  INFO(text);
  REQUIRE(status == 0);
  std::smatch held;
  REQUIRE(std::regex_search(text, held, std::regex("reward worker 0 went away \\(.*\\) holding ([0-9]+) groups; they fail")));
  const int64_t lost = std::stoll(held[1]);
  auto m = metrics(dir);
  REQUIRE(m.size() == static_cast<size_t>(steps));
  int64_t failed = 0;
  for (const auto& s : m) {
    // Each ticket once: a step whose groups all failed makes no update, so versions may pause.
    CHECK(s["rollouts/trained"].get<int64_t>() + s["rollouts/failed"].get<int64_t>() == 16);
    CHECK(s["staleness/max"].get<int64_t>() <= 1);
    failed += s["rollouts/failed"].get<int64_t>();
  }
  MESSAGE("the stopped reward process held " << lost << " groups when given up; " << failed << " groups failed in the run");
  CHECK(lost > 0);
  CHECK(failed == lost);
  CHECK(gone(victim));
  CHECK(text.find("reward worker " + std::to_string(victim) + " ended (killed by signal 9); started worker") != std::string::npos);
  CHECK(reward_pids(run.log).size() == 2);
}
