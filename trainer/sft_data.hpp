// SFT records: chat or prompt/response JSONL rendered through the chat template into token ids
// with a loss mask on assistant tokens. No LibTorch: sft.hpp packs these into tensors.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "policy/chat_template.hpp"
#include "policy/tokenizer.hpp"

namespace troupe::sft {

// One training document: what the model reads, and which of those tokens it is trained to write.
struct Sequence {
  std::vector<int32_t> ids;        // [L] token ids
  std::vector<uint8_t> loss_mask;  // [L] 1 on tokens the loss trains (assistant turns), 0 elsewhere
  int64_t line = 0;                // 1-based line of the record in its file; 0 when built in code

  int64_t size() const { return static_cast<int64_t>(ids.size()); }
  int64_t trained_tokens() const;  // number of 1s in loss_mask
};

// An example longer than max_length: an Error naming its line, cut to its first max_length
// tokens (an example with no trained token left is dropped), or dropped.
enum class Overlong { error, truncate, drop };

struct DataOptions {
  // Records are instruction pairs when both of these are set, else chat records under
  // messages_field: [{"role": "system" | "user" | "assistant", "content": "..."}, ...].
  std::string prompt_field;    // e.g. "question"
  std::string response_field;  // e.g. "answer"
  std::string messages_field = "messages";
  // Render through the chat template (instruction pairs as one user turn and one assistant
  // turn). false: instruction pairs become prompt text + response text (+ eos), and chat
  // records are an Error.
  bool chat = true;
  std::optional<ChatTemplate> chat_template;  // default: the tokenizer's own (an Error if it has none)
  std::string system;       // instruction pairs with chat: a system turn first, if not empty
  bool append_eos = true;   // plain text: the tokenizer's eos after the response, and trained
  std::optional<int32_t> eos_id;  // the eos appended instead of the tokenizer's (e.g. the model's own, when
                                  // the tokenizer's lies outside a small model's vocabulary)
  int64_t max_length = 0;   // tokens per example; 0: no limit
  Overlong overlong = Overlong::error;
  int64_t limit = 0;        // read only the first N records; 0: all
};

// What read_jsonl did with long examples.
struct ReadReport {
  int64_t truncated = 0;  // examples cut to max_length
  int64_t dropped = 0;    // examples left out (drop, or truncation left no trained token)
};

// One conversation, rendered by `chat` and tokenized turn by turn. The loss mask covers each
// assistant turn's content and its end-of-turn token (<|im_end|>, <|eot_id|>), not the header
// before it nor the newline ChatML writes after it: exactly what the model must generate after
// the generation prompt before the engine stops. Each assistant turn is tokenized on its own,
// after the prompt rendered with add_generation_prompt, so training sees the ids generation
// sees. Throws Error for an unknown role, no assistant turn, or a template whose prompt for a
// turn does not render as a prefix of the whole conversation.
Sequence encode_chat(std::span<const ChatMessage> messages, const ChatTemplate& chat, const Tokenizer& tokenizer);
// prompt then response (then eos when given), each tokenized on its own; the mask covers the
// response and the eos.
Sequence encode_plain(const std::string& prompt, const std::string& response, const Tokenizer& tokenizer,
                      std::optional<int32_t> eos);

// Reads every record now. Errors (troupe::Error) name FILE:LINE: a line that is not a JSON
// object, a missing or non-string field, a message without role or content, an unknown role,
// no assistant turn, an example above max_length (with Overlong::error); and FILE alone for a
// missing or empty file.
std::vector<Sequence> read_jsonl(const std::filesystem::path& path, const Tokenizer& tokenizer,
                                 const DataOptions& options = {}, ReadReport* report = nullptr);

// Calls `record(object, line, where)` for each JSON object line of a JSONL file, where `where` is
// "FILE:LINE", skipping blank lines, for the first `limit` records (0: all). Returns the records
// read. Errors name FILE:LINE for a line that is not a JSON object, and FILE when it cannot be
// opened ("cannot open the <what> file") or read. Shared by the SFT and preference readers.
int64_t for_each_jsonl_object(const std::filesystem::path& path, int64_t limit, const std::string& what,
                              const std::function<void(const nlohmann::json&, int64_t, const std::string&)>& record);

// The chat template records of `file` render with: `configured` when set, else the tokenizer's
// own; an Error naming `file` when the tokenizer has none.
ChatTemplate chat_template_for(const Tokenizer& tokenizer, const std::optional<ChatTemplate>& configured,
                               const std::string& file);

}  // namespace troupe::sft
