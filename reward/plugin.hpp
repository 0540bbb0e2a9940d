// The one header a reward plugin includes: write `double f(const troupe::RewardSample&)` and
// TROUPE_REWARD(f). Header-only; the plugin links nothing from troupe.
//
// The ABI the loader looks up with dlsym (plain C, so a plugin may be written in any language):
//   double troupe_reward(const char* prompt, const char* completion, const char* metadata_json);
//       required. Strings are UTF-8 and NUL-terminated; metadata_json is a JSON value ("null"
//       when there is none). Return a finite score, or NaN to report a failure.
//   int troupe_reward_abi_version(void);      optional; must return 1 (TROUPE_REWARD_ABI_VERSION).
//   const char* troupe_reward_last_error(void);  optional; after a NaN, why (this thread's call).
// troupe may call troupe_reward from several threads at once.
#pragma once

#include <exception>
#include <limits>
#include <string>

#include "reward/sample.hpp"

#define TROUPE_REWARD_ABI_VERSION 1
// Exported even when the plugin is built with -fvisibility=hidden.
#define TROUPE_REWARD_EXPORT extern "C" __attribute__((visibility("default")))

namespace troupe::plugin_detail {
inline std::string& last_error() {
  thread_local std::string message;
  return message;
}
}  // namespace troupe::plugin_detail

// Exceptions never cross the C boundary: they become NaN plus troupe_reward_last_error().
#define TROUPE_REWARD(fn)                                                                            \
  TROUPE_REWARD_EXPORT int troupe_reward_abi_version(void) { return TROUPE_REWARD_ABI_VERSION; }     \
  TROUPE_REWARD_EXPORT const char* troupe_reward_last_error(void) {                                 \
    return ::troupe::plugin_detail::last_error().c_str();                                           \
  }                                                                                                  \
  TROUPE_REWARD_EXPORT double troupe_reward(const char* prompt, const char* completion, const char* metadata) { \
    ::troupe::plugin_detail::last_error().clear();                                                   \
    try {                                                                                            \
      return fn(::troupe::RewardSample{prompt, completion, ::nlohmann::json::parse(metadata)});      \
    } catch (const std::exception& e) {                                                              \
      ::troupe::plugin_detail::last_error() = e.what();                                              \
    } catch (...) {                                                                                  \
      ::troupe::plugin_detail::last_error() = "unknown exception";                                   \
    }                                                                                                \
    return std::numeric_limits<double>::quiet_NaN();                                                 \
  }
