// The math verifier: answer extraction, LaTeX normalisation, equivalence by algebra (GiNaC),
// format check. Plain string scanning (no regex engine): the rules are small and read best as
// code. GiNaC does the algebra; this file only reads LaTeX into GiNaC expressions.
#include "reward/math.hpp"

#include <ginac/ginac.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
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

// Stands in for a matrix row break `\\` while spacing commands are dropped.
constexpr std::string_view kRowBreak = "\x01";

// `\text{...}`-like commands: trailing ones are units and dropped, others unwrapped.
constexpr std::string_view kTextCommands[] = {"\\textnormal", "\\textbf", "\\textrm", "\\text", "\\mbox", "\\mathrm"};

// Where a text group that closes exactly at the end of `t` starts, or npos. A square or cube
// after it belongs to the unit: "5\text{ cm}^2".
size_t trailing_text_group(std::string_view t) {
  for (std::string_view power : {"^2", "^3", "^{2}", "^{3}"})
    if (t.ends_with(power)) {
      size_t p = trailing_text_group(t.substr(0, t.size() - power.size()));
      if (p != std::string::npos) return p;
    }
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


// ---- Equivalence by algebra ---------------------------------------------------------------
//
// A normalised answer is read into a structure (tuple, interval, set, union, matrix, equation,
// expression) and each expression into a GiNaC expression. A LaTeX reader of our own rather
// than GiNaC::parser: GiNaC evaluates numeric powers while building them, so "10^{10^{10}}"
// would exhaust memory inside its parser before any check could run; here every power,
// factorial and literal is bounded as it is built. LaTeX also needs \frac, \sqrt[n], implicit
// products and commands, which GiNaC's syntax does not have.

// An answer that is not algebra (a word, an inequality, an unknown command) or is too big: it
// is compared as a string.
struct not_algebra : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr size_t kMaxAlgebraChars = 400;  // longer normalised answers compare as strings
constexpr int kMaxDepth = 32;             // nesting of groups, commands and structures
constexpr size_t kMaxParts = 32;          // elements of one tuple, set or list
constexpr size_t kMaxLiteralDigits = 200;
constexpr long kMaxExponent = 10000;      // |numerator| of a numeric exponent
constexpr long kMaxRootIndex = 1000;      // denominator of a numeric exponent
constexpr int kMaxPowerBits = 1 << 16;    // size of an exact power of a number
constexpr long kMaxFactorial = 1000;
constexpr long kMaxBinomial = 10000;
constexpr int kMaxExpandDegree = 16;      // integer powers of sums that normal() may expand
constexpr size_t kMaxNormalNodes = 400;

// Bits of an exact number's numerator and denominator (both parts of a complex one); 0 for a
// floating-point number, whose powers are cheap.
int numeric_bits(const GiNaC::numeric& n) {
  if (n.is_rational()) return std::max(n.numer().int_length(), n.denom().int_length());
  if (n.is_crational()) return std::max(numeric_bits(n.real()), numeric_bits(n.imag()));
  return 0;
}

GiNaC::ex bounded_pow(const GiNaC::ex& base, const GiNaC::ex& exponent) {
  // GiNaC throws on 0^0 and 0^-n, leaking the half-built power: refuse them first.
  if (base.is_zero() && (exponent.is_zero() || (GiNaC::is_a<GiNaC::numeric>(exponent) &&
                                                !GiNaC::ex_to<GiNaC::numeric>(exponent).is_positive())))
    throw not_algebra("zero to a non-positive power");
  if (GiNaC::is_a<GiNaC::numeric>(exponent)) {
    const auto& e = GiNaC::ex_to<GiNaC::numeric>(exponent);
    if (e.is_rational()) {
      if (GiNaC::abs(e.numer()) > kMaxExponent || e.denom() > kMaxRootIndex) throw not_algebra("exponent too large");
      if (GiNaC::is_a<GiNaC::numeric>(base) && e.is_integer() &&
          static_cast<double>(numeric_bits(GiNaC::ex_to<GiNaC::numeric>(base))) * std::abs(e.to_double()) >
              kMaxPowerBits)
        throw not_algebra("power too large");
    }
  }
  return GiNaC::pow(base, exponent);
}

GiNaC::ex divide(const GiNaC::ex& a, const GiNaC::ex& b) { return a * bounded_pow(b, -1); }

// A non-negative integer argument no larger than `limit`, or not a number at all.
void check_integer_argument(const GiNaC::ex& n, long limit) {
  if (!GiNaC::is_a<GiNaC::numeric>(n)) return;
  const auto& v = GiNaC::ex_to<GiNaC::numeric>(n);
  if (!v.is_nonneg_integer() || v > limit) throw not_algebra("argument out of range");
}

// Symbols by name, shared by both answers of one comparison (GiNaC symbols compare by
// identity, so "x" must be the same object on both sides).
class Symbols {
 public:
  GiNaC::ex get(const std::string& name) {
    auto it = table_.find(name);
    if (it == table_.end()) it = table_.emplace(name, GiNaC::symbol(name)).first;
    return it->second;
  }
  const std::map<std::string, GiNaC::symbol>& all() const { return table_; }

 private:
  std::map<std::string, GiNaC::symbol> table_;
};

// Commands the reader knows, matched by longest prefix because normalisation removed the
// spaces that ended them ("\sin x" arrives as "\sinx", "\pi r" as "\pir").
constexpr std::string_view kFunctions[] = {"arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "sin", "cos",
                                           "tan",    "cot",    "sec",    "csc",  "ln",   "log",  "exp", "sqrt"};
constexpr std::string_view kGreek[] = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta",   "theta", "vartheta", "iota",
    "kappa", "lambda", "mu",  "nu",    "xi",      "rho",        "sigma", "tau",  "upsilon", "phi",    "varphi",
    "chi",   "psi",   "omega", "Gamma", "Delta",  "Theta",      "Lambda", "Xi",  "Sigma", "Phi",      "Psi",
    "Omega"};
