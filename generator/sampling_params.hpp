// The sampling parameters of one request, with vLLM's names and meanings; no LibTorch (troupe
// serve's request reader and its fuzz harness use them without it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

// vLLM's sampling fields and meanings, where troupe supports them.
struct SamplingParams {
  int64_t n = 1;             // samples of the prompt; they share one prefill
  double temperature = 1.0;  // 0 means greedy
  double top_p = 1.0;        // nucleus: keep the smallest set of tokens with mass >= top_p
  int64_t top_k = -1;        // keep the k most likely tokens; -1 (or 0) keeps all
  double min_p = 0.0;        // drop tokens below min_p x the top token's probability
  int64_t max_tokens = 16;   // new tokens at most
  std::vector<int32_t> stop_token_ids;  // besides the model's end-of-sequence ids
  std::vector<std::string> stop;        // stop strings (need a tokenizer)
  bool include_stop_str_in_output = false;
  bool ignore_eos = false;              // do not stop at the model's end-of-sequence ids
  std::optional<uint64_t> seed;         // reproduces the samples whatever else is in the batch
};

}  // namespace troupe
