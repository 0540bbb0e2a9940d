// The chunked log-prob kernel against its full-logits reference: values and gradients.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "kernels/logprobs.hpp"

using namespace troupe;

namespace {
double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}
}  // namespace

TEST_CASE("chunked token log-probs equal the full-logits reference, values and gradients") {
  torch::manual_seed(0);
  for (double temperature : {1.0, 0.7}) {
    for (int64_t chunk : {1, 8, 37, 64}) {
      CAPTURE(temperature);
      CAPTURE(chunk);
      auto hidden = torch::randn({3, 37, 16}, torch::requires_grad());
      auto weight = torch::randn({50, 16}, torch::requires_grad());
      auto targets = torch::randint(0, 50, {3, 37});
      auto upstream = torch::randn({3, 37});

      auto chunked = kernels::token_logprobs(hidden, weight, targets, temperature, chunk);
      auto [gh, gw] = [&] {
        auto g = torch::autograd::grad({(chunked * upstream).sum()}, {hidden, weight});
        return std::pair{g[0], g[1]};
      }();
      auto full = kernels::token_logprobs_reference(hidden, weight, targets, temperature);
      auto g_ref = torch::autograd::grad({(full * upstream).sum()}, {hidden, weight});

      CHECK(max_abs_diff(chunked, full) < 1e-5);
      CHECK(max_abs_diff(gh, g_ref[0]) < 1e-5);
      CHECK(max_abs_diff(gw, g_ref[1]) < 1e-4);
    }
  }
}

TEST_CASE("bfloat16 inputs give float32 log-probs close to the float32 computation") {
  torch::manual_seed(1);
  auto hidden = torch::randn({2, 20, 32});
  auto weight = torch::randn({100, 32}) * 0.2;
  auto targets = torch::randint(0, 100, {2, 20});
  auto ref = kernels::token_logprobs_reference(hidden, weight, targets);
  auto bf = kernels::token_logprobs(hidden.to(torch::kBFloat16), weight.to(torch::kBFloat16), targets, 1.0, 8);
  CHECK((bf.scalar_type() == torch::kFloat32));
  CHECK(max_abs_diff(bf, ref) < 0.1);
}

TEST_CASE("bad shapes are refused with the shapes in the message") {
  auto h = torch::zeros({2, 3, 4});
  CHECK_THROWS_WITH(kernels::token_logprobs(h, torch::zeros({5, 4}), torch::zeros({2, 4}, torch::kLong)),
                    doctest::Contains("must be [B, T, H] and [B, T]"));
  CHECK_THROWS_WITH(kernels::token_logprobs(h, torch::zeros({5, 3}), torch::zeros({2, 3}, torch::kLong)),
                    doctest::Contains("must be [V, H] with H = 4"));
}
