// The RL objectives (grpo, gspo, cispo), importance corrections and advantage estimators:
// against scalar token-by-token references in float64, and against verl 0.9.1's own functions
// (fixtures made by tests/trainer/make_verl_fixtures.py): values and gradients.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "tests/test_util.hpp"
#include "trainer/advantage.hpp"
#include "trainer/correction.hpp"
#include "trainer/grpo.hpp"
#include "trainer/ppo.hpp"

using namespace troupe;
using Json = nlohmann::json;

namespace {

torch::Tensor from_json(const Json& j) {
  if (!j.is_array()) return torch::tensor(j.get<double>(), torch::kFloat64);
  if (!j.at(0).is_array()) return torch::tensor(j.get<std::vector<double>>(), torch::kFloat64);
  std::vector<torch::Tensor> rows;
  for (const auto& r : j) rows.push_back(from_json(r));
  return torch::stack(rows);
}

const Json& verl() {
  static const Json j = [] {
    std::ifstream in(test::fixtures() / "verl" / "verl.json");
    REQUIRE_MESSAGE(in.good(), "missing fixture verl/verl.json (tests/trainer/make_verl_fixtures.py)");
    return Json::parse(in);
  }();
  return j;
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// A float64 batch of 4 sequences of up to 6 tokens with holes at the ends, and the ratios
// spread so that every clip, cap and mask below bites somewhere.
struct Batch {
  torch::Tensor logp, prox, mu, adv, mask;
};
Batch make_batch() {
  torch::manual_seed(11);
  const auto opts = torch::TensorOptions(torch::kFloat64);
  Batch b;
  b.mask = torch::ones({4, 6}, opts);
  b.mask[1].narrow(0, 4, 2).zero_();
  b.mask[2].narrow(0, 1, 5).zero_();
  b.mask[3][5] = 0;
  b.prox = torch::randn({4, 6}, opts) * 0.5 - 1.0;
  b.logp = (b.prox + torch::randn({4, 6}, opts) * 0.3).requires_grad_(true);
  b.mu = b.prox + torch::randn({4, 6}, opts) * 0.8;
  b.adv = torch::tensor({0.9, -1.2, 0.4, -0.3}, opts);
  return b;
}

// The loss and the shares the metrics report, one token at a time in doubles.
struct Scalar {
  double loss = 0, clipped = 0, masked = 0, truncated = 0;
};
Scalar scalar_loss(const Batch& b, const rl::PolicyLoss& c) {
  const int64_t B = b.mask.size(0), L = b.mask.size(1);
  auto at = [](const torch::Tensor& t, int64_t i, int64_t j) { return t[i][j].item<double>(); };
  Scalar out;
  double all_tokens = 0, dapo = 0, grpo = 0, dr = 0;
  for (int64_t i = 0; i < B; ++i) {
    double n = 0, log_s = 0, log_w_seq = 0;
    for (int64_t t = 0; t < L; ++t)
      if (at(b.mask, i, t) > 0) {
        n += 1;
        log_s += at(b.logp, i, t) - at(b.prox, i, t);
        log_w_seq += at(b.prox, i, t) - at(b.mu, i, t);
      }
    log_s /= std::max(n, 1.0);
    log_w_seq /= std::max(n, 1.0);
    const double a = b.adv[i].item<double>();
    double seq = 0;
    for (int64_t t = 0; t < L; ++t) {
      if (at(b.mask, i, t) == 0) continue;
      const double lp = at(b.logp, i, t), px = at(b.prox, i, t), mu = at(b.mu, i, t);
      double r = std::exp(lp - px), term = 0;
      if (c.objective == rl::Objective::gspo) r = std::exp(log_s);
      const double clipped = std::clamp(r, 1 - c.epsilon, 1 + c.epsilon_high);
      if (c.objective == rl::Objective::cispo)
        term = -clipped * a * lp;
      else
        term = -std::min(r * a, clipped * a);
      out.clipped += clipped != r;
      const bool sequence = c.correction.mode == rl::CorrectionMode::sequence_truncate ||
                            c.correction.mode == rl::CorrectionMode::sequence_mask;
      const double w_raw = std::exp(sequence ? log_w_seq : px - mu);
      double w = w_raw;
      if (c.correction.mode == rl::CorrectionMode::none) {
        w = 1;
      } else if (c.correction.mode == rl::CorrectionMode::token_truncate ||
                 c.correction.mode == rl::CorrectionMode::sequence_truncate) {
        w = std::min(w_raw, c.correction.high);
        out.truncated += w_raw > c.correction.high;
      } else if (w_raw < c.correction.low || w_raw > c.correction.high) {
        w = 0;
        out.masked += 1;
      }
      seq += w * term;
    }
    dapo += seq;
    dr += seq;
    grpo += seq / std::max(n, 1.0) / B;
    all_tokens += n;
  }
  out.loss = c.aggregation == rl::Aggregation::dapo ? dapo / all_tokens
             : c.aggregation == rl::Aggregation::grpo ? grpo
                                                      : dr / (B * static_cast<double>(c.max_completion_length));
  out.clipped /= all_tokens;
  out.masked /= all_tokens;
  out.truncated /= all_tokens;
  return out;
}

rl::Objective objective_named(const std::string& name) {
  for (const auto& n : rl::kObjectives)
    if (n.name == name) return n.value;
  FAIL("no objective " << name);
  return {};
}
rl::Aggregation aggregation_named(const std::string& name) {
  for (const auto& n : rl::kAggregations)
    if (n.name == name) return n.value;
  FAIL("no aggregation " << name);
  return {};
}

}  // namespace

TEST_CASE("each objective under each correction equals its scalar reference token by token (float64)") {
  const auto b = make_batch();
  for (const auto& objective : rl::kObjectives)
    for (const auto& mode : rl::kCorrectionModes)
      for (const auto& aggregation : rl::kAggregations) {
        CAPTURE(objective.name);
        CAPTURE(mode.name);
        CAPTURE(aggregation.name);
        const rl::PolicyLoss c{.objective = objective.value, .aggregation = aggregation.value, .epsilon = 0.2,
                               .epsilon_high = 0.28, .correction = {.mode = mode.value, .low = 0.6, .high = 1.5},
                               .max_completion_length = 6};
        const auto want = scalar_loss(b, c);
        auto out = grpo::loss({b.logp, b.prox, b.mu, {}, b.adv, b.mask}, c);
        CHECK(std::abs(out.loss.item<double>() - want.loss) < 1e-10);
        CHECK(std::abs(out.clip_fraction - want.clipped) < 1e-12);
        CHECK(std::abs(out.masked_fraction - want.masked) < 1e-12);
        CHECK(std::abs(out.truncated_fraction - want.truncated) < 1e-12);
      }
  // The batch makes every objective clip, and every correction bite, somewhere.
  const rl::PolicyLoss any{.correction = {.mode = rl::CorrectionMode::token_mask, .low = 0.6, .high = 1.5}};
  CHECK(scalar_loss(b, any).clipped > 0);
  CHECK(scalar_loss(b, any).masked > 0);
}

TEST_CASE("the objectives' losses and gradients equal verl's policy losses, with its TIS and IcePop weights") {
  const auto& j = verl();
  const auto& batch = j.at("batch");
  const auto mask = from_json(batch.at("mask")), prox = from_json(batch.at("old")), mu = from_json(batch.at("rollout"));
  const auto adv = from_json(batch.at("adv"));
  double worst_loss = 0, worst_grad = 0;
  for (const auto& c : j.at("policy_losses")) {
    const std::string objective = c.at("objective"), aggregation = c.at("aggregation"), correction = c.at("correction");
    CAPTURE(objective);
    CAPTURE(aggregation);
    CAPTURE(correction);
    rl::PolicyLoss config{.objective = objective_named(objective), .aggregation = aggregation_named(aggregation),
                          .epsilon = j.at("epsilon"), .epsilon_high = j.at("epsilon_high"),
                          .max_completion_length = mask.size(1)};
    // verl without weights is troupe with mu = pi_prox (every weight exactly 1).
    auto behaviour = prox;
    if (correction != "none") behaviour = mu;
    if (correction == "token_truncate") config.correction = {.mode = rl::CorrectionMode::token_truncate, .high = j.at("token_truncate_high")};
    if (correction == "token_mask")
      config.correction = {.mode = rl::CorrectionMode::token_mask, .low = j.at("token_mask")[0], .high = j.at("token_mask")[1]};
    auto logp = from_json(batch.at("logp")).requires_grad_(true);
    auto out = grpo::loss({logp, prox, behaviour, {}, adv, mask}, config);
    out.loss.backward();
    const double dl = std::abs(out.loss.item<double>() - c.at("loss").get<double>());
    const double dg = max_diff(logp.grad() * mask, from_json(c.at("grad")) * mask);
    worst_loss = std::max(worst_loss, dl);
    worst_grad = std::max(worst_grad, dg);
    // verl adds 1e-8 to each sequence's token count in seq-mean-token-mean: a relative 1e-9 here.
    CHECK(dl < 1e-8);
    CHECK(dg < 1e-8);
  }
  MESSAGE("verl policy losses: " << j.at("policy_losses").size() << " cases, largest differences: loss " << worst_loss
                                 << ", gradient " << worst_grad);
}

TEST_CASE("token-level correction weights equal verl's TIS and IcePop weights") {
  const auto& j = verl();
  const auto& batch = j.at("batch");
  const auto mask = from_json(batch.at("mask")), prox = from_json(batch.at("old")), mu = from_json(batch.at("rollout"));
  auto tis = correction::weights(prox, mu, mask, {.mode = rl::CorrectionMode::token_truncate, .high = j.at("token_truncate_high")});
  CHECK(max_diff(tis.weight * mask, from_json(j.at("weights").at("token_truncate"))) < 1e-12);
  auto icepop = correction::weights(prox, mu, mask,
                                    {.mode = rl::CorrectionMode::token_mask, .low = j.at("token_mask")[0], .high = j.at("token_mask")[1]});
  CHECK(max_diff(icepop.weight * mask, from_json(j.at("weights").at("token_mask"))) < 1e-12);
  CHECK(icepop.masked.sum().item<int64_t>() > 0);
  CHECK(tis.truncated.sum().item<int64_t>() > 0);
}

TEST_CASE("advantage estimators equal verl's (group, group without std, rloo, reinforce_pp, reinforce_pp_baseline)") {
  const auto& a = verl().at("advantages");
  const auto rewards = from_json(a.at("rewards")), lengths = from_json(a.at("lengths"));
  struct Case {
    const char* fixture;
    rl::Advantage which;
    rl::ScaleRewards scale;
  };
  for (const auto& c : {Case{"group", rl::Advantage::group, rl::ScaleRewards::group},
                        Case{"group_none", rl::Advantage::group, rl::ScaleRewards::none},
                        Case{"rloo", rl::Advantage::rloo, rl::ScaleRewards::group},
                        Case{"reinforce_pp", rl::Advantage::reinforce_pp, rl::ScaleRewards::group},
                        Case{"reinforce_pp_baseline", rl::Advantage::reinforce_pp_baseline, rl::ScaleRewards::group}}) {
    CAPTURE(c.fixture);
    auto got = advantage::compute(c.which, {.rewards = rewards, .lengths = lengths, .scale = c.scale, .eps = 1e-6});
    auto want = from_json(a.at("values").at(c.fixture));
    // verl's masked means add 1e-8 to token counts: a relative 1e-10 at these sizes.
    CHECK(max_diff(got, want) < 1e-9);
  }
  // The tied group carries no signal under the group baselines.
  auto rloo = advantage::compute(rl::Advantage::rloo, {.rewards = rewards, .lengths = lengths});
  CHECK(rloo[1].abs().max().item<double>() == 0.0);
}

TEST_CASE("GAE's returns and whitened advantages equal verl's compute_gae_advantage_return") {
  const auto& g = verl().at("gae");
  const auto mask = from_json(g.at("mask")), rewards = from_json(g.at("rewards")), values = from_json(g.at("values"));
  auto out = ppo::gae(rewards, values, mask, g.at("gamma"), g.at("lam"));
  CHECK(max_diff(out.returns * mask, from_json(g.at("returns")) * mask) < 1e-12);
  CHECK(max_diff(ppo::whiten(out.advantages, mask), from_json(g.at("whitened")) * mask) < 1e-9);
}

TEST_CASE("scalar references for the advantage estimators the fixtures do not vary: rloo is leave-one-out") {
  auto r = torch::tensor({0.0, 1.0, 3.0, 0.5, 1.0, 2.0}, torch::kFloat64).view({2, 3});
  auto got = advantage::compute(rl::Advantage::rloo, {.rewards = r, .lengths = torch::ones_like(r)});
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t i = 0; i < 3; ++i) {
      double others = 0;
      for (int64_t k = 0; k < 3; ++k)
        if (k != i) others += r[n][k].item<double>();
      CHECK(std::abs(got[n][i].item<double>() - (r[n][i].item<double>() - others / 2)) < 1e-12);
    }
}

