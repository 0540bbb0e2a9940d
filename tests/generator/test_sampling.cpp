// The engine's top-k, top-p and min-p truncation (generator/sampling.hpp) against
// transformers' logits warpers at ordinary values, alone and chained in troupe's order
// (fixtures: tests/generator/make_sampling_fixtures.py).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "generator/sampling.hpp"
#include "tests/test_util.hpp"

using namespace troupe;
using Json = nlohmann::json;

namespace {

Json load_fixture() {
  std::ifstream in(test::fixtures() / "sampling" / "sampling.json");
  REQUIRE_MESSAGE(in.good(), "missing fixture sampling/sampling.json (tests/generator/make_sampling_fixtures.py)");
  return Json::parse(in);
}

torch::Tensor from_json(const Json& j) { return torch::tensor(j.get<std::vector<double>>(), torch::kFloat64); }

}  // namespace

TEST_CASE("top-k, top-p and min-p keep the tokens transformers' warpers keep, with their probabilities") {
  const Json fixture = load_fixture();
  MESSAGE("reference: transformers ", fixture.at("transformers").get<std::string>(), ", ",
          fixture.at("cases").size(), " cases");
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    double max_err = 0;
    for (const Json& c : fixture.at("cases")) {
      const SamplingParams p{.temperature = c.at("temperature").get<double>(),
                             .top_p = c.at("top_p").get<double>(),
                             .top_k = c.at("top_k").get<int64_t>(),
                             .min_p = c.at("min_p").get<double>()};
      const std::string row = c.at("row").get<std::string>();
      const std::string type = c10::toString(dtype);
      CAPTURE(row);
      CAPTURE(p.temperature);
      CAPTURE(p.top_k);
      CAPTURE(p.top_p);
      CAPTURE(p.min_p);
      CAPTURE(type);
      auto logits = from_json(fixture.at("rows").at(row)).to(dtype);  // (V)
      // As the engine does: probabilities from log_softmax(logits / T), then truncation.
      auto probs = truncate_probs((logits / p.temperature).log_softmax(-1).exp(), p);          // (V)
      auto kept = (probs > 0).nonzero().squeeze(1);
      CHECK(std::vector<int64_t>(kept.data_ptr<int64_t>(), kept.data_ptr<int64_t>() + kept.numel()) ==
            c.at("kept").get<std::vector<int64_t>>());
      const double err = ((probs / probs.sum()).to(torch::kFloat64) - from_json(c.at("probs"))).abs().max().item<double>();
      CHECK(err < 1e-6);
      max_err = std::max(max_err, err);
    }
    MESSAGE(std::string(c10::toString(dtype)), ": max |renormalised probability - transformers'| ", max_err);
  }
}

TEST_CASE("truncating a batch cuts each row as it is cut alone, whatever its neighbours' parameters") {
  // Rows of random logits with a mix of parameters, none among them: each row of the batched cut
  // must equal truncate_probs of that row alone (checked against transformers above).
  torch::manual_seed(7);
  const int64_t R = 24, V = 300;
  auto probs = (torch::randn({R, V}, torch::kFloat64) * 3).softmax(-1).to(torch::kFloat32);
  std::vector<SamplingParams> params(R);
  for (int64_t r = 0; r < R; ++r) {
    params[r].temperature = 1.0;
    if (r % 3 == 0) params[r].top_k = 1 + (r * 7) % 40;
    if (r % 4 == 1) params[r].top_p = 0.5 + 0.02 * r;
    if (r % 5 == 2) params[r].min_p = 0.01 * (1 + r % 7);
    if (r == 5) params[r].top_k = V + 3;  // past the vocabulary: cuts nothing
  }
  std::vector<const SamplingParams*> pointers;
  for (const auto& p : params) pointers.push_back(&p);
  auto batched = truncate_rows(probs, pointers);
  int64_t cut = 0;
  for (int64_t r = 0; r < R; ++r) {
    CAPTURE(r);
    auto alone = truncate_probs(probs[r], params[r]);
    CHECK(torch::equal(batched[r], alone));
    cut += (alone == 0).sum().item<int64_t>();
  }
  CHECK(cut > R * V / 4);  // the parameters above do cut: the comparison is not of untouched rows
  // No row that cuts: the batch comes back as it was.
  std::vector<SamplingParams> plain(R);
  std::vector<const SamplingParams*> plain_pointers;
  for (const auto& p : plain) plain_pointers.push_back(&p);
  CHECK(torch::equal(truncate_rows(probs, plain_pointers), probs));
}

