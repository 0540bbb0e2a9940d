// DPO's pieces: preference pairs read from JSONL and tokenized like SFT examples, the frozen
// reference model's log-probs per pair (optionally cached on disk), and the sigmoid loss
// with label smoothing and TRL's metrics. Trainer::dpo_step wires them to the policy.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <torch/types.h>

#include "policy/chat_template.hpp"
#include "policy/tokenizer.hpp"
#include "trainer/sft.hpp"

namespace troupe {
class TransformerImpl;
}

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

struct ReferenceOptions {
  int64_t batch_pairs = 8;  // pairs per forward pass
  int64_t chunk = 128;      // positions per LM-head chunk
  // When set: read the log-probs from this file if it exists, else compute and write them.
  std::filesystem::path cache;
  // Stored in the cache and compared on reading, e.g. the reference model's path; the pairs'
  // token ids are compared through a fingerprint, so a changed dataset is caught too.
  std::string model_id;
};

// Fills ref_chosen and ref_rejected of every pair from the frozen `reference` (no gradient,
// eval mode). A cache from other pairs or another model_id is an Error naming the file.
void compute_reference(TransformerImpl& reference, std::span<Pair> pairs, const ReferenceOptions& options = {});

// The summed log-probs of each sequence's trained tokens under `model`: [N] float64, no
// gradient. One row per sequence, batch_size sequences per forward pass.
std::vector<double> sequence_logprobs(TransformerImpl& model, std::span<const sft::Sequence> sequences,
                                      int64_t batch_size = 8, int64_t chunk = 128);

struct LossConfig {
  double beta = 0.1;             // strength of the KL to the reference
  double label_smoothing = 0.0;  // cDPO: the chance that a preference label is flipped, in [0, 0.5)
};

// All [B], one per pair: summed response log-probs under the policy (with gradient) and the reference.
struct LossInputs {
  torch::Tensor chosen, rejected;
  torch::Tensor ref_chosen, ref_rejected;
};

// TRL's metric names in comments; rewards are beta x (log pi - log pi_ref), means over the pairs.
struct LossOutput {
  torch::Tensor loss;           // scalar, to backward: mean over the pairs
  double reward_chosen = 0;     // rewards/chosen
  double reward_rejected = 0;   // rewards/rejected
  double accuracy = 0;          // rewards/accuracies: share of pairs with chosen reward > rejected reward
  double margin = 0;            // rewards/margins: mean of chosen - rejected reward
  double logps_chosen = 0;      // logps/chosen: mean summed policy log-prob
  double logps_rejected = 0;    // logps/rejected
};

// With h = (chosen - ref_chosen) - (rejected - ref_rejected) and ls = label_smoothing:
//   loss = mean over pairs of -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)
// TRL's loss_type "sigmoid".
LossOutput loss(const LossInputs& in, const LossConfig& config);

}  // namespace troupe::dpo
