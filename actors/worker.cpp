#include "actors/worker.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <thread>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <caf/io/all.hpp>

#include "actors/generator_actor.hpp"
#include "actors/protocol.hpp"
#include "actors/stage_actors.hpp"
#include "policy/error.hpp"

extern char** environ;

namespace troupe {

using namespace caf;

std::string app_identifier() {
#ifdef TROUPE_VERSION
  std::string version = TROUPE_VERSION;
#else
  std::string version = "dev";
#endif
  // TROUPE_APP_ID lets a test play a worker of another build.
  if (const char* other = std::getenv("TROUPE_APP_ID")) return other;
  return "troupe-" + version + "-graph-protocol-5";
}

namespace {

// Runs until `built` (the worker's actor) or the controller goes down; returns the exit status.
int wait_until_down(actor_system& system, scoped_actor& self, const actor& built, const controller_actor& controller,
                    const std::string& what) {
  self->monitor(built);
  self->monitor(controller);
  int status = 0;
  bool done = false;
  while (!done) {
    self->receive([&](down_msg& dm) {
      if (dm.source == built.address()) {
        // The controller ends the run by stopping what it spawned: that is a clean exit.
        if (dm.reason && dm.reason != exit_reason::user_shutdown) {
          std::cerr << "troupe worker: " << what << " failed: " << reason_text(dm.reason) << std::endl;
          status = 1;
        }
        done = true;
      } else {
        if (dm.reason && dm.reason != exit_reason::normal)
          std::cerr << "troupe worker: the controller went away (" << system.render(dm.reason) << "); stopping " << what
                    << std::endl;
        else
          std::cout << "troupe worker: the run ended; stopping " << what << std::endl;
        self->send_exit(built, exit_reason::user_shutdown);
      }
    });
  }
  return status;
}

// Ends the process with the worker's status if the actor system's shutdown outlasts `limit`.
// CAF 0.17.6's ~actor_system can wait forever for a detached actor that was sent to the run's
// process: the actor has terminated, but its last reference is never dropped, so its private
// thread waits in await_self_destroyed and the main thread in await_detached_threads. All of
// troupe's handles are gone by then. Seen in about one exit in five of a worker that joined
// mid-run, under AddressSanitizer's timing; CAF rewrote this shutdown path after 0.17.6
// (actor-framework issue 1196). The worker's work is done by then, so nothing is lost.
class ShutdownDeadline {
 public:
  ShutdownDeadline() = default;
  ShutdownDeadline(const ShutdownDeadline&) = delete;
  ShutdownDeadline& operator=(const ShutdownDeadline&) = delete;
  ~ShutdownDeadline() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_one();
    if (watchdog_.joinable()) watchdog_.join();
  }

