// The math verifier: pulls the final answer out of a completion and a dataset answer (GSM8K's
// `#### N`, MATH's `\boxed{...}`), normalises LaTeX and judges equivalence with GiNaC's algebra
// ("2x+2" equals "2(x+1)"). It does not solve: "x>2" is not compared with "(2,\infty)".
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace troupe {

// The answer after the first `####` that has one (GSM8K's marker), from the rest of its line:
// where a number comes first (an optional `$` before it), that number with thousands commas
// removed: "#### $1,234." -> "1234", "#### -3.5 kg" -> "-3.5", "#### 3/4" -> "3/4"; where that
// number runs on into math ("#### 2\pi", "#### 2x") or the line has LaTeX ("#### \frac{1}{2}"),
// the whole rest, trimmed; otherwise its last number ("#### The answer is 18." -> "18"), or the
// rest when it has none. nullopt when there is no `####` or nothing follows it.
std::optional<std::string> extract_gsm8k_answer(std::string_view text);

// The content of the last closed `\boxed{...}` (or `\fbox{...}`), nested and escaped braces
// respected: "\boxed{\frac{1}{2}}" -> "\frac{1}{2}". Also `\boxed 5` (up to a space or `$`).
// nullopt when there is none or none is closed.
std::optional<std::string> extract_boxed(std::string_view text);

// The last number in the text with thousands commas removed: "... so 1,800 eggs." -> "1800".
// Numbers are `-?digits[.digits]` (commas only in groups of three) and `a/b` fractions; a minus
// sign counts only after a space, an operator or the start ("5-3" ends in "3", "= -3" in "-3").
std::optional<std::string> extract_last_number(std::string_view text);

// A completion's final answer: extract_gsm8k_answer, else extract_boxed, else
// extract_last_number. nullopt when the completion has none of them.
// Several final answers in one completion: the last `\boxed{}` counts, as in the peers'
// verifiers ("\boxed{3} ... no, \boxed{4}" answers 4); a `####` answer outranks every box;
// among several `####` the first counts (a model that goes on to invent the next few-shot
// question is judged on the answer it gave); with neither, the last number counts.
std::optional<std::string> extract_final_answer(std::string_view completion);

// A dataset's reference answer: extract_gsm8k_answer, else extract_boxed, else the whole text
// trimmed (MATH-style datasets store the bare answer, e.g. "\frac{3}{4}").
std::string extract_reference_answer(std::string_view reference);

// Canonical form of one answer, for comparison. In order: drop `$`, `\(`, `\)`, `\[`, `\]`,
// `\displaystyle`, LaTeX spacing (`\!` `\,` `\;` `\:` `\ `), `\left`/`\right`, degrees (`^\circ`,
// `^{\circ}`, `°`) and percent signs; `\dfrac`/`\tfrac` -> `\frac`, `\frac12` -> `\frac{1}{2}`,
// `\sqrt2` -> `\sqrt{2}`; trailing `\text{...}`/`\mbox{...}`/`\mathrm{...}` groups (units) dropped
// and other ones unwrapped to their content; `1{,}000` -> `1000`; a number followed by words
// keeps the number ("18 dollars" -> "18"); a short left side `x =` dropped; all whitespace
// removed; trailing periods removed; one pair of braces around everything removed; thousands
// commas removed from a plain number; a leading "." gets a "0". A unit's square or cube goes
// with it ("5\text{ cm}^2" -> "5"); matrix row breaks `\\` are kept. Commas: "1,000" and
// "1,000,000" are one number; "1, 000" (a space at a comma) and "(1,000)" keep their commas.
std::string normalize_math_answer(std::string_view answer);

// The value of a normalised answer that is a plain number: "-3", "2.50", ".5", "3/4",
// "\frac{3}{4}", "-\frac{3}{4}", "\frac{-3}{4}". nullopt otherwise (or for a zero denominator).
std::optional<double> parse_math_number(std::string_view normalized);

// Equal after normalize_math_answer: as strings; as numbers when both are plain numbers
// (relative tolerance 1e-9, so "18" == "18.0" and "0.5" == "\frac{1}{2}" but "0.33" != "1/3");
// else by algebra. Two empty answers are not equal. Never throws. Safe from several threads:
// GiNaC is not thread-safe, so the algebra runs under one process-wide lock.
//
// By algebra (GiNaC), each answer is first split by its shape, and shapes must agree:
//  - tuples and intervals "(1,2)", "[1,3)", "(-\infty,2]": in order, bracket kinds equal;
//  - sets "\{1,2\}" and bare lists "1,2" (all solutions): in any order; "\emptyset" = "\{\}";
//    "a\pm b" is the list "a+b,a-b"; a list is not a tuple ("1,2" != "(1,2)");
//  - unions "A\cup B": pieces in any order; matrices (pmatrix, bmatrix): entry by entry;
//  - commas: inside brackets or with a space they separate elements ("(1,000)" is a pair,
//    "1, 000" a list); only a whole answer written "1,000" is the number 1000;
//  - equations: "x=2" equals "2" (one side a lone variable, the other equal); two equations
//    are equal when their sides' differences are proportional ("x+y=3" = "y=3-x" = "2x+2y=6");
//  - expressions: equal when a - b normalises to zero, or, where GiNaC leaves radicals and
//    trigonometry unsimplified, when both agree (relative 1e-9) at 4 sample points with mixed
//    signs ("\sqrt{x^2}" equals "|x|", not "x"); numbers are evaluated once.
// The LaTeX read: + - * / \cdot \times \div, implicit products ("2x", "2(x+1)", "xy" is x*y),
// ^ with a braced or whole-number exponent ("2^10" is 1024), \frac, \sqrt, \sqrt[n] (odd roots
// of negatives are real), \binom, n!, |x|, \pi, \infty, Greek letters, subscripts "x_1",
// \sin \cos \tan \cot \sec \csc \arcsin \arccos \arctan \sinh \cosh \tanh, \ln and \log
// (natural), \log_b, \exp, plain sqrt/sin/cos/tan/ln/log/exp/pi; "e" is Euler's number and "i"
// the imaginary unit; decimals are exact ("0.25" = 1/4), "0.\overline{3}" = 1/3, "1e3" and
// "2.5E-4" are scientific, "2\frac{1}{2}" is the mixed number 5/2. Not algebra, so compared as
// strings only: words of four or more letters ("\text{Monday}"), inequalities, unknown
// commands, answers longer than 400 characters, and anything whose work would be unbounded
// (numeric exponents above 10^4, exact powers over 2^16 bits, n! above 1000, nesting over 32).
bool math_answers_equal(std::string_view a, std::string_view b);

// 1.0 when the completion's final answer equals the reference's (both extracted as above),
// else 0.0. `reference` is the dataset's answer field, e.g. GSM8K's "... #### 18".
double math_answer_reward(std::string_view completion, std::string_view reference);

// 1.0 when the completion ends with a final answer in the expected format, else 0.0. With
// trailing whitespace trimmed, either
//   (a) its last line is `#### N`: N a number as above, optionally after `$` and followed by
//       one `.`, nothing else on the line but spaces ("#### 18 dollars" scores 0 here while
//       math_answer scores it 1); or
//   (b) it has a closed, non-empty `\boxed{...}` and after the last one only whitespace and the
//       closers `$`, `\]`, `\)`, `.` follow ("The answer is $\boxed{18}$.").
double format_reward(std::string_view completion);

}  // namespace troupe
