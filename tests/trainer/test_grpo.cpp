// GRPO: advantages and the decoupled-PPO loss against a scalar re-implementation of the
// formula, micro-batching equivalence, the schedule, and learning on a tiny arithmetic task.
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include <torch/torch.h>

#include "generator/engine.hpp"
#include "policy/checkpoint.hpp"
#include "trainer/advantage.hpp"
#include "trainer/trainer.hpp"
#include "tests/test_util.hpp"

using namespace troupe;

TEST_CASE("group advantages: centred, scaled by group, batch or not at all") {
  auto r = torch::tensor({1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0}).view({2, 4});
  const auto lengths = torch::ones_like(r);
  auto group = [&](rl::ScaleRewards scale, double eps) {
    return advantage::compute(rl::Advantage::group, {.rewards = r, .lengths = lengths, .scale = scale, .eps = eps});
  };
  auto g = group(grpo::ScaleRewards::group, 0.0);
  const double s = std::sqrt(1.0 / 3.0);  // unbiased std of {1, 0, 0, 1}
  CHECK(g[0][0].item<double>() == doctest::Approx(0.5 / s));
  CHECK(g[0][1].item<double>() == doctest::Approx(-0.5 / s));
  CHECK(g[1].abs().max().item<double>() == 0.0);  // equal rewards: no signal
  auto none = group(grpo::ScaleRewards::none, 1e-4);
  CHECK(none[0][0].item<double>() == doctest::Approx(0.5));
  auto batch = group(grpo::ScaleRewards::batch, 0.0);
  CHECK(batch[0][0].item<double>() == doctest::Approx(0.5 / r.std().item<double>()));
}

TEST_CASE("the GRPO loss equals the formula computed token by token") {
  torch::manual_seed(0);
  const int64_t B = 3, L = 5;
  auto logp = (torch::randn({B, L}) * 0.3 - 1.0).requires_grad_(true);
  auto prox = logp.detach() + torch::randn({B, L}) * 0.2;
  auto mu = prox + torch::randn({B, L}) * 0.5;
  auto ref = logp.detach() + torch::randn({B, L}) * 0.1;
  auto adv = torch::tensor({1.2, -0.7, 0.3});
  auto mask = torch::ones({B, L});
  mask[1][4] = 0;
  mask[2][3] = 0;
  mask[2][4] = 0;
  grpo::LossConfig config{.epsilon = 0.2, .epsilon_high = 0.28, .beta = 0.05, .correction = {.high = 2.0},
                          .max_completion_length = 8};

  // The formula, one token at a time in doubles.
  auto token_loss = [&](int64_t b, int64_t t) {
    double lp = logp[b][t].item<double>(), px = prox[b][t].item<double>(), m = mu[b][t].item<double>();
    double rf = ref[b][t].item<double>(), a = adv[b].item<double>();
    double ratio = std::exp(lp - px);
    double clipped = std::clamp(ratio, 1 - 0.2, 1 + 0.28);
    double w = std::min(std::exp(px - m), 2.0);
    double k3 = std::exp(rf - lp) - (rf - lp) - 1;
    return -w * std::min(ratio * a, clipped * a) + 0.05 * k3;
  };
  double dapo = 0, dr = 0, grpo_mean = 0, tokens = 0;
  for (int64_t b = 0; b < B; ++b) {
    double seq = 0, n = 0;
    for (int64_t t = 0; t < L; ++t) {
      if (mask[b][t].item<double>() == 0) continue;
      seq += token_loss(b, t);
      n += 1;
    }
    dapo += seq;
    dr += seq;
    grpo_mean += seq / n / B;
    tokens += n;
  }
  grpo::LossInputs in{logp, prox, mu, ref, adv, mask};
  config.aggregation = grpo::Aggregation::dapo;
  CHECK(grpo::loss(in, config).loss.item<double>() == doctest::Approx(dapo / tokens).epsilon(1e-5));
  config.aggregation = grpo::Aggregation::grpo;
  CHECK(grpo::loss(in, config).loss.item<double>() == doctest::Approx(grpo_mean).epsilon(1e-5));
  config.aggregation = grpo::Aggregation::dr_grpo;
  auto out = grpo::loss(in, config);
  CHECK(out.loss.item<double>() == doctest::Approx(dr / (B * 8.0)).epsilon(1e-5));
  CHECK(out.tokens == 12);
  CHECK(out.kl > 0);
  CHECK(out.clip_fraction > 0);
  // The gradient flows only through log pi_theta.
  out.loss.backward();
  CHECK(logp.grad().defined());
  CHECK(logp.grad()[2][4].item<double>() == 0.0);
}

namespace {

// A tiny arithmetic task over the test model's 160-token vocabulary: prompt "a + b =" as
// ids [10 + a, 20, 10 + b, 21]; the answer is the single token 10 + (a + b).
constexpr int32_t kDigit = 10, kPlus = 20, kEquals = 21;

struct Problem {
  std::vector<int32_t> prompt;
  int32_t answer;
};

std::vector<Problem> problems() {
  std::vector<Problem> out;
  for (int a = 0; a < 5; ++a)
    for (int b = 0; b < 5; ++b) out.push_back({{kDigit + a, kPlus, kDigit + b, kEquals}, kDigit + a + b});
  return out;
}

double reward(const Completion& c, int32_t answer) { return !c.ids.empty() && c.ids[0] == answer ? 1.0 : 0.0; }

}  // namespace

