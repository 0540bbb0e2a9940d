// DPO preference pairs read from JSONL and tokenized like SFT examples (sft_data.hpp). No
// LibTorch: dpo.hpp adds the reference log-probs and the loss.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "policy/chat_template.hpp"
#include "policy/tokenizer.hpp"
#include "trainer/sft_data.hpp"

namespace troupe::dpo {

// One preference pair: the same prompt followed by the chosen and by the rejected response.
struct Pair {
  sft::Sequence chosen;    // prompt + chosen response; loss_mask on the response tokens
  sft::Sequence rejected;  // prompt + rejected response
  // log pi_ref(response | prompt), summed over the response tokens; NaN until compute_reference
  double ref_chosen = std::numeric_limits<double>::quiet_NaN();
  double ref_rejected = std::numeric_limits<double>::quiet_NaN();
  int64_t line = 0;  // 1-based line in the file; 0 when built in code
};

struct DataOptions {
  std::string prompt_field = "prompt";
  std::string chosen_field = "chosen";
  std::string rejected_field = "rejected";
  // With chat, the prompt is a user turn and each response the assistant turn after it (trained
  // span: content + end-of-turn, as in SFT). Without, plain text prompt + response + eos
  // (append_eos), as TRL does for non-conversational data.
  bool chat = true;
  std::optional<ChatTemplate> chat_template;  // default: the tokenizer's own
  std::string system;                         // a system turn first, with chat, if not empty
  bool append_eos = true;
  std::optional<int32_t> eos_id;  // instead of the tokenizer's eos (see sft::DataOptions)
  int64_t max_length = 0;  // tokens per prompt + response; 0: no limit
  sft::Overlong overlong = sft::Overlong::error;  // truncate keeps the start (TRL's keep_start)
  int64_t limit = 0;
};

// Reads every pair now. Errors (troupe::Error) name FILE:LINE: not a JSON object, a missing or
// non-string field, an empty response, a pair above max_length (Overlong::error); FILE alone
// for a missing or empty file.
std::vector<Pair> read_jsonl(const std::filesystem::path& path, const Tokenizer& tokenizer,
                             const DataOptions& options = {}, sft::ReadReport* report = nullptr);

}  // namespace troupe::dpo
