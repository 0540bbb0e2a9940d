// The fused ops of kernels/fused.hpp: each _reference against its definition written
// independently in float64, and the CPU kernels against their references (always run); on a GPU,
// each CUDA kernel against its reference.
// Speed is bench/fused_kernels.cpp's business, not this file's.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

// torch before doctest: c10 defines a glog-style CHECK that doctest's must replace, not the
// reverse (the precompiled header orders them so too, but this file should not depend on it).
#include <torch/torch.h>

#include <doctest/doctest.h>

#include "kernels/fused.hpp"

using namespace troupe;

namespace {

torch::Tensor f64(const torch::Tensor& t) { return t.to(torch::kFloat64); }

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (f64(a) - f64(b)).abs().max().item<double>();
}

// The largest |got - want| / (atol + rtol |want|): at most 1 when every element is within tolerance.
double tolerance_used(const torch::Tensor& got, const torch::Tensor& want, double rtol, double atol) {
  auto w = f64(want).cpu();
  return ((f64(got).cpu() - w).abs() / (atol + rtol * w.abs())).max().item<double>();
}

// ---- the definitions, in float64 from the same inputs, sharing no code with kernels/ ----

// HF LlamaRMSNorm of s = x + residual, without the intermediate rounding to the input dtype.
torch::Tensor rms_norm_f64(const torch::Tensor& s, const torch::Tensor& weight, double eps) {
  auto h = f64(s);
  auto rms = (h * h).sum(-1, /*keepdim=*/true) / static_cast<double>(h.size(-1));
  return f64(weight) * (h / torch::sqrt(rms + eps));
}

// x [B, heads, T, D]; cos, sin [B or 1, T, D]. The rotation written per half: for j < D/2,
// out[j] = x[j] cos[j] - x[j + D/2] sin[j], out[j + D/2] = x[j + D/2] cos[j + D/2] + x[j] sin[j + D/2].
torch::Tensor rotary_f64(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(3) / 2;
  auto x1 = f64(x).narrow(3, 0, half), x2 = f64(x).narrow(3, half, half);
  auto c = f64(cos).unsqueeze(1), s = f64(sin).unsqueeze(1);
  auto lo = x1 * c.narrow(3, 0, half) - x2 * s.narrow(3, 0, half);
  auto hi = x2 * c.narrow(3, half, half) + x1 * s.narrow(3, half, half);
  return torch::cat({lo, hi}, 3);
}

torch::Tensor swiglu_f64(const torch::Tensor& gate, const torch::Tensor& up) {
  auto g = f64(gate);
  return g / (1 + torch::exp(-g)) * f64(up);
}

// Row n: z[t] - logsumexp(z), z = logits / temperature, the sum computed after subtracting the max.
torch::Tensor target_logprobs_f64(const torch::Tensor& logits, const torch::Tensor& targets, double temperature) {
  auto z = f64(logits) / temperature;
  auto m = std::get<0>(z.max(1, /*keepdim=*/true));
  auto lse = m.squeeze(1) + torch::log(torch::exp(z - m).sum(1));
  return z.gather(1, targets.unsqueeze(1)).squeeze(1) - lse;
}

