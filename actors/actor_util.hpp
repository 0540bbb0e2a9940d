// What every actor of the graph does the same way: exceptions become exit reasons naming the
// actor, and blocking actors set their own thread count.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include <caf/all.hpp>
#include <nlohmann/json.hpp>

#include "policy/error.hpp"

namespace troupe {

// `j` as T, through T's NLOHMANN_DEFINE_TYPE_* functions (a spec a worker builds from); a
// missing or mistyped field throws Error naming `what` and the field.
template <class T>
T spec_from_json(const nlohmann::json& j, const std::string& what) {
  try {
    return j.get<T>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(what + ": " + e.what());
  }
}

// What an exception says: its what(), or "unknown exception".
std::string describe(const std::exception_ptr& p);

// Installs the handler that turns an exception inside an actor into its exit reason, prefixed
// with `who` ("generator 1: ..."); the controller monitors every actor and reports the reason.
void name_failures(caf::scheduled_actor* self, std::string who);

// LibTorch keeps the intra-op thread count per thread (OpenMP's and MKL's per-thread settings),
// but a thread's first parallel call resets it from the process-wide value; that first call is
// made here, before this thread's own count is set. n <= 0 leaves the default.
void use_threads(int64_t n);

}  // namespace troupe
