// The troupe command line end to end, on the real SmolLM2-135M-Instruct GGUF: perplexity of
// the import, a coherent greedy chat answer, tokenize round trips, convert, and clear errors.
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>

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
  for (const char* cmd : {"generate", "tokenize", "eval", "convert"}) CHECK(r.out.find(cmd) != std::string::npos);
}

TEST_CASE("the imported SmolLM2 has a low perplexity on GSM8K questions") {
  auto r = run_troupe("eval perplexity --model " + quote(smollm2_gguf().string()) + " --data " +
                  quote((data() / "gsm8k" / "test.jsonl").string()) + " --field question --limit 100");
  REQUIRE(r.status == 0);
  std::smatch m;
  std::string line = last_line(r.out);
  REQUIRE(std::regex_match(line, m, std::regex(R"(perplexity: ([0-9.e+]+))")));
  double ppl = std::stod(m[1]);
  MESSAGE("SmolLM2-135M-Instruct Q4_1, first 100 GSM8K test questions: perplexity " << ppl);
  CHECK(ppl > 1.0);
  CHECK(ppl < 60.0);
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
