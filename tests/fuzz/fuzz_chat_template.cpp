// ChatTemplate::detect on an arbitrary Jinja source, then render of arbitrary messages. Input: the
// template source, then NUL-separated messages, each a role letter (s, u, a; anything else is an
// unknown role) followed by the content. Errors must be troupe::Error.
#include <optional>
#include <vector>

#include "policy/chat_template.hpp"
#include "policy/error.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = troupe::fuzz::split_nul(data, size, 64);
  std::vector<troupe::ChatMessage> messages;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string_view p = parts[i];
    const char r = p.empty() ? 'u' : p[0];
    std::string role = r == 's' ? "system" : r == 'u' ? "user" : r == 'a' ? "assistant" : std::string(1, r);
    messages.push_back({std::move(role), std::string(p.empty() ? p : p.substr(1))});
  }
  std::optional<troupe::ChatTemplate> chat;
  try {
    chat = troupe::ChatTemplate::detect(parts[0], "fuzz.jinja");
  } catch (const troupe::Error&) {
    chat = troupe::ChatTemplate::chatml();
  }
  for (const auto& t : {*chat, troupe::ChatTemplate::llama3()}) {
    std::string plain, prompt;
    try {
      plain = t.render(messages, /*add_generation_prompt=*/false);
      prompt = t.render(messages, /*add_generation_prompt=*/true);
    } catch (const troupe::Error&) {
      continue;
    }
    // The generation prompt only appends the assistant header; the turns before it are the same.
    if (!prompt.starts_with(plain)) fail("render with add_generation_prompt does not extend the plain render");
  }
  return 0;
}
