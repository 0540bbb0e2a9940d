// Chunked token log-probs on ATen (CPU and CUDA alike); log_softmax runs in float32 even for
// bfloat16 models, because log-prob differences feed importance ratios.
#include "kernels/logprobs.hpp"

#include <torch/torch.h>

namespace troupe::kernels {

namespace {
torch::Tensor gather_logprobs(const torch::Tensor& logits, const torch::Tensor& targets, double temperature) {
  auto scaled = logits.to(torch::kFloat32);
  if (temperature != 1.0) scaled = scaled / temperature;
  return scaled.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
}
}  // namespace

torch::Tensor token_logprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                             const torch::Tensor& targets, double temperature, int64_t chunk) {
  TORCH_CHECK(hidden.dim() == 3 && targets.dim() == 2 && hidden.size(0) == targets.size(0) &&
                  hidden.size(1) == targets.size(1),
              "token_logprobs: hidden ", hidden.sizes(), " and targets ", targets.sizes(), " must be [B, T, H] and [B, T]");
  TORCH_CHECK(temperature > 0, "token_logprobs: temperature must be positive, got ", temperature);
  TORCH_CHECK(chunk > 0, "token_logprobs: chunk must be positive");
  const int64_t T = hidden.size(1);
  std::vector<torch::Tensor> parts;
  for (int64_t start = 0; start < T; start += chunk) {
    int64_t len = std::min(chunk, T - start);
    auto logits = torch::nn::functional::linear(hidden.narrow(1, start, len), weight);  // (B, len, V)
    parts.push_back(gather_logprobs(logits, targets.narrow(1, start, len), temperature));
  }
  return parts.empty() ? torch::empty({hidden.size(0), 0}, hidden.options().dtype(torch::kFloat32))
                       : torch::cat(parts, 1);
}

torch::Tensor token_logprobs_reference(const torch::Tensor& hidden, const torch::Tensor& weight,
                                       const torch::Tensor& targets, double temperature) {
  return gather_logprobs(torch::matmul(hidden, weight.t()), targets, temperature);
}

}  // namespace troupe::kernels
