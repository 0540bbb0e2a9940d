// Chat templates for the ChatML family (Qwen, SmolLM2) and Llama-3, rendered in C++ (no
// Jinja at run time): the Jinja source is only inspected to recognise which family it is.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace troupe {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  enum class Family { chatml, llama3 };

  // Recognises the family of a Jinja chat template (and its quirks, such as SmolLM2's
  // default system prompt or Qwen3's empty think block). `origin` names where the template
  // came from (a file or "<model.gguf>:tokenizer.chat_template") for the error thrown when
  // the template is not one troupe supports.
  static ChatTemplate detect(std::string_view jinja_source, std::string_view origin);
  static ChatTemplate chatml();
  static ChatTemplate llama3();

  Family family() const { return family_; }
  // The prompt text for these turns; with add_generation_prompt, it ends with the header
  // of the assistant turn the model should write. Throws Error for an unknown role.
  std::string render(std::span<const ChatMessage> messages, bool add_generation_prompt) const;

 private:
  std::string render_chatml(std::span<const ChatMessage> messages, bool add_generation_prompt) const;
  std::string render_llama3(std::span<const ChatMessage> messages, bool add_generation_prompt) const;

  Family family_ = Family::chatml;
  std::string default_system_;  // chatml: inserted when the first message is not a system message
  bool qwen3_think_ = false;    // chatml: Qwen3's <think> block in assistant turns after the last query
  bool llama3_bos_ = true;      // llama3 templates open with <|begin_of_text|>
  // Llama-3.1 and later always open with a system turn carrying these dates.
  bool llama3_dated_system_ = false;
  std::string knowledge_date_;  // "December 2023"
  std::string today_date_;      // "26 Jul 2024", the template's fallback
  bool today_from_clock_ = false;  // the template asks strftime_now("%d %b %Y"), as transformers gives it
};

}  // namespace troupe
