// The optimizer the trainers step: bf16 parameters through float32 masters, against PyTorch's
// own AdamW on float32 copies fed the same gradients; weights written from outside; the state
// file round trip with the masters' bits; and a bf16 Trainer whose small updates are kept.
#include <doctest/doctest.h>

#include <filesystem>

#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "trainer/optimizer.hpp"
#include "trainer/trainer.hpp"
#include "tests/test_util.hpp"

using namespace troupe;
namespace fs = std::filesystem;

namespace {

constexpr OptimizerConfig kSmallSteps{.lr = 1e-5, .weight_decay = 0.01, .max_grad_norm = 1.0};

// A bf16 parameter of 0.01s: bf16's step there is 2^-14 (6.1e-5), so one AdamW step at lr 1e-5
// (about lr per element) is less than half of it and rounds away.
torch::Tensor bf16_full(int64_t n, double value = 0.01) {
  return torch::full({n}, value, torch::kBFloat16).requires_grad_(true);
}

// The same gradient on every step, as a bf16 tensor (the trainers' backward passes give bf16).
torch::Tensor gradient(int64_t n, int64_t step) {
  return torch::linspace(-1.0, 1.0, n).add(0.01 * step).to(torch::kBFloat16);
}

}  // namespace

TEST_CASE("bf16 parameters step through float32 masters: exactly PyTorch's AdamW on a float32 copy, rounded") {
  const int64_t n = 64, steps = 50;
  auto p = bf16_full(n);
  const auto start = p.detach().clone();
  Optimizer opt({p}, kSmallSteps);
  auto ref = start.to(torch::kFloat32).requires_grad_(true);
  torch::optim::AdamW adamw({ref}, torch::optim::AdamWOptions(kSmallSteps.lr).weight_decay(kSmallSteps.weight_decay));
  auto naive = bf16_full(n);  // plain AdamW on the bf16 tensor: what the trainer did before
  torch::optim::AdamW naive_adamw({naive}, torch::optim::AdamWOptions(kSmallSteps.lr).weight_decay(kSmallSteps.weight_decay));
  for (int64_t s = 0; s < steps; ++s) {
    auto g = gradient(n, s);
    p.mutable_grad() = g.clone();
    const double norm = opt.step(kSmallSteps.lr);
    ref.mutable_grad() = g.to(torch::kFloat32);
    const double ref_norm = torch::nn::utils::clip_grad_norm_({ref}, kSmallSteps.max_grad_norm);
    adamw.step();
    naive.mutable_grad() = g.clone();
    torch::nn::utils::clip_grad_norm_({naive}, kSmallSteps.max_grad_norm);
    naive_adamw.step();
    CHECK(norm == doctest::Approx(ref_norm).epsilon(1e-6));
    CHECK_FALSE(p.grad().defined());
  }
  auto moved = [&](const torch::Tensor& t) { return (t.detach().to(torch::kFloat32) - start.to(torch::kFloat32)).abs().max().item<double>(); };
  MESSAGE("after " << steps << " steps at lr 1e-5 from 0.01: float32 reference moved " << moved(ref)
                   << ", bf16 through masters " << moved(p) << ", plain bf16 AdamW " << moved(naive));
  CHECK(moved(ref) > 4 * 6.1e-5);  // several bf16 steps
  CHECK(torch::equal(opt.master(0).detach(), ref.detach()));
  CHECK(torch::equal(p.detach(), ref.detach().to(torch::kBFloat16)));
  CHECK(moved(p) > 4 * 6.1e-5);
  CHECK(torch::equal(naive.detach(), start));  // every update rounded away
}

TEST_CASE("float32 parameters are their own masters: the step is PyTorch's AdamW, bit for bit") {
  auto p = torch::ones({32}).requires_grad_(true);
  auto ref = torch::ones({32}).requires_grad_(true);
  Optimizer opt({p}, kSmallSteps);
  torch::optim::AdamW adamw({ref}, torch::optim::AdamWOptions(kSmallSteps.lr).weight_decay(kSmallSteps.weight_decay));
  for (int64_t s = 0; s < 5; ++s) {
    p.mutable_grad() = gradient(32, s).to(torch::kFloat32);
    ref.mutable_grad() = gradient(32, s).to(torch::kFloat32);
    opt.step(kSmallSteps.lr);
    torch::nn::utils::clip_grad_norm_({ref}, kSmallSteps.max_grad_norm);
    adamw.step();
  }
  CHECK(opt.master(0).is_same(p));
  CHECK(torch::equal(p.detach(), ref.detach()));
}

