// The one-pass Gumbel-max sampler (kernels/gumbel_max.hpp) against the ATen ops it replaced in the
// engine: argmax(logp - log(-log(u))) with u from uniform_(0, 1, gen). Same seed, same token, row
// after row, and the generator left in the same state, so a sequence's samples do not depend on
// which of the two ran.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "kernels/gumbel_max.hpp"

using namespace troupe;

namespace {

int64_t reference(const torch::Tensor& logp, at::Generator& gen) {
  auto u = torch::empty_like(logp).uniform_(0.0, 1.0, gen);
  return (logp - u.log_().neg_().log_()).argmax().item<int64_t>();
}

}  // namespace

TEST_CASE("gumbel_max draws the token ATen's uniform_, logs and argmax draw, from the same generator state") {
  torch::manual_seed(0);
  // SmolLM2's vocabulary, sizes with a last group of fewer than 8, and a single token; the vector
  // loop (on this CPU, when it has AVX2) and the plain one.
  for (auto loop : {kernels::Loop::best, kernels::Loop::plain}) {
    for (int64_t V : {49152, 1003, 13, 8, 1}) {
      CAPTURE(V);
      CAPTURE(static_cast<int>(loop));
      auto ours = at::make_generator<at::CPUGeneratorImpl>(1234 + V);
      auto theirs = at::make_generator<at::CPUGeneratorImpl>(1234 + V);
      const int rows = V > 10000 ? 300 : 3000;
      int64_t distinct = 0, last = -1;
      for (int r = 0; r < rows; ++r) {
        // Peaked and flat rows: logits of spread 1 to 8, some tokens cut to -inf (top-k/top-p).
        auto logp = (torch::randn({V}) * (1 + r % 8)).log_softmax(0);
        if (r % 3 == 0 && V > 1) logp.masked_fill_(torch::rand({V}) < 0.5, -std::numeric_limits<float>::infinity());
        if (!torch::isfinite(logp).any().item<bool>()) logp[0] = 0.0f;
        const int64_t want = reference(logp, theirs);
        const int64_t got = kernels::gumbel_max(logp, ours, loop);
        REQUIRE(got == want);
        CHECK(std::isfinite(logp[got].item<float>()));
        distinct += got != last;
        last = got;
      }
      // Both generators advanced by the same V outputs per row: their next draws agree.
      CHECK(torch::equal(ours.get_state(), theirs.get_state()));
      if (V > 1) CHECK(distinct > rows / 2);  // draws, not a fixed token
    }
  }
}

TEST_CASE("gumbel_max samples from p: frequencies of 40000 draws match the probabilities") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const std::vector<double> p = {0.5, 0.25, 0.15, 0.07, 0.03, 0.0};
  auto logp = torch::tensor(p, torch::kFloat64).log().to(torch::kFloat32);
  const int n = 40000;
  std::vector<int64_t> counts(p.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[kernels::gumbel_max(logp, gen)];
  double chi2 = 0;
  for (size_t i = 0; i + 1 < p.size(); ++i) {
    const double expected = n * p[i];
    CHECK(std::abs(counts[i] - expected) < 5 * std::sqrt(expected * (1 - p[i])));  // 5 standard errors
    chi2 += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  CHECK(counts.back() == 0);  // probability 0 is never drawn
  CHECK(chi2 < 20.5);         // 4 degrees of freedom: p < 0.0005
}

TEST_CASE("gumbel_max follows ATen's argmax on NaN, and rejects what it cannot sample") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto logp = torch::full({40}, -3.0f);
  logp[17] = std::numeric_limits<float>::quiet_NaN();
  logp[29] = std::numeric_limits<float>::quiet_NaN();
  CHECK(kernels::gumbel_max(logp, gen) == 17);  // the first NaN, as argmax returns it
  CHECK_THROWS_WITH_AS(kernels::gumbel_max(logp.to(torch::kFloat64), gen), doctest::Contains("float32"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(kernels::gumbel_max(torch::zeros({2, 3}), gen), doctest::Contains("[V]"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::gumbel_max(torch::zeros({0}), gen), doctest::Contains("non-empty"), c10::Error);
}