TEST_CASE("a correction range with low > high is refused") {
  const auto m = torch::ones({1, 2}, torch::kFloat64);
  CHECK_THROWS_WITH_AS(correction::weights(m, m, m, {.mode = rl::CorrectionMode::token_mask, .low = 2.0, .high = 1.5}),
                       doctest::Contains("low 2 > high 1.5"), c10::Error);
}

TEST_CASE("overlong penalty: DAPO's soft punishment, 0 up to max_tokens - buffer, then down to -factor at max_tokens") {
  const rl::Overlong c{.mode = rl::OverlongMode::penalty, .buffer = 8, .factor = 0.5, .max_tokens = 16};
  const std::vector<double> lengths{1, 8, 9, 12, 16};
  auto got = advantage::overlong_penalty(torch::tensor(lengths, torch::kFloat64), c);
  for (size_t i = 0; i < lengths.size(); ++i) {
    // verl's DAPO reward manager: min(-(L - (max_len - buffer)) / buffer * factor, 0)
    const double want = std::min(-(lengths[i] - (16.0 - 8.0)) / 8.0 * 0.5, 0.0);
    CHECK(std::abs(got[i].item<double>() - want) < 1e-15);
  }
  CHECK(got[4].item<double>() == -0.5);
  CHECK(advantage::overlong_penalty(torch::tensor(lengths), {.mode = rl::OverlongMode::mask, .max_tokens = 16})
            .abs().sum().item<double>() == 0.0);
}
