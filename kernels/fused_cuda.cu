// The CUDA kernels of kernels/fused.hpp: one block per row for the row reductions (RMSNorm, token
// log-probs), one thread per element or rotary pair for the rest, float32 accumulation throughout.
// Deliberately plain: no vector loads, no per-shape tuning, no autograd (fused_reference.cpp has it).
#include "kernels/fused.hpp"
#include "kernels/fused_internal.hpp"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>

#include <ATen/Dispatch.h>
#include <ATen/core/grad_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

namespace troupe::kernels {
namespace {

using fused_detail::check_no_grad;
using fused_detail::is_float_dtype;

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr int kElementwiseThreads = 256;
constexpr int kLogprobThreads = 512;
// Elementwise kernels loop over the elements grid-stride, so the grid need not cover them.
constexpr int64_t kMaxBlocks = 65536;

// ---------------------------------------------------------------------------------------------
// Reductions. blockDim.x is always a multiple of 32 (the launches make it so): every lane of every
// warp takes part in the full-mask shuffles, and no thread leaves a kernel before its reductions.

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of v over the block, returned to every thread.
__device__ float block_sum(float v) {
  __shared__ float partial[kMaxThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  // Each warp sums the per-warp partials itself, so every thread has the total without a
  // second round through shared memory.
  v = warp_sum(lane < warps ? partial[lane] : 0.0f);
  __syncthreads();  // partial is free again for a later call
  return v;
}

// The running state of an online softmax: max m of the elements seen and s = sum of exp(z - m).
// (-inf, 0) is the empty state.
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ void max_sum_add(MaxSum& a, float z) {
  if (z > a.m) {
    a.s = a.s * expf(a.m - z) + 1.0f;
    a.m = z;
  } else if (z != -INFINITY) {  // -inf adds exp(-inf) = 0; computed, it would be exp(-inf + inf) = NaN
    a.s += expf(z - a.m);
  }
}

__device__ __forceinline__ MaxSum max_sum_merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return a;  // both empty
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_max_sum(MaxSum v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)};
    v = max_sum_merge(v, other);
  }
  return v;
}

// The online-softmax state of the whole block, returned to every thread (as block_sum).
__device__ MaxSum block_max_sum(MaxSum v) {
  __shared__ float partial_m[kMaxThreads / kWarp];
  __shared__ float partial_s[kMaxThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  v = warp_max_sum(v);
  if (lane == 0) {
    partial_m[warp] = v.m;
    partial_s[warp] = v.s;
  }
  __syncthreads();
  v = lane < warps ? MaxSum{partial_m[lane], partial_s[lane]} : MaxSum{-INFINITY, 0.0f};
  v = warp_max_sum(v);
  __syncthreads();
  return v;
}

// z / temperature as the reference computes it, one rounding: __fmul_rn is never contracted into
// an fma, so the forward and backward passes see the same scaled logit bit for bit.
template <typename T>
__device__ __forceinline__ float scaled(T logit, float inv_temperature) {
  return __fmul_rn(static_cast<float>(logit), inv_temperature);
}

// ---------------------------------------------------------------------------------------------
// Kernels.

// One block per row of H. Pass 1 forms the sum (written out when there is a residual) and the
// sum of squares; pass 2 reads the sum back and normalizes.
template <typename T, bool kResidual>
__global__ void rms_norm_residual_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                         const T* __restrict__ weight, T* __restrict__ out, T* __restrict__ sum,
                                         int64_t H, float eps) {
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * H;
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
    T s = x[offset + i];
    if constexpr (kResidual) {
      s = T(static_cast<float>(s) + static_cast<float>(residual[offset + i]));  // rounded, as PyTorch adds
      sum[offset + i] = s;
    }
    const float f = static_cast<float>(s);
    squares += f * f;
  }
  const float r = rsqrtf(block_sum(squares) / static_cast<float>(H) + eps);
  for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
    // Each thread reads back only what it wrote itself in pass 1.
    const float f = static_cast<float>(kResidual ? sum[offset + i] : x[offset + i]);
    const T normed = T(f * r);  // Hugging Face's .to(input_dtype) before the weight
    out[offset + i] = T(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

// One of x * cos + rotate_half(x) * sin's outputs: a * c + b * s with each product and the sum
// rounded to T, as three PyTorch ops in T would.
template <typename T>
__device__ __forceinline__ T rope_mix(float a, T c, float b, T s) {
  const T ac = T(__fmul_rn(a, static_cast<float>(c)));
  const T bs = T(__fmul_rn(b, static_cast<float>(s)));
  return T(__fadd_rn(static_cast<float>(ac), static_cast<float>(bs)));
}

// One thread per pair (j, j + D/2) of a row of x; pairs = B * heads * T * D/2.
template <typename T>
__global__ void rotary_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                              T* __restrict__ out, int64_t pairs, int64_t heads, int64_t seq, int64_t half,
                              bool per_batch) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs; p += stride) {
    const int64_t j = p % half;
    const int64_t row = p / half;  // over (b, h, t)
    const int64_t t = row % seq;
    const int64_t b = row / (heads * seq);
    const int64_t xi = row * 2 * half + j;
    const int64_t ci = ((per_batch ? b : 0) * seq + t) * 2 * half + j;
    const float x1 = static_cast<float>(x[xi]), x2 = static_cast<float>(x[xi + half]);
    out[xi] = rope_mix(x1, cos[ci], -x2, sin[ci]);
    out[xi + half] = rope_mix(x2, cos[ci + half], x1, sin[ci + half]);
  }
}

