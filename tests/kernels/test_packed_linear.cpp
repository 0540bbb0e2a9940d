// Linear layers through a packed oneDNN weight (kernels/packed_linear.hpp) against x times the
// same weight in float64: float32 wherever LibTorch has oneDNN, bfloat16 where this CPU's bf16 is
// native; elsewhere, that no packed copy is made.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "kernels/cpu_features.hpp"
#include "kernels/packed_linear.hpp"

using namespace troupe::kernels;

namespace {

// x W^T + b through the packed weight, in `dtype`, against float64 and against F::linear on the
// plain weight, for any row count and leading dimensions. `tolerance`: of the largest |output|.
void check_packed(torch::ScalarType dtype, double tolerance) {
  torch::manual_seed(0);
  // (N, K, M): SmolLM2's q/k/v, down and LM head shapes, the tiny fixtures', odd counts.
  for (auto [N, K, M] : {std::tuple<int64_t, int64_t, int64_t>{960, 576, 1}, {576, 1536, 1}, {4096, 576, 3},
                         {96, 64, 1}, {33, 40, 7}, {160, 64, 40}, {1536, 576, 128}}) {
    CAPTURE(N);
    CAPTURE(K);
    CAPTURE(M);
    auto w = (torch::randn({N, K}) * 0.05).to(dtype);
    auto x = torch::randn({M, K}).to(dtype);
    auto bias = torch::randn({N}).to(dtype);
    auto packed = pack_linear_weight(w);
    for (bool with_bias : {false, true}) {
      auto ref = torch::matmul(x.to(torch::kFloat64), w.to(torch::kFloat64).t());
      if (with_bias) ref = ref + bias.to(torch::kFloat64);
      auto y = packed_linear(x, packed, with_bias ? bias : torch::Tensor(), N);
      REQUIRE((y.sizes() == ref.sizes()));
      CHECK((y.scalar_type() == dtype));
      const double err = ((y.to(torch::kFloat64) - ref).abs().max() / ref.abs().max()).item<double>();
      CHECK(err < tolerance);
      // The plain path (F::linear on the unpacked weight) gives what the packed one gives, up to
      // the order of summation.
      auto plain = torch::nn::functional::linear(x, w, with_bias ? bias : torch::Tensor());
      const double vs_plain = ((y.to(torch::kFloat64) - plain.to(torch::kFloat64)).abs().max() /
                               ref.abs().max()).item<double>();
      CHECK(vs_plain < tolerance);
      if (M == 1 && N == 960) MESSAGE(dtype << " packed vs float64: " << err << "; vs the plain path: " << vs_plain);
    }
    auto y3 = packed_linear(x.unsqueeze(0), packed, {}, N);  // leading dimensions pass through
    CHECK((y3.sizes() == torch::IntArrayRef({1, M, N})));
    CHECK(packed_linear(x.narrow(0, 0, 0), packed, {}, N).size(0) == 0);  // no rows: no call
    // Activations of another dtype than the packed weight's are refused, not converted.
    auto other = dtype == torch::kFloat32 ? torch::kBFloat16 : torch::kFloat32;
    CHECK_THROWS_WITH_AS(packed_linear(x.to(other), packed, {}, N), doctest::Contains("of the packed weight"),
                         c10::Error);
  }
}

}  // namespace

TEST_CASE("a packed float32 weight gives x W^T + b wherever LibTorch has oneDNN") {
  auto probe = torch::zeros({8, 8});
  CHECK_FALSE(packed_linear_pays(probe, torch::kBFloat16));  // activations of another dtype: never
  CHECK_FALSE(packed_linear_pays(probe.to(torch::kFloat64), torch::kFloat64));  // float64: never
  if (!at::hasMKLDNN()) {
    MESSAGE("no oneDNN in this LibTorch; only the refusals are checked");
    CHECK_FALSE(packed_linear_pays(probe, torch::kFloat32));
    return;
  }
  REQUIRE(packed_linear_pays(probe, torch::kFloat32));
  check_packed(torch::kFloat32, 1e-5);  // float32 output: sums of 1536 terms in another order
  set_packed_linear(false);  // the benchmarks' switch
  CHECK_FALSE(packed_linear_pays(probe, torch::kFloat32));
  set_packed_linear(true);
  CHECK(packed_linear_pays(probe, torch::kFloat32));
}

TEST_CASE("a packed bf16 weight gives x W^T + b where bf16 is native") {
  const auto bf16 = troupe::cpu_bf16();
  auto probe = torch::zeros({8, 8}, torch::kBFloat16);
  CHECK_FALSE(packed_linear_pays(probe, torch::kFloat32));  // activations of another dtype: never
  if (!packed_linear_pays(probe, torch::kBFloat16)) {
    MESSAGE("no packed bf16 weights here (" << bf16.reason << "); only the refusals are checked");
    CHECK_FALSE((bf16.native && at::hasMKLDNN()));  // native bf16 with oneDNN must pack
    return;
  }
  CHECK(bf16.native);
  check_packed(torch::kBFloat16, 8e-3);  // bf16 output: rounded by up to 2^-9 of itself
  set_packed_linear(false);
  CHECK_FALSE(packed_linear_pays(probe, torch::kBFloat16));
  set_packed_linear(true);
  CHECK(packed_linear_pays(probe, torch::kBFloat16));
}