// Known so that a longer name is not read as a shorter one ("\infty" is not "\in"+"fty"), but
// not algebra: an answer using them compares as a string.
constexpr std::string_view kOtherCommands[] = {
    "frac", "dfrac", "tfrac", "sqrt", "binom", "dbinom", "tbinom", "pi", "infty", "cdot", "times", "div", "ast",
    "pm", "mp", "le", "leq", "ge", "geq", "ne", "neq", "lt", "gt", "cdots", "ldots", "dots", "in", "cup", "cap",
    "to", "overline", "circ", "prime", "emptyset", "varnothing", "lfloor", "rfloor", "lceil", "rceil"};

bool is_function(std::string_view name) {
  return std::find(std::begin(kFunctions), std::end(kFunctions), name) != std::end(kFunctions);
}
bool is_greek(std::string_view name) {
  return std::find(std::begin(kGreek), std::end(kGreek), name) != std::end(kGreek);
}

// The longest known command name at s[i...] (after the backslash), or "".
std::string_view command_at(std::string_view s, size_t i) {
  std::string_view best;
  auto consider = [&](std::string_view name) {
    if (name.size() > best.size() && s.substr(std::min(i, s.size())).starts_with(name)) best = name;
  };
  for (auto n : kFunctions) consider(n);
  for (auto n : kGreek) consider(n);
  for (auto n : kOtherCommands) consider(n);
  return best;
}

GiNaC::ex apply_function(std::string_view f, const GiNaC::ex& x) {
  if (f == "sin") return GiNaC::sin(x);
  if (f == "cos") return GiNaC::cos(x);
  if (f == "tan") return GiNaC::tan(x);
  if (f == "cot") return 1 / GiNaC::tan(x);
  if (f == "sec") return 1 / GiNaC::cos(x);
  if (f == "csc") return 1 / GiNaC::sin(x);
  if (f == "arcsin") return GiNaC::asin(x);
  if (f == "arccos") return GiNaC::acos(x);
  if (f == "arctan") return GiNaC::atan(x);
  if (f == "sinh") return GiNaC::sinh(x);
  if (f == "cosh") return GiNaC::cosh(x);
  if (f == "tanh") return GiNaC::tanh(x);
  if (f == "ln" || f == "log") return GiNaC::log(x);  // natural, as latex2sympy reads \log
  if (f == "exp") return GiNaC::exp(x);
  if (f == "sqrt") return bounded_pow(x, GiNaC::numeric(1, 2));
  throw not_algebra("unknown function");
}

// Reads one normalised LaTeX expression into GiNaC. Precedence, loosest first: + -, then
// products (explicit * \cdot \times / \div, or implicit: "2x", "2(x+1)", "x\sqrt{2}"), then a
// sign, then powers (right-associative), then postfix `!`.
class LatexReader {
 public:
  LatexReader(std::string_view s, Symbols& symbols) : s_(s), symbols_(symbols) {}

  GiNaC::ex read() {
    GiNaC::ex e = sum();
    if (i_ != s_.size()) throw not_algebra("unexpected text");
    return e;
  }

 private:
  struct Nested {
    explicit Nested(int& depth) : depth_(depth) {
      if (++depth_ > kMaxDepth) throw not_algebra("nested too deeply");
    }
    ~Nested() { --depth_; }
    int& depth_;
  };