  // Starts the clock; returns `status`.
  int arm(int status, std::chrono::seconds limit) {
    watchdog_ = std::thread([this, status, limit] {
      std::unique_lock lock(mutex_);
      if (done_cv_.wait_for(lock, limit, [this] { return done_; })) return;
      std::cerr << "troupe worker: the actor system did not shut down within " << limit.count()
                << " s (CAF 0.17 waits for a detached actor it still references); exiting with status " << status
                << std::endl;
      std::cout.flush();
      std::_Exit(status);
    });
    return status;
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread watchdog_;
};

std::chrono::milliseconds millis(double s) { return std::chrono::milliseconds(static_cast<int64_t>(s * 1000)); }

// Asks the controller what to build, builds it, joins, and waits until the generator or the
// controller goes down. Returns the exit status.
int serve_generator(actor_system& system, controller_actor controller, double timeout_s) {
  scoped_actor self{system};
  int64_t index = -1;
  std::string spec_json;
  rollout_sink sink;
  std::string failure;
  self->request(controller, millis(timeout_s), join_atom::value)
      .receive([&](int64_t i, std::string& s, rollout_sink& next) { index = i, spec_json = std::move(s), sink = std::move(next); },
               [&](error& e) { failure = system.render(e); });
  if (!failure.empty()) {
    std::cerr << "troupe worker: the controller refused to add a generator: " << failure << std::endl;
    return 1;
  }
  auto spec = generator_spec_from_json(nlohmann::json::parse(spec_json));
  auto generator = spawn_generator(system, std::move(spec), sink, controller, index);
  self->send(controller, join_atom::value, index, generator, static_cast<int64_t>(::getpid()));
  std::cout << "troupe worker: generator " << index << " joined (pid " << ::getpid() << ")" << std::endl;
  return wait_until_down(system, self, actor_cast<actor>(generator), controller, "generator " + std::to_string(index));
}

// The same for a reward or reference stage: it joins the stage's router.
int serve_stage(actor_system& system, controller_actor controller, const std::string& role, double timeout_s) {
  scoped_actor self{system};
  std::string spec_json, failure;
  stage_router router;
  self->request(controller, millis(timeout_s), join_atom::value, role)
      .receive([&](std::string& s, stage_router& r) { spec_json = std::move(s), router = std::move(r); },
               [&](error& e) { failure = reason_text(e); });
  if (!failure.empty()) {
    std::cerr << "troupe worker: the controller refused to add a " << role << " worker: " << failure << std::endl;
    return 1;
  }
  auto j = nlohmann::json::parse(spec_json);
  auto stage = role == "reward" ? spawn_reward_worker(system, reward_stage_spec_from_json(j))
                                : spawn_reference_worker(system, reference_stage_spec_from_json(j));
  self->send(router, join_atom::value, stage, static_cast<int64_t>(::getpid()));
  std::cout << "troupe worker: " << role << " joined (pid " << ::getpid() << ")" << std::endl;
  return wait_until_down(system, self, actor_cast<actor>(stage), controller, role);
}

}  // namespace

int run_worker(const std::string& host, uint16_t port, const std::string& role, double timeout_s) {
  if (role != "generator" && role != "reward" && role != "reference") {
    std::cerr << "troupe worker: --role " << role << ": unknown role (known: generator, reward, reference)" << std::endl;
    return 2;
  }
  actor_system_config config;
  add_message_types(config);
  config.load<io::middleman>();
  ShutdownDeadline shutdown;  // outlives the system: it bounds the system's shutdown
  constexpr std::chrono::seconds shutdown_limit{10};
  actor_system system{config};
  // The controller may still be starting: retry until the deadline.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  expected<controller_actor> controller = sec::cannot_connect_to_node;
  while (true) {
    controller = system.middleman().remote_actor<controller_actor>(host, port);
    if (controller || controller.error() == sec::incompatible_application_ids ||
        controller.error() == sec::unexpected_actor_messaging_interface || std::chrono::steady_clock::now() > deadline)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!controller) {
    std::string why = system.render(controller.error());
    if (controller.error() == sec::incompatible_application_ids)
      why = "it is another troupe build (this worker is " + app_identifier() + "; both ends must run the same build)";
    else if (controller.error() == sec::unexpected_actor_messaging_interface)
      why = "it speaks another version of troupe's actor protocol (another troupe build)";
    std::cerr << "troupe worker: cannot join the run at " << host << ":" << port << ": " << why << std::endl;
    return shutdown.arm(1, shutdown_limit);
  }
  int status = 1;
  try {
    status = role == "generator" ? serve_generator(system, *controller, timeout_s)
                                 : serve_stage(system, *controller, role, timeout_s);
  } catch (const std::exception& e) {
    std::cerr << "troupe worker: " << e.what() << std::endl;
  }
  return shutdown.arm(status, shutdown_limit);
}

WorkerProcesses::WorkerProcesses(std::filesystem::path program, const std::string& host, uint16_t port,
                                 std::vector<std::string> roles, int64_t restarts)
    : program_(program.empty() ? std::filesystem::read_symlink("/proc/self/exe") : std::move(program)),
      where_(host + ":" + std::to_string(port)),
      roles_(std::move(roles)),
      restarts_left_(restarts) {
  try {
    for (const auto& role : roles_) pids_.push_back(start(role));
  } catch (...) {
    for (pid_t pid : pids_) {
      ::kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    throw;
  }
  supervisor_ = std::thread([this] { supervise(); });
}

pid_t WorkerProcesses::start(const std::string& role) const {
  std::vector<std::string> args = {program_.string(), "worker", "--connect", where_, "--role", role};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The run's own signal thread blocks SIGINT and SIGTERM; a worker gets them back, so that a
  // plain `kill` stops it.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, program_.c_str(), nullptr, &attr, argv.data(), environ);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) throw Error("cannot start a " + role + " worker (" + program_.string() + "): " + std::strerror(rc));
  return pid;
}

// Every 100 ms: a worker that exited during the run is replaced while restarts are left.
void WorkerProcesses::supervise() {
  while (!stopping_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < pids_.size(); ++i) {
      auto& pid = pids_[i];
      int status = 0;
      if (pid <= 0 || waitpid(pid, &status, WNOHANG) != pid || stopping_) continue;
      std::string how = WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                            : "exit status " + std::to_string(WEXITSTATUS(status));
      const std::string& role = roles_[i];
      if (restarts_left_ <= 0) {
        std::cerr << "troupe run: " << role << " worker " << pid << " ended (" << how
                  << "); no restarts left (cluster.restarts)" << std::endl;
        pid = -1;
        continue;
      }
      --restarts_left_;
      pid_t replacement = -1;
      try {
        replacement = start(role);
      } catch (const std::exception& e) {
        std::cerr << "troupe run: " << e.what() << std::endl;
      }
      std::cerr << "troupe run: " << role << " worker " << pid << " ended (" << how << "); started worker " << replacement
                << " in its place" << std::endl;
      pid = replacement;
    }
  }
}

void WorkerProcesses::kill(pid_t pid) {
  std::lock_guard lock(mu_);
  if (pid > 0 && std::find(pids_.begin(), pids_.end(), pid) != pids_.end()) ::kill(pid, SIGKILL);
}

WorkerProcesses::~WorkerProcesses() {
  stopping_ = true;
  supervisor_.join();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (pid_t pid : pids_) {
    if (pid <= 0) continue;
    while (waitpid(pid, nullptr, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

}  // namespace troupe
