// The math verifier: hand-written completion/answer pairs (matches and near-misses), MATH-style
// answer pairs judged by algebra, each extraction rule on its own, the format reward, and real
// GSM8K answers from ../shared/data.
#include <doctest/doctest.h>

#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "reward/math.hpp"
#include "tests/test_util.hpp"

using namespace troupe;

namespace {

struct Case {
  const char* completion;
  const char* reference;
  double expected;
};

// GSM8K style: the reference is the dataset's answer field, "... #### N".
const Case kGsm8kCases[] = {
    {"#### 18", "#### 18", 1},
    {"The answer is 18.", "#### 18", 1},
    {"#### 18.0", "#### 18", 1},
    {"#### 18.", "#### 18", 1},
    {"#### $18", "#### 18", 1},
    {"#### \\$18", "#### 18", 1},
    {"#### 18 dollars", "#### 18", 1},
    {"#### 18 eggs.", "#### 18", 1},
    {"####18", "#### 18", 1},
    {"#### 1,800", "#### 1800", 1},
    {"#### 1800", "#### 1,800", 1},
    {"#### 1,000,000", "#### 1000000", 1},
    {"She makes $1,234.50 in total.", "#### 1234.5", 1},
    {"#### 3.50", "#### 3.5", 1},
    {"#### 007", "#### 7", 1},
    {"#### -5", "#### -5", 1},
    {"The temperature drops to -5 degrees.", "#### -5", 1},
    {"#### 0.75", "#### 3/4", 1},
    {"#### 3/4", "#### 0.75", 1},
    {"#### 3/4", "#### 3/4", 1},
    {"The answer is 1/2.", "#### 0.5", 1},
    {"The result is 0.5", "#### .5", 1},
    {"#### 10%", "#### 10", 1},
    {"#### x = 4", "#### 4", 1},
    {"#### The answer is 18.", "#### 18", 1},
    {"So x = 4", "#### 4", 1},
    {"Janet sells 16 - 3 - 4 = 9 eggs. 9 * 2 = 18", "#### 18", 1},
    {"She makes 9*2=$18 every day.", "#### 18", 1},
    {"He has 5 apples and 3 oranges, so 8 fruits.", "#### 8", 1},
    {"#### 18\nQuestion: what is 6*7?\n#### 42", "#### 18", 1},  // the first #### counts
    {"The answer is \\boxed{18}.", "#### 18", 1},
    {"So he made a profit of $70,000.", "The cost was 130,000\nSo he made 70,000\n#### 70000", 1},
    {"#### 70,000", "So he made a profit of 200,000-130,000=$<<200000-130000=70000>>70,000\n#### 70000", 1},
    {"\\boxed{18", "#### 18", 1},  // an unclosed box falls back to the last number
    // near-misses
    {"#### 17", "#### 18", 0},
    {"#### 180", "#### 18", 0},
    {"#### 1.8", "#### 18", 0},
    {"#### 18.01", "#### 18", 0},
    {"#### -18", "#### 18", 0},
    {"#### 5", "#### -5", 0},
    {"#### 7000", "#### 70000", 0},
    {"#### 1234567", "#### 1234568", 0},
    {"#### 42\n#### 18", "#### 18", 0},
    {"#### 20, not \\boxed{18}", "#### 18", 0},  // #### before \boxed
    {"The answer is 18 but then 19", "#### 18", 0},
    {"#### eighteen", "#### 18", 0},
    {"I don't know.", "#### 18", 0},
    {"", "#### 18", 0},
    {"#### 0.33", "#### 1/3", 0},
};

// MATH style: the reference is the bare answer (or a solution with \boxed).
const Case kMathCases[] = {
    {"\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1},
    {"\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1},
    {"\\boxed{\\tfrac12}", "\\frac{1}{2}", 1},
    {"\\boxed{0.5}", "\\frac{1}{2}", 1},
    {"\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1},
    {"\\boxed{-\\frac{3}{4}}", "-0.75", 1},
    {"\\boxed{\\frac{-3}{4}}", "-\\frac{3}{4}", 1},
    {"\\boxed{\\dfrac{3}{4}}", "3/4", 1},
    {"\\boxed{3/4}", "\\frac{3}{4}", 1},
    {"\\boxed{\\frac34}", "0.75", 1},
    {"\\boxed{\\displaystyle \\frac{1}{2}}", "1/2", 1},
    {"\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1},
    {"\\boxed{\\frac{\\frac{1}{2}}{3}}", "\\frac{\\frac{1}{2}}{3}", 1},
    {"\\boxed{\\sqrt{2}}", "\\sqrt2", 1},
    {"\\boxed{2\\sqrt{2}}", "2 \\sqrt{2}", 1},
    {"\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", 1},
    {"\\boxed{\\left[ 1, 2 \\right]}", "[1,2]", 1},
    {"\\boxed{[2,5)}", "[2,5)", 1},
    {"\\boxed{90^\\circ}", "90", 1},
    {"\\boxed{90^{\\circ}}", "90", 1},
    {"\\boxed{5 \\text{ cm}}", "5", 1},
    {"\\boxed{5\\text{ inches}}", "5", 1},
    {"\\boxed{12 \\mathrm{m}}", "12", 1},
    {"\\boxed{\\text{(B)}}", "\\text{(B)}", 1},
    {"\\boxed{\\text{(B)}}", "(B)", 1},
    {"\\boxed{\\mbox{Monday}}", "\\text{Monday}", 1},
    {"\\boxed{x = 3}", "3", 1},
    {"\\boxed{y=-2}", "-2", 1},
    {"\\boxed{\\theta = 30}", "30", 1},
    {"\\boxed{x^2+2x+1}", "x^2 + 2x + 1", 1},
    {"\\boxed{x^2+2x+1}", "(x+1)^2", 1},  // equal by algebra
    {"\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1},
    {"First \\boxed{3}, then \\boxed{4}", "4", 1},
    {"$\\boxed{10\\%}$", "10", 1},
    {"\\boxed{\\$18}", "18", 1},
    {"\\boxed{1,000}", "1000", 1},
    {"\\boxed{1{,}000}", "1000", 1},
    {"\\boxed{1\\,000}", "1000", 1},
    {"\\boxed{\\!5}", "5", 1},
    {"\\boxed{.5}", "0.5", 1},
    {"\\boxed 5", "5", 1},
    {"\\fbox{7}", "7", 1},
    {"\\boxed{\\infty}", "\\infty", 1},
    {"\\boxed{\\pi}", "\\pi", 1},
    {"\\[ \\boxed{-1} \\]", "-1", 1},
    {"\\boxed{\\frac{1}{2}}", "\\frac{1}{2}.", 1},
    {"\\boxed{0.5}", "so the answer is $\\boxed{\\frac{1}{2}}$.", 1},
    {"#### \\frac{1}{2}", "0.5", 1},
    {"\\boxed{5}", "#### 5", 1},
    {"\\boxed{\\{5\\}}", "{5}", 0},
    // near-misses
    {"\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0},
    {"\\boxed{\\frac{3}{4}}", "0.7", 0},
    {"\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{2}}{2}", 0},
    {"\\boxed{2\\sqrt{3}}", "2\\sqrt{2}", 0},
    {"\\boxed{(C)}", "(B)", 0},
    {"\\boxed{[2,5]}", "[2,5)", 0},
    {"\\boxed{2\\pi}", "\\pi", 0},
    {"\\boxed{-1}", "1", 0},
    {"First \\boxed{3}, then \\boxed{4}", "3", 0},
    {"\\boxed{}", "0", 0},
    {"\\boxed{\\frac{1}{0}}", "\\frac{2}{0}", 0},
    {"\\boxed{\\text{Tuesday}}", "\\text{Monday}", 0},
};

void check_cases(const Case* begin, const Case* end) {
  for (const Case* c = begin; c != end; ++c) {
    INFO("completion: " << std::string(c->completion) << "  reference: " << std::string(c->reference));
    CHECK(math_answer_reward(c->completion, c->reference) == c->expected);
  }
}

}  // namespace

TEST_CASE("GSM8K answers: matches and near-misses") {
  check_cases(std::begin(kGsm8kCases), std::end(kGsm8kCases));
}

TEST_CASE("MATH answers: boxed, LaTeX normalisation, matches and near-misses") {
  check_cases(std::begin(kMathCases), std::end(kMathCases));
  CHECK(std::size(kGsm8kCases) + std::size(kMathCases) >= 100);
}

namespace {

struct AnswerPair {
  const char* a;
  const char* b;
  bool equal;
};

// MATH-style final answers, compared by math_answers_equal (both orders).
const AnswerPair kSymbolicPairs[] = {
    // expressions: equal by algebra
    {"x^{2}+1", "x^2+1", true},
    {"2x+2", "2(x+1)", true},
    {"x^2+2x+1", "(x+1)^2", true},
    {"x^2-5x+6", "(x-2)(x-3)", true},
    {"\\frac{x^2-1}{x-1}", "x+1", true},
    {"\\frac{x}{2}", "0.5x", true},
    {"\\dfrac{3}{4}x", "0.75x", true},  // not "0.75 x": a number then words keeps the number
    {"\\frac{1}{x}+\\frac{1}{y}", "\\frac{x+y}{xy}", true},
    {"x^{-1}", "\\frac1x", true},
    {"\\frac{a}{b}\\cdot\\frac{b}{a}", "1", true},
    {"xy", "yx", true},
    {"a_1+a_2", "a_{2}+a_{1}", true},
    {"\\alpha+2\\beta", "2\\beta + \\alpha", true},
    {"\\pi r^2", "r^2\\pi", true},
    {"\\dfrac{3\\pi}{4}", "\\frac34\\pi", true},
    // numbers: fractions, decimals, scientific notation, radicals, functions
    {"\\frac{1}{2}", "0.5", true},
    {"1e3", "1000", true},
    {"2.5E-4", "0.00025", true},
    {"1\\times10^{3}", "1000", true},
    {"2.5\\cdot 10^{-3}", "0.0025", true},
    {"10^{-2}", "0.01", true},
    {"1,000,000", "10^6", true},
    {"2^{10}", "1024", true},
    {"\\frac{\\sqrt{6}}{2\\sqrt{2}}", "\\frac{\\sqrt{3}}{2}", true},
    {"\\sqrt{12}", "2\\sqrt{3}", true},
    {"\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", true},
    {"2^{0.5}", "\\sqrt2", true},
    {"\\sqrt[3]{27}", "3", true},
    {"\\sqrt[3]{-8}", "-2", true},
    {"2\\frac{1}{2}", "\\frac{5}{2}", true},  // a mixed number
    {"0.\\overline{3}", "\\frac{1}{3}", true},
    {"0.1\\overline{6}", "\\frac{1}{6}", true},
    {"|-3|", "3", true},
    {"\\binom{5}{2}", "10", true},
    {"5!", "120", true},
    {"\\sin^2 x + \\cos^2 x", "1", true},
    {"\\sin\\frac{\\pi}{6}", "\\frac{1}{2}", true},
    {"\\tan x", "\\frac{\\sin x}{\\cos x}", true},
    {"\\log_2 8", "3", true},
    {"\\ln(e^2)", "2", true},
    {"e^{i\\pi}", "-1", true},
    {"3+4i", "4i+3", true},
    {"(1+i)^2", "2i", true},
    {"\\sqrt{x^2}", "|x|", true},
    {"\\$1,000", "1000", true},
    {"50\\%", "50", true},
    {"5\\text{ cm}^2", "5", true},
    {"\\text{(A)}", "A", true},
    // intervals, tuples, sets, lists, unions, matrices
    {"[1, 3)", "[1,3)", true},
    {"(-\\infty, \\frac{1}{2}]", "(-\\infty,0.5]", true},
    {"(-\\infty,1)\\cup(2,\\infty)", "(2,\\infty)\\cup(-\\infty,1)", true},
    {"(3, \\frac{\\pi}{2})", "\\left(3,\\frac12\\pi\\right)", true},
    {"(1,2,3)", "(1, 2, 3)", true},
    {"\\{1,2,3\\}", "\\{3,1,2\\}", true},
    {"1, 2, 3", "3,2,1", true},
    {"\\{-1, 1\\}", "\\pm 1", true},
    {"1\\pm\\sqrt{2}", "1+\\sqrt2, 1-\\sqrt2", true},
    {"\\emptyset", "\\{\\}", true},
    {"\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{bmatrix}1\\\\2\\end{bmatrix}", true},
    {"\\begin{pmatrix} \\frac12 & 0 \\\\ 0 & 1 \\end{pmatrix}", "\\begin{pmatrix}0.5&0\\\\0&1\\end{pmatrix}", true},
    // equations
    {"y=2x+1", "2x+1", true},
    {"x=1, x=2", "1, 2", true},
    {"x=1, y=2", "y=2, x=1", true},
    {"x+y=3", "y=3-x", true},
    {"2x+2y=6", "x+y=3", true},
    {"x=2", "2x=4", true},
    // near-misses
    {"x^2+1", "x^2-1", false},
    {"2x+2", "2(x+2)", false},
    {"(x+1)^2", "x^2+1", false},
    {"\\sqrt{x^2}", "x", false},
    {"xy", "x+y", false},
    {"\\frac{1}{2}x", "\\frac{1}{2x}", false},
    {"\\sin x", "\\cos x", false},
    {"\\frac{1}{3}", "0.33", false},
    {"\\sqrt{2}", "1.41421356", false},  // a rounded value is not the exact answer
    {"\\pi", "3.14", false},
    {"e", "2.71828", false},
    {"1e3", "100", false},
    {"2^{10}", "1000", false},
    {"\\log_2 8", "2", false},
    {"\\frac{\\pi}{2}", "\\frac{\\pi}{3}", false},
    {"3+4i", "3-4i", false},
    {"2\\frac{1}{2}", "1", false},  // a mixed number, not 2 times 1/2
    {"[1,3)", "[1,3]", false},
    {"(1,3)", "[1,3)", false},
    {"(-\\infty,1)\\cup(2,\\infty)", "(-\\infty,1)\\cup[2,\\infty)", false},
    {"(1,2)", "(2,1)", false},
    {"(1,2)", "1,2", false},  // a tuple is not a list of solutions
    {"\\{1,2\\}", "\\{1,2,3\\}", false},
    {"\\{5\\}", "5", false},
    {"1\\pm\\sqrt2", "1+\\sqrt2", false},
    {"1,000", "1, 000", false},  // one number against a list of two
    {"(1,000)", "1000", false},  // inside brackets a comma separates
    {"\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}2\\\\1\\end{pmatrix}", false},
    {"\\begin{pmatrix}1\\\\2\\end{pmatrix}", "(1,2)", false},
    {"x+y=3", "x-y=3", false},
    {"x=1, y=2", "x=2, y=1", false},
    {"x=2", "x=3", false},
    {"\\text{Monday}", "\\text{Tuesday}", false},
    {"x^2", "x^3", false},
};

}  // namespace

TEST_CASE("MATH answers by algebra: hand-written pairs, both orders") {
  CHECK(std::size(kSymbolicPairs) >= 40);
  int equal = 0;
  for (const auto& p : kSymbolicPairs) {
    CHECK_MESSAGE(math_answers_equal(p.a, p.b) == p.equal, (std::string(p.a) + "  vs  " + p.b));
    CHECK_MESSAGE(math_answers_equal(p.b, p.a) == p.equal, (std::string(p.b) + "  vs  " + p.a));
    equal += p.equal;
  }
  CHECK(equal >= 20);                                   // both kinds, in numbers
  CHECK(std::size(kSymbolicPairs) - equal >= 20);
}

TEST_CASE("MATH answers by algebra: the cases the verifier promises, through the reward") {
  CHECK(math_answer_reward("so $\\boxed{x^{2}+1}$", "x^2+1") == 1.0);
  CHECK(math_answer_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0);
  CHECK(math_answer_reward("\\boxed{1e3}", "1000") == 1.0);
  CHECK(math_answer_reward("\\boxed{[1, 3)}", "[1,3)") == 1.0);
  CHECK(math_answer_reward("\\boxed{(-\\infty, 2]}", "(-\\infty,2]") == 1.0);
  CHECK(math_answer_reward("\\boxed{\\left(1, \\frac{1}{2}\\right)}", "(1,0.5)") == 1.0);
  CHECK(math_answer_reward("\\boxed{12\\,\\text{cm}}", "12") == 1.0);
  CHECK(math_answer_reward("\\boxed{2(x+1)}", "2x+2") == 1.0);
  CHECK(math_answer_reward("\\boxed{(-\\infty, 2)}", "(-\\infty,2]") == 0.0);
}

TEST_CASE("several final answers in one completion: the last box counts, #### outranks boxes") {
  CHECK(math_answer_reward("First \\boxed{3}. Wait, no: \\boxed{4}.", "4") == 1.0);
  CHECK(math_answer_reward("First \\boxed{3}. Wait, no: \\boxed{4}.", "3") == 0.0);
  CHECK(math_answer_reward("\\boxed{\\frac{1}{2}} or rather \\boxed{x^{2}+1}", "x^2+1") == 1.0);
  CHECK(math_answer_reward("\\boxed{(1,2)} and then \\boxed{\\{1,2\\}}", "\\{2,1\\}") == 1.0);
  CHECK(math_answer_reward("\\boxed{(1,2)} and then \\boxed{\\{1,2\\}}", "(1,2)") == 0.0);
  CHECK(math_answer_reward("\\boxed{6}\n#### 5", "5") == 1.0);      // #### before or after a box wins
  CHECK(math_answer_reward("#### 5\n#### 6", "#### 5") == 1.0);     // the first ####
  CHECK(math_answer_reward("first 3, then 4", "4") == 1.0);         // no marker: the last number
  CHECK(math_answer_reward("\\boxed{4} \\boxed{5", "4") == 1.0);    // the last closed box
}

TEST_CASE("MATH answers by algebra: normalisation of units, commas and matrices") {
  CHECK(normalize_math_answer("5\\text{ cm}^2") == "5");
  CHECK(normalize_math_answer("7 \\mbox{ m}^{3}") == "7");
  CHECK(normalize_math_answer("1,000") == "1000");
  CHECK(normalize_math_answer("1, 000") == "1,000");
  CHECK(normalize_math_answer("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}") == "\\begin{pmatrix}1\\\\2\\end{pmatrix}");
}

TEST_CASE("MATH answers by algebra: bad and pathological answers neither throw nor hang") {
  std::string deep = std::string(500, '(') + "x" + std::string(500, ')');
  std::string fractions;
  for (int i = 0; i < 200; ++i) fractions += "\\frac{1}{";
  fractions += "2" + std::string(200, '}');
  std::string huge(100000, 'x');
  const std::string cases[] = {
      "10^{10^{10}}", "10^10^10", "2^{2^{2^{2^{2}}}}", "9999999!", "(10!)!", "\\binom{100000}{50000}",
      "1e99999", "\\sqrt[1000000]{2}", "(a+b+c+d+f+g)^{10000}", "x^x^x^x^x", deep, fractions, huge,
      "\\frac{1}{0}", "\\frac{1}{x-x}", "\\log(0)", "\\tan\\frac{\\pi}{2}", "0^{-1}", "((((", "\\frac{", "}{",
      "|||", "(1,2", "[,]", ",", "=", "x==2", "\\sqrt[x]{2}", "\\unknown{3}", "x \\le 3",
  };
  for (const auto& c : cases) {
    INFO("answer: " << c.substr(0, 60));
    CHECK_NOTHROW(math_answers_equal(c, "1"));
    CHECK_FALSE(math_answers_equal(c, "1"));
    CHECK(math_answers_equal(c, c));  // the same text still matches as a string
  }
  CHECK_FALSE(math_answers_equal("(a+b+c+d+f+g)^{10000}", "(g+a+b+c+d+f)^{9999}"));
  CHECK(math_answers_equal("(a+b+c+d+f+g)^{10000}", "(g+a+b+c+d+f)^{10000}"));
}

TEST_CASE("MATH answers by algebra: safe to call from several threads") {
  std::vector<std::thread> threads;
  std::vector<int> wrong(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&wrong, t] {
      for (int round = 0; round < 20; ++round)
        for (const auto& p : kSymbolicPairs) wrong[t] += math_answers_equal(p.a, p.b) != p.equal;
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) CHECK(wrong[t] == 0);
}

TEST_CASE("extract_gsm8k_answer") {
  CHECK(extract_gsm8k_answer("so 5+5=10\n#### 1,234") == "1234");
  CHECK(extract_gsm8k_answer("#### $1,234.") == "1234");
  CHECK(extract_gsm8k_answer("#### -3.5 kg") == "-3.5");
  CHECK(extract_gsm8k_answer("#### 3/4") == "3/4");
  CHECK(extract_gsm8k_answer("#### 2\\pi") == "2\\pi");
  CHECK(extract_gsm8k_answer("#### 2x + 1") == "2x + 1");
  CHECK(extract_gsm8k_answer("#### The answer is 1,800.") == "1800");
  CHECK(extract_gsm8k_answer("#### eighteen") == "eighteen");
  CHECK(extract_gsm8k_answer("#### \\frac{1}{2}\nmore") == "\\frac{1}{2}");
  CHECK(extract_gsm8k_answer("####\n#### 7") == "7");  // an empty marker is skipped
  CHECK_FALSE(extract_gsm8k_answer("####   "));
  CHECK_FALSE(extract_gsm8k_answer("the answer is 18"));
}

TEST_CASE("extract_boxed") {
  CHECK(extract_boxed("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}");
  CHECK(extract_boxed("\\boxed{\\frac{\\sqrt{3}}{2}} and") == "\\frac{\\sqrt{3}}{2}");
  CHECK(extract_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}");
  CHECK(extract_boxed("\\boxed{1} then \\boxed{2}") == "2");
  CHECK(extract_boxed("\\boxed{1} then \\boxed{2") == "1");  // the last closed one
  CHECK(extract_boxed("$\\boxed 42$") == "42");
  CHECK(extract_boxed("\\fbox{x}") == "x");
  CHECK(extract_boxed("\\boxed{}") == "");
  CHECK_FALSE(extract_boxed("\\boxed{3"));
  CHECK_FALSE(extract_boxed("no box here 3"));
}

TEST_CASE("extract_last_number") {
  CHECK(extract_last_number("so 1,800 eggs.") == "1800");
  CHECK(extract_last_number("5-3") == "3");
  CHECK(extract_last_number("x = -3") == "-3");
  CHECK(extract_last_number("(-2)") == "-2");
  CHECK(extract_last_number("1,2,3") == "3");
  CHECK(extract_last_number("costs 3.5.") == "3.5");
  CHECK(extract_last_number("half is 1/2") == "1/2");
  CHECK(extract_last_number("it is .5") == ".5");
  CHECK(extract_last_number("12,34") == "34");  // not a thousands group
  CHECK_FALSE(extract_last_number("no numbers here"));
  CHECK_FALSE(extract_last_number(""));
}

TEST_CASE("extract_final_answer prefers ####, then \\boxed, then the last number") {
  CHECK(extract_final_answer("\\boxed{2} 3 #### 1") == "1");
  CHECK(extract_final_answer("\\boxed{2} 3") == "2");
  CHECK(extract_final_answer("2 then 3") == "3");
  CHECK_FALSE(extract_final_answer("nothing"));
  CHECK(extract_reference_answer("  \\frac{3}{4} ") == "\\frac{3}{4}");
  CHECK(extract_reference_answer("solution... #### 5") == "5");
}

TEST_CASE("normalize_math_answer") {
  CHECK(normalize_math_answer(" \\dfrac{1}{2} ") == "\\frac{1}{2}");
  CHECK(normalize_math_answer("\\tfrac12") == "\\frac{1}{2}");
  CHECK(normalize_math_answer("\\frac1{2}") == "\\frac{1}{2}");
  CHECK(normalize_math_answer("\\left( 1, 2 \\right)") == "(1,2)");
  CHECK(normalize_math_answer("$18 dollars.") == "18");
  CHECK(normalize_math_answer("1,234") == "1234");
  CHECK(normalize_math_answer("(1,234)") == "(1,234)");  // only a plain number loses commas
  CHECK(normalize_math_answer("x = 5") == "5");
  CHECK(normalize_math_answer("f(x) = 5") == "f(x)=5");
  CHECK(normalize_math_answer("30^\\circ") == "30");
  CHECK(normalize_math_answer("5 \\text{ cm}") == "5");
  CHECK(normalize_math_answer("\\text{(A)}") == "(A)");
  CHECK(normalize_math_answer("{7}") == "7");
  CHECK(normalize_math_answer("-.5") == "-0.5");
  CHECK(normalize_math_answer("\\sqrt3") == "\\sqrt{3}");
  CHECK(normalize_math_answer("") == "");
}

TEST_CASE("parse_math_number") {
  CHECK(parse_math_number("18") == 18.0);
  CHECK(parse_math_number("-2.5") == -2.5);
  CHECK(parse_math_number("3/4") == 0.75);
  CHECK(parse_math_number("\\frac{3}{4}") == 0.75);
  CHECK(parse_math_number("-\\frac{3}{4}") == -0.75);
  CHECK(parse_math_number("\\frac{-3}{4}") == -0.75);
  CHECK(parse_math_number("\\frac{1.5}{3}") == 0.5);
  CHECK_FALSE(parse_math_number("3/0"));
  CHECK_FALSE(parse_math_number("\\frac{1}{0}"));
  CHECK_FALSE(parse_math_number("\\frac{x}{2}"));
  CHECK_FALSE(parse_math_number("2x"));
  CHECK_FALSE(parse_math_number(""));
  CHECK(math_answers_equal("18", "18.0"));
  CHECK_FALSE(math_answers_equal("", ""));
}

TEST_CASE("format_reward: ends with '#### N' or a closed \\boxed{}") {
  struct FormatCase {
    const char* completion;
    double expected;
  };
  const FormatCase cases[] = {
      {"#### 18", 1},
      {"9 * 2 = 18\n#### 18", 1},
      {"#### 18.", 1},
      {"#### $1,234", 1},
      {"#### -3.5", 1},
      {"#### 3/4", 1},
      {"  #### 18  \n\n", 1},
      {"The answer is \\boxed{18}.", 1},
      {"$\\boxed{18}$", 1},
      {"\\[\\boxed{\\frac{1}{2}}\\]", 1},
      {"\\boxed{18}\n", 1},
      {"#### 18 dollars", 0},
      {"#### 18\nMore text", 0},
      {"#### eighteen", 0},
      {"####", 0},
      {"The answer is 18", 0},
      {"", 0},
      {"\\boxed{18} and more", 0},
      {"\\boxed{}", 0},
      {"\\boxed{ }", 0},
      {"\\boxed{18", 0},
      {"\\boxed 18", 0},
  };
  for (const auto& c : cases) {
    INFO("completion: " << c.completion);
    CHECK(format_reward(c.completion) == c.expected);
  }
}

namespace {

std::vector<std::string> gsm8k_answers(const std::string& split, size_t limit) {
  auto path = troupe::test::data() / "gsm8k" / (split + ".jsonl");
  std::ifstream in(path);
  REQUIRE_MESSAGE(in, "cannot open " << path);
  std::vector<std::string> answers;
  std::string line;
  while (answers.size() < limit && std::getline(in, line))
    answers.push_back(nlohmann::json::parse(line).at("answer").get<std::string>());
  return answers;
}

}  // namespace

TEST_CASE("GSM8K: every reference answer is a number, and scores 1 against itself") {
  for (const char* split : {"test", "train"}) {
    auto answers = gsm8k_answers(split, SIZE_MAX);
    CHECK(answers.size() > 1000);
    for (const auto& a : answers) {
      auto ref = extract_gsm8k_answer(a);
      REQUIRE_MESSAGE(ref, split << ": no #### answer in " << a);
      CHECK_MESSAGE(parse_math_number(normalize_math_answer(*ref)), split << ": not a number: " << *ref);
    }
  }
  auto answers = gsm8k_answers("test", 200);
  REQUIRE(answers.size() == 200);
  int equal_pairs = 0;
  for (size_t i = 0; i < answers.size(); ++i) {
    const std::string& mine = answers[i];
    const std::string& other = answers[(i + 1) % answers.size()];
    double mine_value = *parse_math_number(*extract_gsm8k_answer(mine));
    double other_value = *parse_math_number(*extract_gsm8k_answer(other));
    INFO("line " << i + 1 << ": " << mine);
    CHECK(math_answer_reward(mine, mine) == 1.0);
    CHECK(math_answer_reward("The answer is " + *extract_gsm8k_answer(mine) + ".", mine) == 1.0);
    CHECK(math_answer_reward("\\boxed{" + *extract_gsm8k_answer(mine) + "}", mine) == 1.0);
    CHECK(math_answer_reward(other, mine) == (other_value == mine_value ? 1.0 : 0.0));
    CHECK(math_answer_reward("#### " + std::to_string(static_cast<long long>(mine_value) + 1), mine) == 0.0);
    CHECK(format_reward(mine) == 1.0);
    equal_pairs += other_value == mine_value;
  }
  CHECK(equal_pairs < 20);  // the "other" check compares mostly different answers
}
