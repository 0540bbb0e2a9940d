// Byte-level BPE with the semantics of Hugging Face `tokenizers`: added tokens, NFC, Split/ByteLevel/
// Digits pre-tokenizers, BPE merges, ByteLevel decoding. No training, offsets or post-processors.
#include "policy/tokenizer.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <queue>
#include <unordered_map>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <nlohmann/json.hpp>

#include "policy/error.hpp"
#include "policy/gguf.hpp"

namespace troupe {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// ---- UTF-8 -------------------------------------------------------------------------------------

// One step through possibly invalid UTF-8: the length of the valid sequence at s[i], or of its
// longest valid prefix when it is invalid (Rust's rule, so that lossy decoding puts one U+FFFD per
// "maximal subpart" exactly as String::from_utf8_lossy does).
struct Utf8Step {
  size_t len;
  bool ok;
};

Utf8Step utf8_step(std::string_view s, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned c = at(i);
  if (c < 0x80) return {1, true};
  size_t need = 0;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return {1, false};
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return {k, false};
    const unsigned d = at(i + k);
    if (d < (k == 1 ? lo : 0x80u) || d > (k == 1 ? hi : 0xBFu)) return {k, false};
  }
  return {need + 1, true};
}

// The byte offset of the first invalid sequence, or npos.
size_t utf8_invalid_at(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step step = utf8_step(s, i);
    if (!step.ok) return i;
    i += step.len;
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const Utf8Step step = utf8_step(s, i);
    if (step.ok)
      out.append(s.substr(i, step.len));
    else
      out.append("\xEF\xBF\xBD");
    i += step.len;
  }
  return out;
}

// Decodes the (valid) code point at s[i] and advances i past it.
char32_t next_code_point(std::string_view s, size_t& i) {
  const auto at = [&](size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[k])); };
  const char32_t c = at(i);
  if (c < 0x80) {
    i += 1;
    return c;
  }
  if (c < 0xE0) {
    const char32_t cp = ((c & 0x1F) << 6) | (at(i + 1) & 0x3F);
    i += 2;
    return cp;
  }
  if (c < 0xF0) {
    const char32_t cp = ((c & 0x0F) << 12) | ((at(i + 1) & 0x3F) << 6) | (at(i + 2) & 0x3F);
    i += 3;
    return cp;
  }
  const char32_t cp = ((c & 0x07) << 18) | ((at(i + 1) & 0x3F) << 12) | ((at(i + 2) & 0x3F) << 6) |
                      (at(i + 3) & 0x3F);
  i += 4;
  return cp;
}

char32_t last_code_point(std::string_view s) {
  size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return next_code_point(s, start);
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool is_ascii(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

// Rust's char::is_whitespace and regex `\s`: the Unicode White_Space property.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Rust's char::is_numeric: general categories Nd, Nl, No.
bool is_numeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

// Rust regex `\w`: letters, marks, decimal digits, connector punctuation, joiners.
bool is_word_char(char32_t c) {
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) || c == '_';
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

std::string nfc(std::string_view s) {
  if (is_ascii(s)) return std::string(s);  // NFC leaves ASCII alone; most pieces take this path
  utf8proc_uint8_t* out = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                              static_cast<utf8proc_ssize_t>(s.size()), &out,
                              static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) throw Error(std::string("tokenizer: NFC normalization failed: ") + utf8proc_errmsg(n));
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

// ---- the byte-level alphabet (GPT-2's bytes_to_unicode) ----------------------------------------

struct ByteAlphabet {
  std::array<std::string, 256> to_char;  // byte -> UTF-8 of the printable stand-in
  std::array<int16_t, 324> to_byte;      // stand-in code point -> byte, or -1; all are < 324
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet = [] {
    ByteAlphabet a;
    a.to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const char32_t cp = printable ? static_cast<char32_t>(b) : next++;
      append_utf8(a.to_char[b], cp);
      a.to_byte[cp] = static_cast<int16_t>(b);
    }
    return a;
  }();
  return alphabet;
}

std::string to_byte_level(std::string_view s) {
  const auto& alphabet = byte_alphabet();
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char b : s) out += alphabet.to_char[b];
  return out;
}

// A token's bytes under the ByteLevel decoder: its stand-ins mapped back, or, when any character
// is outside the alphabet (added tokens such as "<｜end｜>"), the token's own UTF-8.
void append_byte_level_decoded(std::string& out, std::string_view token) {
  const auto& alphabet = byte_alphabet();
  const size_t start = out.size();
  for (size_t i = 0; i < token.size();) {
    const bool valid = utf8_step(token, i).ok;  // GGUF token strings are arbitrary bytes
    const char32_t cp = valid ? next_code_point(token, i) : 0;
    if (!valid || cp >= alphabet.to_byte.size() || alphabet.to_byte[cp] < 0) {
      out.resize(start);
      out.append(token);
      return;
    }
    out += static_cast<char>(alphabet.to_byte[cp]);
  }
}

// ---- regular expressions (PCRE2 with Unicode properties) ---------------------------------------

