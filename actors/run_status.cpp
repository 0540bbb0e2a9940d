#include "actors/run_status.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <sstream>

#include "policy/error.hpp"

namespace troupe {

namespace fs = std::filesystem;

namespace {

std::atomic<bool> g_started{false};  // this process wrote a running status
std::atomic<bool> g_ended{false};    // this process wrote its run's end
std::mutex g_write;                // one writer at a time (the controller, a signal's thread)

std::string read_line(const fs::path& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  return line;
}

// This machine, as the weight plane names it: its boot id.
std::string machine() { return read_line("/proc/sys/kernel/random/boot_id"); }

// When process `pid` started (field 22 of /proc/PID/stat, in clock ticks since boot); empty
// when there is no such process. With the pid it names one process, even after pids wrap.
std::string process_start(int64_t pid) {
  std::string stat = read_line("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return "";
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
  }
  return field;
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void write(const fs::path& dir, nlohmann::json j) {
  std::lock_guard lock(g_write);
  j["pid"] = static_cast<int64_t>(getpid());
  j["process_start"] = process_start(getpid());
  j["machine"] = machine();
  j["updated"] = unix_now();
  const fs::path file = dir / "status.json", part = dir / "status.json.part";
  {
    std::ofstream out(part, std::ios::trunc);
    out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!out) return;  // a full disk: the dashboard shows the last status that was written
  }
  std::error_code ec;
  fs::rename(part, file, ec);
}

}  // namespace

RunStatus::RunStatus(fs::path dir, std::string recipe, int64_t steps)
    : dir_(std::move(dir)), recipe_(std::move(recipe)), steps_(steps) {}

void RunStatus::running(int64_t step, const std::vector<ActorStatus>& actors) {
  if (dir_.empty() || g_ended) return;
  g_started = true;
  nlohmann::json list = nlohmann::json::array();
  for (const auto& a : actors)
    list.push_back({{"name", a.name}, {"state", a.state}, {"queue", a.queue}, {"detail", a.detail}});
  write(dir_, {{"state", "running"}, {"recipe", recipe_}, {"step", step}, {"steps", steps_}, {"actors", std::move(list)}});
}

void end_run_status(const fs::path& dir, const std::string& state, int64_t step, const std::string& error) {
  if (dir.empty() || !g_started || g_ended.exchange(true)) return;
  // The last actors written stay, each marked as the run ended (failed ones keep their state).
  nlohmann::json last;
  try {
    last = nlohmann::json::parse(read_line(dir / "status.json"));
  } catch (const std::exception&) {
    last = nlohmann::json::object();
  }
  nlohmann::json actors = last.value("actors", nlohmann::json::array());
  for (auto& a : actors)
    if (a.value("state", "") != "failed") a["state"] = state == "failed" ? "stopped" : state;
  last["state"] = state;
  if (step >= 0) last["step"] = step;
  last["error"] = error;
  last["actors"] = std::move(actors);
  write(dir, std::move(last));
}

nlohmann::json read_run_status(const fs::path& dir) {
  const fs::path file = dir / "status.json";
  if (!fs::exists(file)) {
    if (!fs::exists(dir / "metrics.jsonl")) return {{"state", "unknown"}, {"actors", nlohmann::json::array()}};
    return {{"state", "finished"}, {"actors", nlohmann::json::array()}, {"note", "no status.json (an older run)"}};
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_line(file));
  } catch (const std::exception& e) {
    throw Error(file.string() + ": not a run status (" + e.what() + ")");
  }
  if (j.value("state", "") != "running" || j.value("machine", "") != machine()) return j;
  const int64_t pid = j.value("pid", int64_t{0});
  if (pid > 0 && process_start(pid) == j.value("process_start", "")) return j;
  j["state"] = "failed";
  j["error"] = "the run's process (pid " + std::to_string(pid) + ") is gone without writing its end: killed, or it crashed";
  for (auto& a : j["actors"])
    if (a.value("state", "") != "failed") a["state"] = "stopped";
  return j;
}

}  // namespace troupe
