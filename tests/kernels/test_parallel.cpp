// kernels::parallel_for, called from a file built without OpenMP (this one), as the engine's
// sampler calls it: its ranges must run on more than the calling thread, where ATen's inline
// at::parallel_for would run them all on it.
#include <doctest/doctest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "kernels/parallel.hpp"

using namespace troupe;

TEST_CASE("kernels::parallel_for covers the range once, on the intra-op threads") {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  std::mutex mutex;
  std::set<std::thread::id> threads;
  std::vector<std::atomic<int>> seen(1000);
  kernels::parallel_for(0, 1000, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ++seen[i];
    std::lock_guard<std::mutex> lock(mutex);
    threads.insert(std::this_thread::get_id());
  });
  for (const auto& n : seen) CHECK(n == 1);
  CHECK(threads.size() == 2);
  // One grain, or a nested call: the calling thread alone.
  threads.clear();
  kernels::parallel_for(0, 10, 10, [&](int64_t, int64_t) { threads.insert(std::this_thread::get_id()); });
  CHECK(threads == std::set<std::thread::id>{std::this_thread::get_id()});
  // An exception in a range reaches the caller.
  CHECK_THROWS_AS(kernels::parallel_for(0, 100, 1, [](int64_t b, int64_t) {
                    if (b > 0) throw std::runtime_error("range failed");
                  }),
                  std::runtime_error);
  at::set_num_threads(before);
}