// Per-thread match state: a JIT stack large enough for `\s+(?!\S)` over long runs of spaces.
struct MatchState {
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  pcre2_match_data* data = nullptr;
  MatchState() {
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
    data = pcre2_match_data_create(1, nullptr);
  }
  ~MatchState() {
    pcre2_match_data_free(data);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
  }
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

// Oniguruma (what `tokenizers` compiles patterns with) and PCRE2 disagree on shorthand classes:
// PCRE2 counts U+180E as `\s`; its `\w` (10.42) leaves out marks and connector punctuation, and
// Oniguruma's adds Latin-1's superscript digits and fractions; Oniguruma's `\h` is a hex digit.
// Those escapes are spelled out as Oniguruma's sets, checked code point by code point against
// tokenizers (they differ only on characters newer than PCRE2's Unicode tables). A negated
// shorthand inside a class, `[\S...]`, cannot be spelled out and is left as it is.
std::string onig_to_pcre2(std::string_view pattern) {
  constexpr const char* space = R"(\t\n\x0B\f\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029})"
                                R"(\x{202F}\x{205F}\x{3000})";
  constexpr const char* word = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{B2}\x{B3}\x{B9}\x{BC}-\x{BE})";
  constexpr const char* hex = "0-9a-fA-F";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      const char* set = e == 's' || e == 'S' ? space : e == 'w' || e == 'W' ? word : e == 'h' || e == 'H' ? hex : nullptr;
      const bool negated = e == 'S' || e == 'W' || e == 'H';
      if (!set || (in_class && negated)) {
        if (e == 'Q') {  // \Q...\E is literal text: copy it through untouched
          const size_t end = pattern.find("\\E", i + 1);
          const size_t stop = end == std::string_view::npos ? pattern.size() : end + 2;
          out.append(pattern.substr(i - 1, stop - (i - 1)));
          i = stop - 1;
          continue;
        }
        out += '\\';
        out += e;
      } else if (in_class) {
        out += set;
      } else {
        out += negated ? "[^" : "[";
        out += set;
        out += ']';
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {  // [:alpha:]
      const size_t end = pattern.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(pattern.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

class Regex {
 public:
  // `where` names the pattern's origin for the compile error ("tokenizer.json: pre_tokenizer...").
  Regex(const std::string& source, bool literal, const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    const std::string pattern = literal ? source : onig_to_pcre2(source);
    const uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     options, &error, &offset, nullptr);
    if (!code)
      throw Error(where + ": regex /" + source + "/ does not compile at offset " +
                  std::to_string(offset) + ": " + pcre2_message(error));
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when unavailable
    code_.reset(code, pcre2_code_free);
  }

  // Calls on_match(start, end) for each match in `text` (valid UTF-8), stepping over empty matches
  // the way the onig crate's find_iter does, which is what `tokenizers` iterates with.
  template <class F>
  void for_each_match(std::string_view text, F&& on_match) const {
    thread_local MatchState state;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t from = 0;
    std::optional<size_t> last_end;
    while (from <= text.size()) {
      const int rc = pcre2_match(code_.get(), subject, text.size(), from, PCRE2_NO_UTF_CHECK,
                                 state.data, state.context);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) throw Error("tokenizer: regex match failed: " + pcre2_message(rc));
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
      const size_t start = ovector[0], end = ovector[1];
      if (start == end && last_end == end) {
        from += from < text.size() ? utf8_step(text, from).len : 1;
        continue;
      }
      on_match(start, end);
      from = end;
      last_end = end;
    }
  }

 private:
  std::shared_ptr<pcre2_code> code_;
};

const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// llama.cpp's regexes for these `tokenizer.ggml.pre` values, as transformers' GGUF loader has them.
const char* const kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::shared_ptr<const Regex> gpt2_regex() {
  static const auto regex = std::make_shared<const Regex>(kGpt2Pattern, false, "ByteLevel");
  return regex;
}

// ---- pre-tokenizers ----------------------------------------------------------------------------

// A stretch of a piece and whether the pattern matched it (tokenizers' Pattern::find_matches).
struct Span {
  size_t start, end;
  bool match;
};

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

struct PreTokenizer {
  enum class Kind { split, byte_level, digits } kind = Kind::split;
  std::shared_ptr<const Regex> regex;  // split; byte_level when it uses its regex
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  bool add_prefix_space = false;
  bool individual_digits = false;
};

std::vector<Span> regex_spans(const Regex& regex, std::string_view s) {
  std::vector<Span> spans;
  size_t prev = 0;
  regex.for_each_match(s, [&](size_t start, size_t end) {
    if (prev != start) spans.push_back({prev, start, false});
    spans.push_back({start, end, true});
    prev = end;
  });
  if (prev != s.size()) spans.push_back({prev, s.size(), false});
  return spans;
}

// Each numeric character is its own match, as for tokenizers' char-predicate patterns.
std::vector<Span> digit_spans(std::string_view s) {
  std::vector<Span> spans;
  size_t last = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t at = i;
    const char32_t cp = next_code_point(s, i);
    if (!is_numeric(cp)) continue;
    if (last < at) spans.push_back({last, at, false});
    spans.push_back({at, i, true});
    last = i;
  }
  if (last < s.size()) spans.push_back({last, s.size(), false});
  return spans;
}

// tokenizers' NormalizedString::split: the spans kept, after merging by behaviour.
std::vector<Span> apply_behavior(std::vector<Span> spans, SplitBehavior behavior) {
  std::vector<Span> out;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::isolated:
      return spans;
    case SplitBehavior::removed:
      for (const Span& s : spans)
        if (!s.match) out.push_back(s);
      return out;
    case SplitBehavior::contiguous:
      for (const Span& s : spans) {
        if (s.match == previous_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        previous_match = s.match;
      }
      return out;
    case SplitBehavior::merged_with_previous:
      for (const Span& s : spans) {
        if (s.match && !previous_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        previous_match = s.match;
      }
      return out;
    case SplitBehavior::merged_with_next:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !out.empty())
          out.back().start = it->start;
        else
          out.push_back(*it);
        previous_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      return out;
  }
  return out;
}

void split_pieces(std::vector<std::string>& pieces,
                  const std::function<std::vector<Span>(std::string_view)>& find,
                  SplitBehavior behavior, bool invert) {
  std::vector<std::string> out;
  out.reserve(pieces.size() * 2);
  for (const std::string& piece : pieces) {
    std::vector<Span> spans = find(piece);
    if (invert)
      for (Span& s : spans) s.match = !s.match;
    for (const Span& s : apply_behavior(std::move(spans), behavior))
      if (s.end > s.start) out.emplace_back(piece.substr(s.start, s.end - s.start));
  }
  pieces = std::move(out);
}

void pre_tokenize(const std::vector<PreTokenizer>& steps, std::vector<std::string>& pieces) {
  for (const PreTokenizer& step : steps) {
    switch (step.kind) {
      case PreTokenizer::Kind::split:
        split_pieces(pieces, [&](std::string_view s) { return regex_spans(*step.regex, s); },
                     step.behavior, step.invert);
        break;
      case PreTokenizer::Kind::digits:
        split_pieces(pieces, digit_spans,
                     step.individual_digits ? SplitBehavior::isolated : SplitBehavior::contiguous,
                     false);
        break;
      case PreTokenizer::Kind::byte_level:
        if (step.add_prefix_space)
          for (std::string& p : pieces)
            if (p.empty() || p[0] != ' ') p.insert(0, " ");
        if (step.regex)
          split_pieces(pieces, [&](std::string_view s) { return regex_spans(*step.regex, s); },
                       SplitBehavior::isolated, false);
        for (std::string& p : pieces) p = to_byte_level(p);
        break;
    }
  }
}

// ---- BPE ---------------------------------------------------------------------------------------

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct Bpe {
  StringMap<int32_t> vocab;
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges;  // (a, b) -> (rank, merged id)
  bool ignore_merges = false;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;

  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const std::pair<uint32_t, int32_t>* find_merge(int32_t a, int32_t b) const {
    const auto it = merges.find(key(a, b));
    return it == merges.end() ? nullptr : &it->second;
  }

  // tokenizers' Word::merge_all: repeatedly merge the lowest-ranked adjacent pair, leftmost first,
  // with a heap and lazy invalidation so that long words stay O(n log n).
  void merge_word(std::string_view word, std::vector<int32_t>& out) const {
    struct Symbol {
      int32_t id;
      int prev, next;
      bool alive;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    bool pending_unk = false;  // characters missing from the vocabulary, possibly fused into one unk
    const auto push = [&](int32_t id) {
      const int n = static_cast<int>(symbols.size());
      symbols.push_back({id, n - 1, n + 1, true});
    };
    for (size_t i = 0; i < word.size();) {
      const size_t len = utf8_step(word, i).len;
      const auto it = vocab.find(word.substr(i, len));
      i += len;
      if (it != vocab.end()) {
        if (pending_unk) push(*unk_id);
        pending_unk = false;
        push(it->second);
      } else if (unk_id) {
        if (pending_unk && !fuse_unk) push(*unk_id);
        pending_unk = true;
      }
    }
    if (pending_unk) push(*unk_id);
    if (symbols.empty()) return;
    symbols.back().next = -1;

    struct Merge {
      uint32_t rank;
      int pos;
      int32_t new_id;
      bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Merge, std::vector<Merge>, std::greater<>> queue;
    for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i)
      if (const auto* m = find_merge(symbols[i].id, symbols[i + 1].id)) queue.push({m->first, i, m->second});

    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (!left.alive || left.next == -1) continue;
      Symbol& right = symbols[left.next];
      const auto* current = find_merge(left.id, right.id);
      if (!current || current->second != top.new_id) continue;  // a stale entry

      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (right.next != -1) symbols[right.next].prev = top.pos;
      if (left.prev != -1)
        if (const auto* m = find_merge(symbols[left.prev].id, left.id))
          queue.push({m->first, left.prev, m->second});
      if (left.next != -1)
        if (const auto* m = find_merge(left.id, symbols[left.next].id))
          queue.push({m->first, top.pos, m->second});
    }
    for (const Symbol& s : symbols)
      if (s.alive) out.push_back(s.id);
  }
};

// ---- added tokens ------------------------------------------------------------------------------

struct AddedToken {
  int32_t id = 0;
  std::string content;
  std::string match_text;  // what is searched for: content, or its NFC form when normalized
  bool special = false, lstrip = false, rstrip = false, normalized = false, single_word = false;
};

// Leftmost-longest search over a byte trie, like the daachorse automaton tokenizers uses.
class TokenTrie {
 public:
  void add(std::string_view pattern, int32_t value) {
    if (pattern.empty()) return;
    int node = 0;
    for (unsigned char b : pattern) {
      auto& edges = nodes_[node].edges;
      const auto it = std::find_if(edges.begin(), edges.end(), [&](auto& e) { return e.first == b; });
      if (it != edges.end()) {
        node = it->second;
      } else {
        edges.emplace_back(b, static_cast<int>(nodes_.size()));
        node = static_cast<int>(nodes_.size());
        nodes_.emplace_back();
      }
    }
    nodes_[node].value = value;
    first_[static_cast<unsigned char>(pattern[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }

  struct Match {
    size_t start, end;
    int32_t value;
  };
  std::optional<Match> find(std::string_view s, size_t from) const {
    for (size_t start = from; start < s.size(); ++start) {
      if (!first_[static_cast<unsigned char>(s[start])]) continue;
      std::optional<Match> best;
      int node = 0;
      for (size_t i = start; i < s.size(); ++i) {
        const auto& edges = nodes_[node].edges;
        const unsigned char b = s[i];
        const auto it = std::find_if(edges.begin(), edges.end(), [&](auto& e) { return e.first == b; });
        if (it == edges.end()) break;
        node = it->second;
        if (nodes_[node].value >= 0) best = Match{start, i + 1, nodes_[node].value};
      }
      if (best) return best;
    }
    return std::nullopt;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int>> edges;
    int32_t value = -1;
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_{};
};

// Where the run of whitespace that ends `s` begins, and where the one that starts it ends.
size_t trailing_white_space_start(std::string_view s) {
  size_t start = s.size();
  while (start > 0 && is_white_space(last_code_point(s.substr(0, start)))) {
    --start;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  }
  return start;
}
size_t leading_white_space_end(std::string_view s) {
  size_t end = 0;
  for (size_t i = 0; i < s.size() && is_white_space(next_code_point(s, i));) end = i;
  return end;
}

// A stretch of text, or an added token already recognised in it.
struct Piece {
  std::string text;
  int32_t id = -1;
};

}  // namespace

// ---- the tokenizer -----------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string origin;  // the file it came from, for messages
  Bpe bpe;
  std::vector<std::string> vocab_tokens;  // by id; "" where the model has none
  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  StringMap<int32_t> added_by_content;
  TokenTrie raw_trie, normalized_trie;  // values index `added`
  bool nfc = false;
  std::vector<PreTokenizer> pre_tokenizers;
  bool byte_level_decoder = false;
  int32_t size = 0;
  std::optional<int32_t> bos, eos, pad;
  std::optional<std::string> chat_template;

  static constexpr size_t kCacheCapacity = 10000;  // as tokenizers' BPE cache
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::mutex cache_mutex;
  mutable StringMap<std::vector<int32_t>> cache;

  void finish();
  void split_added(std::string_view text, const TokenTrie& trie, std::vector<Piece>& out) const;
  void tokenize_word(const std::string& word, std::vector<int32_t>& out) const;
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  const AddedToken* added_token(int32_t id) const {
    const auto it = added_by_id.find(id);
    return it == added_by_id.end() ? nullptr : &added[it->second];
  }
};

namespace {

std::string normalize(const Tokenizer::Impl& impl, std::string_view s) {
  return impl.nfc ? nfc(s) : std::string(s);
}

}  // namespace

// Indexes what the loaders filled in: ids, the tries, the vocabulary size.
void Tokenizer::Impl::finish() {
  int32_t max_id = -1;
  for (const auto& [token, id] : bpe.vocab) max_id = std::max(max_id, id);
  for (const AddedToken& t : added) max_id = std::max(max_id, t.id);
  constexpr int32_t kMaxId = 1 << 24;  // far above real vocabularies; keeps the id table allocatable
  if (max_id >= kMaxId)
    throw Error(origin + ": token id " + std::to_string(max_id) + " is implausibly large (ids must be below " +
                std::to_string(kMaxId) + ")");
  size = max_id + 1;
  vocab_tokens.assign(static_cast<size_t>(size), std::string());
  for (const auto& [token, id] : bpe.vocab) vocab_tokens[id] = token;
  for (size_t i = 0; i < added.size(); ++i) {
    AddedToken& t = added[i];
    t.match_text = t.normalized ? normalize(*this, t.content) : t.content;
    added_by_id[t.id] = i;
    added_by_content[t.content] = t.id;
    // Text is valid UTF-8, so a token that is not (GGUF strings are raw bytes) can only match
    // inside a character and split it; such a token stays decodable but is never matched.
    if (utf8_invalid_at(t.match_text) == std::string_view::npos)
      (t.normalized ? normalized_trie : raw_trie).add(t.match_text, static_cast<int32_t>(i));
  }
}

// tokenizers' AddedVocabulary::find_matches, with its single_word, lstrip and rstrip rules.
void Tokenizer::Impl::split_added(std::string_view s, const TokenTrie& trie,
                                  std::vector<Piece>& out) const {
  if (trie.empty()) {
    out.push_back({std::string(s)});
    return;
  }
  size_t start_offset = 0;
  for (size_t from = 0; auto m = trie.find(s, from);) {
    from = m->end;
    const AddedToken& token = added[m->value];
    size_t start = m->start, stop = m->end;
    if (token.single_word) {
      const bool word_before = start > 0 && is_word_char(last_code_point(s.substr(0, start)));
      size_t after = stop;
      const bool word_after = stop < s.size() && is_word_char(next_code_point(s, after));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) start = std::max(trailing_white_space_start(s.substr(0, start)), start_offset);
    if (token.rstrip) stop += leading_white_space_end(s.substr(stop));
    if (start_offset < start) out.push_back({std::string(s.substr(start_offset, start - start_offset))});
    out.push_back({std::string(s.substr(start, stop - start)), token.id});
    start_offset = stop;
  }
  if (start_offset < s.size()) out.push_back({std::string(s.substr(start_offset))});
}

void Tokenizer::Impl::tokenize_word(const std::string& word, std::vector<int32_t>& out) const {
  if (bpe.ignore_merges)
    if (const auto it = bpe.vocab.find(word); it != bpe.vocab.end()) {
      out.push_back(it->second);
      return;
    }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::lock_guard lock(cache_mutex);
    if (const auto it = cache.find(word); it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  bpe.merge_word(word, out);
  if (cacheable) {
    std::lock_guard lock(cache_mutex);
    if (cache.size() < kCacheCapacity) cache.emplace(word, std::vector<int32_t>(out.begin() + first, out.end()));
  }
}

// A stretch between added tokens: normalize, split out normalized added tokens, pre-tokenize, BPE.
void Tokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<Piece> pieces;
  split_added(normalize(*this, text), normalized_trie, pieces);
  for (Piece& piece : pieces) {
    if (piece.id >= 0) {
      out.push_back(piece.id);
      continue;
    }
    std::vector<std::string> words;
    if (!piece.text.empty()) words.push_back(std::move(piece.text));
    pre_tokenize(pre_tokenizers, words);
    for (const std::string& word : words) tokenize_word(word, out);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  if (const size_t bad = utf8_invalid_at(text); bad != std::string_view::npos)
    throw Error("Tokenizer::encode: the text is not valid UTF-8 (byte " + std::to_string(bad) + ")");
  std::vector<int32_t> ids;
  std::vector<Piece> pieces;
  impl_->split_added(text, impl_->raw_trie, pieces);
  for (const Piece& piece : pieces) {
    if (piece.id >= 0)
      ids.push_back(piece.id);
    else
      impl_->encode_text(piece.text, ids);
  }
  return ids;
}

// Ids with no token are dropped, as tokenizers does (a model's padded vocabulary rows).
std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  bool first = true;
  for (const int32_t id : ids) {
    std::string_view token;
    if (const AddedToken* t = impl_->added_token(id)) {
      if (skip_special_tokens && t->special) continue;
      token = t->normalized ? t->match_text : t->content;
    } else if (id >= 0 && id < impl_->size && !impl_->vocab_tokens[id].empty()) {
      token = impl_->vocab_tokens[id];
    } else {
      continue;
    }
    if (impl_->byte_level_decoder) {
      append_byte_level_decoded(bytes, token);
    } else {
      if (!first) bytes += ' ';  // tokenizers joins with spaces when there is no decoder
      bytes.append(token);
    }
    first = false;
  }
  return utf8_lossy(bytes);
}

int32_t Tokenizer::vocab_size() const { return impl_->size; }

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  if (const auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
    return it->second;
  if (const auto it = impl_->bpe.vocab.find(token); it != impl_->bpe.vocab.end()) return it->second;
  return std::nullopt;
}

const std::string& Tokenizer::token(int32_t id) const {
  if (const AddedToken* t = impl_->added_token(id)) return t->content;
  if (id < 0 || id >= impl_->size || impl_->vocab_tokens[id].empty())
    throw Error(impl_->origin + ": token id " + std::to_string(id) + " is not in the vocabulary (size " +
                std::to_string(impl_->size) + ")");
  return impl_->vocab_tokens[id];
}

bool Tokenizer::is_special(int32_t id) const {
  const AddedToken* t = impl_->added_token(id);
  return t && t->special;
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::pad_id() const { return impl_->pad; }
const std::optional<std::string>& Tokenizer::chat_template() const { return impl_->chat_template; }

// ---- tokenizer.json ----------------------------------------------------------------------------

namespace {

// Reads fields of a JSON document and names the file and the field path in every error.
struct JsonFields {
  const std::string& origin;

  [[noreturn]] void fail(const std::string& what) const { throw Error(origin + ": " + what); }

  const json& need(const json& obj, const std::string& path, const char* key) const {
    if (!obj.is_object()) fail((path.empty() ? "the top level" : path) + " must be an object");
    const auto it = obj.find(key);
    if (it == obj.end()) fail(join(path, key) + " is missing");
    return *it;
  }
  const json* find(const json& obj, const char* key) const {
    const auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  bool flag(const json& obj, const std::string& path, const char* key, std::optional<bool> fallback) const {
    const json* v = find(obj, key);
    if (!v) {
      if (fallback) return *fallback;
      fail(join(path, key) + " is missing");
    }
    if (!v->is_boolean()) fail(join(path, key) + " must be true or false");
    return v->get<bool>();
  }
  std::string string(const json& obj, const std::string& path, const char* key) const {
    const json& v = need(obj, path, key);
    if (!v.is_string()) fail(join(path, key) + " must be a string");
    return v.get<std::string>();
  }
  static std::string join(const std::string& path, const char* key) {
    return path.empty() ? key : path + "." + key;
  }
};

SplitBehavior parse_behavior(const JsonFields& f, const json& obj, const std::string& path) {
  const std::string name = f.string(obj, path, "behavior");
  if (name == "Removed") return SplitBehavior::removed;
  if (name == "Isolated") return SplitBehavior::isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (name == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (name == "Contiguous") return SplitBehavior::contiguous;
  f.fail(path + ".behavior '" + name +
         "' is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

void parse_pre_tokenizer(const JsonFields& f, const json& obj, const std::string& path,
                         std::vector<PreTokenizer>& out) {
  const std::string type = f.string(obj, path, "type");
  PreTokenizer p;
  if (type == "Sequence") {
    const json& list = f.need(obj, path, "pretokenizers");
    if (!list.is_array()) f.fail(path + ".pretokenizers must be a list");
    for (size_t i = 0; i < list.size(); ++i)
      parse_pre_tokenizer(f, list[i], path + ".pretokenizers[" + std::to_string(i) + "]", out);
    return;
  } else if (type == "Split") {
    const json& pattern = f.need(obj, path, "pattern");
    const bool literal = pattern.is_object() && pattern.contains("String");
    if (!pattern.is_object() || (!literal && !pattern.contains("Regex")))
      f.fail(path + ".pattern must be {\"Regex\": ...} or {\"String\": ...}");
    const std::string text = f.string(pattern, path + ".pattern", literal ? "String" : "Regex");
    p.kind = PreTokenizer::Kind::split;
    p.regex = std::make_shared<const Regex>(text, literal, f.origin + ": " + path + ".pattern");
    p.behavior = parse_behavior(f, obj, path);
    p.invert = f.flag(obj, path, "invert", false);
  } else if (type == "ByteLevel") {
    p.kind = PreTokenizer::Kind::byte_level;
    p.add_prefix_space = f.flag(obj, path, "add_prefix_space", std::nullopt);
    if (f.flag(obj, path, "use_regex", true)) p.regex = gpt2_regex();
  } else if (type == "Digits") {
    p.kind = PreTokenizer::Kind::digits;
    p.individual_digits = f.flag(obj, path, "individual_digits", std::nullopt);
  } else {
    f.fail(path + " type '" + type + "' is not supported (supported: Sequence, Split, ByteLevel, Digits)");
  }
  out.push_back(std::move(p));
}

bool parse_normalizer(const JsonFields& f, const json& obj, const std::string& path) {
  const std::string type = f.string(obj, path, "type");
  if (type == "NFC") return true;
  if (type == "Sequence") {
    const json& list = f.need(obj, path, "normalizers");
    if (!list.is_array()) f.fail(path + ".normalizers must be a list");
    bool any = false;
    for (size_t i = 0; i < list.size(); ++i)
      any = parse_normalizer(f, list[i], path + ".normalizers[" + std::to_string(i) + "]") || any;
    return any;
  }
  f.fail(path + " type '" + type + "' is not supported (supported: NFC, or a Sequence of NFC)");
}

std::pair<std::string, std::string> parse_merge(const JsonFields& f, const json& m, size_t i) {
  if (m.is_string()) {
    const std::string s = m.get<std::string>();
    const size_t space = s.find(' ');
    if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
      f.fail("model.merges[" + std::to_string(i) + "] '" + s + "' is not two tokens separated by one space");
    return {s.substr(0, space), s.substr(space + 1)};
  }
  if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
    return {m[0].get<std::string>(), m[1].get<std::string>()};
  f.fail("model.merges[" + std::to_string(i) + "] must be \"a b\" or [\"a\", \"b\"]");
}

// Merges by rank; each side and the result must be in the vocabulary, as tokenizers requires.
void add_merges(Bpe& bpe, const std::vector<std::pair<std::string, std::string>>& merges,
                const std::string& origin, const std::string& field) {
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const auto ia = bpe.vocab.find(a), ib = bpe.vocab.find(b), iab = bpe.vocab.find(a + b);
    const std::string* missing = ia == bpe.vocab.end() ? &a : ib == bpe.vocab.end() ? &b : nullptr;
    if (missing || iab == bpe.vocab.end())
      throw Error(origin + ": " + field + "[" + std::to_string(rank) + "] '" + a + " " + b + "': token '" +
                  (missing ? *missing : a + b) + "' is not in the vocabulary");
    bpe.merges[Bpe::key(ia->second, ib->second)] = {static_cast<uint32_t>(rank), iab->second};
  }
}

void parse_model(const JsonFields& f, const json& model, Bpe& bpe) {
  if (!model.is_object()) f.fail("model must be an object");
  if (const json* type = f.find(model, "type"); type && *type != "BPE")
    f.fail(type->is_string() ? "model type '" + type->get<std::string>() + "' is not supported (only BPE)"
                             : std::string("model.type must be a string, got ") + type->type_name());
  const json& vocab = f.need(model, "model", "vocab");
  if (!vocab.is_object()) f.fail("model.vocab must be an object of token: id");
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      f.fail("model.vocab['" + token + "'] must be a non-negative integer id");
    bpe.vocab[token] = id.get<int32_t>();
  }
  const json& merges = f.need(model, "model", "merges");
  if (!merges.is_array()) f.fail("model.merges must be a list");
  std::vector<std::pair<std::string, std::string>> pairs;
  pairs.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    if (merges[i].is_string() && merges[i].get_ref<const std::string&>().starts_with("#version")) continue;
    pairs.push_back(parse_merge(f, merges[i], i));
  }
  add_merges(bpe, pairs, f.origin, "model.merges");

  bpe.ignore_merges = f.flag(model, "model", "ignore_merges", false);
  bpe.fuse_unk = f.flag(model, "model", "fuse_unk", false);
  if (f.flag(model, "model", "byte_fallback", false)) f.fail("model.byte_fallback is not supported");
  if (const json* d = f.find(model, "dropout"); d && d->is_number() && d->get<double>() != 0.0)
    f.fail("model.dropout is not supported (BPE dropout is for training)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = f.find(model, key); v && !(v->is_string() && v->get<std::string>().empty()))
      f.fail(std::string("model.") + key + " is not supported");
  if (const json* unk = f.find(model, "unk_token")) {
    if (!unk->is_string()) f.fail("model.unk_token must be a string");
    const auto it = bpe.vocab.find(unk->get<std::string>());
    if (it == bpe.vocab.end()) f.fail("model.unk_token '" + unk->get<std::string>() + "' is not in the vocabulary");
    bpe.unk_id = it->second;
  }
}

void parse_added_tokens(const JsonFields& f, const json& list, std::vector<AddedToken>& out) {
  if (!list.is_array()) f.fail("added_tokens must be a list");
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    const json& t = list[i];
    AddedToken token;
    const json& id = f.need(t, path, "id");
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      f.fail(path + ".id must be a non-negative integer");
    token.id = id.get<int32_t>();
    token.content = f.string(t, path, "content");
    token.special = f.flag(t, path, "special", false);
    token.single_word = f.flag(t, path, "single_word", false);
    token.lstrip = f.flag(t, path, "lstrip", false);
    token.rstrip = f.flag(t, path, "rstrip", false);
    token.normalized = f.flag(t, path, "normalized", !token.special);
    if (token.content.empty()) continue;  // tokenizers ignores empty added tokens
    out.push_back(std::move(token));
  }
}

std::shared_ptr<Tokenizer::Impl> parse_tokenizer_json(const json& doc, const std::string& origin) {
  const JsonFields f{origin};
  auto impl = std::make_shared<Tokenizer::Impl>();
  impl->origin = origin;
  parse_model(f, f.need(doc, "", "model"), impl->bpe);
  if (const json* added = f.find(doc, "added_tokens")) parse_added_tokens(f, *added, impl->added);
  if (const json* n = f.find(doc, "normalizer")) impl->nfc = parse_normalizer(f, *n, "normalizer");
  if (const json* p = f.find(doc, "pre_tokenizer"))
    parse_pre_tokenizer(f, *p, "pre_tokenizer", impl->pre_tokenizers);
  if (const json* d = f.find(doc, "decoder")) {
    const std::string type = f.string(*d, "decoder", "type");
    if (type != "ByteLevel") f.fail("decoder type '" + type + "' is not supported (supported: ByteLevel)");
    impl->byte_level_decoder = true;
  }
  impl->finish();
  return impl;
}

json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path.string() + ": cannot open (" + std::strerror(errno) + ")");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(path.string() + ": invalid JSON: " + e.what());
  }
}

// A special token in tokenizer_config.json: "<s>", {"content": "<s>", ...} or null.
std::optional<int32_t> config_token(const JsonFields& f, const json& config, const char* key,
                                    const Tokenizer& tokenizer) {
  const json* v = f.find(config, key);
  if (!v) return std::nullopt;
  const json* content = v->is_object() ? f.find(*v, "content") : v;
  if (!content || !content->is_string()) f.fail(std::string(key) + " must be a string or {\"content\": string}");
  const auto id = tokenizer.token_id(content->get<std::string>());
  if (!id) f.fail(std::string(key) + " '" + content->get<std::string>() + "' is not in the vocabulary");
  return id;
}

// The chat template: a string, or (older multi-template configs) a list of {name, template}.
std::optional<std::string> config_chat_template(const JsonFields& f, const json& config) {
  const json* v = f.find(config, "chat_template");
  if (!v) return std::nullopt;
  if (v->is_string()) return v->get<std::string>();
  if (v->is_array())
    for (const json& entry : *v)
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string())
        return entry["template"].get<std::string>();
  f.fail("chat_template must be a string or a list holding a {\"name\": \"default\", \"template\": ...}");
}

// ---- GGUF --------------------------------------------------------------------------------------

// llama.cpp's `tokenizer.ggml.pre` names, as the tokenizer.json pieces they stand for.
void gguf_pre_tokenizer(const std::string& pre, const std::string& origin, Tokenizer::Impl& impl) {
  PreTokenizer byte_level;
  byte_level.kind = PreTokenizer::Kind::byte_level;
  const auto split = [&](const char* pattern) {
    PreTokenizer p;
    p.regex = std::make_shared<const Regex>(pattern, false, origin + ": tokenizer.ggml.pre");
    return p;
  };
  if (pre == "smollm") {  // llama.cpp: `\p{N}`, then the GPT-2 regex
    PreTokenizer digits;
    digits.kind = PreTokenizer::Kind::digits;
    digits.individual_digits = true;
    byte_level.regex = gpt2_regex();
    impl.pre_tokenizers = {digits, byte_level};
  } else if (pre == "gpt-2") {
    byte_level.regex = gpt2_regex();
    impl.pre_tokenizers = {byte_level};
  } else if (pre == "qwen2") {
    impl.nfc = true;  // as Qwen2's tokenizer.json; llama.cpp itself does not normalize
    impl.pre_tokenizers = {split(kQwen2Pattern), byte_level};
  } else if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") {
    impl.pre_tokenizers = {split(kLlama3Pattern), byte_level};
  } else {
    throw Error(origin + ": tokenizer.ggml.pre '" + pre +
                "' is not supported (supported: smollm, qwen2, llama-bpe, gpt-2)");
  }
}

std::optional<int32_t> gguf_token_id(const gguf::File& file, const char* key, int32_t size) {
  if (!file.has(key)) return std::nullopt;
  const uint64_t id = file.get_uint(key);
  if (id >= static_cast<uint64_t>(size))
    throw Error(file.path().string() + ": " + key + " = " + std::to_string(id) +
                " is outside the vocabulary (size " + std::to_string(size) + ")");
  return static_cast<int32_t>(id);
}

}  // namespace

