// The troupe command line end to end, on the real SmolLM2-135M-Instruct GGUF: perplexity of
// the import, a coherent greedy chat answer, tokenize round trips, convert, and clear errors.
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using troupe::test::data;
using troupe::test::env_dir;
using troupe::test::smollm2_gguf;

namespace {

using Run = troupe::test::CommandResult;

std::string quote(const std::string& s) { return troupe::test::shell_quote(s); }

// Runs `troupe ARGS` through the shell, feeding `input` on stdin.
Run run_troupe(const std::string& args, const std::string& input = "") {
  auto in = fs::temp_directory_path() / "troupe_cli_stdin.txt";
  std::ofstream(in) << input;
  std::string cmd = quote(env_dir("TROUPE_BIN").string()) + " " + args + " < " + quote(in.string()) + " 2>&1";
  return troupe::test::run_command(cmd);
}

std::string last_line(const std::string& s) {
  auto end = s.find_last_not_of('\n');
  auto start = s.rfind('\n', end);
  return s.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1) + 1);
}

}  // namespace

TEST_CASE("--help lists the subcommands") {
  auto r = run_troupe("--help");
  CHECK(r.status == 0);
  for (const char* cmd : {"generate", "tokenize", "eval", "convert", "plot"}) CHECK(r.out.find(cmd) != std::string::npos);
}

// One float32 evaluation serves both: the import's own perplexity, and the reference of int8's
// and int4's.
TEST_CASE("the imported SmolLM2 has a low perplexity on GSM8K questions; int8 and int4 weights keep it within 2 % and 6 %") {
  auto ppl = [](const std::string& weights) {
    auto r = run_troupe("eval perplexity --model " + quote(smollm2_gguf().string()) + " --data " +
                        quote((data() / "gsm8k" / "test.jsonl").string()) + " --field question --limit 100 --weights " +
                        weights);
    REQUIRE_MESSAGE(r.status == 0, r.out);
    std::smatch m;
    std::string line = last_line(r.out);
    REQUIRE(std::regex_match(line, m, std::regex(R"(perplexity: ([0-9.e+]+))")));
    return std::stod(m[1]);
  };
  const double full = ppl("full");
  CHECK(full > 1.0);
  CHECK(full < 60.0);
  const double int8 = ppl("int8"), int4 = ppl("int4");
  MESSAGE("SmolLM2-135M-Instruct Q4_1, first 100 GSM8K test questions: perplexity float32 " << full << ", int8 " << int8 << " ("
          << 100 * (int8 / full - 1) << " %), int4 " << int4 << " (" << 100 * (int4 / full - 1) << " %)");
  CHECK(int8 != full);  // the weights really are others
  CHECK(std::abs(int8 / full - 1) < 0.02);
  CHECK(std::abs(int4 / full - 1) < 0.06);
  auto r = run_troupe("eval perplexity --model " + quote(smollm2_gguf().string()) + " --data " +
                      quote((data() / "gsm8k" / "test.jsonl").string()) + " --field question --limit 1 --weights int3");
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.out.find("--weights int3: expected full, int8 or int4") != std::string::npos, r.out);
}

TEST_CASE("greedy chat answer is coherent") {
  auto r = run_troupe("generate --model " + quote(smollm2_gguf().string()) +
                  " --chat --max-tokens 40 --prompt 'What is the capital of France?'");
  REQUIRE(r.status == 0);
  MESSAGE("answer: " << r.out);
  CHECK(r.out.find("Paris") != std::string::npos);
}

TEST_CASE("sampling with a seed is reproducible") {
  std::string args = "generate --model " + quote(smollm2_gguf().string()) +
                     " --max-tokens 12 --temperature 1.0 --seed 7 --prompt 'Once upon a time'";
  auto a = run_troupe(args), b = run_troupe(args);
  REQUIRE(a.status == 0);
  CHECK(a.out == b.out);
}

TEST_CASE("tokenize and --decode round trip through the Qwen3 tokenizer") {
  std::string tok = quote((data() / "tokenizers" / "qwen3").string());
  auto enc = run_troupe("tokenize --tokenizer " + tok, "Hello, world!\n<|im_start|>user 123\n");
  REQUIRE(enc.status == 0);
  CHECK(enc.out.rfind("[9707,11,1879,0]\n", 0) == 0);  // ids from HF tokenizers for "Hello, world!"
  auto dec = run_troupe("tokenize --decode --tokenizer " + tok, enc.out);
  REQUIRE(dec.status == 0);
  CHECK(dec.out == "\"Hello, world!\"\n\"<|im_start|>user 123\"\n");
}

TEST_CASE("convert writes a Hugging Face folder") {
  auto out = fs::temp_directory_path() / "troupe_cli_convert";
  fs::remove_all(out);
  auto r = run_troupe("convert " + quote(smollm2_gguf().string()) + " " + quote(out.string()) + " --dtype bfloat16");
  REQUIRE(r.status == 0);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    CHECK(fs::exists(out / f));
  auto config = nlohmann::json::parse(std::ifstream(out / "config.json"));
  CHECK(config["dtype"] == "bfloat16");
  CHECK(config["num_hidden_layers"] == 30);
}

