// Reward plugins that misbehave on purpose, one shared library per TEST_PLUGIN_* variant.
#include <cstring>
#include <limits>
#include <stdexcept>

#if defined(TEST_PLUGIN_THROWS)
#include "reward/plugin.hpp"
// The completion's length; throws when the metadata asks it to.
double length_or_throw(const troupe::RewardSample& s) {
  if (s.metadata.is_object() && s.metadata.value("fail", false)) throw std::runtime_error("asked to fail");
  return static_cast<double>(s.completion.size());
}
TROUPE_REWARD(length_or_throw)

#elif defined(TEST_PLUGIN_RAW)
// The ABI by hand, without troupe's header: NaN for an empty completion, else its length.
extern "C" double troupe_reward(const char* prompt, const char* completion, const char* metadata_json) {
  size_t n = std::strlen(completion);
  return n == 0 ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(n);
}

#elif defined(TEST_PLUGIN_NO_SYMBOL)
extern "C" double score(const char*, const char*, const char*) { return 1.0; }

#elif defined(TEST_PLUGIN_ABI2)
extern "C" int troupe_reward_abi_version(void) { return 2; }
extern "C" double troupe_reward(const char*, const char*, const char*) { return 1.0; }
#endif
