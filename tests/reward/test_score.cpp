// `troupe score` end to end through the binary: built-in rewards, the example plugin, the
// example Python reward service over HTTP, and bad lines named by file and line.
#include <doctest/doctest.h>

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using troupe::test::env_dir;

extern char** environ;

namespace {

using Run = troupe::test::CommandResult;

std::string quote(const std::string& s) { return troupe::test::shell_quote(s); }

Run run_troupe(const std::string& args) {
  std::string cmd = quote(env_dir("TROUPE_BIN").string()) + " " + args + " 2>&1";
  return troupe::test::run_command(cmd);
}

// A file in a fresh temporary folder, removed with it at the end of the test.
struct TempDir {
  fs::path dir = fs::temp_directory_path() / ("troupe_test_score_" + std::to_string(getpid()));
  TempDir() { fs::create_directories(dir); }
  ~TempDir() { fs::remove_all(dir); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  }
};

const char* kSamples =
    "{\"prompt\": \"Janet has 16 eggs...\", \"completion\": \"16 - 3 - 4 = 9, 9 * 2 = 18\\n#### 18\", "
    "\"answer\": \"9 * 2 = 18\\n#### 18\"}\n"
    "{\"completion\": \"She makes $18 a day, so that is it.\", \"answer\": \"#### 18\"}\n"
    "\n"
    "{\"completion\": \"The answer is \\\\boxed{17}\", \"answer\": \"#### 18\"}\n";

// The example reward service (Python standard library) on a free port.
struct RewardService {
  pid_t pid = -1;
  int stdout_fd = -1;  // kept open while it runs: a closed pipe would kill it on its next print
  std::string url;

  RewardService() {
    int out[2];
    REQUIRE(pipe(out) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    std::string script = (troupe::test::source() / "examples" / "reward_service" / "reward_service.py").string();
    std::vector<std::string> args = {"python3", script, "--port", "0"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = posix_spawnp(&pid, "python3", &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(out[1]);
    REQUIRE(rc == 0);
    std::string seen;
    std::smatch m;
    static const std::regex listening(R"(on (http://\S+/score))");
    while (!std::regex_search(seen, m, listening)) {
      pollfd p{out[0], POLLIN, 0};
      if (poll(&p, 1, 30'000) <= 0) break;
      char buf[256];
      ssize_t n = read(out[0], buf, sizeof buf);
      if (n <= 0) break;
      seen.append(buf, static_cast<size_t>(n));
    }
    stdout_fd = out[0];
    bool up = std::regex_search(seen, m, listening);
    if (!up) stop();  // REQUIRE throws, and a half-made object gets no destructor
    REQUIRE_MESSAGE(up, "the reward service printed: " << seen);
    url = m[1];
  }
  ~RewardService() { stop(); }
  void stop() {
    kill(pid, SIGTERM);
    waitpid(pid, nullptr, 0);
    close(stdout_fd);
  }
};

}  // namespace

TEST_CASE("troupe score prints one score per sample") {
  TempDir tmp;
  auto data = tmp.write("samples.jsonl", kSamples);

  auto r = run_troupe("score --reward math_answer " + quote(data));
  CHECK(r.status == 0);
  CHECK(r.out == "1\n1\n0\n");

  r = run_troupe("score --reward format " + quote(data));
  CHECK(r.status == 0);
  CHECK(r.out == "1\n0\n1\n");

  r = run_troupe("score --reward " + quote(MY_REWARD_PLUGIN) + " " + quote(data));
  CHECK(r.status == 0);
  CHECK(r.out == "0\n1\n0\n");  // only the second shows its reasoning ("so")

  r = run_troupe("--help");
  CHECK(r.out.find("score") != std::string::npos);
}

TEST_CASE("troupe score through the example HTTP reward service") {
  RewardService service;
  TempDir tmp;
  auto data = tmp.write("samples.jsonl", kSamples);
  auto r = run_troupe("score --reward " + quote(service.url) + " " + quote(data));
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(r.out == "1\n0\n0\n");  // the example service wants "#### N" at the end
}

TEST_CASE("troupe score: bad lines and unknown rewards exit 1 with one clear message") {
  TempDir tmp;
  auto bad_json = tmp.write("bad.jsonl", "{\"completion\": \"#### 1\", \"answer\": \"1\"}\n{\"completion\": \n");
  auto r = run_troupe("score --reward math_answer " + quote(bad_json));
  CHECK(r.status == 1);
  CHECK(r.out == "troupe: error: " + bad_json + ":2: not valid JSON\n");  // no scores printed first

  auto no_answer = tmp.write("no_answer.jsonl", "{\"completion\": \"#### 1\"}\n");
  r = run_troupe("score --reward math_answer " + quote(no_answer));
  CHECK(r.status == 1);
  CHECK(r.out.find(no_answer + ":1: no field 'answer'") != std::string::npos);

  r = run_troupe("score --reward math_anwser " + quote(no_answer));
  CHECK(r.status == 1);
  CHECK(r.out.find("'math_anwser': not a built-in reward") != std::string::npos);

  r = run_troupe("score --reward math_answer " + quote((tmp.dir / "missing.jsonl").string()));
  CHECK(r.status == 1);
  CHECK(r.out.find("missing.jsonl: cannot open") != std::string::npos);
}
