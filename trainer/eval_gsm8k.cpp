// `troupe eval gsm8k`: reads questions through PromptSource (file order), generates with the
// engine's continuous batching, scores each sample with the math verifier as it finishes.
#include "trainer/eval_gsm8k.hpp"

#include <algorithm>
#include <cstdio>
#include <map>

#include "generator/engine.hpp"
#include "policy/error.hpp"
#include "reward/math.hpp"
#include "trainer/prompts.hpp"

namespace troupe {

double pass_at_k(int64_t n, int64_t c, int64_t k) {
  if (n < 1 || c < 0 || c > n || k < 1 || k > n)
    throw Error("pass@k: need 0 <= c <= n and 1 <= k <= n, got n=" + std::to_string(n) + " c=" + std::to_string(c) +
                " k=" + std::to_string(k));
  // Every k-subset holds a correct sample when fewer than k are wrong.
  if (n - c < k) return 1.0;
  // C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): the Codex paper's form, no factorials.
  double fail = 1.0;
  for (int64_t i = n - c + 1; i <= n; ++i) fail *= 1.0 - static_cast<double>(k) / static_cast<double>(i);
  return 1.0 - fail;
}

std::string EvalAccuracy::line(std::string_view task) const {
  char buf[160];
  int len = std::snprintf(buf, sizeof buf, "%.*s: n=%lld pass@1=%.3f", static_cast<int>(task.size()), task.data(),
                          static_cast<long long>(questions), pass_at_1);
  std::string out(buf, std::min<size_t>(len, sizeof buf - 1));
  if (samples > 1) {
    len = std::snprintf(buf, sizeof buf, " pass@%lld=%.3f", static_cast<long long>(samples), pass_at_k);
    out.append(buf, std::min<size_t>(len, sizeof buf - 1));
  }
  return out;
}

EvalAccuracy eval_accuracy(const std::vector<std::vector<uint8_t>>& correct) {
  if (correct.empty()) throw Error("eval: no questions to score");
  EvalAccuracy a;
  a.questions = static_cast<int64_t>(correct.size());
  a.samples = static_cast<int64_t>(correct.front().size());
  if (a.samples < 1) throw Error("eval: question 0 has no samples");
  for (size_t q = 0; q < correct.size(); ++q) {
    if (static_cast<int64_t>(correct[q].size()) != a.samples)
      throw Error("eval: question " + std::to_string(q) + " has " + std::to_string(correct[q].size()) +
                  " samples, question 0 has " + std::to_string(a.samples));
    const int64_t c = std::count_if(correct[q].begin(), correct[q].end(), [](uint8_t v) { return v != 0; });
    a.pass_at_1 += static_cast<double>(c) / static_cast<double>(a.samples);
    a.pass_at_k += pass_at_k(a.samples, c, a.samples);
  }
  a.pass_at_1 /= static_cast<double>(a.questions);
  a.pass_at_k /= static_cast<double>(a.questions);
  return a;
}

Gsm8kEvalResult eval_gsm8k(const LoadedModel& model, const Gsm8kEvalOptions& options,
                           const std::function<void(int64_t, int64_t)>& progress) {
  if (!model.tokenizer) throw Error(model.source.string() + ": eval gsm8k needs the model's tokenizer");
  if (options.samples < 1) throw Error("eval gsm8k: --samples must be at least 1");
  if (options.max_tokens < 1) throw Error("eval gsm8k: --max-tokens must be at least 1");
  if (options.batch < 1) throw Error("eval gsm8k: --batch must be at least 1");
  const Tokenizer& tok = *model.tokenizer;
  // Instruct models answer best in the format they were tuned on; a base model without a
  // template gets the bare question.
  const bool chat = tok.chat_template().has_value();
  if (!chat && !options.system.empty())
    throw Error(model.source.string() + ": --system needs a chat template and the tokenizer has none");

  PromptSource source(options.data, tok,
                      {.prompt_field = options.prompt_field,
                       .answer_field = options.answer_field,
                       .chat = chat,
                       .system = options.system,
                       .limit = options.limit,
                       .shuffle = false});
  const auto& prompts = source.prompts();

  Gsm8kEvalResult result;
  result.temperature = options.temperature.value_or(options.samples == 1 ? 0.0 : 1.0);
  SamplingParams params;
  params.n = options.samples;
  params.temperature = result.temperature;
  params.max_tokens = options.max_tokens;
  // The engine stops at end-of-sequence ids; chat models end a turn with their own token.
  for (const char* end_of_turn : {"<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"})
    if (auto id = tok.token_id(end_of_turn)) params.stop_token_ids.push_back(*id);

  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.ids.size());
  EngineOptions engine_options;
  engine_options.max_batch = std::max(options.batch, options.samples);
  engine_options.max_seq_len = static_cast<int64_t>(longest) + options.max_tokens;
  engine_options.seed = options.seed;
  Engine engine(model.model, tok, engine_options);

  std::map<uint64_t, size_t> question_of;  // request id -> index into prompts
  for (size_t q = 0; q < prompts.size(); ++q) question_of[engine.add_request(prompts[q].ids, params)] = q;

  const int64_t total = static_cast<int64_t>(prompts.size());
  result.correct.assign(prompts.size(), std::vector<uint8_t>(options.samples, 0));
  std::vector<int64_t> pending(prompts.size(), options.samples);
  int64_t done = 0;
  while (engine.has_work()) {
    for (const Completion& c : engine.step()) {
      const size_t q = question_of.at(c.request_id);
      const auto& answer = prompts[q].metadata.at(options.answer_field);
      const std::string reference = answer.is_string() ? answer.get<std::string>() : answer.dump();
      result.correct[q][c.index] = math_answer_reward(c.text, reference) > 0.5;
      result.generated_tokens += static_cast<int64_t>(c.ids.size());
      if (--pending[q] == 0) {
        ++done;
        if (progress) progress(done, total);
      }
    }
  }
  result.accuracy = eval_accuracy(result.correct);
  return result;
}

}  // namespace troupe
