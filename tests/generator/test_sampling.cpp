// The engine's top-k, top-p and min-p truncation (generator/sampling.hpp) against
// transformers' logits warpers at ordinary values, alone and chained in troupe's order
// (fixtures: tests/generator/make_sampling_fixtures.py).
#include <doctest/doctest.h>

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
