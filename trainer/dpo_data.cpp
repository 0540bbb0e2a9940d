// Reads preference pairs and tokenizes each side like an SFT example (sft_data.cpp). The
// reference log-probs and the loss are dpo.cpp's.
#include "trainer/dpo_data.hpp"

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "policy/error.hpp"

namespace troupe::dpo {
namespace {

std::string string_field(const nlohmann::json& j, const std::string& field, const std::string& where) {
  auto it = j.find(field);
  if (it == j.end()) throw Error(where + ": no field '" + field + "' (set the field names to the dataset's)");
  if (!it->is_string()) throw Error(where + ": field '" + field + "' is " + it->type_name() + ", expected a string");
  return it->get<std::string>();
}

}  // namespace

std::vector<Pair> read_jsonl(const std::filesystem::path& path, const Tokenizer& tokenizer, const DataOptions& o,
                             sft::ReadReport* report_out) {
  const std::string file = path.string();
  std::optional<ChatTemplate> chat;
  std::optional<int32_t> eos;
  if (o.chat) {
    chat = sft::chat_template_for(tokenizer, o.chat_template, file);
  } else if (o.append_eos) {
    eos = o.eos_id ? o.eos_id : tokenizer.eos_id();
    if (!eos) throw Error(file + ": append_eos is set but the tokenizer has no eos token (turn append_eos off)");
  }

  sft::ReadReport report;
  std::vector<Pair> out;
  const int64_t records = sft::for_each_jsonl_object(path, o.limit, "preference data", [&](const nlohmann::json& j,
                                                                                          int64_t line_no,
                                                                                          const std::string& where) {
    const std::string prompt = string_field(j, o.prompt_field, where);
    const std::string chosen = string_field(j, o.chosen_field, where);
    const std::string rejected = string_field(j, o.rejected_field, where);

    auto encode = [&](const std::string& response) {
      if (!chat) return sft::encode_plain(prompt, response, tokenizer, eos);
      std::vector<ChatMessage> messages;
      if (!o.system.empty()) messages.push_back({"system", o.system});
      messages.push_back({"user", prompt});
      messages.push_back({"assistant", response});
      try {
        return sft::encode_chat(messages, *chat, tokenizer);
      } catch (const Error& e) {
        throw Error(where + ": " + e.what());
      }
    };
    Pair p{encode(chosen), encode(rejected)};
    p.line = p.chosen.line = p.rejected.line = line_no;
    for (auto [s, field] : {std::pair{&p.chosen, &o.chosen_field}, std::pair{&p.rejected, &o.rejected_field}})
      if (s->trained_tokens() == 0) throw Error(where + ": field '" + *field + "' is empty (no tokens to score)");

    const int64_t longest = std::max(p.chosen.size(), p.rejected.size());
    if (o.max_length > 0 && longest > o.max_length) {
      if (o.overlong == sft::Overlong::error)
        throw Error(where + ": prompt + response is " + std::to_string(longest) + " tokens, above max_length " +
                    std::to_string(o.max_length) + " (raise max_length, or set overlong to truncate or drop)");
      if (o.overlong == sft::Overlong::drop) {
        ++report.dropped;
        return;
      }
      for (auto* s : {&p.chosen, &p.rejected})
        if (s->size() > o.max_length) {
          s->ids.resize(o.max_length);
          s->loss_mask.resize(o.max_length);
        }
      if (p.chosen.trained_tokens() == 0 || p.rejected.trained_tokens() == 0) {
        ++report.dropped;  // the prompt alone fills max_length
        return;
      }
      ++report.truncated;
    }
    out.push_back(std::move(p));
  });
  if (out.empty())
    throw Error(file + (records == 0 ? ": no preference pairs (the file is empty or has only blank lines)"
                                     : ": no pairs left after max_length (raise max_length)"));
  if (report_out) *report_out = report;
  return out;
}

}  // namespace troupe::dpo
