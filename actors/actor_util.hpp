// What every actor of the graph does the same way: exceptions become exit reasons naming the
// actor, and blocking actors set their own thread count.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include <caf/all.hpp>

namespace troupe {

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
