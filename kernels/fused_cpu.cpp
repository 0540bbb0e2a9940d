// The CPU kernels of kernels/fused.hpp's RMSNorm and rotary embedding, and the entry points that
// pick a tensor's device. On a CPU these ops are cheap in arithmetic and dear in dispatch: the
// plain versions are 8 and 9 ATen ops, each a dispatch, a TensorIterator and an allocation, which
// in a one-sequence decode step cost more than their arithmetic. Here each is one pass over the
// rows, spread over the threads when there are many. Plain loops: the compiler vectorizes what
// it can; the sums of squares are kept in 8 lanes so that it can. The roundings are the plain
// ops' (each product and sum rounded to the dtype where PyTorch rounds); compiled without
// contraction into fmas, so in float32 the rotary gives the plain ops' bits.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/Parallel.h>
#include <torch/types.h>

#include "kernels/fused.hpp"
#include "kernels/fused_internal.hpp"

namespace troupe::kernels {
namespace fused_detail {
namespace {

// Rows per task: about 16K elements each, so that a decode step's few rows run inline.
int64_t grain_rows(int64_t row_size) { return std::max<int64_t>(1, (int64_t{1} << 14) / row_size); }

void check_cpu(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  const at::Tensor& first = *inputs.begin()->second;
  TORCH_CHECK(is_float_dtype(first.scalar_type()), op, ": ", inputs.begin()->first,
              " must be float32, bfloat16 or float16, got ", first.scalar_type());
  for (const auto& [name, t] : inputs) {
    if (!t->defined()) continue;
    TORCH_CHECK(t->is_cpu(), op, ": ", name, " is on ", t->device(), ", the first input on the CPU");
    TORCH_CHECK(t->scalar_type() == first.scalar_type(), op, ": ", name, " must be ", first.scalar_type(), ", got ",
                t->scalar_type());
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* sum, int64_t rows, int64_t H,
                   float eps) {
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * H;
      const T* s = xr;
      if (residual) {
        T* sr = sum + r * H;
        const T* rr = residual + r * H;
        for (int64_t i = 0; i < H; ++i) sr[i] = T(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));  // rounded
        s = sr;
      }
      float lanes[8] = {};
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        for (int j = 0; j < 8; ++j) {
          const float f = static_cast<float>(s[i + j]);
          lanes[j] += f * f;
        }
      for (; i < H; ++i) lanes[0] += static_cast<float>(s[i]) * static_cast<float>(s[i]);
      const float squares = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(H) + eps);
      T* o = out + r * H;
      for (int64_t k = 0; k < H; ++k) {
        const T normed = T(static_cast<float>(s[k]) * inv);  // Hugging Face's .to(input_dtype) before the weight
        o[k] = T(static_cast<float>(weight[k]) * static_cast<float>(normed));
      }
    }
  });
}

// a * c + b * s with each product and the sum rounded to T, as three PyTorch ops in T would.
template <typename T>
inline T rope_mix(float a, T c, float b, T s) {
  const T ac = T(a * static_cast<float>(c));
  const T bs = T(b * static_cast<float>(s));
  return T(static_cast<float>(ac) + static_cast<float>(bs));
}

}  // namespace

std::pair<at::Tensor, at::Tensor> rms_norm_residual_cpu(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                        const at::Tensor& weight_in, double eps) {
  constexpr const char* op = "rms_norm_residual";
  check_cpu(op, {{"x", &x_in}, {"residual", &residual_in}, {"weight", &weight_in}});
  check_rms_norm_shapes(op, x_in, residual_in, weight_in);
  check_no_grad(op, {x_in, residual_in, weight_in}, "rms_norm_residual_reference");
  auto x = x_in.contiguous(), weight = weight_in.contiguous();
  auto residual = residual_in.defined() ? residual_in.contiguous() : residual_in;
  const int64_t H = x.size(-1), rows = x.numel() / H;
  auto out = at::empty(x.sizes(), x.options());
  auto sum = residual.defined() ? at::empty(x.sizes(), x.options()) : x_in;
  TROUPE_DISPATCH_FLOATS(x.scalar_type(), op, [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.defined() ? residual.data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            residual.defined() ? sum.data_ptr<scalar_t>() : nullptr, rows, H, static_cast<float>(eps));
  });
  return {out, sum};
}

at::Tensor rotary_cpu(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  constexpr const char* op = "rotary";
  check_cpu(op, {{"x", &x_in}, {"cos", &cos_in}, {"sin", &sin_in}});
  check_rotary_shapes(op, x_in, cos_in, sin_in);
  check_no_grad(op, {x_in, cos_in, sin_in}, "rotary_reference");
  // x may be a transposed view (the heads of a [B, T, heads, D] projection): any strides but the last.
  auto x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  auto cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t B = x.size(0), heads = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  auto out = at::empty(x.sizes(), x.options());  // contiguous
  const bool per_batch = cos.size(0) != 1;
  TROUPE_DISPATCH_FLOATS(x.scalar_type(), op, [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
    at::parallel_for(0, B * heads * T, grain_rows(D), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t t = row % T, h = (row / T) % heads, b = row / (T * heads);
        const scalar_t* xr = xp + b * sb + h * sh + t * st;
        const scalar_t* c = cp + ((per_batch ? b : 0) * T + t) * D;
        const scalar_t* s = sp + ((per_batch ? b : 0) * T + t) * D;
        scalar_t* o = op_ + row * D;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = static_cast<float>(xr[j]), x2 = static_cast<float>(xr[j + half]);
          o[j] = rope_mix(x1, c[j], -x2, s[j]);
          o[j + half] = rope_mix(x2, c[j + half], x1, s[j + half]);
        }
      }
    });
  });
  return out;
}

}  // namespace fused_detail

std::pair<torch::Tensor, torch::Tensor> rms_norm_residual(const torch::Tensor& x, const torch::Tensor& residual,
                                                          const torch::Tensor& weight, double eps) {
  return x.is_cpu() ? fused_detail::rms_norm_residual_cpu(x, residual, weight, eps)
                    : fused_detail::rms_norm_residual_cuda(x, residual, weight, eps);
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return x.is_cpu() ? fused_detail::rotary_cpu(x, cos, sin) : fused_detail::rotary_cuda(x, cos, sin);
}

}  // namespace troupe::kernels
