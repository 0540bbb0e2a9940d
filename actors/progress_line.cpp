// The progress line `troupe run` prints per step of the actor graph.
#include <cmath>
#include <cstdio>

#include "actors/controller.hpp"

namespace troupe {

std::string progress_line(const nlohmann::json& j, int64_t steps) {
  // A non-finite figure is stored as null: shown as nan, never a throw.
  auto num = [&](const char* key) { return j.contains(key) && j[key].is_number() ? j[key].get<double>() : std::nan(""); };
  char buf[320];
  const auto failed = j["rollouts/failed"].get<int64_t>();
  if (j["loss"].is_null() && failed == 0) {
    std::snprintf(buf, sizeof buf, "step %lld/%lld  v%lld  no preference pairs (every group's rewards tied), no update",
                  (long long)j["step"].get<int64_t>(), (long long)steps, (long long)j["policy_version"].get<int64_t>());
    return buf;
  }
  if (j["loss"].is_null()) {
    std::snprintf(buf, sizeof buf, "step %lld/%lld  v%lld  all %lld groups failed, no update (see failures.jsonl)",
                  (long long)j["step"].get<int64_t>(), (long long)steps, (long long)j["policy_version"].get<int64_t>(),
                  (long long)failed);
    return buf;
  }
  int n = std::snprintf(buf, sizeof buf,
                        "step %lld/%lld  v%lld  reward %.3f  loss %+.4f  kl %.4f  stale %.2f/%lld  wait %.1fs  train %.1fs  %.0f tok/s",
                        (long long)j["step"].get<int64_t>(), (long long)steps, (long long)j["policy_version"].get<int64_t>(),
                        num("reward/mean"), num("loss"), num("kl"), num("staleness/mean"),
                        (long long)j["staleness/max"].get<int64_t>(), num("time/generate_wait_s"), num("time/step_s"),
                        num("tokens_per_s"));
  if (failed > 0 && n > 0 && n < static_cast<int>(sizeof buf))
    std::snprintf(buf + n, sizeof buf - n, "  %lld failed", (long long)failed);
  return buf;
}

}  // namespace troupe
