// GSM8K evaluation: the pass@k estimator and the accuracy aggregation against hand-computed
// values, then `troupe eval gsm8k` end to end on the real SmolLM2 GGUF (format of the last line).
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>

#include "policy/error.hpp"
#include "reward/math.hpp"
#include "trainer/eval_gsm8k.hpp"
#include "tests/test_util.hpp"

using namespace troupe;
namespace fs = std::filesystem;

namespace {

using Run = troupe::test::CommandResult;

std::string quote(const std::string& s) { return troupe::test::shell_quote(s); }

Run run_troupe(const std::string& args) {
  std::string cmd = quote(test::env_dir("TROUPE_BIN").string()) + " " + args + " < /dev/null 2>&1";
  return troupe::test::run_command(cmd);
}

std::string last_line(const std::string& s) {
  auto end = s.find_last_not_of('\n');
  if (end == std::string::npos) return "";
  auto start = s.rfind('\n', end);
  start = start == std::string::npos ? 0 : start + 1;
  return s.substr(start, end - start + 1);
}

// log C(n, k), independently of the product form the library uses.
double log_choose(int64_t n, int64_t k) { return std::lgamma(n + 1.0) - std::lgamma(k + 1.0) - std::lgamma(n - k + 1.0); }

}  // namespace

TEST_CASE("pass@k matches 1 - C(n-c, k) / C(n, k) by hand") {
  CHECK(pass_at_k(8, 2, 4) == doctest::Approx(1.0 - 15.0 / 70.0));  // C(6,4)=15, C(8,4)=70
  CHECK(pass_at_k(4, 1, 2) == doctest::Approx(0.5));                // 1 - C(3,2)/C(4,2) = 1 - 3/6
  CHECK(pass_at_k(10, 3, 1) == doctest::Approx(0.3));               // pass@1 is c/n
  CHECK(pass_at_k(8, 0, 8) == 0.0);
  CHECK(pass_at_k(8, 1, 8) == 1.0);
  CHECK(pass_at_k(8, 7, 4) == 1.0);  // one wrong sample cannot fill a subset of 4
  CHECK(pass_at_k(200, 10, 100) == doctest::Approx(1.0 - std::exp(log_choose(190, 100) - log_choose(200, 100))));
  CHECK_THROWS_AS(pass_at_k(4, 5, 2), Error);
  CHECK_THROWS_AS(pass_at_k(4, 1, 5), Error);
  CHECK_THROWS_AS(pass_at_k(4, 1, 0), Error);
}

TEST_CASE("accuracy aggregation over given correctness vectors") {
  auto a = eval_accuracy({{1, 0, 0, 0}, {1, 1, 1, 1}, {0, 0, 0, 0}});
  CHECK(a.questions == 3);
  CHECK(a.samples == 4);
  CHECK(a.pass_at_1 == doctest::Approx((0.25 + 1.0 + 0.0) / 3));
  CHECK(a.pass_at_k == doctest::Approx(2.0 / 3));
  CHECK(a.line("gsm8k") == "gsm8k: n=3 pass@1=0.417 pass@4=0.667");

  auto b = eval_accuracy({{1, 0, 0, 0, 0, 0, 1, 0}, {0, 0, 0, 0, 0, 0, 0, 0}});
  CHECK(b.pass_at_k == doctest::Approx(0.5));
  CHECK(b.pass_at_1 == doctest::Approx(2.0 / 16));

  auto greedy = eval_accuracy({{1}, {0}, {1}, {1}});
  CHECK(greedy.pass_at_1 == doctest::Approx(0.75));
  CHECK(greedy.line("gsm8k") == "gsm8k: n=4 pass@1=0.750");

  CHECK_THROWS_AS(eval_accuracy({}), Error);
  CHECK_THROWS_AS(eval_accuracy({{1, 0}, {1}}), Error);

  // What the eval feeds the aggregation: the verifier on a completion against GSM8K's answer field.
  const std::string reference = "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18";
  CHECK(math_answer_reward("9 eggs at $2 each, so she makes $18 every day.", reference) == 1.0);
  CHECK(math_answer_reward("16 - 3 - 4 = 9 eggs, so she makes $16 every day.", reference) == 0.0);
}

TEST_CASE("troupe eval gsm8k on SmolLM2: last line gives n and pass@1") {
  const auto data = test::data() / "gsm8k" / "test.jsonl";
  auto r = run_troupe("eval gsm8k --model " + quote(test::smollm2_gguf().string()) + " --data " + quote(data.string()) +
                      " --limit 20 --max-tokens 128");
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::smatch m;
  const std::string line = last_line(r.out);
  REQUIRE(std::regex_match(line, m, std::regex(R"(gsm8k: n=20 pass@1=([0-9]\.[0-9]{3}))")));
  const double pass1 = std::stod(m[1]);
  MESSAGE("SmolLM2-135M-Instruct Q4_1, first 20 GSM8K test questions, greedy, 128 tokens: " << line);
  CHECK(pass1 >= 0.0);
  CHECK(pass1 <= 1.0);
}

TEST_CASE("troupe eval gsm8k with K samples prints pass@K; bad data is one clear error") {
  const auto data = test::data() / "gsm8k" / "test.jsonl";
  auto r = run_troupe("eval gsm8k --model " + quote(test::smollm2_gguf().string()) + " --data " + quote(data.string()) +
                      " --limit 2 --samples 4 --max-tokens 32 --seed 1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::smatch m;
  const std::string line = last_line(r.out);
  REQUIRE(std::regex_match(line, m, std::regex(R"(gsm8k: n=2 pass@1=([0-9.]+) pass@4=([0-9.]+))")));
  CHECK(std::stod(m[1]) <= std::stod(m[2]));  // pass@k never falls below pass@1

  const auto bad = fs::temp_directory_path() / "troupe_eval_gsm8k_bad.jsonl";
  std::ofstream(bad) << R"({"question": "What is 2+2?", "answer": "#### 4"})" "\n" R"({"question": "x"})" "\n";
  auto e = run_troupe("eval gsm8k --model " + quote(test::smollm2_gguf().string()) + " --data " + quote(bad.string()));
  CHECK(e.status == 1);
  CHECK(last_line(e.out) == "troupe: error: " + bad.string() + ":2: no field 'answer' (set the answer field, or leave it empty for none)");
}
