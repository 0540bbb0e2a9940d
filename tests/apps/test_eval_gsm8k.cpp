// GSM8K evaluation: the pass@k estimator and the accuracy aggregation against hand-computed
// values, then `troupe eval gsm8k` end to end on the real SmolLM2 GGUF: the exact score on a fixture
// whose right answers are known, K-sample output and bad data.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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

// The exact score on answers whose truth is known. The model's greedy completions come from
// `troupe generate --chat` (the single-sequence decoder and the app's own chat rendering, not the
// eval's engine and PromptSource), and this test reads each one's final number with its own regex.
// The fixture gives k of the N real GSM8K questions that number as the answer and the rest a
// number the completion never contains, so the eval must print pass@1 = k/N exactly: an eval
// that never gives credit, always gives it, or scores other text than greedy decoding of the
// chat-formatted question fails.
TEST_CASE("troupe eval gsm8k on SmolLM2 gives the exact score on answers made from its own completions") {
  constexpr int64_t kTokens = 48;
  std::vector<std::string> questions;
  {
    std::ifstream in(test::data() / "gsm8k" / "test.jsonl");
    std::string line;
    while (questions.size() < 3 && std::getline(in, line))
      questions.push_back(nlohmann::json::parse(line).at("question").get<std::string>());
  }
  REQUIRE(questions.size() == 3);

  const std::regex number(R"(-?[0-9][0-9,]*(\.[0-9]+)?)");
  std::vector<std::string> finals;
  for (const auto& q : questions) {
    auto g = troupe::test::run_command(quote(test::env_dir("TROUPE_BIN").string()) + " generate --model " +
                                       quote(test::smollm2_gguf().string()) + " --chat --temperature 0 --max-tokens " +
                                       std::to_string(kTokens) + " --prompt " + quote(q) + " < /dev/null 2>/dev/null");
    REQUIRE(g.status == 0);
    const std::string text = g.out.substr(0, g.out.size() - (g.out.ends_with('\n') ? 1 : 0));
    INFO(text);
    // The verifier prefers "####" and \boxed{} over the last number; these completions have neither.
    REQUIRE(text.find("####") == std::string::npos);
    REQUIRE(text.find("boxed") == std::string::npos);
    std::string last;
    for (auto it = std::sregex_iterator(text.begin(), text.end(), number); it != std::sregex_iterator(); ++it)
      last = it->str();
    REQUIRE(!last.empty());
    last.erase(std::remove(last.begin(), last.end(), ','), last.end());
    REQUIRE(text.find("987654321") == std::string::npos);
    finals.push_back(last);
  }

  // Questions 0 and 2 get the model's own final number (one in GSM8K's rationale-then-#### form),
  // question 1 a number it never wrote.
  const auto data = fs::temp_directory_path() / "troupe_eval_gsm8k_known.jsonl";
  {
    std::ofstream out(data);
    out << nlohmann::json{{"question", questions[0]}, {"answer", "Worked out step by step.\n#### " + finals[0]}}.dump()
        << "\n"
        << nlohmann::json{{"question", questions[1]}, {"answer", "#### 987654321"}}.dump() << "\n"
        << nlohmann::json{{"question", questions[2]}, {"answer", "#### " + finals[2]}}.dump() << "\n";
  }
  auto r = run_troupe("eval gsm8k --model " + quote(test::smollm2_gguf().string()) + " --data " + quote(data.string()) +
                      " --max-tokens " + std::to_string(kTokens));
  INFO(r.out);
  INFO("final numbers of the greedy completions: " << finals[0] << ", " << finals[1] << ", " << finals[2]);
  REQUIRE(r.status == 0);
  CHECK(last_line(r.out) == "gsm8k: n=3 pass@1=0.667");  // 2 of 3
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
