// Chunked token log-probs as a custom autograd function on ATen (CPU and CUDA alike).
// log_softmax runs in float32 even for bfloat16 models: log-prob differences feed ratios.
#include "kernels/logprobs.hpp"

#include <torch/torch.h>

#include "kernels/batch_invariant.hpp"

namespace troupe::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_args(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                double temperature, int64_t chunk) {
  TORCH_CHECK(hidden.dim() == 3 && targets.dim() == 2 && hidden.size(0) == targets.size(0) &&
                  hidden.size(1) == targets.size(1),
              "token_logprobs: hidden ", hidden.sizes(), " and targets ", targets.sizes(),
              " must be [B, T, H] and [B, T]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(2), "token_logprobs: weight ", weight.sizes(),
              " must be [V, H] with H = ", hidden.size(2));
  TORCH_CHECK(temperature > 0, "token_logprobs: temperature must be positive, got ", temperature);
  TORCH_CHECK(chunk > 0, "token_logprobs: chunk must be positive, got ", chunk);
}

// float32 for bfloat16 and float32 models; float64 models stay float64 (exactness tests).
at::ScalarType wide(at::ScalarType t) { return at::promote_types(t, torch::kFloat32); }

// (B, len, H) x (V, H) -> float32 (or float64) logits / T, (B, len, V)
torch::Tensor chunk_logits(const torch::Tensor& h, const torch::Tensor& weight, double temperature) {
  auto logits = torch::matmul(h, weight.t()).to(wide(h.scalar_type()));
  return temperature == 1.0 ? logits : logits / temperature;
}

struct ChunkedLogprobs : public torch::autograd::Function<ChunkedLogprobs> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& targets, double temperature, int64_t chunk) {
    const int64_t T = hidden.size(1);
    auto out = torch::empty(targets.sizes(), hidden.options().dtype(wide(hidden.scalar_type())));
    for (int64_t start = 0; start < T; start += chunk) {
      const int64_t len = std::min(chunk, T - start);
      auto logp = chunk_logits(hidden.narrow(1, start, len), weight, temperature).log_softmax(-1);
      out.narrow(1, start, len).copy_(logp.gather(-1, targets.narrow(1, start, len).unsqueeze(-1)).squeeze(-1));
    }
    ctx->save_for_backward({hidden, weight, targets});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["chunk"] = chunk;
    return out;
  }

  // d log p(y) / d z = onehot(y) - softmax(z), with z = h W^T / T; so per chunk
  // g_z = grad[..., None] * (onehot - softmax) / T, g_h = g_z W, g_W = g_z^T h.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& hidden = saved[0];
    const auto& weight = saved[1];
    const auto& targets = saved[2];
    const double temperature = ctx->saved_data["temperature"].toDouble();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const auto& grad = grads[0];  // (B, T)
    const int64_t T = hidden.size(1);
    auto grad_hidden = torch::zeros_like(hidden);
    const auto acc = wide(weight.scalar_type());
    auto grad_weight = torch::zeros(weight.sizes(), weight.options().dtype(acc));
    for (int64_t start = 0; start < T; start += chunk) {
      const int64_t len = std::min(chunk, T - start);
      auto h = hidden.narrow(1, start, len);
      auto g = grad.narrow(1, start, len).to(acc).unsqueeze(-1);                  // (B, len, 1)
      auto gz = -chunk_logits(h, weight, temperature).softmax(-1) * g;            // (B, len, V)
      gz.scatter_add_(-1, targets.narrow(1, start, len).unsqueeze(-1), g);
      if (temperature != 1.0) gz.div_(temperature);
      auto gz_flat = gz.reshape({-1, gz.size(-1)});                               // (B*len, V)
      grad_hidden.narrow(1, start, len).copy_(torch::matmul(gz.to(weight.scalar_type()), weight));
      grad_weight.add_(torch::matmul(gz_flat.t(), h.reshape({-1, h.size(-1)}).to(acc)));
    }
    return {grad_hidden, grad_weight.to(weight.scalar_type()), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor token_logprobs(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                             double temperature, int64_t chunk) {
  check_args(hidden, weight, targets, temperature, chunk);
  return ChunkedLogprobs::apply(hidden, weight, targets, temperature, chunk);
}

torch::Tensor token_logprobs_invariant(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                                       double temperature, int64_t chunk) {
  check_args(hidden, weight, targets, temperature, chunk);
  TORCH_CHECK(!torch::GradMode::is_enabled(), "token_logprobs_invariant: no autograd (run it under NoGradGuard)");
  const int64_t B = hidden.size(0), T = hidden.size(1);
  auto out = torch::empty(targets.sizes(), hidden.options());
  const auto t = torch::tensor({temperature}, torch::kFloat64);
  for (int64_t start = 0; start < T; start += chunk) {
    const int64_t len = std::min(chunk, T - start);
    auto logits = bi_linear(hidden.narrow(1, start, len), weight, {}).reshape({B * len, -1});  // (B*len, V)
    auto logp = bi_log_softmax(logits, t);
    out.narrow(1, start, len).copy_(logp.gather(1, targets.narrow(1, start, len).reshape({B * len, 1})).view({B, len}));
  }
  return out;
}

torch::Tensor token_logprobs_reference(const torch::Tensor& hidden, const torch::Tensor& weight,
                                       const torch::Tensor& targets, double temperature) {
  check_args(hidden, weight, targets, temperature, 1);
  auto logp = chunk_logits(hidden, weight, temperature).log_softmax(-1);
  return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1);
}

}  // namespace troupe::kernels
