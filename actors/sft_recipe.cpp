// recipe: sft and recipe: lora. Supervised fine-tuning on chat or prompt/response JSONL, the
// loss on assistant tokens only, examples packed into rows; with LoRA only the adapters train.
// The trainer runs alone: there is nothing to overlap, so no actors.
#include <iostream>

#include <torch/torch.h>

#include "actors/recipe_run.hpp"
#include "policy/error.hpp"
#include "trainer/sft.hpp"

namespace troupe {
namespace {

sft::DataOptions data_options(const RunConfig& c, const DatasetSection& d, const Tokenizer& tokenizer,
                              std::optional<int32_t> eos) {
  sft::DataOptions o;
  if (!d.response.empty()) {
    o.prompt_field = d.prompt;
    o.response_field = d.response;
  }
  o.messages_field = d.messages;
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
  return o;
}

std::vector<sft::Sequence> read(const RunConfig& c, const DatasetSection& d, const Tokenizer& tokenizer,
                                std::optional<int32_t> eos) {
  sft::ReadReport report;
  auto seqs = sft::read_jsonl(d.path, tokenizer, data_options(c, d, tokenizer, eos), &report);
  if (report.truncated || report.dropped)
    std::cout << d.path << ": " << report.truncated << " examples cut to trainer.max_length " << c.trainer.max_length
              << ", " << report.dropped << " left out (no trained token left)" << std::endl;
  if (seqs.empty()) throw Error(d.path + ": no examples left to train on");
  return seqs;
}

}  // namespace

GraphResult run_sft(const RunConfig& c, const std::atomic<bool>* stop_requested) {
  // Set up: data, model (with adapters for LoRA), trainer, run folder.
  auto resume = recipe::find_resume(c);  // first: a wrong checkpoint fails before any loading
  auto policy = recipe::load_policy(c, recipe::trainer_config(c));
  if (!policy.model.tokenizer) throw Error(c.model.path + ": no tokenizer with the model (model.path); sft needs one");
  const Tokenizer& tokenizer = *policy.model.tokenizer;
  const auto eos = recipe::model_eos(policy.model.config, tokenizer);
  auto train = read(c, c.data.train, tokenizer, eos);
  std::vector<sft::Sequence> held_out;
  if (c.data.eval) held_out = read(c, *c.data.eval, tokenizer, eos);
  const sft::BatchOptions batching{.packing = c.trainer.packing, .max_length = c.trainer.max_length,
                                   .micro_rows = c.trainer.micro_batch};
  auto eval_loss = [&] {
    auto batches = sft::micro_batches(held_out, batching);
    return policy.trainer->sft_eval(batches);
  };
  recipe::DataOrder order(static_cast<int64_t>(train.size()), c.data.shuffle, c.data.seed);
  int64_t start = 1;
  if (resume) {
    recipe::restore(policy, *resume);
    start = resume->step + 1;
  }
  recipe::RunFolder folder(c, resume ? resume->step : 0, policy.writer());
  if (policy.writer()) std::cout << "troupe run: " << to_string(c.recipe) << " on " << train.size() << " examples"
            << (held_out.empty() ? "" : ", " + std::to_string(held_out.size()) + " held out")
            << (policy.lora ? ", LoRA rank " + std::to_string(policy.lora->rank) : std::string()) << std::endl;

  // Train: batch_size examples per optimizer step, packed into rows of max_length tokens.
  GraphResult result;
  if (resume) {
    order.seek(resume->cursor.value("epoch", int64_t{0}), resume->cursor.value("position", int64_t{0}));
    std::cout << "troupe run: resumed from " << resume->dir.string() << " (step " << resume->step << ")" << std::endl;
  }
  for (int64_t step = start; step <= c.trainer.steps; ++step) {
    std::vector<sft::Sequence> batch;
    const auto indices = order.next(c.trainer.batch_size);
    const auto [begin, end] = policy.share(static_cast<int64_t>(indices.size()));  // this rank's part
    for (int64_t k = begin; k < end; ++k) batch.push_back(train[indices[k]]);
    auto m = policy.trainer->sft_step(sft::micro_batches(batch, batching));
    nlohmann::json j{{"loss", m.loss}, {"grad_norm", m.grad_norm}, {"lr", m.lr}, {"tokens", m.tokens},
                     {"sequences", m.sequences}, {"rows", m.rows}, {"epoch", order.epoch()}};
    recipe::add_memory_metrics(policy, j);
    bool last = step == c.trainer.steps;
    if (!held_out.empty() && (last || (c.trainer.eval_every > 0 && step % c.trainer.eval_every == 0)))
      j["eval/loss"] = eval_loss();
    folder.step(step, j, m.tokens, result);
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
