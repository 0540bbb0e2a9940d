// `troupe run` end to end on the tiny arithmetic config: the command line, the config, the
// sft warmup, the actor graph and the run folder, as a user runs them.
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/actors/tensorboard_util.hpp"
#include "tests/serve_process.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using namespace troupe::test;

namespace {

using Run = troupe::test::CommandResult;

Run shell(const std::string& cmd) { return run_command(cmd + " 2>&1"); }

// `troupe run configs/CONFIG.yaml ARGS` on the arithmetic fixture (its sft warm-up included)
// into fixtures/RUN_NAME; the lines of its metrics.jsonl.
std::vector<nlohmann::json> run_arithmetic(const std::string& config, const std::string& run_name, const std::string& args = "") {
  auto task = fixtures() / "arithmetic";
  auto dir = fixtures() / run_name;
  fs::remove_all(dir);
  std::string cmd = "cd '" + source().string() + "' && '" + env_dir("TROUPE_BIN").string() + "' run configs/" + config +
                    ".yaml model.path='" + (task / "model").string() + "' data.train.path='" +
                    (task / "train.jsonl").string() + "' trainer.sft_warmup.path='" + (task / "format.jsonl").string() +
                    "' run.dir='" + dir.string() + "' " + args;
  auto r = shell(cmd);
  REQUIRE_MESSAGE(r.status == 0, r.out);
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<nlohmann::json> steps;
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line));
  return steps;
}

}  // namespace

TEST_CASE("troupe run trains the tiny arithmetic config and writes the run folder") {
  auto task = fixtures() / "arithmetic";
  auto dir = fixtures() / "run_tiny_arithmetic";
  fs::remove_all(dir);
  std::string cmd = "cd '" + source().string() + "' && '" + env_dir("TROUPE_BIN").string() +
                    "' run configs/tiny_arithmetic_grpo.yaml trainer.steps=40 model.path='" + (task / "model").string() +
                    "' data.train.path='" + (task / "train.jsonl").string() + "' trainer.sft_warmup.path='" +
                    (task / "format.jsonl").string() + "' run.dir='" + dir.string() + "'";
  auto r = shell(cmd);
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("step 40/40") != std::string::npos);
  // The progress line: where the time went, the pace and the time left; plain text off a terminal.
  int64_t progress_lines = 0;
  std::istringstream out(r.out);
  for (std::string l; std::getline(out, l);) {
    if (l.rfind("step ", 0) != 0) continue;
    ++progress_lines;
    for (const char* part : {"reward ", "gen ", "train ", "wait ", "tok/s", "steps/min"}) CHECK_MESSAGE(l.find(part) != std::string::npos, l);
    CHECK_MESSAGE(l.find(l.rfind("step 40/40", 0) == 0 ? "done in " : "ETA ") != std::string::npos, l);
  }
  CHECK(progress_lines == 40);
  CHECK(r.out.find('\033') == std::string::npos);
  // The summary of what was written where.
  CHECK(r.out.find("troupe run: wrote " + dir.string() + "/") != std::string::npos);
  CHECK(r.out.find("metrics.jsonl ") != std::string::npos);
  CHECK(r.out.find("40 lines  metrics, one line per step") != std::string::npos);
  CHECK(r.out.find("latest checkpoint: " + (dir / "checkpoints" / "step_40").string()) != std::string::npos);
  CHECK(fs::exists(dir / "config.yaml"));
  CHECK(fs::exists(dir / "checkpoints" / "step_40" / "model.safetensors"));
  CHECK(fs::exists(dir / "checkpoints" / "step_40" / "tokenizer.json"));
  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  int64_t lines = 0;
  double first = -1, last = 0, first5 = 0, last5 = 0, generate_s = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    for (const char* key : {"step", "policy_version", "reward/mean", "reward/correct/mean", "loss", "kl", "staleness/mean",
                            "staleness/max", "time/step_s", "time/generate_wait_s", "time/generate_s", "tokens_per_s"})
      CHECK_MESSAGE(j.contains(key), key);
    CHECK(j["staleness/max"].get<int64_t>() <= 1);
    if (first < 0) first = j["reward/mean"].get<double>();
    last = j["reward/mean"].get<double>();
    if (lines < 5) first5 += j["reward/mean"].get<double>() / 5;
    if (lines >= 35) last5 += j["reward/mean"].get<double>() / 5;
    generate_s += j["time/generate_s"].get<double>();
    ++lines;
  }
  CHECK(lines == 40);
  CHECK(generate_s > 0);  // the generator's decode time reaches the metrics
  MESSAGE("tiny arithmetic via troupe run: reward/mean step 1 " << first << ", step 40 " << last << "; mean of steps 1-5 "
                                                                << first5 << ", 36-40 " << last5);
  CHECK(last5 > first5 + 0.1);  // it learns
  // TensorBoard's EventAccumulator reads tb/ back equal to metrics.jsonl; samples.jsonl has two
  // decoded completions a step, shown as TensorBoard text too.
  std::ifstream samples(dir / "samples.jsonl");
  int64_t sample_lines = 0;
  for (std::string s; std::getline(samples, s); ++sample_lines) {
    auto j = nlohmann::json::parse(s);
    CHECK(j["step"] == sample_lines + 1);
    REQUIRE(j["samples"].size() == 2);
    for (const auto& x : j["samples"]) {
      CHECK(!x["prompt"].get<std::string>().empty());
      CHECK(x["rewards"].contains("correct"));
      CHECK(x["reward"].is_number());
    }
  }
  CHECK(sample_lines == 40);
  auto board = read_board(dir / "tb");
  CHECK(board["files"].size() == 1);
  const size_t scalars = check_board_matches(dir, board);
  CHECK(board["texts"].size() == 40);
  MESSAGE("tensorboard: " << scalars << " scalars of 40 metrics lines read back equal by EventAccumulator");
}