TEST_CASE("bad input gives one clear error line and exit code 1") {
  auto dir = fs::temp_directory_path() / "troupe_cli_bad";
  fs::create_directories(dir);
  auto r = run_troupe("generate --model " + quote((dir / "none.gguf").string()) + " --prompt hi");
  CHECK(r.status == 1);
  CHECK(r.out.find("troupe: error: ") != std::string::npos);
  CHECK(r.out.find("none.gguf: no such file or folder") != std::string::npos);

  std::ofstream(dir / "data.jsonl") << "{\"question\": \"fine\"}\n{\"text\": 3}\n";
  r = run_troupe("eval perplexity --model " + quote(smollm2_gguf().string()) + " --data " +
             quote((dir / "data.jsonl").string()) + " --field question");
  CHECK(r.status == 1);
  CHECK(r.out.find("data.jsonl:2: no field 'question'") != std::string::npos);

  r = run_troupe("tokenize --decode --tokenizer " + quote((data() / "tokenizers" / "qwen3").string()), "[1, 2, \"x\"]\n");
  CHECK(r.status == 1);
  CHECK(r.out.find("<stdin>:1: \"x\" is not a token id") != std::string::npos);

  r = run_troupe("frobnicate");
  CHECK(r.status != 0);
}

namespace {

// `troupe ls` run in `dir`, as a user would from the repository root.
Run run_ls_in(const fs::path& dir) {
  return troupe::test::run_command("cd " + quote(dir.string()) + " && " + quote(env_dir("TROUPE_BIN").string()) +
                                   " ls 2>&1");
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> lines;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The output line whose first word is `first`, split into words; empty if there is none.
std::vector<std::string> words_of_line(const std::string& out, const std::string& first) {
  for (const auto& line : lines_of(out)) {
    std::istringstream in(line);
    std::vector<std::string> words;
    for (std::string w; in >> w;) words.push_back(w);
    if (!words.empty() && words[0] == first) return words;
  }
  return {};
}

std::string joined(const std::vector<std::string>& words) {
  std::string s;
  for (const auto& w : words) s += (s.empty() ? "" : " ") + w;
  return s;
}

// The value of a config's top-level `recipe:` key, read as text (not through the config parser).
std::string recipe_in_file(const fs::path& path) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_match(line, m, std::regex(R"(recipe:\s*([a-z_]+)\s*(#.*)?)"))) return m[1];
  }
  return "";
}

}  // namespace

TEST_CASE("ls lists the seven recipes and every file in configs/ with its recipe") {
  auto r = run_ls_in(troupe::test::source());
  INFO(r.out);
  CHECK(r.status == 0);
  for (const char* recipe : {"grpo", "ppo", "online_dpo", "reinforce", "sft", "lora", "dpo"}) {
    CAPTURE(recipe);
    auto line = joined(words_of_line(r.out, recipe));
    CAPTURE(line);
    // A description that says whether the recipe runs the actor graph or the trainer alone.
    CHECK(line.size() > 40);
    CHECK((line.find("(actor graph") != std::string::npos || line.find("(trainer alone)") != std::string::npos));
  }
  int count = 0;
  for (const auto& e : fs::directory_iterator(troupe::test::source() / "configs")) {
    if (!e.is_regular_file() || e.path().filename().string()[0] == '.') continue;
    ++count;
    std::string name = "configs/" + e.path().filename().string();
    CAPTURE(name);
    auto words = words_of_line(r.out, name);
    REQUIRE(words.size() >= 3);  // the path, the recipe and the opening comment
    CHECK(words[1] == recipe_in_file(e.path()));
    CHECK(words[2] != "(no");    // every shipped config opens with a comment
  }
  CHECK(count >= 9);
}

TEST_CASE("ls shows a broken config as an error line and goes on; a missing configs/ is named") {
  auto dir = fs::temp_directory_path() / "troupe_cli_ls";
  fs::remove_all(dir);
  fs::create_directories(dir / "configs");
  std::ofstream(dir / "configs" / "a_broken.yaml") << "# Broken on purpose.\nrecipe: sft\nmodel: {path: m}\n"
                                                      "data: {train: {path: d.jsonl, response: answer}}\ntrainer: {lr: -1}\n";
  std::ofstream(dir / "configs" / "b_fine.yaml")
      << "# A fine one: supervised fine-tuning,\n# on two lines.\nrecipe: sft\nmodel: {path: m}\n"
         "data: {train: {path: d.jsonl, response: answer}}\n";
  auto r = run_ls_in(dir);
  INFO(r.out);
  CHECK(r.status == 1);
  auto broken = words_of_line(r.out, "configs/a_broken.yaml");
  REQUIRE(broken.size() >= 3);
  CHECK(broken[1] == "error:");
  CHECK(r.out.find("configs/a_broken.yaml:5: trainer.lr: must be > 0") != std::string::npos);
  auto fine = words_of_line(r.out, "configs/b_fine.yaml");
  REQUIRE(fine.size() >= 3);
  CHECK(fine[1] == "sft");
  CHECK(r.out.find("A fine one: supervised fine-tuning ...") != std::string::npos);
  CHECK(r.out.find("1 of 2 configs in configs/ did not load") != std::string::npos);

  fs::remove_all(dir / "configs");
  r = run_ls_in(dir);
  CHECK(r.status == 1);
  CHECK(!words_of_line(r.out, "dpo").empty());  // the recipes are still listed
  CHECK(r.out.find("no configs/ folder in ") != std::string::npos);
}
