// The progress line `troupe run` prints per step, its pace, and the summary of the run folder.
// Nothing here reads a clock but Pace, and nothing writes a file.
#include "actors/progress_line.hpp"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <system_error>
#include <vector>

namespace troupe {

namespace {

std::string duration_text(double seconds) {
  const auto s = static_cast<int64_t>(std::llround(std::max(seconds, 0.0)));
  char buf[48];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(s / 3600), (long long)(s % 3600 / 60));
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  else std::snprintf(buf, sizeof buf, "%llds", (long long)s);
  return buf;
}

std::string bytes_text(uintmax_t bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

// Bytes and files under `p` (a file: its own size); errors count as nothing.
std::pair<uintmax_t, int64_t> disk_usage(const std::filesystem::path& p) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(p, ec)) return {std::filesystem::file_size(p, ec), 1};
  uintmax_t bytes = 0;
  int64_t files = 0;
  for (auto it = std::filesystem::recursive_directory_iterator(p, ec); !ec && it != std::filesystem::recursive_directory_iterator();
       it.increment(ec))
    if (it->is_regular_file(ec)) {
      bytes += it->file_size(ec);
      ++files;
    }
  return {bytes, files};
}

int64_t lines_in(const std::filesystem::path& p) {
  FILE* f = std::fopen(p.c_str(), "r");
  if (!f) return 0;
  int64_t n = 0;
  for (int c; (c = std::fgetc(f)) != EOF;) n += c == '\n';
  std::fclose(f);
  return n;
}

}  // namespace

Pace::Pace(int64_t total_steps) : total_(total_steps) {}

std::string Pace::tick(int64_t step) {
  if (first_step_ < 0) first_step_ = step - 1;
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const auto made = step - first_step_;
  if (made <= 0 || elapsed <= 0) return "";
  const double per_minute = 60.0 * static_cast<double>(made) / elapsed;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f steps/min", per_minute);
  std::string out = buf;
  if (step >= total_) return out + "  done in " + duration_text(elapsed);
  return out + "  ETA " + duration_text(static_cast<double>(total_ - step) * elapsed / static_cast<double>(made));
}

bool colour_terminal() {
  const char* term = std::getenv("TERM");
  return isatty(STDOUT_FILENO) && !std::getenv("NO_COLOR") && term && std::strcmp(term, "dumb") != 0;
}

std::string progress_line(const nlohmann::json& j, int64_t steps, const std::string& pace, bool colour) {
  // A non-finite figure is stored as null: shown as nan, never a throw.
  auto num = [&](const char* key) { return j.contains(key) && j[key].is_number() ? j[key].get<double>() : std::nan(""); };
  const char* bold = colour ? "\033[1m" : "";
  const char* green = colour ? "\033[32m" : "";
  const char* red = colour ? "\033[31m" : "";
  const char* dim = colour ? "\033[2m" : "";
  const char* reset = colour ? "\033[0m" : "";
  char head[96];
  std::snprintf(head, sizeof head, "%sstep %lld/%lld%s  v%lld", bold, (long long)j["step"].get<int64_t>(), (long long)steps, reset,
                (long long)j["policy_version"].get<int64_t>());
  std::string line = head;
  const auto failed = j["rollouts/failed"].get<int64_t>();
  char buf[320];
  if (j["loss"].is_null() && failed == 0) {
    line += "  no preference pairs (every group's rewards tied), no update";
  } else if (j["loss"].is_null()) {
    std::snprintf(buf, sizeof buf, "  %sall %lld groups failed%s, no update (see failures.jsonl)", red, (long long)failed, reset);
    line += buf;
  } else {
    std::snprintf(buf, sizeof buf,
                  "  reward %s%.3f%s  loss %+.4f  kl %.4f  stale %.2f/%lld  gen %.1fs  train %.1fs  wait %.1fs  %.0f tok/s", green,
                  num("reward/mean"), reset, num("loss"), num("kl"), num("staleness/mean"), (long long)j["staleness/max"].get<int64_t>(),
                  num("time/generate_s"), num("time/step_s"), num("time/generate_wait_s"), num("tokens_per_s"));
    line += buf;
    if (failed > 0) line += std::string("  ") + red + std::to_string(failed) + " failed" + reset;
  }
  if (!pace.empty()) line += std::string("  ") + dim + pace + reset;
  return line;
}

std::string run_folder_summary(const std::filesystem::path& dir) {
  struct Entry {
    const char* name;
    const char* what;
  };
  const std::vector<Entry> entries = {
      {"config.yaml", "the resolved config"},
      {"metrics.jsonl", "metrics, one line per step"},
      {"tb", "TensorBoard events (tensorboard --logdir)"},
      {"samples.jsonl", "sampled completions with their rewards"},
      {"status.json", "how the run ended, and its actors (the dashboard reads it)"},
      {"failures.jsonl", "rollout groups that failed"},
      {"checkpoints", "checkpoints (Hugging Face folders; resume= continues from the last)"},
  };
  std::string out = "troupe run: wrote " + dir.string() + "/\n";
  std::error_code ec;
  for (const auto& e : entries) {
    const auto p = dir / e.name;
    if (!std::filesystem::exists(p, ec)) continue;
    const auto [bytes, files] = disk_usage(p);
    char buf[160];
    if (std::filesystem::is_directory(p, ec))
      std::snprintf(buf, sizeof buf, "  %-16s %-9s %lld file%s  %s\n", (std::string(e.name) + "/").c_str(), bytes_text(bytes).c_str(),
                    (long long)files, files == 1 ? "" : "s", e.what);
    else if (std::string(e.name).ends_with(".jsonl"))
      std::snprintf(buf, sizeof buf, "  %-16s %-9s %lld lines  %s\n", e.name, bytes_text(bytes).c_str(), (long long)lines_in(p), e.what);
    else std::snprintf(buf, sizeof buf, "  %-16s %-9s %s\n", e.name, bytes_text(bytes).c_str(), e.what);
    out += buf;
  }
  if (std::filesystem::is_directory(dir / "checkpoints", ec)) {
    int64_t last = -1;  // the newest checkpoints/step_N
    for (const auto& d : std::filesystem::directory_iterator(dir / "checkpoints", ec)) {
      const std::string name = d.path().filename().string();
      if (!d.is_directory(ec) || name.size() <= 5 || name.rfind("step_", 0) != 0 || name.size() > 23 ||
          name.find_first_not_of("0123456789", 5) != std::string::npos)
        continue;
      last = std::max<int64_t>(last, std::stoll(name.substr(5)));
    }
    if (last >= 0) out += "  latest checkpoint: " + (dir / "checkpoints" / ("step_" + std::to_string(last))).string() + "\n";
  }
  if (std::filesystem::exists(dir / "metrics.jsonl", ec))
    out += "  look at it: troupe dashboard " + dir.string() + "  (the browser), or troupe plot " + dir.string() +
           " -o curves.png\n";
  return out;
}

}  // namespace troupe
