// The memory-bandwidth limit the benchmarks measure their results against, in the same run.
#pragma once

#include <algorithm>
#include <chrono>

#include <torch/cuda.h>
#include <torch/torch.h>

namespace troupe::bench {

// Bytes per second of a plain copy of a buffer well beyond the caches (256 MB; read plus write
// counted), on `device`, best of five: the limit a decode step that streams its weights and its
// keys and values cannot beat.
inline double copy_bandwidth(const torch::Device& device = torch::kCPU) {
  auto src = torch::rand({64 << 20}, torch::TensorOptions().device(device));
  auto dst = torch::empty_like(src);
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index() < 0 ? -1 : device.index());
  };
  dst.copy_(src);  // first touch of the pages (or the allocator's first use) outside the timing
  sync();
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    dst.copy_(src);
    sync();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * src.numel() * src.element_size() / s);
  }
  return best;
}

}  // namespace troupe::bench