  bool at_end() const { return i_ >= s_.size(); }
  char peek(size_t ahead = 0) const { return i_ + ahead < s_.size() ? s_[i_ + ahead] : '\0'; }
  bool eat(char c) {
    if (peek() != c) return false;
    ++i_;
    return true;
  }
  void expect(char c) {
    if (!eat(c)) throw not_algebra("missing bracket");
  }
  std::string_view command() const { return peek() == '\\' ? command_at(s_, i_ + 1) : std::string_view(); }
  bool eat_command(std::string_view name) {
    if (command() != name) return false;
    i_ += 1 + name.size();
    return true;
  }

  GiNaC::ex sum() {
    GiNaC::ex e = signed_factor_product();
    for (;;) {
      if (eat('+')) e += signed_factor_product();
      else if (eat('-')) e -= signed_factor_product();
      else return e;
    }
  }

  GiNaC::ex signed_factor_product() {
    GiNaC::ex e = signed_power();
    for (;;) {
      if (eat('*') || eat_command("cdot") || eat_command("times") || eat_command("ast")) e *= signed_power();
      else if (eat('/') || eat_command("div")) e = divide(e, signed_power());
      else if (starts_factor(false)) e *= power();
      else return e;
    }
  }

  GiNaC::ex signed_power() {
    Nested n(depth_);
    if (eat('-')) return -signed_power();
    if (eat('+')) return signed_power();
    return power();
  }

  GiNaC::ex power() {
    GiNaC::ex base = postfix();
    if (eat('^')) return bounded_pow(base, exponent());
    return base;
  }

  // An exponent: a braced group, a signed one, a whole number ("2^10" is 1024, as written by
  // people rather than as TeX sets it), or one primary; right-associative.
  GiNaC::ex exponent() {
    Nested n(depth_);
    GiNaC::ex e;
    if (peek() == '{') e = primary();
    else if (eat('-')) e = -exponent();
    else if (eat('+')) e = exponent();
    else if (is_digit(peek())) e = unsigned_integer();
    else e = primary();
    if (eat('^')) e = bounded_pow(e, exponent());
    return e;
  }

  GiNaC::ex postfix() {
    GiNaC::ex e = primary();
    while (eat('!')) {
      check_integer_argument(e, kMaxFactorial);
      e = GiNaC::factorial(e);
    }
    return e;
  }

  // Whether what follows starts a factor of an implicit product. Inside |...| a bar closes;
  // in a function's unbracketed argument ("\sin 2x") another function starts a new factor.
  bool starts_factor(bool in_function_argument) const {
    char c = peek();
    if (is_digit(c) || is_alpha(c) || c == '(' || c == '[' || c == '{') return true;
    if (c == '.') return is_digit(peek(1));
    if (c == '|') return abs_depth_ == 0;
    if (c != '\\') return false;
    std::string_view name = command();
    if (is_function(name)) return !in_function_argument;
    return is_greek(name) || name == "frac" || name == "dfrac" || name == "tfrac" || name == "sqrt" ||
           name == "binom" || name == "dbinom" || name == "tbinom" || name == "pi" || name == "infty";
  }

  GiNaC::ex primary() {
    Nested n(depth_);
    char c = peek();
    if (c == '(' || c == '[' || c == '{') {
      ++i_;
      int saved_abs = abs_depth_;
      abs_depth_ = 0;
      GiNaC::ex e = sum();
      abs_depth_ = saved_abs;
      expect(c == '(' ? ')' : c == '[' ? ']' : '}');
      return e;
    }
    if (eat('|')) {
      ++abs_depth_;
      GiNaC::ex e = sum();
      --abs_depth_;
      expect('|');
      return GiNaC::abs(e);
    }
    if (is_digit(c) || (c == '.' && is_digit(peek(1)))) return number();
    if (is_alpha(c)) return letter();
    if (c == '\\') return latex_command();
    throw not_algebra("not an expression");
  }

  std::string digits() {
    size_t start = i_;
    while (is_digit(peek())) ++i_;
    if (i_ - start > kMaxLiteralDigits) throw not_algebra("number too long");
    return std::string(s_.substr(start, i_ - start));
  }

  static GiNaC::numeric integer_of(std::string d) {
    d.erase(0, std::min(d.find_first_not_of('0'), d.size()));
    return d.empty() ? GiNaC::numeric(0) : GiNaC::numeric(d.c_str());
  }

  GiNaC::ex unsigned_integer() { return integer_of(digits()); }