TEST_CASE("hashed Gumbel noise draws each row from its distribution, from its own seed and counter alone") {
  // Gumbel-max with this noise must sample exactly from p: 40,000 draws (counters 0..N-1 of two
  // seeds) of a 6-token distribution, each frequency within 5 standard errors and Pearson's
  // chi-square (5 degrees of freedom) below 25 (p ~ 1e-4 for a correct sampler).
  const std::vector<double> p = {0.4, 0.25, 0.15, 0.1, 0.07, 0.03};
  const int64_t V = static_cast<int64_t>(p.size()), N = 20000;
  auto logp = torch::tensor(p, torch::kFloat64).log().to(torch::kFloat32).unsqueeze(0);  // (1, V)
  for (uint64_t seed : {uint64_t{0}, uint64_t{0x5eed}}) {
    CAPTURE(seed);
    std::vector<int64_t> counters(N);
    for (int64_t i = 0; i < N; ++i) counters[i] = i;
    auto ids = (logp + hashed_gumbel(std::vector<uint64_t>(N, seed), counters, V, torch::kCPU)).argmax(-1);
    auto counts = torch::bincount(ids, {}, V).to(torch::kFloat64);
    double chi2 = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double expected = p[v] * N, f = counts[v].item<double>() / N;
      CAPTURE(v);
      CHECK(std::abs(f - p[v]) < 5 * std::sqrt(p[v] * (1 - p[v]) / N));
      chi2 += (counts[v].item<double>() - expected) * (counts[v].item<double>() - expected) / expected;
    }
    MESSAGE("seed ", seed, ": chi-square ", chi2, " over ", N, " draws");
    CHECK(chi2 < 25);
  }
  // The noise itself: Gumbel(0, 1) has mean 0.5772 (Euler's constant) and variance pi^2/6.
  auto g = hashed_gumbel({42, 42, 43}, {0, 1, 0}, 200000, torch::kCPU).to(torch::kFloat64);  // (3, V)
  for (int64_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(std::abs(g[r].mean().item<double>() - 0.5772157) < 0.015);
    CHECK(std::abs(g[r].var().item<double>() - M_PI * M_PI / 6) < 0.05);
  }
  // Another counter or another seed is another stream: uncorrelated noise.
  auto corr = [](const torch::Tensor& a, const torch::Tensor& b) {
    return torch::corrcoef(torch::stack({a, b}))[0][1].item<double>();
  };
  CHECK(std::abs(corr(g[0], g[1])) < 0.015);
  CHECK(std::abs(corr(g[0], g[2])) < 0.015);
  // A row's noise depends on its (seed, counter) only: alone or among other rows, the same bits.
  auto alone = hashed_gumbel({43}, {0}, 200000, torch::kCPU);
  CHECK(torch::equal(alone[0], hashed_gumbel({7, 43, 9}, {3, 0, 0}, 200000, torch::kCPU)[1]));
  CHECK(torch::equal(alone[0], g[2].to(torch::kFloat32)));
  // Finite everywhere: u is never 0 or 1, over a whole vocabulary's worth of many keys.
  std::vector<int64_t> many(256);
  for (int64_t i = 0; i < 256; ++i) many[i] = i;
  CHECK(torch::isfinite(hashed_gumbel(std::vector<uint64_t>(256, 1), many, 50000, torch::kCPU)).all().item<bool>());
}
