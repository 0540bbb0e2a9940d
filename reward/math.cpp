// The math verifier: answer extraction, LaTeX normalisation, numeric comparison, format check.
// Plain string scanning (no regex engine): the rules are small and read best as code.
#include "reward/math.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <vector>

namespace troupe {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size()))
    s.replace(pos, from.size(), to);
}

std::string without_commas(std::string_view s) {
  std::string out;
  for (char c : s)
    if (c != ',') out += c;
  return out;
}

// Length of the number that starts at s[i], or 0: an optional '-', digits (thousands commas
// only in groups of exactly three), an optional decimal part, or an integer fraction "a/b".
size_t number_length(std::string_view s, size_t i) {
  size_t j = i;
  if (j < s.size() && s[j] == '-') ++j;
  size_t digits_start = j;
  while (j < s.size() && is_digit(s[j])) ++j;
  size_t int_digits = j - digits_start;
  bool grouped = false;
  if (int_digits >= 1 && int_digits <= 3) {
    while (j + 3 < s.size() && s[j] == ',' && is_digit(s[j + 1]) && is_digit(s[j + 2]) && is_digit(s[j + 3]) &&
           (j + 4 == s.size() || !is_digit(s[j + 4]))) {
      j += 4;
      grouped = true;
    }
  }
  bool decimal = false;
  if (j + 1 < s.size() && s[j] == '.' && is_digit(s[j + 1])) {
    j += 1;
    while (j < s.size() && is_digit(s[j])) ++j;
    decimal = true;
  }
  if (int_digits == 0 && !decimal) return 0;
  if (!decimal && !grouped && j + 1 < s.size() && s[j] == '/' && is_digit(s[j + 1])) {
    j += 1;
    while (j < s.size() && is_digit(s[j])) ++j;
  }
  return j - i;
}

// Where a brace group that opens at s[open] closes (escaped braces "\{" "\}" skipped), or npos.
size_t closing_brace(std::string_view s, size_t open) {
  int depth = 0;
  for (size_t k = open; k < s.size(); ++k) {
    if (s[k] == '\\') {
      ++k;
    } else if (s[k] == '{') {
      ++depth;
    } else if (s[k] == '}' && --depth == 0) {
      return k;
    }
  }
  return std::string::npos;
}

struct Boxed {
  std::string content;
  size_t end;  // one past the box in the text
};

// The last closed box: `\boxed{...}`, `\fbox{...}`, or `\boxed 5` (up to a space or `$`).
std::optional<Boxed> last_boxed(std::string_view s) {
  std::vector<std::pair<size_t, size_t>> starts;  // (position, command length)
  for (std::string_view cmd : {std::string_view("\\boxed"), std::string_view("\\fbox")})
    for (size_t p = s.find(cmd); p != std::string::npos; p = s.find(cmd, p + 1)) starts.emplace_back(p, cmd.size());
  std::sort(starts.begin(), starts.end(), std::greater<>());
  for (auto [pos, len] : starts) {
    size_t j = pos + len;
    while (j < s.size() && s[j] == ' ') ++j;
    if (j < s.size() && s[j] == '{') {
      size_t close = closing_brace(s, j);
      if (close != std::string::npos) return Boxed{std::string(s.substr(j + 1, close - j - 1)), close + 1};
    } else if (j > pos + len && j < s.size()) {
      size_t e = j;
      while (e < s.size() && !is_space(s[e]) && s[e] != '$') ++e;
      return Boxed{std::string(s.substr(j, e - j)), e};
    }
  }
  return std::nullopt;
}

// A minus sign starts a number only where it cannot be subtraction.
bool sign_allowed_after(char prev) {
  return !is_digit(prev) && !is_alpha(prev) && prev != ')' && prev != '}' && prev != ']';
}

// `\text{...}`-like commands: trailing ones are units and dropped, others unwrapped.
constexpr std::string_view kTextCommands[] = {"\\textnormal", "\\textbf", "\\textrm", "\\text", "\\mbox", "\\mathrm"};

// Where a text group that closes exactly at the end of `t` starts, or npos.
size_t trailing_text_group(std::string_view t) {
  for (std::string_view cmd : kTextCommands)
    for (size_t p = t.find(cmd); p != std::string::npos; p = t.find(cmd, p + 1)) {
      size_t open = p + cmd.size();
      if (open < t.size() && t[open] == '{' && closing_brace(t, open) == t.size() - 1) return p;
    }
  return std::string::npos;
}

// Drops trailing text groups that follow something ("5\text{ cm}" -> "5"), then replaces the
// remaining ones by their content ("\text{(A)}" -> "(A)").
std::string strip_text_groups(std::string s) {
  for (size_t p = trailing_text_group(s); p != std::string::npos && !trim(s.substr(0, p)).empty();
       p = trailing_text_group(s))
    s = std::string(trim(s.substr(0, p)));
  for (std::string_view cmd : kTextCommands) {
    for (size_t p = s.find(cmd); p != std::string::npos; p = s.find(cmd, p)) {
      size_t open = p + cmd.size();
      size_t close = open < s.size() && s[open] == '{' ? closing_brace(s, open) : std::string::npos;
      if (close == std::string::npos) {
        p = open;
        continue;
      }
      s = s.substr(0, p) + s.substr(open + 1, close - open - 1) + s.substr(close + 1);
    }
  }
  return s;
}