  // "12", "0.25" (exact: 1/4), "0.\overline{3}" (1/3), "1e3", "2.5E-4", and the mixed number
  // "2\frac{1}{2}" (5/2: an integer right before a fraction of integers).
  GiNaC::ex number() {
    std::string whole = digits(), fraction;
    bool has_point = eat('.');
    if (has_point) fraction = digits();
    GiNaC::numeric value = integer_of(whole + fraction) / GiNaC::numeric(10).power(fraction.size());
    if (has_point && eat_command("overline")) {
      if (!eat('{')) throw not_algebra("bad repeating decimal");
      std::string repeat = digits();
      if (repeat.empty() || !eat('}')) throw not_algebra("bad repeating decimal");
      value += integer_of(repeat) / (GiNaC::numeric(10).power(repeat.size()) - 1) /
               GiNaC::numeric(10).power(fraction.size());
    }
    if ((peek() == 'e' || peek() == 'E') &&
        (is_digit(peek(1)) || ((peek(1) == '-' || peek(1) == '+') && is_digit(peek(2))))) {
      ++i_;
      bool negative = eat('-');
      if (!negative) eat('+');
      std::string e = digits();
      if (e.size() > 4) throw not_algebra("exponent too large");
      return value * GiNaC::ex_to<GiNaC::numeric>(bounded_pow(10, (negative ? -1 : 1) * std::stol(e)));
    }
    if (!has_point && (command() == "frac" || command() == "dfrac" || command() == "tfrac")) {
      size_t save = i_;
      i_ += 1 + command().size();
      if (eat('{') && is_digit(peek())) {
        GiNaC::numeric num = integer_of(digits());
        if (eat('}') && eat('{') && is_digit(peek())) {
          GiNaC::numeric den = integer_of(digits());
          if (eat('}') && !den.is_zero()) return value + num / den;
        }
      }
      i_ = save;
    }
    return value;
  }

  // One letter of a run ("xy" is x*y), with its subscript: "x_1", "a_{n}". A run of four or
  // more letters is a word, not algebra, unless it names a function; "e" is Euler's number and
  // "i" the imaginary unit.
  GiNaC::ex letter() {
    if (i_ >= run_end_) {
      size_t end = i_;
      while (end < s_.size() && is_alpha(s_[end])) ++end;
      std::string_view run = s_.substr(i_, end - i_);
      if (run == "pi") {
        i_ = end;
        return GiNaC::Pi;
      }
      if (run == "sqrt" || run == "sin" || run == "cos" || run == "tan" || run == "ln" || run == "log" ||
          run == "exp") {
        i_ = end;
        return function(run);
      }
      if (run.size() > 3) throw not_algebra("a word");
      run_end_ = end;
    }
    std::string name(1, s_[i_++]);
    if (eat('_')) return symbols_.get(name + "_" + subscript());
    if (name == "e") return GiNaC::exp(GiNaC::ex(1));
    if (name == "i") return GiNaC::I;
    return symbols_.get(name);
  }

  std::string subscript() {
    if (peek() == '{') {
      size_t close = closing_brace(s_, i_);
      if (close == std::string::npos) throw not_algebra("bad subscript");
      std::string text(s_.substr(i_ + 1, close - i_ - 1));
      i_ = close + 1;
      return text;
    }
    if (!is_digit(peek()) && !is_alpha(peek())) throw not_algebra("bad subscript");
    return std::string(1, s_[i_++]);
  }

  // A command's argument: a braced group, or one digit, letter or command ("\frac\pi2").
  GiNaC::ex argument() {
    if (peek() == '{') return primary();
    if (is_digit(peek())) return GiNaC::numeric(s_[i_++] - '0');
    if (is_alpha(peek())) {
      run_end_ = i_ + 1;
      return letter();
    }
    if (peek() == '\\') return primary();
    throw not_algebra("missing argument");
  }