Tokenizer Tokenizer::from_json_file(const fs::path& tokenizer_json) {
  return Tokenizer(parse_tokenizer_json(read_json(tokenizer_json), tokenizer_json.string()));
}

Tokenizer Tokenizer::from_gguf(const gguf::File& file) {
  const std::string origin = file.path().string();
  const std::string model = file.get_string("tokenizer.ggml.model");
  if (model != "gpt2")
    throw Error(origin + ": tokenizer.ggml.model '" + model + "' is not supported (only gpt2, byte-level BPE)");
  if (!file.has("tokenizer.ggml.pre"))
    throw Error(origin + ": tokenizer.ggml.pre is missing (supported: smollm, qwen2, llama-bpe, gpt-2)");

  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  gguf_pre_tokenizer(file.get_string("tokenizer.ggml.pre"), origin, *impl);
  impl->byte_level_decoder = true;

  const std::vector<std::string> tokens = file.get_string_array("tokenizer.ggml.tokens");
  std::vector<int64_t> types(tokens.size(), 1);
  if (file.has("tokenizer.ggml.token_type")) types = file.get_int_array("tokenizer.ggml.token_type");
  if (types.size() != tokens.size())
    throw Error(origin + ": tokenizer.ggml.token_type has " + std::to_string(types.size()) +
                " entries for " + std::to_string(tokens.size()) + " tokens");
  for (size_t id = 0; id < tokens.size(); ++id) {
    impl->bpe.vocab[tokens[id]] = static_cast<int32_t>(id);
    // llama.cpp token types: 3 = control (special), 4 = user defined; both are matched whole in text.
    if (types[id] == 3 || types[id] == 4)
      impl->added.push_back(
          {.id = static_cast<int32_t>(id), .content = tokens[id], .match_text = {}, .special = types[id] == 3});
  }
  std::vector<std::pair<std::string, std::string>> merges;
  for (const std::string& m : file.get_string_array("tokenizer.ggml.merges")) {
    const size_t space = m.find(' ');
    if (space == std::string::npos)
      throw Error(origin + ": tokenizer.ggml.merges entry '" + m + "' has no space");
    merges.emplace_back(m.substr(0, space), m.substr(space + 1));
  }
  add_merges(impl->bpe, merges, origin, "tokenizer.ggml.merges");
  impl->finish();

  impl->bos = gguf_token_id(file, "tokenizer.ggml.bos_token_id", impl->size);
  impl->eos = gguf_token_id(file, "tokenizer.ggml.eos_token_id", impl->size);
  impl->pad = gguf_token_id(file, "tokenizer.ggml.padding_token_id", impl->size);
  if (file.has("tokenizer.chat_template")) impl->chat_template = file.get_string("tokenizer.chat_template");
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(path.string() + ": no such file or directory");
  if (path.extension() == ".gguf") return from_gguf(*gguf::File::open(path));
  if (!fs::is_directory(path, ec)) return from_json_file(path);

  const fs::path json_path = path / "tokenizer.json";
  if (!fs::exists(json_path, ec))
    throw Error(path.string() + ": has no tokenizer.json (troupe reads Hugging Face fast tokenizers only)");
  auto impl = parse_tokenizer_json(read_json(json_path), json_path.string());
  const Tokenizer plain(impl);  // for token lookups while the config is read

  const fs::path config_path = path / "tokenizer_config.json";
  if (fs::exists(config_path, ec)) {
    const json config = read_json(config_path);
    const std::string origin = config_path.string();
    const JsonFields f{origin};
    if (!config.is_object()) f.fail("the top level must be an object");
    impl->bos = config_token(f, config, "bos_token", plain);
    impl->eos = config_token(f, config, "eos_token", plain);
    impl->pad = config_token(f, config, "pad_token", plain);
    impl->chat_template = config_chat_template(f, config);
  }
  // Newer transformers save the template beside the config instead of inside it.
  if (const fs::path jinja = path / "chat_template.jinja"; !impl->chat_template && fs::exists(jinja, ec)) {
    std::ifstream in(jinja, std::ios::binary);
    impl->chat_template = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return Tokenizer(std::move(impl));
}

}  // namespace troupe
