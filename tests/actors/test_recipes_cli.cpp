// `troupe run` on the trainer-alone recipes (sft, lora, dpo) with the tiny arithmetic configs:
// the loss falls, DPO's reward accuracy rises, and the run folder holds what a user exports
// (a Hugging Face folder of merged weights, the PEFT adapter with LoRA, the optimizer state).
#include <doctest/doctest.h>

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/actors/tensorboard_util.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using namespace troupe::test;

namespace {

// Runs configs/NAME.yaml on the arithmetic fixture into fixtures()/run_NAME; returns metrics.jsonl.
std::vector<nlohmann::json> run_recipe(const std::string& name, const std::string& data_file,
                                       const std::string& extra = "") {
  auto task = fixtures() / "arithmetic";
  auto dir = fixtures() / ("run_" + name);
  fs::remove_all(dir);
  std::string cmd = "cd " + shell_quote(source().string()) + " && " + shell_quote(env_dir("TROUPE_BIN").string()) +
                    " run configs/" + name + ".yaml model.path=" + shell_quote((task / "model").string()) +
                    " data.train.path=" + shell_quote((task / data_file).string()) + " run.dir=" +
                    shell_quote(dir.string()) + " " + extra + " 2>&1";
  auto r = run_command(cmd);
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

double mean(const std::vector<nlohmann::json>& m, size_t from, size_t n, const char* key) {
  double s = 0;
  for (size_t i = from; i < from + n; ++i) s += m[i][key].get<double>();
  return s / n;
}

}  // namespace

TEST_CASE("recipe sft: the loss falls and a Hugging Face checkpoint with optimizer state is written") {
  auto eval = fixtures() / "arithmetic" / "train.jsonl";
  auto m = run_recipe("tiny_arithmetic_sft", "train.jsonl", "data.eval.path=" + shell_quote(eval.string()));
  REQUIRE(m.size() == 150);
  double first = mean(m, 0, 3, "loss"), last = mean(m, 140, 10, "loss");
  MESSAGE("sft: loss first 3 steps " << first << ", last 10 " << last << "; eval/loss at 50 "
                                     << m[49]["eval/loss"] << ", at 150 " << m[149]["eval/loss"]);
  CHECK(first > 1.0);
  CHECK(last < 0.05);
  CHECK(m[149]["eval/loss"].get<double>() < m[49]["eval/loss"].get<double>());
  auto ckpt = fixtures() / "run_tiny_arithmetic_sft" / "checkpoints" / "step_150";
  for (const char* f : {"model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "trainer_state.json"})
    CHECK_MESSAGE(fs::exists(ckpt / f), f);
  // TensorBoard's EventAccumulator reads tb/ back equal to metrics.jsonl (eval/loss at its steps too).
  auto run = fixtures() / "run_tiny_arithmetic_sft";
  auto board = read_board(run / "tb");
  CHECK(board["files"].size() == 1);
  const size_t scalars = check_board_matches(run, board);
  CHECK(scalar_at(board, "eval/loss", 150));
  MESSAGE("sft tensorboard: " << scalars << " scalars read back equal to metrics.jsonl");
}

TEST_CASE("recipe lora: only adapters train, and the checkpoint carries a PEFT adapter beside the merged model") {
  auto eval = fixtures() / "arithmetic" / "train.jsonl";
  auto m = run_recipe("tiny_arithmetic_lora", "train.jsonl",
                      "trainer.steps=60 data.eval.path=" + shell_quote(eval.string()));
  REQUIRE(m.size() == 60);
  double first = mean(m, 0, 3, "loss"), last = mean(m, 50, 10, "loss");
  MESSAGE("lora: loss first 3 steps " << first << ", last 10 " << last);
  CHECK(last < first / 2);
  auto ckpt = fixtures() / "run_tiny_arithmetic_lora" / "checkpoints" / "step_60";
  CHECK(fs::exists(ckpt / "adapter" / "adapter_config.json"));
  CHECK(fs::exists(ckpt / "adapter" / "adapter_model.safetensors"));
  CHECK(fs::exists(ckpt / "model.safetensors"));
  auto config = nlohmann::json::parse(std::ifstream(ckpt / "adapter" / "adapter_config.json"));
  CHECK(config["peft_type"] == "LORA");
  CHECK(config["r"] == 8);
}

TEST_CASE("recipe dpo: reward accuracy rises above 0.9 on the arithmetic preferences") {
  auto m = run_recipe("tiny_arithmetic_dpo", "prefs.jsonl");
  REQUIRE(m.size() == 60);
  double first = mean(m, 0, 3, "rewards/accuracies"), last = mean(m, 50, 10, "rewards/accuracies");
  MESSAGE("dpo: rewards/accuracies first 3 steps " << first << ", last 10 " << last << "; loss "
                                                   << m[0]["loss"] << " -> " << m[59]["loss"]);
  CHECK(m[0]["loss"].get<double>() == doctest::Approx(0.6931).epsilon(0.01));  // log 2: policy = reference
  CHECK(last > 0.9);
  CHECK(m[59]["rewards/margins"].get<double>() > 0.5);
  CHECK(fs::exists(fixtures() / "run_tiny_arithmetic_dpo" / "reference_logprobs.json"));
}

TEST_CASE("trainer-alone recipes name the bad file and line") {
  auto bad = fs::temp_directory_path() / "troupe_bad_prefs.jsonl";
  std::ofstream(bad) << "{\"prompt\": \"1+1=\", \"chosen\": \"2\", \"rejected\": \"3\"}\n{\"prompt\": \"1+2=\", \"chosen\": \"3\"}\n";
  auto task = fixtures() / "arithmetic";
  auto r = run_command("cd " + shell_quote(source().string()) + " && " + shell_quote(env_dir("TROUPE_BIN").string()) +
                       " run configs/tiny_arithmetic_dpo.yaml model.path=" + shell_quote((task / "model").string()) +
                       " data.train.path=" + shell_quote(bad.string()) + " run.dir=" +
                       shell_quote((fixtures() / "run_bad_prefs").string()) + " 2>&1");
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.out.find(bad.string() + ":2") != std::string::npos, r.out);
  CHECK(r.out.find("rejected") != std::string::npos);
}
