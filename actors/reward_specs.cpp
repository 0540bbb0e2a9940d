// RunConfig's rewards as reward/'s RewardSpec, the one place config.cpp meets troupe_reward.
// Kept apart so that config.cpp itself depends on nothing but yaml-cpp.
#include "actors/config.hpp"
#include "reward/registry.hpp"

namespace troupe {

std::vector<RewardSpec> to_reward_specs(const RunConfig& config) {
  std::vector<RewardSpec> specs;
  for (const auto& r : config.rewards)
    specs.push_back({.name = r.name,
                     .kind = r.kind,
                     .weight = r.weight,
                     .answer_key = r.answer_key,
                     .plugin = r.plugin,
                     .url = r.url,
                     .timeout_s = r.timeout_s,
                     .retries = static_cast<int>(r.retries),
                     .backoff_s = r.backoff_s,
                     .max_batch = r.max_batch});
  return specs;
}

}  // namespace troupe
