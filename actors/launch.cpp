// fork + exec per rank, one supervising loop on sigtimedwait: child exits (SIGCHLD) and stop
// signals arrive in one place. The ranks live in their own process group, so a terminal's
// Ctrl-C reaches them once (passed on from here), and PR_SET_PDEATHSIG ends them if this
// process dies.
#include "actors/launch.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "policy/error.hpp"

namespace troupe {
namespace {

// A port that is free on loopback now, for rank 0's TCPStore.
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error("troupe run: cannot open a socket to find a free port: " + std::string(std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    throw Error("troupe run: cannot bind a loopback port for the ranks' rendezvous: " + std::string(std::strerror(errno)));
  }
  close(fd);
  return ntohs(a.sin_port);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "ended with wait status " + std::to_string(status);
}

}  // namespace

namespace {

// In the forked child: rank r's environment (torchrun's variables), then the troupe binary.
[[noreturn]] void exec_rank(const std::string& exe, const std::vector<std::string>& args, int r, int n, int port,
                            int threads, pid_t parent, const sigset_t& previous) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(1);  // the launcher died before prctl took hold
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  setenv("RANK", std::to_string(r).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("TROUPE_LAUNCHER", "troupe", 1);
  setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
  std::vector<std::string> argv_s{exe};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  argv_s.push_back("trainer.threads=" + std::to_string(threads));
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  execv(exe.c_str(), argv.data());
  std::fprintf(stderr, "troupe run: cannot start rank %d (%s): %s\n", r, exe.c_str(), std::strerror(errno));
  _exit(127);
}

// Until every rank has exited: a stop signal goes to all of them; the first rank to fail stops
// the others (SIGTERM, then SIGKILL after grace_s). Returns how many failed.
int wait_ranks(std::map<pid_t, int>& live, const sigset_t& watched, int n, double grace_s) {
  int failures = 0;
  bool requested = false;  // a stop was asked for: ranks ending non-zero are not an error of theirs
  using Clock = std::chrono::steady_clock;
  auto kill_at = Clock::time_point::max();  // SIGKILL for what is left, once the first failure's grace is over
  auto stop_all = [&](int sig) {
    for (auto [pid, r] : live) kill(pid, sig);
  };
  while (!live.empty()) {
    timespec tick{0, 100'000'000};
    siginfo_t info;
    int sig = sigtimedwait(&watched, &info, &tick);
    if (sig == SIGINT || sig == SIGTERM) {
      requested = true;
      stop_all(sig);
    }
    for (;;) {
      int status = 0;
      pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      auto it = live.find(pid);
      if (it == live.end()) continue;
      const int r = it->second;
      live.erase(it);
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      ++failures;
      if (failures == 1 && !requested) {
        std::cerr << "troupe: error: trainer rank " << r << " of " << n << " (pid " << pid << ") " << describe(status)
                  << (live.empty() ? "" : "; stopping the other ranks") << std::endl;
        stop_all(SIGTERM);
        kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
      }
    }
    if (Clock::now() > kill_at) {
      stop_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
  }
  return failures;
}

}  // namespace

int launch_ranks(const std::string& exe, const std::vector<std::string>& args, const LaunchOptions& o) {
  const int n = o.ranks;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = o.threads_per_rank > 0 ? o.threads_per_rank : std::max(1, static_cast<int>(cores) / n);
  const int port = free_port();
  std::cout << "troupe run: starting " << n << " trainer ranks on this machine (" << threads
            << (threads == 1 ? " thread" : " threads") << " each, rendezvous 127.0.0.1:" << port << ")" << std::endl;

  sigset_t watched, previous;
  sigemptyset(&watched);
  sigaddset(&watched, SIGINT);
  sigaddset(&watched, SIGTERM);
  sigaddset(&watched, SIGCHLD);
  pthread_sigmask(SIG_BLOCK, &watched, &previous);

  std::map<pid_t, int> live;  // pid -> rank
  const pid_t parent = getpid();
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw Error("troupe run: cannot start rank " + std::to_string(r) + ": " + std::strerror(errno));
    if (pid == 0) exec_rank(exe, args, r, n, port, threads, parent, previous);
    live[pid] = r;
  }
  const int failures = wait_ranks(live, watched, n, o.grace_s);
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return failures ? 1 : 0;
}

}  // namespace troupe