// (cos, sin) [B, T, D] of Hugging Face's rotary embedding (theta 10000) at positions 0.. T-1 + shift b.
std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(int64_t B, int64_t T, int64_t D) {
  auto inv_freq = 1.0 / torch::pow(10000.0, torch::arange(0, D, 2, torch::kFloat64) / static_cast<double>(D));
  auto positions = torch::arange(T, torch::kFloat64).unsqueeze(0) + 3 * torch::arange(B, torch::kFloat64).unsqueeze(1);
  auto freqs = positions.unsqueeze(-1) * inv_freq;  // (B, T, D/2)
  auto emb = torch::cat({freqs, freqs}, -1);        // (B, T, D)
  return {emb.cos().to(torch::kFloat32), emb.sin().to(torch::kFloat32)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CPU: the references against the definitions.

TEST_CASE("rms_norm_residual_reference is Hugging Face's RMSNorm of x + residual") {
  torch::manual_seed(0);
  for (int64_t H : {64, 576, 1000}) {
    CAPTURE(H);
    auto x = torch::randn({3, 5, H}), residual = torch::randn({3, 5, H}), weight = 1 + 0.1 * torch::randn({H});
    auto [out, sum] = kernels::rms_norm_residual_reference(x, residual, weight, 1e-6);
    CHECK(torch::equal(sum, x + residual));
    CHECK(max_abs_diff(out, rms_norm_f64(f64(x) + f64(residual), weight, 1e-6)) < 1e-5);

    auto [plain, same] = kernels::rms_norm_residual_reference(x, torch::Tensor(), weight, 1e-5);
    CHECK(same.is_same(x));
    CHECK(max_abs_diff(plain, rms_norm_f64(x, weight, 1e-5)) < 1e-5);

    // bfloat16: the sum rounded to bfloat16 first, as Hugging Face's residual add does.
    auto xb = x.to(torch::kBFloat16), rb = residual.to(torch::kBFloat16), wb = weight.to(torch::kBFloat16);
    auto [outb, sumb] = kernels::rms_norm_residual_reference(xb, rb, wb, 1e-6);
    CHECK((outb.scalar_type() == torch::kBFloat16 && sumb.scalar_type() == torch::kBFloat16));
    CHECK(tolerance_used(outb, rms_norm_f64(sumb, wb, 1e-6), 2e-2, 2e-2) <= 1);
  }
}

TEST_CASE("rotary_reference rotates each pair (j, j + D/2) by its angle") {
  torch::manual_seed(1);
  for (int64_t cos_batch : {1, 2}) {
    CAPTURE(cos_batch);
    auto x = torch::randn({2, 3, 7, 64});
    auto [cos, sin] = rope_cos_sin(cos_batch, 7, 64);
    auto out = kernels::rotary_reference(x, cos, sin);
    CHECK(max_abs_diff(out, rotary_f64(x, cos, sin)) < 1e-5);
    // A rotation: each pair keeps its length (cos and sin repeat over the halves of D).
    auto pair_norm = [](const torch::Tensor& t) { return t.narrow(3, 0, 32).pow(2) + t.narrow(3, 32, 32).pow(2); };
    CHECK(max_abs_diff(pair_norm(out), pair_norm(x)) < 1e-4);
  }
  auto x = torch::randn({1, 2, 3, 8});
  CHECK(torch::allclose(kernels::rotary_reference(x, torch::ones({1, 3, 8}), torch::zeros({1, 3, 8})), x));
  CHECK_THROWS_WITH(kernels::rotary_reference(x, torch::ones({1, 4, 8}), torch::zeros({1, 4, 8})),
                    doctest::Contains("must be [B or 1, T, D]"));
}

TEST_CASE("swiglu_reference is silu(gate) * up") {
  torch::manual_seed(2);
  auto gate = 3 * torch::randn({4, 1001}), up = torch::randn({4, 1001});
  CHECK(max_abs_diff(kernels::swiglu_reference(gate, up), swiglu_f64(gate, up)) < 1e-5);
  CHECK_THROWS_WITH(kernels::swiglu_reference(gate, up.narrow(1, 0, 1000)), doctest::Contains("must have one shape"));
}

TEST_CASE("target_logprobs_reference and its backward equal log_softmax, gather and autograd in float64") {
  torch::manual_seed(3);
  for (double temperature : {1.0, 0.7}) {
    for (int64_t V : {7, 1000}) {
      CAPTURE(temperature);
      CAPTURE(V);
      auto logits = 2 * torch::randn({9, V});
      auto targets = torch::randint(0, V, {9});
      auto upstream = torch::randn({9});

      auto logp = kernels::target_logprobs_reference(logits, targets, temperature);
      CHECK((logp.scalar_type() == torch::kFloat32));
      CHECK(max_abs_diff(logp, target_logprobs_f64(logits, targets, temperature)) < 1e-5);
      auto gathered = torch::log_softmax(f64(logits) / temperature, 1).gather(1, targets.unsqueeze(1)).squeeze(1);
      CHECK(max_abs_diff(logp, gathered) < 1e-5);

      auto l64 = f64(logits).requires_grad_(true);
      auto want =
          torch::autograd::grad({(target_logprobs_f64(l64, targets, temperature) * f64(upstream)).sum()}, {l64})[0];
      auto got = kernels::target_logprobs_backward_reference(logits, targets, upstream, temperature);
      CHECK((got.scalar_type() == torch::kFloat32));
      CHECK(max_abs_diff(got, want) < 1e-6);

      // bfloat16 logits: float32 log-probs of the bfloat16 values, a bfloat16 gradient.
      auto lb = logits.to(torch::kBFloat16);
      CHECK(max_abs_diff(kernels::target_logprobs_reference(lb, targets, temperature),
                         target_logprobs_f64(lb, targets, temperature)) < 1e-5);
      auto gb = kernels::target_logprobs_backward_reference(lb, targets, upstream, temperature);
      CHECK((gb.scalar_type() == torch::kBFloat16));
      auto lb64 = f64(lb).requires_grad_(true);
      auto wantb =
          torch::autograd::grad({(target_logprobs_f64(lb64, targets, temperature) * f64(upstream)).sum()}, {lb64})[0];
      CHECK(tolerance_used(gb, wantb, 1e-2, 1e-4) <= 1);
    }
  }
  CHECK_THROWS_WITH(kernels::target_logprobs_reference(torch::zeros({3, 5}), torch::zeros({2}, torch::kLong)),
                    doctest::Contains("must be [N, V] and [N]"));
  CHECK_THROWS_WITH(kernels::target_logprobs_reference(torch::zeros({3, 5}), torch::zeros({3}, torch::kLong), 0.0),
                    doctest::Contains("temperature must be positive"));
}

TEST_CASE("swiglu and the token log-probs refuse CPU tensors, or say the build has no CUDA") {
  const std::string expected = kernels::fused_cuda_built() ? "must be a CUDA tensor" : "built without CUDA";
  auto t = torch::randn({2, 3, 4, 8});
  auto logits = torch::randn({3, 10});
  auto targets = torch::zeros({3}, torch::kLong);
  CHECK_THROWS_WITH(kernels::swiglu(t, t), doctest::Contains(expected.c_str()));
  CHECK_THROWS_WITH(kernels::target_logprobs(logits, targets), doctest::Contains(expected.c_str()));
  CHECK_THROWS_WITH(kernels::target_logprobs_backward(logits, targets, torch::ones({3})),
                    doctest::Contains(expected.c_str()));
}

TEST_CASE("on the CPU, the fused RMSNorm and rotary refuse what their contract excludes") {
  auto x = torch::randn({2, 8});
  CHECK_THROWS_WITH(kernels::rms_norm_residual(x, x, torch::ones({7}), 1e-6), doctest::Contains("must be [..., H] and [H]"));
  CHECK_THROWS_WITH(kernels::rms_norm_residual(x, x.to(torch::kBFloat16), torch::ones({8}), 1e-6),
                    doctest::Contains("residual must be Float"));
  CHECK_THROWS_WITH(kernels::rms_norm_residual(x.to(torch::kFloat64), {}, torch::ones({8}, torch::kFloat64), 1e-6),
                    doctest::Contains("must be float32, bfloat16 or float16"));
  auto q = torch::randn({1, 2, 3, 8});
  CHECK_THROWS_WITH(kernels::rotary(q, torch::ones({1, 4, 8}), torch::zeros({1, 4, 8})),
                    doctest::Contains("must be [B or 1, T, D]"));
  auto w = torch::ones({8}).requires_grad_(true);
  CHECK_THROWS_WITH(kernels::rms_norm_residual(x, {}, w, 1e-6), doctest::Contains("NoGradGuard"));
  if (kernels::fused_cuda_built() && torch::cuda::is_available())
    CHECK_THROWS_WITH(kernels::rms_norm_residual(x, x.cuda(), torch::ones({8}), 1e-6),
                      doctest::Contains("the first input on the CPU"));
}

// ---------------------------------------------------------------------------------------------
// Each fused kernel against its reference, on the same device and the same inputs: the CPU's
// kernels always, the GPU's where there is one.

namespace {

struct Tolerance {
  double rtol, atol;
};

// float32 to 1e-5; bfloat16 and float16 to 1e-2 (one rounding of the result may differ).
Tolerance tolerance_for(torch::ScalarType t) {
  return t == torch::kFloat32 ? Tolerance{1e-5, 1e-5} : Tolerance{1e-2, 1e-2};
}

const char* dtype_name(torch::ScalarType t) {
  return t == torch::kFloat32 ? "float32" : t == torch::kBFloat16 ? "bfloat16" : "float16";
}

// Checks got against want and returns the max |difference|.
double expect_close(const torch::Tensor& got, const torch::Tensor& want, Tolerance tol) {
  CHECK((got.scalar_type() == want.scalar_type()));
  CHECK((got.sizes() == want.sizes()));
  CHECK(tolerance_used(got, want, tol.rtol, tol.atol) <= 1);
  return max_abs_diff(got, want);
}

// Whether the GPU tests can run; says why not once, not once per test case.
bool gpu_ready() {
  static const bool ready = [] {
    if (!kernels::fused_cuda_built()) {
      MESSAGE("GPU part skipped: this build has no CUDA kernels (kernels/fused_cuda.cu not compiled)");
      return false;
    }
    if (!torch::cuda::is_available()) {
      MESSAGE("GPU part skipped: no CUDA device here (the CPU tests above still ran)");
      return false;
    }
    return true;
  }();
  return ready;
}

const torch::ScalarType kDtypes[] = {torch::kFloat32, torch::kBFloat16, torch::kHalf};

// Each fused kernel on `device` against its reference on the same inputs. swiglu has no CPU kernel.
void check_fused_against_references(torch::Device device) {
  torch::manual_seed(4);
  const bool cpu = device.is_cpu();

  for (auto dtype : kDtypes) {
    const auto opts = torch::TensorOptions().dtype(dtype).device(device);
    const auto tol = tolerance_for(dtype);
    double err_norm = 0, err_sum = 0, err_rope = 0, err_swiglu = 0;

    // rms_norm_residual: hidden sizes of SmolLM (576), of Qwen2.5-1.5B (1536), a head (64), and
    // sizes that are no multiple of a warp.
    for (int64_t H : {64, 576, 1000, 1536, 4099}) {
      CAPTURE(H);
      auto x = torch::randn({3, 37, H}, opts), residual = torch::randn({3, 37, H}, opts);
      auto weight = (1 + 0.1 * torch::randn({H})).to(opts);
      auto [out, sum] = kernels::rms_norm_residual(x, residual, weight, 1e-6);
      auto [want, want_sum] = kernels::rms_norm_residual_reference(x, residual, weight, 1e-6);
      CHECK(torch::equal(sum, want_sum));  // one rounded add: the same bits
      err_sum = std::max(err_sum, max_abs_diff(sum, want_sum));
      err_norm = std::max(err_norm, expect_close(out, want, tol));

      auto [plain, same] = kernels::rms_norm_residual(x, torch::Tensor(), weight, 1e-5);
      CHECK(same.is_same(x));
      err_norm =
          std::max(err_norm, expect_close(plain, kernels::rms_norm_residual_reference(x, {}, weight, 1e-5).first, tol));
    }

    // rotary: head dims 64 and 128, cos and sin per batch row or shared, odd head and token counts.
    for (int64_t D : {64, 128}) {
      for (int64_t cos_batch : {1, 2}) {
        CAPTURE(D);
        CAPTURE(cos_batch);
        auto x = torch::randn({2, 9, 37, D}, opts);
        auto [cos, sin] = rope_cos_sin(cos_batch, 37, D);
        cos = cos.to(opts);
        sin = sin.to(opts);
        auto out = kernels::rotary(x, cos, sin);
        err_rope = std::max(err_rope, expect_close(out, kernels::rotary_reference(x, cos, sin), tol));
      }
    }

    // On the CPU, x as the attention hands it over: a [B, T, heads, D] view transposed, and the
    // float32 result the plain ops' bits (no fma contraction, the same roundings).
    if (cpu) {
      auto x = torch::randn({2, 37, 9, 64}, opts).transpose(1, 2);
      auto [cos, sin] = rope_cos_sin(2, 37, 64);
      cos = cos.to(opts);
      sin = sin.to(opts);
      auto out = kernels::rotary(x, cos, sin), want = kernels::rotary_reference(x, cos, sin);
      err_rope = std::max(err_rope, expect_close(out, want, tol));
      if (dtype == torch::kFloat32) CHECK(torch::equal(out, want));
      // And a residual stream that is a slice of a wider buffer.
      auto wide = torch::randn({5, 2 * 576}, opts), residual = torch::randn({5, 576}, opts);
      auto weight = (1 + 0.1 * torch::randn({576})).to(opts);
      auto [normed, sum] = kernels::rms_norm_residual(wide.narrow(1, 100, 576), residual, weight, 1e-6);
      auto [want_normed, want_sum] = kernels::rms_norm_residual_reference(wide.narrow(1, 100, 576), residual, weight, 1e-6);
      CHECK(torch::equal(sum, want_sum));
      err_norm = std::max(err_norm, expect_close(normed, want_normed, tol));
      MESSAGE(std::string(dtype_name(dtype)), " on the CPU, max |fused - reference|: rms_norm ", err_norm, " (sum ",
              err_sum, "), rotary ", err_rope);
      continue;
    }

    // swiglu: an intermediate size (1536) and an odd element count.
    for (auto shape : {std::vector<int64_t>{4, 37, 1536}, std::vector<int64_t>{7, 1001}, std::vector<int64_t>{5}}) {
      auto gate = 3 * torch::randn(shape, opts), up = torch::randn(shape, opts);
      err_swiglu =
          std::max(err_swiglu, expect_close(kernels::swiglu(gate, up), kernels::swiglu_reference(gate, up), tol));
    }
    // Inputs one element past a 16-byte boundary take the kernel's element-by-element path.
    auto gate = (3 * torch::randn({4100}, opts)).narrow(0, 1, 4099), up = torch::randn({4100}, opts).narrow(0, 1, 4099);
    err_swiglu = std::max(err_swiglu, expect_close(kernels::swiglu(gate, up), kernels::swiglu_reference(gate, up), tol));

    MESSAGE(std::string(dtype_name(dtype)), " max |fused - reference|: rms_norm ", err_norm, " (sum ", err_sum, "), rotary ",
            err_rope, ", swiglu ", err_swiglu);
  }
}

}  // namespace

TEST_CASE("on the CPU, the fused RMSNorm and rotary equal their references") {
  check_fused_against_references(torch::kCPU);
}

TEST_CASE("on the GPU, the fused kernels equal their references") {
  if (!gpu_ready()) return;
  check_fused_against_references(torch::Device(torch::kCUDA, 0));
}

TEST_CASE("on the GPU, target_logprobs and its backward equal their references") {
  if (!gpu_ready()) return;
  const torch::Device cuda(torch::kCUDA, 0);
  torch::manual_seed(5);

  for (auto dtype : kDtypes) {
    // The log-probs are float32 from the same inputs: float32's tolerance for every dtype. The
    // gradient is in the logits' dtype; in bfloat16 and float16 its entries are as small as 1/V,
    // so a smaller atol there (float32's 1e-5 covers 1 - p with p near 1 scaled by 1 / 0.7).
    const Tolerance value_tol{1e-5, 1e-5};
    const Tolerance grad_tol = dtype == torch::kFloat32 ? Tolerance{1e-5, 1e-5} : Tolerance{1e-2, 1e-4};
    double err_value = 0, err_grad = 0, err_autograd = 0;

    // V: SmolLM's 49152 (a multiple of the 512 threads), 50000 and Qwen's 151936 (not), a small
    // one and one smaller than a warp.
    for (int64_t V : {49152, 50000, 151936, 1000, 7}) {
      for (double temperature : {1.0, 0.7}) {
        CAPTURE(V);
        CAPTURE(temperature);
        const int64_t N = V > 100000 ? 5 : 37;
        auto logits = (3 * torch::randn({N, V}, torch::TensorOptions().device(cuda))).to(dtype);
        auto targets = torch::randint(0, V, {N}, torch::TensorOptions().dtype(torch::kLong).device(cuda));
        auto upstream = torch::randn({N}, torch::TensorOptions().device(cuda));

        auto got = kernels::target_logprobs_forward(logits, targets, temperature);
        err_value = std::max(
            err_value, expect_close(got, kernels::target_logprobs_reference(logits, targets, temperature), value_tol));

        auto grad = kernels::target_logprobs_backward(logits, targets, upstream, temperature);
        auto want = kernels::target_logprobs_backward_reference(logits, targets, upstream, temperature);
        err_grad = std::max(err_grad, expect_close(grad, want, grad_tol));

        // Through autograd: the differentiable entry point calls the same pair.
        auto leaf = logits.detach().requires_grad_(true);
        auto g =
            torch::autograd::grad({(kernels::target_logprobs(leaf, targets, temperature) * upstream).sum()}, {leaf})[0];
        err_autograd = std::max(err_autograd, expect_close(g, want, grad_tol));
      }
    }

    // Rows with -inf logits (masked vocabulary) other than at the target.
    auto logits = torch::randn({4, 3000}, torch::TensorOptions().device(cuda)).to(dtype);
    logits.narrow(1, 0, 1500).fill_(-std::numeric_limits<float>::infinity());
    auto targets = torch::randint(1500, 3000, {4}, torch::TensorOptions().dtype(torch::kLong).device(cuda));
    auto masked = kernels::target_logprobs_forward(logits, targets, 1.0);
    CHECK(torch::isfinite(masked).all().item<bool>());
    err_value =
        std::max(err_value, expect_close(masked, kernels::target_logprobs_reference(logits, targets, 1.0), value_tol));
    auto ones = torch::ones({4}, torch::TensorOptions().device(cuda));
    err_grad = std::max(
        err_grad, expect_close(kernels::target_logprobs_backward(logits, targets, ones, 1.0),
                               kernels::target_logprobs_backward_reference(logits, targets, ones, 1.0), grad_tol));

    MESSAGE(std::string(dtype_name(dtype)), " max |fused - reference|: log-probs ", err_value, ", backward ", err_grad,
            ", through autograd ", err_autograd);
  }
}

TEST_CASE("on the GPU, the fused kernels refuse what their contract excludes") {
  if (!gpu_ready()) return;
  const auto opts = torch::TensorOptions().device(torch::kCUDA, 0);
  auto x = torch::randn({2, 8}, opts);
  CHECK_THROWS_WITH(kernels::swiglu(x.t(), x.t()), doctest::Contains("must be contiguous"));
  CHECK_THROWS_WITH(kernels::swiglu(x, x.to(torch::kBFloat16)), doctest::Contains("must be Float"));
  CHECK_THROWS_WITH(kernels::swiglu(x.to(torch::kFloat64), x.to(torch::kFloat64)),
                    doctest::Contains("must be float32, bfloat16 or float16"));
  CHECK_THROWS_WITH(kernels::rms_norm_residual(x, x, torch::ones({7}, opts), 1e-6),
                    doctest::Contains("must be [..., H] and [H]"));
  CHECK_THROWS_WITH(kernels::rms_norm_residual(x, x.cpu(), torch::ones({8}, opts), 1e-6),
                    doctest::Contains("must be a CUDA tensor"));
  CHECK_THROWS_WITH(kernels::target_logprobs_forward(x, torch::zeros({2}, opts.dtype(torch::kInt32))),
                    doctest::Contains("must be Long"));
  auto w = x.clone().requires_grad_(true);
  CHECK_THROWS_WITH(kernels::swiglu(w, w), doctest::Contains("NoGradGuard"));
}