  GiNaC::ex latex_command() {
    std::string_view name = command();
    if (name.empty()) throw not_algebra("unknown command");
    i_ += 1 + name.size();
    if (name == "frac" || name == "dfrac" || name == "tfrac") {
      GiNaC::ex num = argument();
      return divide(num, argument());
    }
    if (name == "sqrt") {
      GiNaC::ex index = 2;
      if (eat('[')) {
        index = sum();
        expect(']');
      }
      GiNaC::ex radicand = argument();
      if (!GiNaC::is_a<GiNaC::numeric>(index) || !GiNaC::ex_to<GiNaC::numeric>(index).is_pos_integer())
        throw not_algebra("bad root index");
      // An odd root of a negative number is real: \sqrt[3]{-8} = -2.
      if (GiNaC::ex_to<GiNaC::numeric>(index).is_odd() && GiNaC::is_a<GiNaC::numeric>(radicand) &&
          GiNaC::ex_to<GiNaC::numeric>(radicand).is_negative())
        return -bounded_pow(-radicand, 1 / index);
      return bounded_pow(radicand, 1 / index);
    }
    if (name == "binom" || name == "dbinom" || name == "tbinom") {
      GiNaC::ex n = argument(), k = argument();
      check_integer_argument(n, kMaxBinomial);
      check_integer_argument(k, kMaxBinomial);
      return GiNaC::binomial(n, k);
    }
    if (name == "pi") return GiNaC::Pi;
    if (name == "infty") return symbols_.get("\\infty");
    if (is_greek(name)) {
      std::string symbol = "\\" + std::string(name);
      if (eat('_')) symbol += "_" + subscript();
      return symbols_.get(symbol);
    }
    if (is_function(name)) return function(name);
    throw not_algebra("not algebra: \\" + std::string(name));
  }

  // "\sin x", "\sin(x)", "\sin^2 x" (the square of the sine), "\log_2 8", "\sin 2x" (the
  // argument runs over an implicit product).
  GiNaC::ex function(std::string_view name) {
    std::optional<GiNaC::ex> raised_to, base;
    for (;;) {
      if (eat('^')) raised_to = exponent();
      else if (name == "log" && eat('_')) base = argument();
      else break;
    }
    GiNaC::ex arg;
    if (peek() == '(' || peek() == '[' || peek() == '{') {
      arg = primary();
    } else {
      arg = power_of_argument();
      while (starts_factor(true)) arg *= power_of_argument();
    }
    GiNaC::ex value = apply_function(name, arg);
    if (base) value /= GiNaC::log(*base);
    return raised_to ? bounded_pow(value, *raised_to) : value;
  }

  GiNaC::ex power_of_argument() {
    Nested n(depth_);
    return power();
  }

  std::string_view s_;
  Symbols& symbols_;
  size_t i_ = 0;
  size_t run_end_ = 0;  // the end of the run of letters being read one by one
  int abs_depth_ = 0;
  int depth_ = 0;
};

// ---- Structure: tuples, intervals, sets, unions, matrices, equations ----------------------

// Where the bracket that opens at s[0] (or "\{" at s[0..1]) closes, one past it, or npos;
// (), [] and {} nest alike, so "[1,3)" closes at its end.
size_t group_end(std::string_view s) {
  int depth = 0;
  for (size_t k = 0; k < s.size(); ++k) {
    char c = s[k];
    if (c == '\\') {
      bool brace = k + 1 < s.size() && (s[k + 1] == '{' || s[k + 1] == '}');
      if (brace) depth += s[k + 1] == '{' ? 1 : -1;
      ++k;
      if (!brace) continue;
    } else if (c == '(' || c == '[' || c == '{') {
      ++depth;
    } else if (c == ')' || c == ']' || c == '}') {
      --depth;
    } else {
      continue;
    }
    if (depth == 0) return k + 1;
    if (depth < 0) return std::string::npos;
  }
  return std::string::npos;
}

// `s` split at `sep` where it stands outside every bracket.
std::vector<std::string_view> split_top(std::string_view s, std::string_view sep) {
  std::vector<std::string_view> parts;
  int depth = 0;
  size_t start = 0;
  for (size_t k = 0; k < s.size(); ++k) {
    if (depth == 0 && s.substr(k).starts_with(sep)) {
      parts.push_back(s.substr(start, k - start));
      start = k + sep.size();
      k = start - 1;
      continue;
    }
    char c = s[k];
    if (c == '\\') {
      if (k + 1 < s.size() && (s[k + 1] == '{' || s[k + 1] == '}')) depth += s[k + 1] == '{' ? 1 : -1;
      if (k + 1 < s.size() && !is_alpha(s[k + 1])) ++k;
    } else if (c == '(' || c == '[' || c == '{') {
      ++depth;
    } else if (c == ')' || c == ']' || c == '}') {
      --depth;
    }
  }
  parts.push_back(s.substr(start));
  return parts;
}

struct Answer {
  enum class Kind { expression, equation, ordered, unordered, union_of };
  Kind kind = Kind::expression;
  std::string text;            // the normalised text, compared as a string first
  std::string brackets;        // ordered: "()", "[)", ... or "matrix", "row"
  std::vector<Answer> parts;   // elements, union pieces, matrix rows, or an equation's two sides
};

Answer structure_of(std::string_view s, int depth);

