// Reads SFT records and renders and tokenizes them turn by turn with an assistant-only loss
// mask. Packing and tensors are sft.cpp's; the loss is in trainer.cpp.
#include "trainer/sft_data.hpp"

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "policy/error.hpp"

namespace troupe::sft {
namespace {

std::string_view end_of_turn(const ChatTemplate& chat) {
  return chat.family() == ChatTemplate::Family::chatml ? "<|im_end|>" : "<|eot_id|>";
}

void append(Sequence& s, const std::vector<int32_t>& ids, uint8_t trained) {
  s.ids.insert(s.ids.end(), ids.begin(), ids.end());
  s.loss_mask.insert(s.loss_mask.end(), ids.size(), trained);
}

std::string string_field(const nlohmann::json& j, const std::string& field, const std::string& where,
                         const char* hint) {
  auto it = j.find(field);
  if (it == j.end()) throw Error(where + ": no field '" + field + "'" + hint);
  if (!it->is_string()) throw Error(where + ": field '" + field + "' is " + it->type_name() + ", expected a string");
  return it->get<std::string>();
}

std::vector<ChatMessage> read_messages(const nlohmann::json& j, const std::string& field, const std::string& where) {
  auto it = j.find(field);
  if (it == j.end())
    throw Error(where + ": no field '" + field +
                "' (chat records need a list of messages; for prompt/response records set prompt_field and "
                "response_field)");
  if (!it->is_array()) throw Error(where + ": field '" + field + "' is " + it->type_name() + ", expected a list of messages");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& m = (*it)[i];
    const std::string at = where + ": message " + std::to_string(i);
    if (!m.is_object()) throw Error(at + " is " + m.type_name() + ", expected an object with role and content");
    ChatMessage message{string_field(m, "role", at, ""), string_field(m, "content", at, "")};
    if (message.role != "system" && message.role != "user" && message.role != "assistant")
      throw Error(at + " has role '" + message.role + "' (supported: system, user, assistant)");
    messages.push_back(std::move(message));
  }
  if (messages.empty()) throw Error(where + ": field '" + field + "' has no messages");
  return messages;
}

// Applies max_length; false when the example is to be left out.
bool fit(Sequence& s, const DataOptions& o, const std::string& where, ReadReport& report) {
  if (o.max_length <= 0 || s.size() <= o.max_length) return true;
  switch (o.overlong) {
    case Overlong::error:
      throw Error(where + ": the example is " + std::to_string(s.size()) + " tokens, above max_length " +
                  std::to_string(o.max_length) + " (raise max_length, or set overlong to truncate or drop)");
    case Overlong::drop:
      ++report.dropped;
      return false;
    case Overlong::truncate:
      s.ids.resize(o.max_length);
      s.loss_mask.resize(o.max_length);
      if (s.trained_tokens() == 0) {
        ++report.dropped;
        return false;
      }
      ++report.truncated;
      return true;
  }
  return true;
}

}  // namespace

int64_t Sequence::trained_tokens() const { return std::count(loss_mask.begin(), loss_mask.end(), uint8_t{1}); }

Sequence encode_chat(std::span<const ChatMessage> messages, const ChatTemplate& chat, const Tokenizer& tokenizer) {
  const std::string full = chat.render(messages, /*add_generation_prompt=*/false);
  const std::string_view marker = end_of_turn(chat);
  Sequence s;
  size_t cursor = 0;  // `full` up to here is tokenized
  bool any = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role != "assistant") continue;
    const std::string head = chat.render(messages.first(i), /*add_generation_prompt=*/true);
    if (!full.starts_with(head) || head.size() < cursor)
      throw Error("chat template: the prompt before message " + std::to_string(i) +
                  " (assistant) does not render as a prefix of the whole conversation, so its tokens cannot be "
                  "told apart (the template rewrites earlier turns; train on one assistant turn per record)");
    const size_t end = full.find(marker, head.size());
    if (end == std::string::npos)
      throw Error("chat template: no end-of-turn " + std::string(marker) + " after message " + std::to_string(i));
    append(s, tokenizer.encode(std::string_view(full).substr(cursor, head.size() - cursor)), 0);
    append(s, tokenizer.encode(std::string_view(full).substr(head.size(), end + marker.size() - head.size())), 1);
    cursor = end + marker.size();
    any = true;
  }
  if (!any) throw Error("chat: the conversation has no assistant message to train on");
  if (cursor < full.size()) append(s, tokenizer.encode(std::string_view(full).substr(cursor)), 0);
  return s;
}

