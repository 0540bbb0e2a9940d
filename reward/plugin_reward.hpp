// A reward from a shared library loaded by path (dlopen); the ABI is in reward/plugin.hpp.
// Loading checks the file and the symbols up front, so a bad path fails at start-up, not mid-run.
#pragma once

#include <memory>
#include <string>

#include "reward/sample.hpp"

namespace troupe {

class PluginReward : public RewardFn {
 public:
  // Throws troupe::Error naming the path (and the symbol) when the file is missing, is not a
  // loadable library, lacks troupe_reward, or reports another ABI version.
  explicit PluginReward(const std::string& path);
  // Throws troupe::Error naming the path when the plugin returns NaN/inf or throws.
  double score(const RewardSample& sample) const override;
  const std::string& path() const { return path_; }

 private:
  using ScoreFn = double (*)(const char* prompt, const char* completion, const char* metadata_json);
  using LastErrorFn = const char* (*)();
  std::string path_;
  std::shared_ptr<void> library_;  // the dlopen handle; dlclose when the last copy goes
  ScoreFn score_ = nullptr;
  LastErrorFn last_error_ = nullptr;
};

}  // namespace troupe
