// The prompt source: a JSONL dataset read, rendered and tokenized once, handed out in seeded,
// reshuffled epochs through a cursor that saves and restores. Plain C++: no actors, no LibTorch.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "policy/chat_template.hpp"
#include "policy/tokenizer.hpp"

namespace troupe {

struct Prompt {
  uint64_t id = 0;           // 0-based index of the record in the file (blank lines not counted)
  std::vector<int32_t> ids;  // [P] token ids of `text`
  std::string text;          // the prompt as the model sees it (after the chat template, if any)
  nlohmann::json metadata;   // the whole JSONL object, so rewards find the answer and any other field
};

struct PromptSourceOptions {
  std::string prompt_field = "question";  // GSM8K's names
  std::string answer_field = "answer";    // required in every record (string or number); "" for none
  bool chat = false;                      // render the prompt as a user turn of the chat template
  // The template for `chat`; by default the tokenizer's own (an Error when it has none).
  std::optional<ChatTemplate> chat_template;
  std::string system;              // a system message before the user turn (with `chat`), if not empty
  int64_t max_prompt_tokens = 0;   // a longer prompt is an Error naming its line; 0: no limit
  int64_t limit = 0;               // read only the first N records; 0: all
  bool shuffle = true;             // false: every epoch in file order (evaluation)
  uint64_t seed = 0;
};

// Where a run is in the data; the next prompt handed out is order(epoch)[position].
struct PromptCursor {
  uint64_t epoch = 0;
  uint64_t position = 0;  // prompts already handed out in this epoch, in [0, size)
  uint64_t seed = 0;      // the source's shuffling seed, so a resume under another seed is caught

  nlohmann::json to_json() const;  // {"epoch": e, "position": p, "seed": s}
  // Throws Error naming `origin` and the key for a missing or non-integer key.
  static PromptCursor from_json(const nlohmann::json& j, const std::string& origin = "prompt cursor");
  bool operator==(const PromptCursor&) const = default;
};

class PromptSource {
 public:
  // Reads, renders and tokenizes every record now, so a bad line fails at start-up rather than
  // hours into a run. Errors (troupe::Error) name FILE:LINE and the field: a missing file, a line
  // that is not a JSON object, a missing or non-string prompt, a missing answer, an empty
  // dataset, a prompt above max_prompt_tokens.
  PromptSource(const std::filesystem::path& path, const Tokenizer& tokenizer, PromptSourceOptions options = {});

  // The next n prompts, crossing into the next epoch (reshuffled) as often as needed.
  std::vector<Prompt> next(int64_t n);

  const PromptCursor& cursor() const { return cursor_; }
  // Continues exactly where `cursor` was taken. Throws Error when its seed is not this source's
  // or its position is past the end of the dataset (a different file?).
  void restore(const PromptCursor& cursor);

  // The records in file order, independent of the cursor.
  const std::vector<Prompt>& prompts() const { return prompts_; }
  int64_t size() const { return static_cast<int64_t>(prompts_.size()); }
  // The record indices in the order epoch `epoch` hands them out: a permutation of [0, size).
  std::vector<uint64_t> order(uint64_t epoch) const;

 private:
  std::filesystem::path path_;
  PromptSourceOptions options_;
  std::vector<Prompt> prompts_;
  PromptCursor cursor_;
  std::vector<uint64_t> order_;  // order(cursor_.epoch), kept between calls
};

}  // namespace troupe