TEST_CASE("troupe run with engine: remote generates through troupe serve and syncs its weights from disk") {
  auto task = fixtures() / "arithmetic";
  auto dir = fixtures() / "run_tiny_arithmetic_remote";
  fs::remove_all(dir);
  // The server loads the raw model; the run pushes its SFT-warmed weights as version 0 and
  // new weights after every step, so learning only shows if the server really takes them.
  ServerProcess server({"--model", (task / "model").string(), "--port", "0", "--max-batch", "256", "--max-seq-len",
                        "16", "--max-n", "16", "--seed", "3"});
  std::string cmd = "cd '" + source().string() + "' && '" + env_dir("TROUPE_BIN").string() +
                    "' run configs/tiny_arithmetic_grpo.yaml trainer.steps=120 model.path='" + (task / "model").string() +
                    "' data.train.path='" + (task / "train.jsonl").string() + "' trainer.sft_warmup.path='" +
                    (task / "format.jsonl").string() + "' run.dir='" + dir.string() +
                    "' generator.engine=remote generator.url=http://127.0.0.1:" + std::to_string(server.port);
  auto r = shell(cmd);
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<nlohmann::json> steps;
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line));
  REQUIRE(steps.size() == 120);
  auto mean = [&](size_t from, size_t n) {
    double s = 0;
    for (size_t i = from; i < from + n; ++i) s += steps[i]["reward/mean"].get<double>();
    return s / n;
  };
  int64_t worst = 0;
  for (const auto& j : steps) worst = std::max(worst, j["staleness/max"].get<int64_t>());
  MESSAGE("remote generator via troupe serve: reward/mean first 5 steps " << mean(0, 5) << ", last 10 " << mean(110, 10)
                                                                          << "; staleness max " << worst);
  CHECK(worst <= 1);
  CHECK(mean(0, 5) < 0.3);
  CHECK(mean(110, 10) > 0.5);
  CHECK(fs::exists(dir / "weights_for_server" / "generator_0" / "model.safetensors"));
  CHECK(server.terminate() == 0);
}