Answer collection(Answer::Kind kind, std::string brackets, std::string_view text,
                  const std::vector<std::string_view>& items, int depth) {
  Answer a{.kind = kind, .text = std::string(text), .brackets = std::move(brackets)};
  if (items.size() > kMaxParts) throw not_algebra("too many elements");
  for (auto item : items) a.parts.push_back(structure_of(item, depth + 1));
  return a;
}

Answer structure_of(std::string_view s, int depth) {
  if (depth > kMaxDepth) throw not_algebra("nested too deeply");
  while (s.size() >= 2 && s.front() == '{' && group_end(s) == s.size()) s = s.substr(1, s.size() - 2);
  using Kind = Answer::Kind;
  if (s == "\\emptyset" || s == "\\varnothing" || s == "\\{\\}") return {.kind = Kind::unordered, .text = std::string(s)};
  if (auto pieces = split_top(s, "\\cup"); pieces.size() > 1) return collection(Kind::union_of, "", s, pieces, depth);
  for (std::string_view env : {"pmatrix", "bmatrix", "matrix"}) {
    std::string begin = "\\begin{" + std::string(env) + "}", end = "\\end{" + std::string(env) + "}";
    if (!s.starts_with(begin) || !s.ends_with(end) || s.size() < begin.size() + end.size()) continue;
    auto rows = split_top(s.substr(begin.size(), s.size() - begin.size() - end.size()), "\\\\");
    if (rows.size() > 1 && rows.back().empty()) rows.pop_back();
    Answer m{.kind = Kind::ordered, .text = std::string(s), .brackets = "matrix"};
    if (rows.size() > kMaxParts) throw not_algebra("too many rows");
    for (auto row : rows) m.parts.push_back(collection(Kind::ordered, "row", row, split_top(row, "&"), depth + 1));
    return m;
  }
  if (s.starts_with("\\{") && s.ends_with("\\}") && group_end(s) == s.size())
    return collection(Kind::unordered, "", s, split_top(s.substr(2, s.size() - 4), ","), depth);
  if (s.size() >= 2 && (s.front() == '(' || s.front() == '[') && (s.back() == ')' || s.back() == ']') &&
      group_end(s) == s.size()) {
    auto items = split_top(s.substr(1, s.size() - 2), ",");
    if (items.size() > 1) return collection(Kind::ordered, {s.front(), s.back()}, s, items, depth);
  }
  if (auto items = split_top(s, ","); items.size() > 1) return collection(Kind::unordered, "", s, items, depth);
  if (size_t pm = s.find("\\pm"); pm != std::string_view::npos && s.find("\\pm", pm + 1) == std::string_view::npos &&
                                  command_at(s, pm + 1) == "pm") {
    std::string plus(s), minus(s);
    plus.replace(pm, 3, "+");
    minus.replace(pm, 3, "-");
    return collection(Kind::unordered, "", s, {plus, minus}, depth);
  }
  if (auto sides = split_top(s, "="); sides.size() == 2 && !sides[0].empty() && !sides[1].empty() &&
                                      !sides[0].ends_with("<") && !sides[0].ends_with(">") && !sides[0].ends_with("!"))
    return collection(Kind::equation, "", s, sides, depth);
  return {.kind = Kind::expression, .text = std::string(s)};
}

// ---- Comparison ---------------------------------------------------------------------------

bool has_symbols(const GiNaC::ex& e) {
  return std::any_of(e.preorder_begin(), e.preorder_end(), [](const GiNaC::ex& x) { return GiNaC::is_a<GiNaC::symbol>(x); });
}

bool close(const GiNaC::numeric& a, const GiNaC::numeric& b) {
  GiNaC::numeric scale = std::max({GiNaC::numeric(1), GiNaC::abs(a), GiNaC::abs(b)});
  return GiNaC::abs(a - b) <= GiNaC::numeric(1e-9) * scale;
}

// Whether normal() can work on `e` in bounded time: a small tree with no high power of a sum.
bool small_enough_to_normalize(const GiNaC::ex& e) {
  size_t nodes = 0;
  for (auto it = e.preorder_begin(); it != e.preorder_end(); ++it) {
    if (++nodes > kMaxNormalNodes) return false;
    if (GiNaC::is_a<GiNaC::power>(*it) && GiNaC::is_a<GiNaC::add>(it->op(0)) && GiNaC::is_a<GiNaC::numeric>(it->op(1)) &&
        GiNaC::abs(GiNaC::ex_to<GiNaC::numeric>(it->op(1))) > kMaxExpandDegree)
      return false;
  }
  return true;
}

bool normalizes_to_zero(const GiNaC::ex& e) {
  if (!small_enough_to_normalize(e)) return false;
  try {
    return e.normal().is_zero();
  } catch (const std::exception&) {
    return false;
  }
}

