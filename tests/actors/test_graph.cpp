// The async GRPO actor graph end to end on a tiny model: prompts from a data actor, samples
// from a generator actor, scores from the real math verifier, GRPO steps in the trainer actor,
// weights back to the generator. Reward must rise, with eta = 1 and with eta = 0.
#include <doctest/doctest.h>

#include <fstream>
#include <random>

#include <torch/torch.h>

#include "actors/graph.hpp"
#include "policy/checkpoint.hpp"
#include "tests/test_util.hpp"

using namespace troupe;

namespace {

// "a+b=" through the Qwen3 tokenizer is four single-character tokens, all inside the tiny
// test model's 160-token vocabulary; the answer is one digit token.
struct Arithmetic {
  Tokenizer tokenizer = Tokenizer::load(test::data() / "tokenizers" / "qwen3");
  std::vector<std::pair<std::string, int>> problems;
  Arithmetic() {
    for (int a = 0; a < 5; ++a)
      for (int b = 0; b < 5; ++b) problems.push_back({std::to_string(a) + "+" + std::to_string(b) + "=", a + b});
  }
  int32_t digit(int d) const { return tokenizer.encode(std::to_string(d))[0]; }
};

// The tiny Llama after a format stage: one-digit answers, right only 15% of the time.
std::map<std::string, torch::Tensor> format_stage(const Arithmetic& task) {
  auto m = load_model(test::fixtures() / "hf_models" / "llama3", {.tokenizer = false});
  Trainer trainer(m.model, {.optimizer = {.lr = 1e-3}});
  std::mt19937 rng(0);
  for (int step = 0; step < 30; ++step) {
    std::vector<SftExample> batch;
    for (const auto& [text, sum] : task.problems) {
      int d = rng() % 100 < 15 ? sum : static_cast<int>(rng() % 9);
      batch.push_back({task.tokenizer.encode(text), {task.digit(d)}});
    }
    trainer.sft_step(batch);
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : state_dict(*m.model)) out[name] = t.detach().clone();
  return out;
}

GraphResult run(int64_t eta, const std::map<std::string, torch::Tensor>& start, const Arithmetic& task,
                const std::filesystem::path& dir, int64_t steps = 200) {
  auto rng = std::make_shared<std::mt19937>(1);
  GraphSpec spec;
  spec.make_policy = [&] {
    auto m = load_model(test::fixtures() / "hf_models" / "llama3", {.tokenizer = false});
    load_weights(*m.model, start, "format stage");
    return m.model;
  };
  spec.tokenizer = task.tokenizer;
  spec.tokenizer_path = test::data() / "tokenizers" / "qwen3";
  spec.next_prompts = [&task, rng](int64_t n) {
    std::vector<PromptItem> out;
    for (int64_t i = 0; i < n; ++i) {
      const auto& [text, sum] = task.problems[(*rng)() % task.problems.size()];
      out.push_back({0, 0, task.tokenizer.encode(text), text, nlohmann::json{{"answer", "#### " + std::to_string(sum)}}.dump()});
    }
    return out;
  };
  spec.reward = std::make_shared<CombinedReward>(make_combined_reward({{.name = "arith", .kind = "math_answer"}}));
  spec.trainer = {.optimizer = {.lr = 1e-3, .total_steps = 30 + steps, .min_lr_ratio = 0.1}};
  spec.batch_groups = 16;
  spec.steps = steps;
  spec.engine = {.max_batch = 256, .max_seq_len = 8};
  spec.sampling = {.n = 16, .temperature = 1.0, .max_tokens = 1};
  spec.max_staleness = eta;
  spec.run_dir = dir;
  spec.model_config = ModelConfig::from_file(test::fixtures() / "hf_models" / "llama3" / "config.json");
  spec.model_source = test::fixtures() / "hf_models" / "llama3";
  spec.quiet = true;
  std::filesystem::remove_all(dir);
  return run_graph(spec);
}

// metrics.jsonl as the run wrote it.
std::vector<nlohmann::json> read_metrics(const std::filesystem::path& dir) {
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

double mean_of(const std::vector<nlohmann::json>& m, size_t from, size_t n, const char* key) {
  double s = 0;
  for (size_t i = from; i < from + n; ++i) s += m[i][key].get<double>();
  return s / n;
}

}  // namespace

TEST_CASE("async GRPO through the actor graph raises the reward (eta = 1 and eta = 0)") {
  torch::manual_seed(0);
  Arithmetic task;
  auto start = format_stage(task);
  for (int64_t eta : {1, 0}) {
    CAPTURE(eta);
    auto dir = test::fixtures() / ("graph_eta" + std::to_string(eta));
    auto r = run(eta, start, task, dir);
    INFO(r.error);
    REQUIRE(r.ok);
    REQUIRE(r.metrics.size() == 200);
    double first = mean_of(r.metrics, 0, 5, "reward/mean"), last = mean_of(r.metrics, 190, 10, "reward/mean");
    double max_stale = 0, mean_stale = 0;
    for (const auto& j : r.metrics) {
      max_stale = std::max(max_stale, j["staleness/max"].get<double>());
      mean_stale += j["staleness/mean"].get<double>() / r.metrics.size();
      CHECK(j.contains("reward/arith/mean"));
      CHECK(j.contains("time/generate_wait_s"));
    }
    MESSAGE("eta " << eta << ": reward/mean first 5 steps " << first << ", last 10 " << last << "; staleness mean "
                   << mean_stale << " max " << max_stale);
    CHECK(first < 0.3);
    CHECK(last > 0.7);
    CHECK(max_stale <= eta);
    if (eta == 1) CHECK(mean_stale > 0.5);  // the generator really ran ahead of the trainer
    CHECK(std::filesystem::exists(dir / "metrics.jsonl"));
    CHECK(std::filesystem::exists(dir / "checkpoints" / "step_200" / "model.safetensors"));
  }
}

TEST_CASE("metrics.jsonl shows the staleness bound: eta = 0 trains only current groups, eta = 2 none older than 2") {
  torch::manual_seed(0);
  Arithmetic task;
  auto start = format_stage(task);
  for (int64_t eta : {0, 2}) {
    CAPTURE(eta);
    auto dir = test::fixtures() / ("graph_staleness_eta" + std::to_string(eta));
    auto r = run(eta, start, task, dir, 40);
    INFO(r.error);
    REQUIRE(r.ok);
    auto metrics = read_metrics(dir);
    REQUIRE(metrics.size() == 40);
    int64_t worst = 0;
    double mean = 0;
    for (size_t i = 0; i < metrics.size(); ++i) {
      CHECK(metrics[i]["step"].get<size_t>() == i + 1);
      CHECK(metrics[i]["policy_version"].get<size_t>() == i + 1);
      worst = std::max(worst, metrics[i]["staleness/max"].get<int64_t>());
      mean += metrics[i]["staleness/mean"].get<double>() / metrics.size();
    }
    MESSAGE("eta " << eta << ": staleness mean " << mean << ", max " << worst);
    CHECK(worst <= eta);
    if (eta == 2) CHECK(worst == 2);  // the generators did run two versions ahead
  }
}