// "\frac12" -> "\frac{1}{2}", "\frac1{2}" -> "\frac{1}{2}", "\sqrt2" -> "\sqrt{2}" (no spaces left).
std::string brace_arguments(const std::string& s, std::string_view cmd, int nargs) {
  std::string out;
  size_t i = 0;
  for (size_t p = s.find(cmd); p != std::string::npos; p = s.find(cmd, i)) {
    out += s.substr(i, p + cmd.size() - i);
    size_t j = p + cmd.size();
    for (int a = 0; a < nargs && j < s.size(); ++a) {
      if (s[j] == '{') {
        size_t close = closing_brace(s, j);
        if (close == std::string::npos) break;
        out += s.substr(j, close + 1 - j);
        j = close + 1;
      } else if (s[j] == '[' || s[j] == '\\' || s[j] == '}') {
        break;  // an optional argument or a command: leave as written
      } else {
        out += '{';
        out += s[j];
        out += '}';
        ++j;
      }
    }
    i = j;
  }
  return out + s.substr(std::min(i, s.size()));
}

// "x = 5" -> "5" when the left side is one short variable (x, y_1, k2, \theta).
std::string drop_variable_assignment(const std::string& s) {
  size_t eq = s.find('=');
  if (eq == std::string::npos || s.find('=', eq + 1) != std::string::npos) return s;
  std::string_view lhs = trim(std::string_view(s).substr(0, eq));
  bool variable = false;
  if (!lhs.empty() && lhs.size() <= 3 && is_alpha(lhs[0]))
    variable = std::all_of(lhs.begin(), lhs.end(), [](char c) { return is_alpha(c) || is_digit(c) || c == '_'; });
  if (lhs.size() >= 2 && lhs[0] == '\\')
    variable = std::all_of(lhs.begin() + 1, lhs.end(), [](char c) { return is_alpha(c); });
  return variable ? std::string(trim(std::string_view(s).substr(eq + 1))) : s;
}

// "18 dollars" -> "18", "5 cm." -> "5": a number, a space, then only words.
std::string drop_trailing_words(const std::string& s) {
  size_t n = number_length(s, 0);
  if (n == 0 || n == s.size() || !is_space(s[n])) return s;
  std::string_view rest = std::string_view(s).substr(n);
  bool words = std::all_of(rest.begin(), rest.end(), [](char c) { return is_alpha(c) || is_space(c) || c == '.'; });
  bool any_letter = std::any_of(rest.begin(), rest.end(), is_alpha);
  return words && any_letter ? s.substr(0, n) : s;
}

std::optional<double> to_double(std::string_view s) {
  double v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// A plain number or integer fraction, the whole of `s`.
std::optional<double> plain_number(std::string_view s) {
  if (s.empty() || number_length(s, 0) != s.size()) return std::nullopt;
  std::string t = without_commas(s);
  size_t slash = t.find('/');
  if (slash == std::string::npos) return to_double(t);
  auto num = to_double(std::string_view(t).substr(0, slash));
  auto den = to_double(std::string_view(t).substr(slash + 1));
  if (!num || !den || *den == 0) return std::nullopt;
  return *num / *den;
}

}  // namespace

std::optional<std::string> extract_gsm8k_answer(std::string_view s) {
  for (size_t pos = s.find("####"); pos != std::string::npos; pos = s.find("####", pos + 4)) {
    size_t j = pos + 4;
    while (j < s.size() && s[j] == '#') ++j;
    size_t line_end = std::min(s.find('\n', j), s.size());
    std::string_view rest = trim(s.substr(j, line_end - j));
    if (rest.empty()) continue;
    size_t k = 0;
    if (rest.starts_with("\\$")) k = 2;
    else if (rest.starts_with("$")) k = 1;
    while (k < rest.size() && rest[k] == ' ') ++k;
    if (size_t n = number_length(rest, k)) {
      char next = k + n < rest.size() ? rest[k + n] : ' ';
      bool more_math = is_alpha(next) || next == '\\' || next == '^' || next == '{' || next == '_';  // "2\pi", "2x"
      return more_math ? std::string(rest) : without_commas(rest.substr(k, n));
    }
    bool latex = rest.find_first_of("\\{") != std::string_view::npos;
    if (auto last = latex ? std::nullopt : extract_last_number(rest)) return last;  // "#### The answer is 18."
    return std::string(rest);
  }
  return std::nullopt;
}

std::optional<std::string> extract_boxed(std::string_view text) {
  auto b = last_boxed(text);
  if (!b) return std::nullopt;
  return std::move(b->content);
}

std::optional<std::string> extract_last_number(std::string_view s) {
  std::optional<std::string> last;
  for (size_t i = 0; i < s.size();) {
    char prev = i > 0 ? s[i - 1] : ' ';
    bool start = is_digit(s[i]) || (s[i] == '.' && !is_digit(prev)) || (s[i] == '-' && sign_allowed_after(prev));
    if (size_t n = start ? number_length(s, i) : 0) {
      last = without_commas(s.substr(i, n));
      i += n;
    } else {
      ++i;
    }
  }
  return last;
}

