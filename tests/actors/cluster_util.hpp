// What the tests of the actor graph across processes share: bounded command lines, a tiny
// deterministic task, a background `troupe run` and its workers' pids, and the checks that two
// runs are the same and that every step trained a full batch within the staleness bound.
#pragma once

#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <thread>

#include "tests/actors/run_util.hpp"

namespace troupe::test {

namespace fs = std::filesystem;

// A command line bounded in time: a hang fails the test instead of stalling it.
inline std::string bounded(int seconds, const std::string& command) {
  return "timeout " + std::to_string(seconds) + " sh -c " + shell_quote(command);
}

// The tiny arithmetic task's files (the format stage's too) from the fixtures of the build that
// runs the test: the configs' own paths name the default build folder.
inline std::string task_args(int64_t steps) {
  auto task = fixtures() / "arithmetic";
  return "model.path=" + shell_quote((task / "model").string()) + " data.train.path=" +
         shell_quote((task / "train.jsonl").string()) + " trainer.sft_warmup.path=" +
         shell_quote((task / "format.jsonl").string()) + " trainer.steps=" + std::to_string(steps) +
         " run.deterministic=true async.max_staleness=1 generator.threads=1 trainer.threads=1";
}

// Every metric of every step, without the timings (and the figures derived from them) and
// the controller's bookkeeping of which generator got how many prompts when.
inline bool is_timing(const std::string& key) {
  return key.rfind("time/", 0) == 0 || key == "tokens_per_s" || key.rfind("generators/", 0) == 0;
}

inline void check_same_run(const fs::path& a, const fs::path& b, int64_t steps) {
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

// A background `troupe run`, its output in a file; the port its controller listens on.
struct Background {
  pid_t pid = -1;
  fs::path log;
  int port = -1;
};

inline Background start_run(const std::string& config, const std::string& args, const fs::path& log) {
  Background b{-1, log};
  fs::remove(log);
  b.pid = fork();
  REQUIRE(b.pid >= 0);
  if (b.pid == 0) {
    std::string cmd = bounded(600, troupe_run(config, args)) + " > " + shell_quote(log.string()) + " 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const std::regex listening("workers join at 127\\.0\\.0\\.1:([0-9]+)");
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

inline int wait_for(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Waits (60 s at most) until DIR/metrics.jsonl has `steps` lines.
inline void wait_for_steps(const fs::path& dir, size_t steps) {
  for (int i = 0; i < 6000 && steps_written(dir) < steps; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(steps_written(dir) >= steps);
}

// The pids of the worker processes whose generators joined, from the run's log.
inline std::vector<pid_t> worker_pids(const fs::path& log) {
  const std::regex joined("generator [0-9]+ joined \\(pid ([0-9]+)\\)");
  auto text = read_file(log);
  std::vector<pid_t> out;
  for (std::sregex_iterator it(text.begin(), text.end(), joined), end; it != end; ++it) out.push_back(std::stoi((*it)[1]));
  return out;
}

inline bool gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = s.rfind(')');
  return close == std::string::npos || s.substr(close + 2, 1) == "Z";  // a zombie has exited
}

// Every step trained a full batch (trained + failed = batch_groups: each ticket once, none lost,
// none doubled), kept the staleness bound, and advanced the version by one.
inline void check_steps(const std::vector<nlohmann::json>& m, int64_t batch_groups, int64_t eta) {
  for (size_t i = 0; i < m.size(); ++i) {
    CAPTURE(i);
    CHECK(m[i]["step"].get<size_t>() == i + 1);
    CHECK(m[i]["rollouts/trained"].get<int64_t>() + m[i]["rollouts/failed"].get<int64_t>() == batch_groups);
    CHECK(m[i]["staleness/max"].get<int64_t>() <= eta);
    CHECK(m[i]["policy_version"].get<size_t>() == i + 1);
  }
}

}  // namespace troupe::test