Sequence encode_plain(const std::string& prompt, const std::string& response, const Tokenizer& tokenizer,
                      std::optional<int32_t> eos) {
  Sequence s;
  append(s, tokenizer.encode(prompt), 0);
  append(s, tokenizer.encode(response), 1);
  if (eos) append(s, {*eos}, 1);
  return s;
}

int64_t for_each_jsonl_object(const std::filesystem::path& path, int64_t limit, const std::string& what,
                              const std::function<void(const nlohmann::json&, int64_t, const std::string&)>& record) {
  const std::string file = path.string();
  std::ifstream in(path);
  if (!in) throw Error(file + ": cannot open the " + what + " file");
  std::string line;
  int64_t records = 0;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (limit > 0 && records >= limit) break;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++records;
    const std::string where = file + ":" + std::to_string(line_no);
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) throw Error(where + ": not valid JSON");
    if (!j.is_object()) throw Error(where + ": expected a JSON object, got " + std::string(j.type_name()));
    record(j, line_no, where);
  }
  if (in.bad()) throw Error(file + ": read error");
  return records;
}

ChatTemplate chat_template_for(const Tokenizer& tokenizer, const std::optional<ChatTemplate>& configured,
                               const std::string& file) {
  if (configured) return *configured;
  if (!tokenizer.chat_template())
    throw Error(file + ": chat rendering was asked for but the tokenizer has no chat template (turn chat off)");
  return ChatTemplate::detect(*tokenizer.chat_template(), "the tokenizer's chat template");
}

std::vector<Sequence> read_jsonl(const std::filesystem::path& path, const Tokenizer& tokenizer,
                                 const DataOptions& o, ReadReport* report_out) {
  const std::string file = path.string();
  const bool pairs = !o.prompt_field.empty() || !o.response_field.empty();
  if (pairs && (o.prompt_field.empty() || o.response_field.empty()))
    throw Error(file + ": set both prompt_field and response_field for instruction records, or neither for chat records");
  std::optional<ChatTemplate> chat;
  if (o.chat) {
    chat = chat_template_for(tokenizer, o.chat_template, file);
  } else if (!pairs) {
    throw Error(file + ": chat records (field '" + o.messages_field + "') need the chat template (turn chat on)");
  }
  std::optional<int32_t> eos;
  if (!o.chat && o.append_eos) {
    eos = o.eos_id ? o.eos_id : tokenizer.eos_id();
    if (!eos) throw Error(file + ": append_eos is set but the tokenizer has no eos token (turn append_eos off)");
  }

  ReadReport report;
  std::vector<Sequence> out;
  const int64_t records = for_each_jsonl_object(path, o.limit, "SFT data", [&](const nlohmann::json& j, int64_t line_no,
                                                                               const std::string& where) {
    Sequence s;
    try {
      if (pairs) {
        const char* hint = " (set prompt_field / response_field to the dataset's names)";
        std::string prompt = string_field(j, o.prompt_field, where, hint);
        std::string response = string_field(j, o.response_field, where, hint);
        if (chat) {
          std::vector<ChatMessage> messages;
          if (!o.system.empty()) messages.push_back({"system", o.system});
          messages.push_back({"user", std::move(prompt)});
          messages.push_back({"assistant", std::move(response)});
          s = encode_chat(messages, *chat, tokenizer);
        } else {
          s = encode_plain(prompt, response, tokenizer, eos);
        }
      } else {
        s = encode_chat(read_messages(j, o.messages_field, where), *chat, tokenizer);
      }
    } catch (const Error& e) {
      const std::string what = e.what();
      if (what.starts_with(where)) throw;
      throw Error(where + ": " + what);
    }
    s.line = line_no;
    if (s.trained_tokens() == 0) throw Error(where + ": the response is empty (no tokens to train on)");
    if (fit(s, o, where, report)) out.push_back(std::move(s));
  });
  if (out.empty())
    throw Error(file + (records == 0 ? ": no examples (the file is empty or has only blank lines)"
                                     : ": no examples left after max_length (raise max_length)"));
  if (report_out) *report_out = report;
  return out;
}

}  // namespace troupe::sft
