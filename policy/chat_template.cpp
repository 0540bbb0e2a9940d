// Renders chat prompts for the ChatML family (Qwen2.5, Qwen3, SmolLM2) and Llama-3/3.1 exactly as
// transformers' apply_chat_template does for plain system/user/assistant turns. No Jinja, no tools.
#include "policy/chat_template.hpp"

#include <ctime>

#include "policy/error.hpp"

namespace troupe {
namespace {

constexpr std::string_view kSupported =
    "troupe renders the ChatML family (Qwen2.5, Qwen3, SmolLM2: <|im_start|>/<|im_end|>) and Llama-3/3.1 "
    "(<|start_header_id|>/<|eot_id|>)";

bool contains(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

// Python's str.isspace, which Jinja's `trim` filter (str.strip) uses.
bool py_is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The code point whose UTF-8 starts at s[i] (s is valid UTF-8 for all that matters here) and its length.
char32_t code_point_at(std::string_view s, size_t i, size_t& len) {
  const auto b = [&](size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[k])); };
  const char32_t c = b(i);
  len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  if (i + len > s.size()) {
    len = 1;
    return c;
  }
  if (len == 1) return c;
  if (len == 2) return ((c & 0x1F) << 6) | (b(i + 1) & 0x3F);
  if (len == 3) return ((c & 0x0F) << 12) | ((b(i + 1) & 0x3F) << 6) | (b(i + 2) & 0x3F);
  return ((c & 0x07) << 18) | ((b(i + 1) & 0x3F) << 12) | ((b(i + 2) & 0x3F) << 6) | (b(i + 3) & 0x3F);
}

// Jinja's `trim`: Unicode whitespace off both ends.
std::string_view py_strip(std::string_view s) {
  size_t start = 0, len = 0;
  while (start < s.size() && py_is_space(code_point_at(s, start, len))) start += len;
  size_t end = s.size();
  while (end > start) {
    size_t back = end - 1;
    while (back > start && (static_cast<unsigned char>(s[back]) & 0xC0) == 0x80) --back;
    if (!py_is_space(code_point_at(s, back, len))) break;
    end = back;
  }
  return s.substr(start, end - start);
}

// str.lstrip('\n') and str.rstrip('\n'), which Qwen3's template applies around think blocks.
std::string_view lstrip_newlines(std::string_view s) {
  const size_t start = s.find_first_not_of('\n');
  return start == std::string_view::npos ? std::string_view() : s.substr(start);
}
std::string_view rstrip_newlines(std::string_view s) {
  const size_t end = s.find_last_not_of('\n');
  return end == std::string_view::npos ? std::string_view() : s.substr(0, end + 1);
}

void check_roles(std::span<const ChatMessage> messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant")
      throw Error("chat template: message " + std::to_string(i) + " has role '" + role +
                  "' (supported: system, user, assistant)");
  }
}

// ---- reading facts out of the Jinja source -----------------------------------------------------

// Jinja string-literal escapes, for text lifted out of a literal.
std::string unescape_literal(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char e = s[++i];
    out += e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e;
  }
  return out;
}

// A system prompt the template writes itself: a literal '<|im_start|>system\n...<|im_end|>' with
// text inside the same string literal (SmolLM2's "You are a helpful AI assistant named SmolLM...",
// Qwen2.5's "You are Qwen..."). Qwen3's `'<|im_start|>system\n' + messages[0].content` is not one.
std::string chatml_default_system(std::string_view source) {
  constexpr std::string_view open = "<|im_start|>system";
  for (size_t at = source.find(open); at != std::string_view::npos; at = source.find(open, at + 1)) {
    size_t start = at + open.size();
    if (source.substr(start, 2) == "\\n")
      start += 2;
    else if (source.substr(start, 1) == "\n")
      start += 1;
    else
      continue;
    const size_t end = source.find("<|im_end|>", start);
    if (end == std::string_view::npos) continue;
    const std::string_view text = source.substr(start, end - start);
    if (text.empty() || text.find_first_of("'\"{}") != std::string_view::npos) continue;
    return unescape_literal(text);
  }
  return "";
}

// The text after `prefix` up to the end of its string literal or a newline escape.
std::string literal_after(std::string_view source, std::string_view prefix) {
  const size_t at = source.find(prefix);
  if (at == std::string_view::npos) return "";
  const size_t start = at + prefix.size();
  size_t end = start;
  while (end < source.size() && source[end] != '\\' && source[end] != '"' && source[end] != '\'' &&
         source[end] != '\n')
    ++end;
  return std::string(source.substr(start, end - start));
}

std::string today_like_strftime_now() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%d %b %Y", &local);
  return buffer;
}

}  // namespace

ChatTemplate ChatTemplate::chatml() { return ChatTemplate(); }

ChatTemplate ChatTemplate::llama3() {
  ChatTemplate t;
  t.family_ = Family::llama3;
  return t;
}