// Generic sample values for the symbols, mixed in sign so that "\sqrt{x^2}" differs from "x".
constexpr double kSamples[] = {0.5772156649, -1.3247179572, 1.8392867552, -0.7390851332,
                               2.2955871493, -2.5029078751, 0.3183098862, 1.2020569032};
constexpr int kSamplePoints = 8;
constexpr int kAgreeingPoints = 4;

class Algebra {
 public:
  bool same(const Answer& a, const Answer& b) {
    using Kind = Answer::Kind;
    if (a.text == b.text) return true;
    if (a.kind == Kind::expression && b.kind == Kind::expression) return expressions_equal(a.text, b.text);
    if (a.kind == Kind::equation && b.kind == Kind::equation) return equations_equal(a, b);
    if (a.kind == Kind::equation && b.kind == Kind::expression) return assignment_equals(a, b);
    if (a.kind == Kind::expression && b.kind == Kind::equation) return assignment_equals(b, a);
    if (a.kind != b.kind || a.brackets != b.brackets || a.parts.size() != b.parts.size()) return false;
    if (a.kind == Kind::ordered) {
      for (size_t k = 0; k < a.parts.size(); ++k)
        if (!same(a.parts[k], b.parts[k])) return false;
      return true;
    }
    std::vector<bool> used(b.parts.size(), false);  // sets, lists and unions: in any order
    for (const Answer& part : a.parts) {
      size_t k = 0;
      while (k < b.parts.size() && (used[k] || !same(part, b.parts[k]))) ++k;
      if (k == b.parts.size()) return false;
      used[k] = true;
    }
    return true;
  }

 private:
  std::optional<GiNaC::ex> read(const std::string& text) {
    auto it = cache_.find(text);
    if (it != cache_.end()) return it->second;
    std::optional<GiNaC::ex> e;
    try {
      e = LatexReader(text, symbols_).read();
    } catch (const std::exception&) {  // not_algebra, or GiNaC's own (a zero divisor, log(0))
    }
    return cache_.emplace(text, e).first->second;
  }

  // Values at sample point k: each symbol gets its own value.
  GiNaC::exmap point(int k) const {
    GiNaC::exmap values;
    int j = 0;
    for (const auto& [name, symbol] : symbols_.all()) {
      values[symbol] = kSamples[(k + 3 * j) % std::size(kSamples)] + 0.0137 * (j / std::size(kSamples));
      ++j;
    }
    return values;
  }

  static std::optional<GiNaC::numeric> value(const GiNaC::ex& e, const GiNaC::exmap& at) {
    try {
      GiNaC::ex v = e.subs(at).evalf();
      if (GiNaC::is_a<GiNaC::numeric>(v)) return GiNaC::ex_to<GiNaC::numeric>(v);
    } catch (const std::exception&) {  // a pole or a domain error at this point
    }
    return std::nullopt;
  }

  // Equal when the difference normalises to zero, else when both agree at sample points
  // (GiNaC leaves radicals and trigonometric identities unsimplified: sqrt(6)/(2 sqrt(2))).
  bool expressions_equal(const std::string& a, const std::string& b) {
    auto ea = read(a), eb = read(b);
    if (!ea || !eb) return false;
    GiNaC::ex d = *ea - *eb;
    if (d.is_zero() || normalizes_to_zero(d)) return true;
    if (!has_symbols(*ea) && !has_symbols(*eb)) {  // numbers: one evaluation decides
      auto va = value(*ea, {}), vb = value(*eb, {});
      return va && vb && close(*va, *vb);
    }
    int agreed = 0;
    for (int k = 0; k < kSamplePoints && agreed < kAgreeingPoints; ++k) {
      GiNaC::exmap at = point(k);
      auto va = value(*ea, at), vb = value(*eb, at);
      if (!va || !vb) continue;
      if (!close(*va, *vb)) return false;
      ++agreed;
    }
    return agreed == kAgreeingPoints;
  }

  // Two equations are the same when their sides' differences are proportional by a non-zero
  // number: "x+y=3", "y=3-x" and "2x+2y=6" are one equation.
  bool equations_equal(const Answer& a, const Answer& b) {
    auto la = read(a.parts[0].text), ra = read(a.parts[1].text);
    auto lb = read(b.parts[0].text), rb = read(b.parts[1].text);
    if (!la || !ra || !lb || !rb) return false;
    GiNaC::ex da = *la - *ra, db = *lb - *rb;
    if (da.is_zero() || db.is_zero()) return da.is_zero() && db.is_zero();
    if (small_enough_to_normalize(da) && small_enough_to_normalize(db)) {
      try {
        GiNaC::ex q = (da / db).normal();
        if (GiNaC::is_a<GiNaC::numeric>(q) && !q.is_zero()) return true;
      } catch (const std::exception&) {
      }
    }
    std::optional<GiNaC::numeric> ratio;
    int agreed = 0;
    for (int k = 0; k < kSamplePoints && agreed < kAgreeingPoints; ++k) {
      GiNaC::exmap at = point(k);
      auto va = value(da, at), vb = value(db, at);
      if (!va || !vb || vb->is_zero()) continue;
      GiNaC::numeric r = *va / *vb;
      if (r.is_zero() || (ratio && !close(r, *ratio))) return false;
      ratio = r;
      ++agreed;
    }
    return agreed == kAgreeingPoints;
  }