TEST_CASE("micro-batches accumulate to the same update as one batch") {
  auto run = [](int64_t micro) {
    auto m = load_model(test::fixtures() / "hf_models" / "qwen2", {.tokenizer = false});
    Trainer trainer(m.model, {.optimizer = {.lr = 1e-2, .max_grad_norm = 0}, .micro_batch = micro});
    RolloutGroup g;
    g.prompt_ids = {5, 6, 7};
    g.completion_ids = {{8, 9}, {10, 11, 12}, {13}, {14, 15}};
    g.behaviour_logprobs = {{-1.f, -2.f}, {-1.5f, -0.5f, -3.f}, {-2.f}, {-1.f, -1.f}};
    g.reward = {1, 0, 0.5, 0};
    trainer.grpo_step({g});
    return state_dict(*trainer.model());
  };
  auto whole = run(0), parts = run(3);
  double worst = 0;
  for (const auto& [name, t] : whole) worst = std::max(worst, (t - parts.at(name)).abs().max().item<double>());
  CHECK(worst < 1e-6);
}

TEST_CASE("learning rate: linear warmup, then cosine to the floor") {
  auto m = load_model(test::fixtures() / "hf_models" / "qwen2", {.tokenizer = false});
  Trainer t(m.model, {.optimizer = {.lr = 1.0, .warmup_steps = 4, .total_steps = 14, .min_lr_ratio = 0.1}});
  CHECK(t.lr_at(0) == doctest::Approx(0.25));
  CHECK(t.lr_at(3) == doctest::Approx(1.0));
  CHECK(t.lr_at(4) == doctest::Approx(1.0));
  CHECK(t.lr_at(9) == doctest::Approx(0.1 + 0.9 * 0.5));
  CHECK(t.lr_at(14) == doctest::Approx(0.1));
  CHECK(t.lr_at(100) == doctest::Approx(0.1));
}

TEST_CASE("GRPO raises the reward on a tiny arithmetic task (synchronous, in-process)") {
  torch::manual_seed(0);
  auto m = load_model(test::fixtures() / "hf_models" / "llama3", {.tokenizer = false});
  const int sft_steps = 30, rl_steps = 200;
  const int64_t G = 16;
  Trainer trainer(m.model, {.optimizer = {.lr = 1e-3, .total_steps = sft_steps + rl_steps, .min_lr_ratio = 0.1}});
  Engine engine(m.model, std::nullopt, {.max_batch = 256, .max_seq_len = 8});
  auto all = problems();

  // Format stage: teach "answer with one digit" on labels that are right only 15% of the
  // time (else a random digit), so the model starts near chance on the sums themselves.
  std::mt19937 rng(0);
  for (int step = 0; step < sft_steps; ++step) {
    std::vector<SftExample> batch;
    for (const auto& p : all) {
      bool right = rng() % 100 < 15;
      batch.push_back({p.prompt, {right ? p.answer : kDigit + static_cast<int32_t>(rng() % 9)}});
    }
    trainer.sft_step(batch);
  }

  std::vector<double> curve;  // reward/mean per step
  for (int step = 0; step < rl_steps; ++step) {
    std::vector<std::vector<int32_t>> prompts;
    std::vector<int32_t> answers;
    for (int i = 0; i < 16; ++i) {
      const auto& p = all[rng() % all.size()];
      prompts.push_back(p.prompt);
      answers.push_back(p.answer);
    }
    engine.update_weights({}, trainer.version());  // shared parameters: only the version moves
    auto completions = engine.generate(prompts, {.n = G, .temperature = 1.0, .max_tokens = 1});
    std::vector<RolloutGroup> groups(prompts.size());
    double total = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto& g = groups[i];
      g.prompt_ids = prompts[i];
      for (int64_t s = 0; s < G; ++s) {
        const auto& c = completions[i * G + s];
        g.completion_ids.push_back(c.ids);
        g.behaviour_logprobs.push_back(c.logprobs);
        g.reward.push_back(reward(c, answers[i]));
        total += g.reward.back();
      }
    }
    curve.push_back(total / (prompts.size() * G));
    auto metrics = trainer.grpo_step(groups);
    CHECK(metrics.behaviour_weight == doctest::Approx(1.0));  // on-policy: mu == pi_prox
  }
  auto window = [&](size_t from, size_t n) {
    double s = 0;
    for (size_t i = from; i < from + n; ++i) s += curve[i];
    return s / n;
  };
  double start = window(0, 5), end = window(curve.size() - 10, 10);
  MESSAGE("reward/mean over the first 5 steps " << start << ", over the last 10 " << end);
  CHECK(start < 0.3);
  CHECK(end > 0.7);
}