ChatTemplate ChatTemplate::detect(std::string_view source, std::string_view origin) {
  const bool chatml_markers = contains(source, "<|im_start|>") && contains(source, "<|im_end|>");
  const bool llama3_markers = contains(source, "<|start_header_id|>") && contains(source, "<|eot_id|>");
  if (chatml_markers == llama3_markers)
    throw Error(std::string(origin) + ": chat template not recognised; " + std::string(kSupported));

  if (chatml_markers) {
    ChatTemplate t = chatml();
    t.default_system_ = chatml_default_system(source);
    t.qwen3_think_ = contains(source, "</think>") && contains(source, "reasoning_content");
    return t;
  }
  ChatTemplate t = llama3();
  t.llama3_bos_ = contains(source, "bos_token");
  if (contains(source, "Cutting Knowledge Date: ")) {
    t.llama3_dated_system_ = true;
    t.knowledge_date_ = literal_after(source, "Cutting Knowledge Date: ");
    t.today_date_ = literal_after(source, "set date_string = \"");
    if (t.today_date_.empty()) t.today_date_ = literal_after(source, "set date_string = '");
    t.today_from_clock_ = contains(source, "strftime_now");
    if (t.knowledge_date_.empty() || (t.today_date_.empty() && !t.today_from_clock_))
      throw Error(std::string(origin) + ": a Llama-3.1 style template without a readable knowledge date or "
                  "default date_string; " + std::string(kSupported));
  }
  return t;
}

std::string ChatTemplate::render(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  check_roles(messages);
  return family_ == Family::chatml ? render_chatml(messages, add_generation_prompt)
                                   : render_llama3(messages, add_generation_prompt);
}

namespace {

std::string chatml_turn(std::string_view role, std::string_view content) {
  return "<|im_start|>" + std::string(role) + "\n" + std::string(content) + "<|im_end|>\n";
}

// Qwen3's template: the index of the last user turn that is a real query (not a wrapped tool
// response); assistant turns after it get a <think> block.
size_t last_query_index(std::span<const ChatMessage> messages) {
  for (size_t i = messages.size(); i-- > 0;) {
    const std::string& c = messages[i].content;
    const bool tool_response = c.starts_with("<tool_response>") && c.ends_with("</tool_response>");
    if (messages[i].role == "user" && !tool_response) return i;
  }
  return messages.size() - 1;
}

// Qwen3's assistant turn: reasoning split off at </think>, re-emitted in a <think> block after the
// last query (always for the final turn, so an empty one appears there).
std::string qwen3_assistant_turn(std::string_view content, bool after_last_query, bool last) {
  std::string_view answer = content;
  std::string_view reasoning;
  if (const size_t close = content.find("</think>"); close != std::string_view::npos) {
    answer = lstrip_newlines(content.substr(content.rfind("</think>") + 8));
    std::string_view before = rstrip_newlines(content.substr(0, close));
    if (const size_t open = before.rfind("<think>"); open != std::string_view::npos) before = before.substr(open + 7);
    reasoning = lstrip_newlines(before);
  }
  std::string out = "<|im_start|>assistant\n";
  if (after_last_query && (last || !reasoning.empty()))
    out += "<think>\n" + std::string(lstrip_newlines(rstrip_newlines(reasoning))) + "\n</think>\n\n" +
           std::string(lstrip_newlines(answer));
  else
    out += answer;
  return out + "<|im_end|>\n";
}

}  // namespace

std::string ChatTemplate::render_chatml(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  std::string out;
  if (!messages.empty() && messages[0].role != "system" && !default_system_.empty())
    out += chatml_turn("system", default_system_);
  const size_t last_query = messages.empty() ? 0 : last_query_index(messages);
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (qwen3_think_ && m.role == "assistant")
      out += qwen3_assistant_turn(m.content, i > last_query, i + 1 == messages.size());
    else
      out += chatml_turn(m.role, m.content);
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

std::string ChatTemplate::render_llama3(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  const auto turn = [](std::string_view role, std::string_view content) {
    return "<|start_header_id|>" + std::string(role) + "<|end_header_id|>\n\n" + std::string(py_strip(content)) +
           "<|eot_id|>";
  };
  std::string out;
  if (llama3_dated_system_) {
    // Llama-3.1: the first system message (trimmed) goes under a system header that always exists.
    if (llama3_bos_) out += "<|begin_of_text|>";
    std::string_view system;
    if (!messages.empty() && messages[0].role == "system") {
      system = messages[0].content;
      messages = messages.subspan(1);
    }
    const std::string today = today_from_clock_ ? today_like_strftime_now() : today_date_;
    out += "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: " + knowledge_date_ +
           "\nToday Date: " + today + "\n\n" + std::string(py_strip(system)) + "<|eot_id|>";
  }
  for (size_t i = 0; i < messages.size(); ++i)
    out += (i == 0 && llama3_bos_ && !llama3_dated_system_ ? "<|begin_of_text|>" : "") +
           turn(messages[i].role, messages[i].content);
  if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

}  // namespace troupe