// 100 of the config's 200 steps: PPO's four epochs a batch learn it by then (0.92 over the last
// 10 when measured).
TEST_CASE("troupe run trains the tiny arithmetic config with PPO (value head, GAE) through the async graph") {
  auto steps = run_arithmetic("tiny_arithmetic_ppo", "run_tiny_arithmetic_ppo", "trainer.steps=100");
  auto dir = fixtures() / "run_tiny_arithmetic_ppo";
  REQUIRE(steps.size() == 100);
  auto mean = [&](size_t from, size_t n) {
    double s = 0;
    for (size_t i = from; i < from + n; ++i) s += steps[i]["reward/mean"].get<double>();
    return s / n;
  };
  int64_t worst = 0;
  for (const auto& j : steps) {
    worst = std::max(worst, j["staleness/max"].get<int64_t>());
    CHECK(j.contains("value_loss"));
    CHECK(j.contains("explained_variance"));
  }
  MESSAGE("ppo via troupe run (eta 1): reward/mean first 5 steps " << mean(0, 5) << ", last 10 " << mean(90, 10)
                                                                   << "; staleness max " << worst);
  CHECK(mean(0, 5) < 0.3);
  CHECK(mean(90, 10) > 0.7);
  CHECK(worst <= 1);
  CHECK(steps.back()["policy_version"] == 100);  // versions count steps, not the 4 epochs of each
  CHECK(fs::exists(dir / "checkpoints" / "step_100" / "value_head.safetensors"));
}

TEST_CASE("troupe run trains the tiny arithmetic config with online DPO: best and worst of each group form a pair") {
  auto steps = run_arithmetic("tiny_arithmetic_online_dpo", "run_tiny_arithmetic_online_dpo");
  REQUIRE(steps.size() == 200);
  // A step whose groups all tied trains nothing and reports no reward; the means skip it.
  auto mean = [&](size_t from, size_t n) {
    double s = 0;
    int64_t k = 0;
    for (size_t i = from; i < from + n; ++i)
      if (steps[i]["reward/mean"].is_number()) {
        s += steps[i]["reward/mean"].get<double>();
        ++k;
      }
    REQUIRE(k > 0);
    return s / k;
  };
  int64_t worst = 0, pairs = 0;
  for (const auto& j : steps) {
    worst = std::max(worst, j["staleness/max"].get<int64_t>());
    REQUIRE(j.contains("pairs"));
    CHECK(j["pairs"].get<int64_t>() <= 16);
    pairs += j["pairs"].get<int64_t>();
    if (j["pairs"].get<int64_t>() > 0) CHECK(j.contains("rewards/accuracies"));
  }
  MESSAGE("online dpo via troupe run (eta 1): reward/mean first 10 steps " << mean(0, 10) << ", last 20 " << mean(180, 20)
                                                                           << "; " << pairs << " pairs; staleness max " << worst);
  CHECK(mean(0, 10) < 0.3);
  CHECK(mean(180, 20) > 0.7);
  CHECK(worst <= 1);
  CHECK(pairs > 0);
}

TEST_CASE("troupe run refuses a bad config before starting anything") {
  auto bad = fs::temp_directory_path() / "troupe_bad_run.yaml";
  std::ofstream(bad) << "recipe: grpo\nmodel: {path: nowhere.gguf}\n"
                         "data: {train: {path: train.jsonl}}\nrewards: [{name: r, kind: format}]\n"
                         "generator: {group_size: eight}\n";
  auto r = shell("'" + env_dir("TROUPE_BIN").string() + "' run '" + bad.string() + "'");
  CHECK(r.status == 1);
  CHECK(r.out.find("troupe_bad_run.yaml:5: generator.group_size") != std::string::npos);
  // A good config whose files are missing stops before any actor starts, naming the file.
  std::ofstream(bad) << "recipe: grpo\nmodel: {path: nowhere.gguf}\n"
                        "data: {train: {path: train.jsonl}}\nrewards: [{name: r, kind: format}]\n";
  r = shell("'" + env_dir("TROUPE_BIN").string() + "' run '" + bad.string() + "'");
  CHECK(r.status == 1);
  CHECK(r.out.find("nowhere.gguf") != std::string::npos);
}