  // "x=3" inside a list against "3": one side a lone symbol, the other equal to the value.
  bool assignment_equals(const Answer& equation, const Answer& value) {
    for (int side = 0; side < 2; ++side) {
      auto e = read(equation.parts[side].text);
      if (e && GiNaC::is_a<GiNaC::symbol>(*e)) return expressions_equal(equation.parts[1 - side].text, value.text);
    }
    return false;
  }

  Symbols symbols_;
  std::map<std::string, std::optional<GiNaC::ex>> cache_;
};

// GiNaC is not thread-safe (its reference counts and shared constants are plain integers), and
// reward actors may score on several threads: every GiNaC object lives and dies under this lock.
std::mutex algebra_mutex;

bool equal_by_algebra(const std::string& a, const std::string& b) {
  if (a.size() > kMaxAlgebraChars || b.size() > kMaxAlgebraChars) return false;
  std::lock_guard lock(algebra_mutex);
  try {
    Answer sa = structure_of(a, 0), sb = structure_of(b, 0);
    return Algebra().same(sa, sb);
  } catch (...) {  // never let a reward call fail: not algebra, or GiNaC/CLN gave up
    return false;
  }
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

namespace {

// normalize_math_answer, optionally keeping a left side `x =` (the algebra reads equations).
std::string normalize(std::string_view answer, bool drop_assignment) {
  std::string s(answer);
  for (char& c : s)
    if (is_space(c)) c = ' ';
  replace_all(s, "\\\\", kRowBreak);  // a matrix row break is not the spacing command "\ "
  // Order matters: spacing commands before `\left`/`\right`, degrees before dollars.
  for (std::string_view drop : {"\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\left", "\\right", "\\(",
                                "\\)", "\\[", "\\]", "^{\\circ}", "^\\circ", "\xC2\xB0", "\\%", "%", "\\$", "$", "{,}"})
    replace_all(s, drop, "");
  replace_all(s, "\\dfrac", "\\frac");
  replace_all(s, "\\tfrac", "\\frac");
  s = strip_text_groups(std::string(trim(s)));
  if (drop_assignment) s = drop_variable_assignment(std::string(trim(s)));
  s = drop_trailing_words(std::string(trim(s)));
  // "1, 234" is a list of two numbers, "1,234" one number: decide before spaces go.
  bool spaced_comma = false;
  for (size_t k = 0; k < s.size(); ++k)
    spaced_comma |= s[k] == ',' && ((k > 0 && s[k - 1] == ' ') || (k + 1 < s.size() && s[k + 1] == ' '));
  std::erase_if(s, is_space);
  replace_all(s, kRowBreak, "\\\\");
  s = brace_arguments(s, "\\frac", 2);
  s = brace_arguments(s, "\\sqrt", 1);
  while (!s.empty() && s.back() == '.') s.pop_back();
  while (s.size() >= 2 && s.front() == '{' && closing_brace(s, 0) == s.size() - 1) s = s.substr(1, s.size() - 2);
  if (!s.empty() && !spaced_comma && number_length(s, 0) == s.size()) s = without_commas(s);
  if (s.size() >= 2 && s[0] == '.' && is_digit(s[1])) s.insert(0, "0");
  if (s.size() >= 3 && s[0] == '-' && s[1] == '.' && is_digit(s[2])) s.insert(1, "0");
  return s;
}

}  // namespace

std::string normalize_math_answer(std::string_view answer) { return normalize(answer, true); }

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
  // A comma left in a normalised answer separates elements ("1, 000" is a list of two).
  auto number = [](const std::string& n) { return n.find(',') == std::string::npos ? parse_math_number(n) : std::nullopt; };
  auto va = number(na), vb = number(nb);
  if (va && vb) return std::abs(*va - *vb) <= 1e-9 * std::max({1.0, std::abs(*va), std::abs(*vb)});
  return equal_by_algebra(normalize(a, false), normalize(b, false));
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