template <typename T>
__device__ __forceinline__ T swiglu_one(T gate, T up) {
  const float g = static_cast<float>(gate);
  const T act = T(g / (1.0f + expf(-g)));  // PyTorch's silu rounds to T before the product
  return T(__fmul_rn(static_cast<float>(act), static_cast<float>(up)));
}

// 16 bytes of elements, moved by one load or store instruction.
template <typename T>
struct alignas(16) Pack16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// `packed`: the three pointers are 16-byte aligned, so whole packs are read and written at once;
// the last n mod pack elements, or all of them when unaligned, one at a time. On an H200 at
// SmolLM2's 4096 x 1536 in bf16, element by element took 23.3 us against ATen's silu and mul's
// 18.2; in packs, 10.6 us (bench/fused_kernels.cpp).
template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, int64_t n,
                              bool packed) {
  using Pack = Pack16<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = packed ? n / Pack::kSize : 0;
  for (int64_t p = first; p < packs; p += stride) {
    const Pack g = reinterpret_cast<const Pack*>(gate)[p], u = reinterpret_cast<const Pack*>(up)[p];
    Pack o;
#pragma unroll
    for (int k = 0; k < Pack::kSize; ++k) o.v[k] = swiglu_one(g.v[k], u.v[k]);
    reinterpret_cast<Pack*>(out)[p] = o;
  }
  for (int64_t i = packs * Pack::kSize + first; i < n; i += stride) out[i] = swiglu_one(gate[i], up[i]);
}

// One block per row of V: the online max and sum of exp in one read of the row.
template <typename T>
__global__ void target_logprobs_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                       float* __restrict__ out, int64_t V, float inv_temperature) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * V;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) max_sum_add(acc, scaled(z[v], inv_temperature));
  acc = block_max_sum(acc);
  if (threadIdx.x == 0) {
    const int64_t target = targets[row];
    CUDA_KERNEL_ASSERT(target >= 0 && target < V);
    out[row] = scaled(z[target], inv_temperature) - acc.m - logf(acc.s);
  }
}

