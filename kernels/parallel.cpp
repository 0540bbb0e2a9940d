#include "kernels/parallel.hpp"

#include <ATen/Parallel.h>

namespace troupe::kernels {

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { f(b, e); });
}

}  // namespace troupe::kernels
