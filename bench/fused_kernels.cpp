// Each fused CUDA kernel of kernels/fused.hpp against its plain-ATen reference on one GPU, at a
// model's shapes: the median time of each side, the ratio, and the bytes the op must move at
// least (inputs read once, outputs written once) per second, one JSON line per op.
// Not a test (no assertions; tests/kernels/test_fused.cpp checks the numbers). Needs a GPU: exits 2
// without one, or when this build has no CUDA kernels.
#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "kernels/fused.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// The sizes that matter for the ops here, from the models' config.json.
struct Shape {
  const char* name;
  int64_t hidden, intermediate, heads, head_dim, vocab;
};

constexpr Shape kShapes[] = {
    {"smollm-135m", 576, 1536, 9, 64, 49152},
    {"qwen2.5-1.5b", 1536, 8960, 12, 128, 151936},
};

struct Timing {
  int warmup = 3, repeats = 11, iters = 20;
};

// Median over `repeats` of the mean time of `iters` back-to-back calls. A synchronize closes each
// repeat; with `iters` calls per repeat its cost is spread thin, and the launches queue up as they
// would in a forward pass.
double median_seconds(const std::function<void()>& op, const Timing& t) {
  for (int i = 0; i < t.warmup; ++i) op();
  torch::cuda::synchronize();
  std::vector<double> seconds;
  for (int r = 0; r < t.repeats; ++r) {
    const auto start = Clock::now();
    for (int i = 0; i < t.iters; ++i) op();
    torch::cuda::synchronize();
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count() / t.iters);
  }
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return seconds[seconds.size() / 2];
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// Times both sides of one op and prints its line. `check` runs each side once more and returns the
// max |fused - reference|: a sanity figure beside the timings, not a test.
void report(const std::string& op, const std::string& shape, const std::string& dtype, double bytes,
            const std::function<void()>& fused, const std::function<void()>& reference,
            const std::function<double()>& check, const Timing& t) {
  const double f = median_seconds(fused, t), r = median_seconds(reference, t);
  nlohmann::json line = {{"op", op},
                         {"shape", shape},
                         {"dtype", dtype},
                         {"fused_us", f * 1e6},
                         {"reference_us", r * 1e6},
                         {"speedup", r / f},
                         {"bytes", bytes},
                         {"fused_GB_per_s", bytes / f / 1e9},
                         {"reference_GB_per_s", bytes / r / 1e9},
                         {"max_abs_diff", check()}};
  std::cout << line.dump() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape_name = "smollm-135m", dtype_name = "bfloat16";
  int64_t tokens = 4096, seq = 512;
  Timing timing;
  CLI::App app{"Fused CUDA kernels against their ATen references (needs a GPU)"};
  app.add_option("--shape", shape_name, "smollm-135m or qwen2.5-1.5b");
  app.add_option("--dtype", dtype_name, "bfloat16, float16 or float32");
  app.add_option("--tokens", tokens, "rows: batch * sequence length");
  app.add_option("--seq", seq, "sequence length of the rotary input (batch = tokens / seq)");
  app.add_option("--warmup", timing.warmup);
  app.add_option("--repeats", timing.repeats, "timed repeats; the median counts");
  app.add_option("--iters", timing.iters, "calls per timed repeat");
  CLI11_PARSE(app, argc, argv);

  if (!troupe::kernels::fused_cuda_built()) {
    std::cerr << "bench_fused_kernels: this build has no CUDA kernels (kernels/fused_cuda.cu was not compiled: "
                 "configure with a CUDA toolkit matching the torch wheel)\n";
    return 2;
  }
  if (!torch::cuda::is_available()) {
    std::cerr << "bench_fused_kernels: needs a CUDA GPU, and there is none here\n";
    return 2;
  }
  const auto* shape =
      std::find_if(std::begin(kShapes), std::end(kShapes), [&](const Shape& s) { return shape_name == s.name; });
  if (shape == std::end(kShapes)) {
    std::cerr << "--shape " << shape_name << ": expected smollm-135m or qwen2.5-1.5b\n";
    return 2;
  }
  const auto dtype = dtype_name == "float32"    ? torch::kFloat32
                     : dtype_name == "float16"  ? torch::kHalf
                     : dtype_name == "bfloat16" ? torch::kBFloat16
                                                : torch::kFloat64;
  if (dtype == torch::kFloat64 || tokens <= 0 || seq <= 0 || tokens % seq != 0) {
    std::cerr << "--dtype must be bfloat16, float16 or float32, and --tokens a positive multiple of --seq\n";
    return 2;
  }

  namespace k = troupe::kernels;
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().dtype(dtype).device(torch::kCUDA, 0);
  const double e = static_cast<double>(torch::elementSize(dtype));
  const int64_t N = tokens, H = shape->hidden, I = shape->intermediate, V = shape->vocab;
  const int64_t B = tokens / seq, heads = shape->heads, D = shape->head_dim;
  const std::string sname = shape->name;
  auto shape_of = [](std::initializer_list<int64_t> dims) {
    std::string s;
    for (auto d : dims) s += (s.empty() ? "" : "x") + std::to_string(d);
    return s;
  };

  {  // rms_norm_residual: read x, residual, weight; write out and sum.
    auto x = torch::randn({N, H}, opts), residual = torch::randn({N, H}, opts), w = torch::ones({H}, opts);
    report(
        "rms_norm_residual", sname + " " + shape_of({N, H}), dtype_name, e * (4.0 * N * H + H),
        [&] { k::rms_norm_residual(x, residual, w, 1e-6); },
        [&] { k::rms_norm_residual_reference(x, residual, w, 1e-6); },
        [&] {
          return max_abs_diff(k::rms_norm_residual(x, residual, w, 1e-6).first,
                              k::rms_norm_residual_reference(x, residual, w, 1e-6).first);
        },
        timing);
    report(
        "rms_norm", sname + " " + shape_of({N, H}), dtype_name, e * (2.0 * N * H + H),
        [&] { k::rms_norm_residual(x, {}, w, 1e-6); }, [&] { k::rms_norm_residual_reference(x, {}, w, 1e-6); },
        [&] {
          return max_abs_diff(k::rms_norm_residual(x, {}, w, 1e-6).first,
                              k::rms_norm_residual_reference(x, {}, w, 1e-6).first);
        },
        timing);
  }
  {  // rotary on the queries: read x, cos, sin; write out.
    auto x = torch::randn({B, heads, seq, D}, opts);
    auto angles = torch::rand({B, seq, D}, opts.dtype(torch::kFloat32)) * 6.3;
    auto cos = angles.cos().to(dtype), sin = angles.sin().to(dtype);
    report(
        "rotary", sname + " " + shape_of({B, heads, seq, D}), dtype_name,
        e * (2.0 * B * heads * seq * D + 2.0 * B * seq * D), [&] { k::rotary(x, cos, sin); },
        [&] { k::rotary_reference(x, cos, sin); },
        [&] { return max_abs_diff(k::rotary(x, cos, sin), k::rotary_reference(x, cos, sin)); }, timing);
  }
  {  // swiglu: read gate and up; write out.
    auto gate = torch::randn({N, I}, opts), up = torch::randn({N, I}, opts);
    report(
        "swiglu", sname + " " + shape_of({N, I}), dtype_name, e * 3.0 * N * I, [&] { k::swiglu(gate, up); },
        [&] { k::swiglu_reference(gate, up); },
        [&] { return max_abs_diff(k::swiglu(gate, up), k::swiglu_reference(gate, up)); }, timing);
  }
  {  // target log-probs: read the logits (and targets); write [N] float32, or the [N, V] gradient.
    auto logits = (3 * torch::randn({N, V}, opts.dtype(torch::kFloat32))).to(dtype);
    auto targets = torch::randint(0, V, {N}, opts.dtype(torch::kLong));
    auto grad = torch::randn({N}, opts.dtype(torch::kFloat32));
    report(
        "target_logprobs", sname + " " + shape_of({N, V}), dtype_name, e * N * V + 12.0 * N,
        [&] { k::target_logprobs_forward(logits, targets, 1.0); },
        [&] { k::target_logprobs_reference(logits, targets, 1.0); },
        [&] {
          return max_abs_diff(k::target_logprobs_forward(logits, targets, 1.0),
                              k::target_logprobs_reference(logits, targets, 1.0));
        },
        timing);
    report(
        "target_logprobs_backward", sname + " " + shape_of({N, V}), dtype_name, 2.0 * e * N * V + 12.0 * N,
        [&] { k::target_logprobs_backward(logits, targets, grad, 1.0); },
        [&] { k::target_logprobs_backward_reference(logits, targets, grad, 1.0); },
        [&] {
          return max_abs_diff(k::target_logprobs_backward(logits, targets, grad, 1.0),
                              k::target_logprobs_backward_reference(logits, targets, grad, 1.0));
        },
        timing);
  }
  return 0;
}
