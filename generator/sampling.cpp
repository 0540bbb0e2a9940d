// Next-token selection shared by the plain loop and the engine.
#include "generator/sampling.hpp"

#include <torch/torch.h>

namespace troupe {

torch::Tensor sample_next(const torch::Tensor& logits, const SamplingParams& params, at::Generator& generator) {
  if (params.temperature <= 0) return logits.argmax(-1);
  auto probs = (logits.to(torch::kFloat32) / params.temperature).softmax(-1);
  return at::multinomial(probs, 1, /*replacement=*/false, generator).squeeze(-1);
}

torch::Tensor truncate_probs(torch::Tensor probs, const SamplingParams& p) {
  const int64_t V = probs.size(0);
  if (p.min_p > 0) probs = probs.masked_fill(probs < p.min_p * probs.max(), 0);
  if (p.top_k > 0 && p.top_k < V) {
    auto kth = std::get<0>(probs.topk(p.top_k)).select(0, p.top_k - 1);
    probs = probs.masked_fill(probs < kth, 0);
  }
  if (p.top_p < 1.0) {
    auto [sorted, order] = probs.sort(/*dim=*/0, /*descending=*/true);
    auto before = sorted.cumsum(0) - sorted;  // mass of the tokens ranked above each one
    auto drop_sorted = before >= p.top_p * sorted.sum();
    drop_sorted.index_put_({0}, false);  // the most likely token always stays
    probs = probs.masked_fill(torch::zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0);
  }
  return probs;
}

}  // namespace troupe
