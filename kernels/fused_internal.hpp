// What the entry points of kernels/fused.hpp share between their CPU kernels (fused_cpu.cpp) and
// their CUDA kernels (fused_cuda.cu): the dtype dispatch, the checks of the contract, and the
// per-device functions the entry points call. Not for callers outside kernels/.
#pragma once

#include <initializer_list>
#include <utility>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

// The contract's three dtypes (no float64: its statistics would be narrowed to float32).
#define TROUPE_DISPATCH_FLOATS(TYPE, NAME, ...)                                                             \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                            \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace troupe::kernels::fused_detail {

inline bool is_float_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

inline void check_no_grad(const char* op, std::initializer_list<at::Tensor> tensors, const char* hint) {
  if (!at::GradMode::is_enabled()) return;
  for (const auto& t : tensors) {
    TORCH_CHECK(!(t.defined() && t.requires_grad()), op, ": this kernel has no backward pass, and an input ",
                "requires grad; run it under torch::NoGradGuard, or use ", hint);
  }
}

inline void check_rms_norm_shapes(const char* op, const at::Tensor& x, const at::Tensor& residual,
                                  const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1) && x.size(-1) > 0, op, ": x ",
              x.sizes(), " and weight ", weight.sizes(), " must be [..., H] and [H], H > 0");
  TORCH_CHECK(!residual.defined() || residual.sizes() == x.sizes(), op, ": residual ", residual.sizes(),
              " must have x's shape ", x.sizes());
}

inline void check_rotary_shapes(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, op, ": x ", x.sizes(), " must be [B, heads, T, D], D even");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && (cos.size(0) == 1 || cos.size(0) == x.size(0)) &&
                  cos.size(1) == x.size(2) && cos.size(2) == x.size(3),
              op, ": cos ", cos.sizes(), " and sin ", sin.sizes(), " must be [B or 1, T, D] for x ", x.sizes());
}

// fused_cuda.cu's kernels; where it is not built, stand-ins that say so (fused_reference.cpp).
std::pair<at::Tensor, at::Tensor> rms_norm_residual_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                         const at::Tensor& weight, double eps);
at::Tensor rotary_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// fused_cpu.cpp's kernels.
std::pair<at::Tensor, at::Tensor> rms_norm_residual_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                        const at::Tensor& weight, double eps);
at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace troupe::kernels::fused_detail
