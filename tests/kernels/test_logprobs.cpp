// The chunked log-prob kernel against an independent full-logits path (plain matmul and
// log_softmax in float64, nothing from kernels/): values and gradients.
#include <doctest/doctest.h>

#include <cmath>

#include <torch/torch.h>

#include "kernels/logprobs.hpp"

using namespace troupe;

namespace {
double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// hidden [B, T, H], weight [V, H], targets [B, T] -> log p(targets) [B, T] in float64, from the
// whole [B, T, V] logits at once; differentiable in hidden and weight through plain autograd.
torch::Tensor full_logits_logprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& targets, double temperature = 1.0) {
  auto logits = torch::matmul(hidden.to(torch::kFloat64), weight.to(torch::kFloat64).t()) / temperature;  // (B, T, V)
  return torch::log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);                  // (B, T)
}
}  // namespace

TEST_CASE("chunked token log-probs equal an independent full-logits path, values and gradients") {
  torch::manual_seed(0);
  double err_value = 0, err_gh = 0, err_gw = 0;
  for (double temperature : {1.0, 0.7}) {
    for (int64_t chunk : {1, 8, 37, 64}) {
      CAPTURE(temperature);
      CAPTURE(chunk);
      auto hidden = torch::randn({3, 37, 16}, torch::requires_grad());
      auto weight = torch::randn({50, 16}, torch::requires_grad());
      auto targets = torch::randint(0, 50, {3, 37});
      auto upstream = torch::randn({3, 37});

      auto chunked = kernels::token_logprobs(hidden, weight, targets, temperature, chunk);
      auto g = torch::autograd::grad({(chunked * upstream).sum()}, {hidden, weight});
      auto full = full_logits_logprobs(hidden, weight, targets, temperature);
      auto g_ref = torch::autograd::grad({(full * upstream.to(torch::kFloat64)).sum()}, {hidden, weight});

      CHECK(max_abs_diff(chunked, full) < 1e-5);
      CHECK(max_abs_diff(g[0], g_ref[0]) < 1e-5);
      CHECK(max_abs_diff(g[1], g_ref[1]) < 1e-4);
      err_value = std::max(err_value, max_abs_diff(chunked, full));
      err_gh = std::max(err_gh, max_abs_diff(g[0], g_ref[0]));
      err_gw = std::max(err_gw, max_abs_diff(g[1], g_ref[1]));

      // The kernels' own reference and the batch-invariant path agree with the same path.
      torch::NoGradGuard no_grad;
      CHECK(max_abs_diff(kernels::token_logprobs_reference(hidden, weight, targets, temperature), full) < 1e-5);
      CHECK(max_abs_diff(kernels::token_logprobs_invariant(hidden, weight, targets, temperature, chunk), full) < 1e-5);
    }
  }
  MESSAGE("max |error| vs float64 full logits: value ", err_value, ", d hidden ", err_gh, ", d weight ", err_gw);
}

TEST_CASE("float64 inputs match the full-logits path to rounding") {
  torch::manual_seed(2);
  auto hidden = torch::randn({2, 19, 8}, torch::dtype(torch::kFloat64).requires_grad(true));
  auto weight = torch::randn({30, 8}, torch::dtype(torch::kFloat64).requires_grad(true));
  auto targets = torch::randint(0, 30, {2, 19});
  auto chunked = kernels::token_logprobs(hidden, weight, targets, 0.9, 5);
  auto full = full_logits_logprobs(hidden, weight, targets, 0.9);
  auto g = torch::autograd::grad({chunked.sum()}, {hidden, weight});
  auto g_ref = torch::autograd::grad({full.sum()}, {hidden, weight});
  CHECK((chunked.scalar_type() == torch::kFloat64));
  CHECK(max_abs_diff(chunked, full) < 1e-12);
  CHECK(max_abs_diff(g[0], g_ref[0]) < 1e-12);
  CHECK(max_abs_diff(g[1], g_ref[1]) < 1e-12);
}

TEST_CASE("zero hidden states give the uniform log-probability -log V") {
  auto hidden = torch::zeros({1, 5, 4});
  auto weight = torch::randn({40, 4});
  auto targets = torch::randint(0, 40, {1, 5});
  auto logp = kernels::token_logprobs(hidden, weight, targets, 1.0, 2);
  CHECK(max_abs_diff(logp, torch::full({1, 5}, -std::log(40.0), torch::kFloat64)) < 1e-6);
}

TEST_CASE("bfloat16 inputs give float32 log-probs close to the float32 computation") {
  torch::manual_seed(1);
  auto hidden = torch::randn({2, 20, 32});
  auto weight = torch::randn({100, 32}) * 0.2;
  auto targets = torch::randint(0, 100, {2, 20});
  auto ref = full_logits_logprobs(hidden, weight, targets);
  auto bf = kernels::token_logprobs(hidden.to(torch::kBFloat16), weight.to(torch::kBFloat16), targets, 1.0, 8);
  CHECK((bf.scalar_type() == torch::kFloat32));
  CHECK(max_abs_diff(bf, ref) < 0.1);
  MESSAGE("bfloat16 max |error| vs float64 full logits: ", max_abs_diff(bf, ref));
}

TEST_CASE("bad shapes are refused with the shapes in the message") {
  auto h = torch::zeros({2, 3, 4});
  CHECK_THROWS_WITH(kernels::token_logprobs(h, torch::zeros({5, 4}), torch::zeros({2, 4}, torch::kLong)),
                    doctest::Contains("must be [B, T, H] and [B, T]"));
  CHECK_THROWS_WITH(kernels::token_logprobs(h, torch::zeros({5, 3}), torch::zeros({2, 3}, torch::kLong)),
                    doctest::Contains("must be [V, H] with H = 4"));
}
