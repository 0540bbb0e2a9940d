// The plain-ATen references of kernels/fused.hpp (any device), target_logprobs's autograd
// function over the fused pair, and the entry points' stand-ins when CUDA is not built.
// No kernels of its own: the CUDA ones are in fused_cuda.cu.
#include "kernels/fused.hpp"
#include "kernels/fused_internal.hpp"

#include <torch/torch.h>

namespace troupe::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// float32 statistics for float32, bfloat16 and float16 inputs; float64 stays float64.
at::ScalarType wide(at::ScalarType t) { return at::promote_types(t, torch::kFloat32); }

void check_logprobs_args(const char* op, const torch::Tensor& logits, const torch::Tensor& targets,
                         double temperature) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0), op, ": logits ",
              logits.sizes(), " and targets ", targets.sizes(), " must be [N, V] and [N]");
  TORCH_CHECK(temperature > 0, op, ": temperature must be positive, got ", temperature);
}

// Scaled float32 (or float64) logits, (N, V).
torch::Tensor scaled_logits(const torch::Tensor& logits, double temperature) {
  auto z = logits.to(wide(logits.scalar_type()));
  return temperature == 1.0 ? z : z / temperature;
}

struct TargetLogprobs : public torch::autograd::Function<TargetLogprobs> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               double temperature) {
    ctx->save_for_backward({logits, targets});
    ctx->saved_data["temperature"] = temperature;
    return target_logprobs_forward(logits, targets, temperature);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const double temperature = ctx->saved_data["temperature"].toDouble();
    // A sum() upstream hands an expanded (stride 0) gradient; the kernel wants it dense.
    auto grad = grads[0].to(torch::kFloat32).contiguous();
    return {target_logprobs_backward(saved[0], saved[1], grad, temperature), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

std::pair<torch::Tensor, torch::Tensor> rms_norm_residual_reference(const torch::Tensor& x,
                                                                    const torch::Tensor& residual,
                                                                    const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm_residual_reference: x ",
              x.sizes(), " and weight ", weight.sizes(), " must be [..., H] and [H]");
  TORCH_CHECK(!residual.defined() || residual.sizes() == x.sizes(), "rms_norm_residual_reference: residual ",
              residual.sizes(), " must have x's shape ", x.sizes());
  auto sum = residual.defined() ? x + residual : x;  // (..., H)
  auto h = sum.to(wide(sum.scalar_type()));
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return {weight * h.to(sum.scalar_type()), sum};
}

torch::Tensor rotary_reference(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  fused_detail::check_rotary_shapes("rotary_reference", x, cos, sin);
  auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // (B|1, 1, T, D)
  auto halves = x.chunk(2, -1);
  return x * c + torch::cat({-halves[1], halves[0]}, -1) * s;
}

torch::Tensor swiglu_reference(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "swiglu_reference: gate ", gate.sizes(), " and up ", up.sizes(),
              " must have one shape");
  return torch::silu(gate) * up;
}

torch::Tensor target_logprobs(const torch::Tensor& logits, const torch::Tensor& targets, double temperature) {
  return TargetLogprobs::apply(logits, targets, temperature);
}

torch::Tensor target_logprobs_reference(const torch::Tensor& logits, const torch::Tensor& targets, double temperature) {
  check_logprobs_args("target_logprobs_reference", logits, targets, temperature);
  auto logp = scaled_logits(logits, temperature).log_softmax(-1);  // (N, V)
  return logp.gather(1, targets.unsqueeze(1)).squeeze(1);
}

torch::Tensor target_logprobs_backward_reference(const torch::Tensor& logits, const torch::Tensor& targets,
                                                 const torch::Tensor& grad, double temperature) {
  check_logprobs_args("target_logprobs_backward_reference", logits, targets, temperature);
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == logits.size(0), "target_logprobs_backward_reference: grad ",
              grad.sizes(), " must be [N] with N = ", logits.size(0));
  auto z = scaled_logits(logits, temperature);
  auto g = grad.to(z.scalar_type()).unsqueeze(1);  // (N, 1)
  auto gz = -z.softmax(-1) * g;                    // (N, V)
  gz.scatter_add_(1, targets.unsqueeze(1), g);
  if (temperature != 1.0) gz.div_(temperature);
  return gz.to(logits.scalar_type());
}

#ifndef TROUPE_FUSED_CUDA
// This build has no fused_cuda.cu (no CUDA toolkit matching the torch wheel): the entry points
// exist so that callers link either way, and say what happened when called.
namespace {
void built_without_cuda(const char* op, const char* reference) {
  TORCH_CHECK(false, op, ": troupe was built without CUDA (kernels/fused_cuda.cu was not compiled: no CUDA ",
              "toolkit matching the torch wheel at configure time); use ", reference, " instead");
}
}  // namespace

bool fused_cuda_built() { return false; }

std::pair<torch::Tensor, torch::Tensor> fused_detail::rms_norm_residual_cuda(const torch::Tensor&,
                                                                             const torch::Tensor&,
                                                                             const torch::Tensor&, double) {
  built_without_cuda("rms_norm_residual", "rms_norm_residual_reference");
  return {};
}

torch::Tensor fused_detail::rotary_cuda(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  built_without_cuda("rotary", "rotary_reference");
  return {};
}

torch::Tensor swiglu(const torch::Tensor&, const torch::Tensor&) {
  built_without_cuda("swiglu", "swiglu_reference");
  return {};
}

torch::Tensor target_logprobs_forward(const torch::Tensor&, const torch::Tensor&, double) {
  built_without_cuda("target_logprobs_forward", "target_logprobs_reference");
  return {};
}

torch::Tensor target_logprobs_backward(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, double) {
  built_without_cuda("target_logprobs_backward", "target_logprobs_backward_reference");
  return {};
}
#endif

}  // namespace troupe::kernels
