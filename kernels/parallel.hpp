// at::parallel_for for files built without OpenMP. LibTorch's at::parallel_for is inline
// `#pragma omp parallel` in its headers (ATen/ParallelOpenMP.h): a file compiled without OpenMP
// gets the pragma ignored and runs every range on the calling thread, silently. This one is
// compiled with OpenMP (kernels/CMakeLists.txt), so callers anywhere spread their ranges over the
// intra-op threads as ATen's own kernels do. ATen ops called inside run on their thread alone.
#pragma once

#include <cstdint>
#include <functional>

namespace troupe::kernels {

// f(b, e) over [begin, end) cut into at most one range per intra-op thread, none under `grain`
// long; on the calling thread alone when the work is one grain or already in a parallel region.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

}  // namespace troupe::kernels
