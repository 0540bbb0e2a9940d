#include "kernels/prefix_attention.hpp"

#include <limits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

namespace troupe::kernels {

std::pair<torch::Tensor, torch::Tensor> prefix_attention(const torch::Tensor& q, const std::vector<PrefixPart>& parts,
                                                         double scale) {
  TORCH_CHECK(q.dim() == 4, "prefix_attention: q must be [B, nkv, g, hd], got ", q.sizes());
  const int64_t B = q.size(0), nkv = q.size(1), g = q.size(2), hd = q.size(3);
  auto out = at::zeros({B, nkv, g, hd}, q.options().dtype(at::kFloat));
  auto lse = at::full({B, nkv, g}, -std::numeric_limits<double>::infinity(), out.options());
  // ATen's worker threads do not inherit the caller's thread-local state (grad mode among it).
  const at::ThreadLocalState state;
  at::parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t i = begin; i < end; ++i) {
      const auto& part = parts[i];
      const int64_t G = part.rows.size(0);
      auto rows = q.index_select(0, part.rows).transpose(0, 1).reshape({1, nkv, G * g, hd});
      auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(rows, part.k, part.v, 0.0, false, std::nullopt, scale);
      // The parts' rows are disjoint, so are these writes.
      out.index_copy_(0, part.rows, o.reshape({nkv, G, g, hd}).transpose(0, 1).to(at::kFloat));
      lse.index_copy_(0, part.rows, l.reshape({nkv, G, g}).transpose(0, 1));
    }
  });
  return {out, lse};
}

}  // namespace troupe::kernels