std::optional<std::string> extract_final_answer(std::string_view completion) {
  if (auto a = extract_gsm8k_answer(completion)) return a;
  if (auto a = extract_boxed(completion)) return a;
  return extract_last_number(completion);
}

std::string extract_reference_answer(std::string_view reference) {
  if (auto a = extract_gsm8k_answer(reference)) return *a;
  if (auto a = extract_boxed(reference)) return *a;
  return std::string(trim(reference));
}

std::string normalize_math_answer(std::string_view answer) {
  std::string s(answer);
  for (char& c : s)
    if (is_space(c)) c = ' ';
  // Order matters: spacing commands before `\left`/`\right`, degrees before dollars.
  for (std::string_view drop : {"\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\left", "\\right", "\\(",
                                "\\)", "\\[", "\\]", "^{\\circ}", "^\\circ", "\xC2\xB0", "\\%", "%", "\\$", "$", "{,}"})
    replace_all(s, drop, "");
  replace_all(s, "\\dfrac", "\\frac");
  replace_all(s, "\\tfrac", "\\frac");
  s = strip_text_groups(std::string(trim(s)));
  s = drop_variable_assignment(std::string(trim(s)));
  s = drop_trailing_words(std::string(trim(s)));
  std::erase_if(s, is_space);
  s = brace_arguments(s, "\\frac", 2);
  s = brace_arguments(s, "\\sqrt", 1);
  while (!s.empty() && s.back() == '.') s.pop_back();
  while (s.size() >= 2 && s.front() == '{' && closing_brace(s, 0) == s.size() - 1) s = s.substr(1, s.size() - 2);
  if (!s.empty() && number_length(s, 0) == s.size()) s = without_commas(s);
  if (s.size() >= 2 && s[0] == '.' && is_digit(s[1])) s.insert(0, "0");
  if (s.size() >= 3 && s[0] == '-' && s[1] == '.' && is_digit(s[2])) s.insert(1, "0");
  return s;
}

std::optional<double> parse_math_number(std::string_view s) {
  if (auto v = plain_number(s)) return v;
  double sign = 1;
  if (s.starts_with("-")) {
    sign = -1;
    s.remove_prefix(1);
  }
  if (!s.starts_with("\\frac{")) return std::nullopt;
  size_t num_close = closing_brace(s, 5);
  if (num_close == std::string::npos || num_close + 1 >= s.size() || s[num_close + 1] != '{') return std::nullopt;
  size_t den_close = closing_brace(s, num_close + 1);
  if (den_close != s.size() - 1) return std::nullopt;
  auto num = plain_number(s.substr(6, num_close - 6));
  auto den = plain_number(s.substr(num_close + 2, den_close - num_close - 2));
  if (!num || !den || *den == 0) return std::nullopt;
  return sign * *num / *den;
}

bool math_answers_equal(std::string_view a, std::string_view b) {
  std::string na = normalize_math_answer(a), nb = normalize_math_answer(b);
  if (na.empty() || nb.empty()) return false;
  if (na == nb) return true;
  auto va = parse_math_number(na), vb = parse_math_number(nb);
  if (!va || !vb) return false;
  return std::abs(*va - *vb) <= 1e-9 * std::max({1.0, std::abs(*va), std::abs(*vb)});
}

double math_answer_reward(std::string_view completion, std::string_view reference) {
  auto answer = extract_final_answer(completion);
  if (!answer) return 0.0;
  return math_answers_equal(*answer, extract_reference_answer(reference)) ? 1.0 : 0.0;
}

double format_reward(std::string_view completion) {
  std::string_view t = trim(completion);
  if (t.empty()) return 0.0;
  size_t nl = t.rfind('\n');
  std::string_view last = trim(nl == std::string::npos ? t : t.substr(nl + 1));
  if (last.starts_with("####")) {
    size_t j = 4;
    while (j < last.size() && last[j] == ' ') ++j;
    if (last.substr(j).starts_with("\\$")) j += 2;
    else if (last.substr(j).starts_with("$")) j += 1;
    while (j < last.size() && last[j] == ' ') ++j;
    if (size_t n = number_length(last, j)) {
      size_t k = j + n;
      while (k < last.size() && last[k] == ' ') ++k;
      if (k < last.size() && last[k] == '.') ++k;
      while (k < last.size() && last[k] == ' ') ++k;
      if (k == last.size()) return 1.0;
    }
  }
  auto box = last_boxed(t);
  if (!box || trim(box->content).empty() || t[box->end - 1] != '}') return 0.0;
  std::string_view tail = t.substr(box->end);
  for (;;) {
    tail = trim(tail);
    if (tail.starts_with("\\]") || tail.starts_with("\\)")) tail.remove_prefix(2);
    else if (tail.starts_with("$") || tail.starts_with(".")) tail.remove_prefix(1);
    else break;
  }
  return tail.empty() ? 1.0 : 0.0;
}

}  // namespace troupe
