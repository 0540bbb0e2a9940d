// recipe: dpo. Direct preference optimization from a JSONL file of (prompt, chosen, rejected):
// the frozen reference's log-probs are computed once (and cached in the run folder), then the
// trainer runs alone on the sigmoid DPO loss. With a lora section only adapters train.
#include <iostream>

#include <torch/torch.h>

#include "actors/recipe_run.hpp"
#include "policy/error.hpp"
#include "trainer/dpo.hpp"

namespace troupe {
namespace {

std::vector<dpo::Pair> read(const RunConfig& c, const DatasetSection& d, const Tokenizer& tokenizer,
                            std::optional<int32_t> eos) {
  dpo::DataOptions o;
  o.prompt_field = d.prompt;
  o.chosen_field = d.chosen;
  o.rejected_field = d.rejected;
  o.chat = d.chat_template;
  if (d.chat_template) {
    if (!tokenizer.chat_template())
      throw Error(c.model.path + ": the data asks for the chat template (chat_template: true) but the tokenizer has none");
    o.chat_template = ChatTemplate::detect(*tokenizer.chat_template(), c.model.path);
  }
  o.system = d.system.value_or("");
  o.max_length = c.trainer.max_length;
  o.overlong = sft::Overlong::truncate;
  o.limit = d.limit;
  o.eos_id = eos;
  sft::ReadReport report;
  auto pairs = dpo::read_jsonl(d.path, tokenizer, o, &report);
  if (report.truncated || report.dropped)
    std::cout << d.path << ": " << report.truncated << " pairs cut to trainer.max_length " << c.trainer.max_length
              << ", " << report.dropped << " left out" << std::endl;
  if (pairs.empty()) throw Error(d.path + ": no preference pairs left to train on");
  return pairs;
}

// Each rank computes and caches the reference log-probs of every pair itself (rank 0 under the
// one-rank name): no rank waits on another's, however long the pass.
std::string rank_file(const std::string& stem, const recipe::Policy& p) {
  return stem + (p.rank > 0 ? ".rank" + std::to_string(p.rank) : std::string()) + ".json";
}

// The frozen reference's log-probs of every pair, computed once and cached next to the run;
// the reference model is freed on return: the steps need only its numbers.
void add_reference_logprobs(const RunConfig& c, const recipe::Policy& policy, std::vector<dpo::Pair>& train,
                            std::vector<dpo::Pair>& held_out) {
  auto reference = load_model(c.reference.path, {.dtype = recipe::dtype_of(c.model.dtype),
                                                 .device = torch::Device(c.model.device), .tokenizer = false});
  dpo::ReferenceOptions ro{.batch_pairs = std::max<int64_t>(1, c.trainer.micro_batch > 0 ? c.trainer.micro_batch : 8),
                           .chunk = c.trainer.logprob_chunk,
                           .cache = std::filesystem::path(c.run.dir) / rank_file("reference_logprobs", policy),
                           .model_id = c.reference.path};
  dpo::compute_reference(*reference.model, train, ro);
  if (!held_out.empty()) {
    ro.cache = std::filesystem::path(c.run.dir) / rank_file("reference_logprobs_eval", policy);
    dpo::compute_reference(*reference.model, held_out, ro);
  }
}

// The next batch_size pairs in data order, this rank's part of them; `tokens` counts all of them.
std::vector<dpo::Pair> next_batch(const RunConfig& c, const recipe::Policy& policy, const std::vector<dpo::Pair>& train,
                                  recipe::DataOrder& order, int64_t& tokens) {
  std::vector<dpo::Pair> batch;
  const auto indices = order.next(c.trainer.batch_size);
  const auto [begin, end] = policy.share(static_cast<int64_t>(indices.size()));
  for (int64_t k = 0; k < static_cast<int64_t>(indices.size()); ++k) {
    const auto& pair = train[indices[k]];
    tokens += pair.chosen.size() + pair.rejected.size();
    if (k >= begin && k < end) batch.push_back(pair);
  }
  return batch;
}

}  // namespace

GraphResult run_dpo(const RunConfig& c, const std::atomic<bool>* stop_requested) {
  // Set up: the policy (with adapters for LoRA), the pairs, and their reference log-probs
  // from the frozen reference model, computed once and cached next to the run.
  auto resume = recipe::find_resume(c);  // first: a wrong checkpoint fails before any loading
  auto policy = recipe::load_policy(c, recipe::trainer_config(c));
  if (!policy.model.tokenizer) throw Error(c.model.path + ": no tokenizer with the model (model.path); dpo needs one");
  const Tokenizer& tokenizer = *policy.model.tokenizer;
  const auto eos = recipe::model_eos(policy.model.config, tokenizer);
  auto train = read(c, c.data.train, tokenizer, eos);
  std::vector<dpo::Pair> held_out;
  if (c.data.eval) held_out = read(c, *c.data.eval, tokenizer, eos);
  int64_t start = 1;
  if (resume) {
    recipe::restore(policy, *resume);
    start = resume->step + 1;
  }
  recipe::RunFolder folder(c, resume ? resume->step : 0, policy.writer());
  add_reference_logprobs(c, policy, train, held_out);
  recipe::DataOrder order(static_cast<int64_t>(train.size()), c.data.shuffle, c.data.seed);
  if (policy.writer()) std::cout << "troupe run: dpo on " << train.size() << " pairs"
            << (held_out.empty() ? "" : ", " + std::to_string(held_out.size()) + " held out") << ", beta "
            << c.trainer.loss.beta << (policy.lora ? ", LoRA rank " + std::to_string(policy.lora->rank) : std::string())
            << std::endl;

  // Train: batch_size pairs per optimizer step.
  GraphResult result;
  if (resume) {
    order.seek(resume->cursor.value("epoch", int64_t{0}), resume->cursor.value("position", int64_t{0}));
    std::cout << "troupe run: resumed from " << resume->dir.string() << " (step " << resume->step << ")" << std::endl;
  }
  for (int64_t step = start; step <= c.trainer.steps; ++step) {
    int64_t tokens = 0;
    auto batch = next_batch(c, policy, train, order, tokens);
    auto m = policy.trainer->dpo_step(batch);
    nlohmann::json j{{"loss", m.loss}, {"rewards/chosen", m.reward_chosen}, {"rewards/rejected", m.reward_rejected},
                     {"rewards/accuracies", m.accuracy}, {"rewards/margins", m.margin},
                     {"logps/chosen", m.logps_chosen}, {"logps/rejected", m.logps_rejected},
                     {"grad_norm", m.grad_norm}, {"lr", m.lr}, {"pairs", m.pairs}, {"epoch", order.epoch()}};
    recipe::add_memory_metrics(policy, j);
    bool last = step == c.trainer.steps;
    if (!held_out.empty() && (last || (c.trainer.eval_every > 0 && step % c.trainer.eval_every == 0))) {
      auto e = policy.trainer->dpo_eval(held_out);
      j["eval/loss"] = e.loss;
      j["eval/rewards/accuracies"] = e.accuracy;
      j["eval/rewards/margins"] = e.margin;
    }
    folder.step(step, j, tokens, result);
    nlohmann::json cursor{{"epoch", order.epoch()}, {"position", order.position()}};
    if (last || (c.run.checkpoint_every > 0 && step % c.run.checkpoint_every == 0))
      folder.checkpoint(policy, step, cursor);
    if (stop_requested && stop_requested->load() && !last) {
      folder.checkpoint(policy, step, cursor);
      result.error = "stopped on request after step " + std::to_string(step);
      return result;
    }
  }
  result.ok = true;
  return result;
}

}  // namespace troupe