// One block per row of V: the forward pass's statistics again, then one write of the row.
template <typename T>
__global__ void target_logprobs_backward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                                const float* __restrict__ grad, T* __restrict__ grad_logits, int64_t V,
                                                float inv_temperature) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * V;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) max_sum_add(acc, scaled(z[v], inv_temperature));
  acc = block_max_sum(acc);
  const int64_t target = targets[row];
  CUDA_KERNEL_ASSERT(target >= 0 && target < V);
  const float inv_sum = 1.0f / acc.s;
  const float scale = grad[row] * inv_temperature;  // d z / d logit = 1 / temperature
  T* g = grad_logits + row * V;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = expf(scaled(z[v], inv_temperature) - acc.m) * inv_sum;
    g[v] = T(scale * ((v == target ? 1.0f : 0.0f) - p));
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: checks, then one launch on the current stream of the inputs' device.

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t elementwise_blocks(int64_t n) { return std::min(ceil_div(n, kElementwiseThreads), kMaxBlocks); }

bool aligned16(std::initializer_list<const void*> pointers) {
  return std::all_of(pointers.begin(), pointers.end(), [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; });
}

// About two elements per thread, in whole warps, at most 1024 threads.
int row_threads(int64_t H) {
  return static_cast<int>(std::clamp<int64_t>(ceil_div(ceil_div(H, 2), kWarp) * kWarp, kWarp, kMaxThreads));
}

// t lives on `first`'s CUDA device, is contiguous, and (when dtype is given) of that dtype.
void check_input(const char* op, const char* name, const at::Tensor& t, const at::Tensor& first,
                 std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device(),
              " (the _reference version runs on any device)");
  TORCH_CHECK(t.device() == first.device(), op, ": ", name, " is on ", t.device(), " but the first input is on ",
              first.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " ", t.sizes(), " with strides ", t.strides(),
              " must be contiguous (call .contiguous() first)");
  if (dtype) {
    TORCH_CHECK(t.scalar_type() == *dtype, op, ": ", name, " must be ", *dtype, ", got ", t.scalar_type());
  }
}

void check_float_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name, " must be float32, bfloat16 or float16, got ",
              t.scalar_type());
  check_input(op, name, t, t, t.scalar_type());
}

void check_logprobs_inputs(const char* op, const at::Tensor& logits, const at::Tensor& targets, double temperature) {
  check_float_input(op, "logits", logits);
  check_input(op, "targets", targets, logits, at::kLong);
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0), op, ": logits ",
              logits.sizes(), " and targets ", targets.sizes(), " must be [N, V] and [N]");
  TORCH_CHECK(logits.size(1) > 0, op, ": logits ", logits.sizes(), " has no vocabulary");
  TORCH_CHECK(logits.size(0) <= std::numeric_limits<int32_t>::max(), op, ": ", logits.size(0),
              " rows is more than one launch's grid holds");
  TORCH_CHECK(temperature > 0, op, ": temperature must be positive, got ", temperature);
}

}  // namespace

bool fused_cuda_built() { return true; }

std::pair<torch::Tensor, torch::Tensor> fused_detail::rms_norm_residual_cuda(const torch::Tensor& x,
                                                                             const torch::Tensor& residual,
                                                                             const torch::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm_residual";
  check_float_input(op, "x", x);
  if (residual.defined()) check_input(op, "residual", residual, x, x.scalar_type());
  check_input(op, "weight", weight, x, x.scalar_type());
  fused_detail::check_rms_norm_shapes(op, x, residual, weight);
  check_no_grad(op, {x, residual, weight}, "rms_norm_residual_reference");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), op, ": ", rows,
              " rows is more than one launch's grid holds");

  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty(x.sizes(), x.options());
  auto sum = residual.defined() ? at::empty(x.sizes(), x.options()) : x;
  if (rows == 0) return {out, sum};
  auto stream = at::cuda::getCurrentCUDAStream();
  TROUPE_DISPATCH_FLOATS(x.scalar_type(), op, [&] {
    if (residual.defined()) {
      rms_norm_residual_kernel<scalar_t, true><<<static_cast<unsigned>(rows), row_threads(H), 0, stream>>>(
          x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
          sum.data_ptr<scalar_t>(), H, static_cast<float>(eps));
    } else {
      rms_norm_residual_kernel<scalar_t, false><<<static_cast<unsigned>(rows), row_threads(H), 0, stream>>>(
          x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), nullptr, H,
          static_cast<float>(eps));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, sum};
}

