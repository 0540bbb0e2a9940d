// GSM8K accuracy of a model: K samples per question from the built-in engine, scored by the math
// verifier, reported as pass@1 and the unbiased pass@k. No few-shot prompts, no answer-format hints.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "policy/checkpoint.hpp"

namespace troupe {

// The Codex paper's unbiased estimator of pass@k from n samples of which c are correct:
// 1 - C(n-c, k) / C(n, k), computed as a product so large n does not overflow.
// Throws Error unless 0 <= c <= n and 1 <= k <= n.
double pass_at_k(int64_t n, int64_t c, int64_t k);

struct EvalAccuracy {
  int64_t questions = 0;
  int64_t samples = 0;   // K per question
  double pass_at_1 = 0;  // mean over questions and samples of correctness
  double pass_at_k = 0;  // mean over questions of pass_at_k(K, c, K); equals pass_at_1 when K == 1

  // "gsm8k: n=100 pass@1=0.123" and, when K > 1, " pass@8=0.456".
  std::string line(std::string_view task) const;
};

// correct [Q][K]: whether sample j of question i was right; every question has the same K >= 1.
EvalAccuracy eval_accuracy(const std::vector<std::vector<uint8_t>>& correct);

struct Gsm8kEvalOptions {
  std::filesystem::path data;  // JSONL with the fields below (GSM8K's test.jsonl)
  std::string prompt_field = "question";
  std::string answer_field = "answer";
  int64_t limit = 0;         // the first N questions; 0: all
  int64_t samples = 1;       // K per question
  int64_t max_tokens = 256;  // new tokens per sample
  // Unset: greedy for K == 1; 1.0 for K > 1, the temperature GRPO samples its groups at, so pass@k
  // says what a training group can find. Plain sampling: no top-k, top-p or min-p.
  std::optional<double> temperature;
  int64_t batch = 32;   // sequences decoded together (raised to K when smaller)
  std::string system;   // a system message; empty keeps the template's default
  uint64_t seed = 0;    // for the samples when temperature > 0
};

struct Gsm8kEvalResult {
  EvalAccuracy accuracy;
  std::vector<std::vector<uint8_t>> correct;  // [Q][K]
  int64_t generated_tokens = 0;
  double temperature = 0;  // the one used
};

// Questions are rendered as one user turn through the tokenizer's chat template when it has one
// (plain text otherwise), generated until an end-of-sequence or end-of-turn token or max_tokens,
// and scored with math_answer_reward against the answer field. `progress(done, total)` is called
// as questions finish. Throws Error for bad data (naming FILE:LINE) or bad options.
Gsm8kEvalResult eval_gsm8k(const LoadedModel& model, const Gsm8kEvalOptions& options,
                           const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace troupe
