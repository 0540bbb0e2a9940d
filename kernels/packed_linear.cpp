// The two ops are registered by LibTorch under the `mkldnn` namespace (TORCH_LIBRARY, not
// ATen's generated functions), so they are called through the dispatcher, boxed: a few
// microseconds per call, against the milliseconds of the GEMMs they run.
#include "kernels/packed_linear.hpp"

#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "kernels/cpu_features.hpp"

namespace troupe::kernels {
namespace {

std::atomic<bool> enabled{true};

std::optional<c10::OperatorHandle> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchema({name, ""});
}

struct Ops {
  std::optional<c10::OperatorHandle> reorder, linear;
  bool here = false;  // both ops present, oneDNN built in
  bool bf16 = false;  // and bf16 native on this CPU
};

const Ops& ops() {
  static const Ops o = [] {
    Ops r;
    r.reorder = find_op("mkldnn::_reorder_linear_weight");
    r.linear = find_op("mkldnn::_linear_pointwise");
    r.here = r.reorder && r.linear && at::hasMKLDNN();
    r.bf16 = r.here && cpu_bf16().native;
    return r;
  }();
  return o;
}

torch::Tensor call(const std::optional<c10::OperatorHandle>& op, std::vector<c10::IValue> stack) {
  TORCH_CHECK(op, "packed linear: LibTorch has no mkldnn ops here (check packed_linear_pays first)");
  op->callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace

bool packed_linear_pays(const torch::Tensor& weight, torch::ScalarType activations) {
  const auto dtype = weight.scalar_type();
  const bool kind = dtype == torch::kFloat32 || (dtype == torch::kBFloat16 && ops().bf16);
  return enabled.load(std::memory_order_relaxed) && kind && activations == dtype && weight.device().is_cpu() &&
         weight.dim() == 2 && ops().here && at::globalContext().userEnabledMkldnn();
}

void set_packed_linear(bool on) { enabled.store(on, std::memory_order_relaxed); }

torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && weight.device().is_cpu(),
              "pack_linear_weight: a [N, K] float32 or bfloat16 CPU weight, not ", weight.sizes(), " ", dtype);
  // No batch-size hint: the same packed weight serves decode (M = rows) and prefill.
  return call(ops().reorder, {weight.contiguous(), c10::IValue()});
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias,
                            int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() && x.device().is_cpu(), "packed_linear: CPU activations in the ",
              packed.scalar_type(), " of the packed weight, not ", x.scalar_type(), " on ", x.device());
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  if (x.numel() == 0) return torch::empty(sizes, x.options());
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  auto y = call(ops().linear, {rows, packed, bias.defined() ? c10::IValue(bias) : c10::IValue(), std::string("none"),
                               c10::List<std::optional<at::Scalar>>(), c10::IValue()});
  return y.view(sizes);
}

}  // namespace troupe::kernels
