// `troupe serve` as a child process for tests: started with arguments, its port read from the
// listening line it prints, stopped by SIGTERM (or SIGKILL when the test ends first).
#pragma once

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "tests/test_util.hpp"

extern char** environ;

namespace troupe::test {

// A `troupe serve` child process; its stdout is read until the listening line names the port.
struct ServerProcess {
  pid_t pid = -1;
  int port = 0;

  explicit ServerProcess(const std::vector<std::string>& args) {
    int out[2];
    REQUIRE(pipe(out) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    std::vector<std::string> argv_s = {env_dir("TROUPE_BIN").string(), "serve"};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(out[1]);
    REQUIRE(rc == 0);
    std::string seen;
    std::smatch m;
    static const std::regex listening(R"(listening on http://[^:\s]+:(\d+))");
    while (!std::regex_search(seen, m, listening)) {
      pollfd p{out[0], POLLIN, 0};
      if (poll(&p, 1, 300'000) <= 0) break;  // the model loads in seconds; this only guards a hang
      char buf[256];
      ssize_t n = read(out[0], buf, sizeof buf);
      if (n <= 0) break;
      seen.append(buf, static_cast<size_t>(n));
    }
    close(out[0]);  // the server prints nothing else on stdout
    REQUIRE_MESSAGE(std::regex_search(seen, m, listening), "no listening line; stdout was: " << seen);
    port = std::stoi(m[1]);
  }

  // SIGTERM, then the exit status (-1: did not exit normally within a minute).
  int terminate() {
    kill(pid, SIGTERM);
    for (int i = 0; i < 600; ++i) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return -1;
  }

  ~ServerProcess() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

}  // namespace troupe::test
