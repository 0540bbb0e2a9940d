// Worker processes: `troupe worker --connect HOST:PORT --role generator|reward|reference` joins
// a run's controller over CAF's network layer, builds the generator (or reward, or reference
// stage) the controller describes, and runs it until the run ends (or the controller's process
// goes away). A run with cluster.generator_processes, reward_processes or reference_processes
// starts them on this host itself.
#pragma once

#include <cstdint>
#include <filesystem>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

namespace troupe {

// The name both ends present at CAF's handshake: a build of another protocol is refused there.
std::string app_identifier();

// The body of `troupe worker`; returns the process's exit status. Every wait is bounded by
// `timeout_s` (connecting, and the controller's answer), and every failure is one line on stderr.
int run_worker(const std::string& host, uint16_t port, const std::string& role, double timeout_s);

// One `troupe worker` process of `program` (empty: this executable) per role, connecting to
// host:port, supervised: one that dies is replaced with one of its role (up to `restarts` times
// in all), and the replacement joins the run anew. The destructor waits for them to exit after
// the run (up to 10 s each), then kills what is left.
class WorkerProcesses {
 public:
  WorkerProcesses(std::filesystem::path program, const std::string& host, uint16_t port, std::vector<std::string> roles,
                  int64_t restarts);
  ~WorkerProcesses();
  // Kills `pid` if it is one of these workers (one that went silent); the supervisor replaces it.
  void kill(pid_t pid);
  WorkerProcesses(const WorkerProcesses&) = delete;
  WorkerProcesses& operator=(const WorkerProcesses&) = delete;

 private:
  pid_t start(const std::string& role) const;
  void supervise();
  std::filesystem::path program_;
  std::string where_;
  std::vector<std::string> roles_;
  int64_t restarts_left_;
  std::mutex mu_;
  std::vector<pid_t> pids_;  // one per role
  std::atomic<bool> stopping_{false};
  std::thread supervisor_;
};

}  // namespace troupe
