// Loads a reward plugin with dlopen and calls its C entry point.
#include "reward/plugin_reward.hpp"

#include <dlfcn.h>

#include <cmath>
#include <filesystem>

#include "policy/error.hpp"
#include "reward/plugin.hpp"

namespace troupe {

PluginReward::PluginReward(const std::string& path) : path_(path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw Error(path + ": no such reward plugin file (build it first, e.g. `cmake --build build --target my_reward`)");
  // An absolute path, so dlopen loads this file rather than searching LD_LIBRARY_PATH.
  std::string file = fs::absolute(path).string();
  dlerror();
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = dlerror();
    throw Error(path + ": cannot load reward plugin: " + (why ? why : "dlopen failed"));
  }
  library_ = std::shared_ptr<void>(handle, [](void* h) { dlclose(h); });
  if (auto version = reinterpret_cast<int (*)()>(dlsym(handle, "troupe_reward_abi_version"))) {
    if (int v = version(); v != TROUPE_REWARD_ABI_VERSION)
      throw Error(path + ": troupe_reward_abi_version() is " + std::to_string(v) + ", this troupe expects " +
                  std::to_string(TROUPE_REWARD_ABI_VERSION) + " (rebuild the plugin against this reward/plugin.hpp)");
  }
  score_ = reinterpret_cast<ScoreFn>(dlsym(handle, "troupe_reward"));
  if (!score_)
    throw Error(path + ": no symbol 'troupe_reward' in the reward plugin (export extern \"C\" double "
                "troupe_reward(const char*, const char*, const char*), e.g. with TROUPE_REWARD(fn) from reward/plugin.hpp)");
  last_error_ = reinterpret_cast<LastErrorFn>(dlsym(handle, "troupe_reward_last_error"));
}

double PluginReward::score(const RewardSample& sample) const {
  std::string metadata = sample.metadata.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  double v = 0;
  try {
    v = score_(sample.prompt.c_str(), sample.completion.c_str(), metadata.c_str());
  } catch (const std::exception& e) {  // a hand-written plugin that lets an exception out
    throw Error(path_ + ": troupe_reward threw: " + e.what());
  }
  if (!std::isfinite(v)) {
    const char* why = last_error_ ? last_error_() : nullptr;
    throw Error(path_ + ": troupe_reward failed: " + (why && *why ? std::string(why) : "returned " + std::to_string(v)));
  }
  return v;
}

}  // namespace troupe