torch::Tensor fused_detail::rotary_cuda(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  constexpr const char* op = "rotary";
  check_float_input(op, "x", x);
  check_input(op, "cos", cos, x, x.scalar_type());
  check_input(op, "sin", sin, x, x.scalar_type());
  fused_detail::check_rotary_shapes(op, x, cos, sin);
  check_no_grad(op, {x, cos, sin}, "rotary_reference");

  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty(x.sizes(), x.options());
  const int64_t pairs = x.numel() / 2;
  if (pairs == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  TROUPE_DISPATCH_FLOATS(x.scalar_type(), op, [&] {
    rotary_kernel<scalar_t><<<static_cast<unsigned>(elementwise_blocks(pairs)), kElementwiseThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), pairs,
        x.size(1), x.size(2), x.size(3) / 2, cos.size(0) != 1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  constexpr const char* op = "swiglu";
  check_float_input(op, "gate", gate);
  check_input(op, "up", up, gate, gate.scalar_type());
  TORCH_CHECK(gate.sizes() == up.sizes(), op, ": gate ", gate.sizes(), " and up ", up.sizes(), " must have one shape");
  check_no_grad(op, {gate, up}, "swiglu_reference");

  const c10::cuda::CUDAGuard guard(gate.device());
  auto out = at::empty(gate.sizes(), gate.options());
  const int64_t n = gate.numel();
  if (n == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  TROUPE_DISPATCH_FLOATS(gate.scalar_type(), op, [&] {
    const bool packed = aligned16({gate.data_ptr(), up.data_ptr(), out.data_ptr()});
    const int64_t threads = packed ? ceil_div(n, Pack16<scalar_t>::kSize) : n;
    swiglu_kernel<scalar_t><<<static_cast<unsigned>(elementwise_blocks(threads)), kElementwiseThreads, 0, stream>>>(
        gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, packed);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

torch::Tensor target_logprobs_forward(const torch::Tensor& logits, const torch::Tensor& targets, double temperature) {
  constexpr const char* op = "target_logprobs_forward";
  check_logprobs_inputs(op, logits, targets, temperature);
  check_no_grad(op, {logits}, "target_logprobs (differentiable) or target_logprobs_reference");

  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t N = logits.size(0), V = logits.size(1);
  auto out = at::empty({N}, logits.options().dtype(at::kFloat));
  if (N == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto inv_temperature = static_cast<float>(1.0 / temperature);
  TROUPE_DISPATCH_FLOATS(logits.scalar_type(), op, [&] {
    target_logprobs_kernel<scalar_t><<<static_cast<unsigned>(N), kLogprobThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), out.data_ptr<float>(), V, inv_temperature);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

torch::Tensor target_logprobs_backward(const torch::Tensor& logits, const torch::Tensor& targets,
                                       const torch::Tensor& grad, double temperature) {
  constexpr const char* op = "target_logprobs_backward";
  check_logprobs_inputs(op, logits, targets, temperature);
  check_input(op, "grad", grad, logits, at::kFloat);
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == logits.size(0), op, ": grad ", grad.sizes(),
              " must be [N] with N = ", logits.size(0));
  check_no_grad(op, {logits, grad}, "target_logprobs_backward_reference");

  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t N = logits.size(0), V = logits.size(1);
  auto grad_logits = at::empty({N, V}, logits.options());
  if (N == 0) return grad_logits;
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto inv_temperature = static_cast<float>(1.0 / temperature);
  TROUPE_DISPATCH_FLOATS(logits.scalar_type(), op, [&] {
    target_logprobs_backward_kernel<scalar_t><<<static_cast<unsigned>(N), kLogprobThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), grad.data_ptr<float>(),
        grad_logits.data_ptr<scalar_t>(), V, inv_temperature);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_logits;
}

}  // namespace troupe::kernels