TEST_CASE("a master follows weights written into its parameter from outside (loaded weights)") {
  auto p = bf16_full(16);
  Optimizer opt({p}, kSmallSteps);
  p.mutable_grad() = gradient(16, 0);
  opt.step(kSmallSteps.lr);
  {
    torch::NoGradGuard no_grad;
    p.copy_(torch::full({16}, 3.0, torch::kBFloat16));  // as load_weights writes a checkpoint
  }
  CHECK(torch::equal(opt.master(0).detach(), torch::full({16}, 3.0)));
  p.mutable_grad() = torch::zeros({16}, torch::kBFloat16);
  opt.step(kSmallSteps.lr);  // a zero gradient: only the decay and the old moments move it
  CHECK((opt.master(0).detach() - 3).abs().max().item<double>() < 1e-3);
  CHECK(torch::equal(p.detach(), opt.master(0).detach().to(torch::kBFloat16)));
}

TEST_CASE("the state file keeps the masters' bits: a resumed optimizer continues exactly") {
  const auto file = fs::temp_directory_path() / "troupe_test_optimizer_state.pt";
  const int64_t n = 64;
  auto a = bf16_full(n);
  Optimizer first({a}, kSmallSteps);
  for (int64_t s = 0; s < 10; ++s) {
    a.mutable_grad() = gradient(n, s);
    first.step(kSmallSteps.lr);
  }
  first.save(file, 10);
  // A new process: the model comes back from its bf16 checkpoint, then the optimizer state.
  auto b = a.detach().clone().requires_grad_(true);
  Optimizer second({b}, kSmallSteps);
  CHECK(second.load(file) == 10);
  CHECK(torch::equal(second.master(0).detach(), first.master(0).detach()));
  CHECK_FALSE(torch::equal(second.master(0).detach(), b.detach().to(torch::kFloat32)));  // bits the bf16 copy lacks
  for (int64_t s = 10; s < 20; ++s) {
    a.mutable_grad() = gradient(n, s);
    b.mutable_grad() = gradient(n, s);
    first.step(kSmallSteps.lr);
    second.step(kSmallSteps.lr);
  }
  CHECK(torch::equal(first.master(0).detach(), second.master(0).detach()));
  CHECK(torch::equal(a.detach(), b.detach()));

  // A file from float32 training of the same shapes has no masters: they come from the parameters.
  auto f32 = torch::ones({n}).requires_grad_(true);
  Optimizer plain({f32}, kSmallSteps);
  plain.save(file, 3);
  auto c = torch::full({n}, 2.0, torch::kBFloat16).requires_grad_(true);
  Optimizer third({c}, kSmallSteps);
  CHECK(third.load(file) == 3);
  CHECK(torch::equal(third.master(0).detach(), torch::full({n}, 2.0)));

  auto other = bf16_full(n + 1);
  Optimizer wrong({other}, kSmallSteps);
  CHECK_THROWS_WITH_AS(wrong.load(file), doctest::Contains("when saved"), Error);
  fs::remove(file);
}

TEST_CASE("a bf16 Trainer keeps updates far below bf16's resolution") {
  auto bf16 = load_model(test::fixtures() / "hf_models" / "llama3", {.dtype = torch::kBFloat16, .tokenizer = false});
  Trainer b(bf16.model, {.optimizer = {.lr = 1e-5}});
  const std::vector<SftExample> examples{{.prompt_ids = {1, 2, 3}, .completion_ids = {4, 5, 6, 7}},
                                         {.prompt_ids = {8, 9}, .completion_ids = {10, 11, 12}}};
  auto start = b.model()->lm_head_weight().detach().clone();
  for (int step = 0; step < 30; ++step) b.sft_step(examples);
  // AdamW moves each weight by about lr per step: 3e-4 after 30 steps, a few bf16 steps for the
  // small weights of a random model. Without masters each 1e-5 step rounded away.
  auto moved16 = (b.model()->lm_head_weight().detach().to(torch::kFloat32) - start.to(torch::kFloat32)).abs();
  const double changed = moved16.gt(0).to(torch::kFloat32).mean().item<double>();
  MESSAGE("bf16 trainer at lr 1e-5 for 30 steps: " << changed * 100 << " % of lm_head weights changed, max move "
                                                   << moved16.max().item<double>());
  CHECK(changed > 0.5);
  CHECK(moved16.max().item<double>() > 1e-4);
}
