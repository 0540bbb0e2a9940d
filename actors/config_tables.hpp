// The run config's keys, one table per section, in the order config.yaml writes them: each
// line names a key, the member it fills and the rules its value keeps. Reading, checking and
// to_yaml all go through these tables (config_fields.hpp); what relates keys of one section to
// each other or to other sections is checked after reading, in config_parse.cpp.
#pragma once

#include <algorithm>
#include <concepts>
#include <type_traits>

#include "actors/config_fields.hpp"

namespace troupe::cfg {

// A table takes a section, const (to write it) or not (to read it).
template <class C, class S>
concept Of = std::same_as<std::remove_const_t<C>, S>;

inline bool is_device(const std::string& d) {
  const bool cuda_n = d.starts_with("cuda:") && d.size() > 5 && d.find_first_not_of("0123456789", 5) == std::string::npos;
  return d == "cpu" || d == "cuda" || cuda_n;
}
inline bool is_listen_address(const std::string& a) { return a.empty() || split_host_port(a).has_value(); }
inline bool one_of(const std::string& v, std::initializer_list<std::string_view> names) {
  return std::find(names.begin(), names.end(), v) != names.end();
}

void fields(auto& v, Of<RunConfig> auto& c) {
  v("recipe", c.recipe, Required{"one of " + join(names(Recipe{}))});
  v("resume", c.resume, OmitIfEmpty{});
}

void fields(auto& v, Of<ModelSection> auto& c) {
  v("path", c.path, Required{"the model to train: a Hugging Face folder or a .gguf file"}, not_empty());
  v("dtype", c.dtype);
  v("device", c.device, TextRule{is_device, "expected cpu, cuda or cuda:N", true});
  v("batch_invariant", c.batch_invariant);
}

void fields(auto& v, Of<LoraSection> auto& c) {
  v("rank", c.rank, at_least(1));
  v("alpha", c.alpha, above(0));
  v("dropout", c.dropout, within("[0, 1)", [](double x) { return x >= 0 && x < 1; }));
  v("target_modules", c.target_modules);
}

void fields(auto& v, Of<DatasetSection> auto& c) {
  v("path", c.path, Required{"a JSONL file of prompts"}, not_empty());
  v("prompt", c.prompt, not_empty("must name the JSONL field holding the prompt"));
  v("answer", c.answer);
  v("system", c.system);
  v("chat_template", c.chat_template);
  v("limit", c.limit, at_least(0, "0: every record"));
  v("response", c.response);
  v("messages", c.messages, not_empty("must name the JSONL field holding the chat messages"));
  v("chosen", c.chosen, not_empty("must name the JSONL field holding the preferred response"));
  v("rejected", c.rejected, not_empty("must name the JSONL field holding the rejected response"));
}

// data.train and data.eval are datasets of their own, read and written around this table.
void fields(auto& v, Of<DataSection> auto& c) {
  v("shuffle", c.shuffle);
  v("seed", c.seed);
}

void fields(auto& v, Of<GeneratorSection> auto& c) {
  v("count", c.count, at_least(1));
  v("engine", c.engine);
  v("dtype", c.dtype, OnlyWhen{c.engine == EngineKind::builtin, "only used with engine: builtin (a server keeps its own)"});
  v("weights", c.weights, OnlyWhen{c.engine == EngineKind::builtin, "only used with engine: builtin (a server keeps its own)"});
  v("url", c.url, OmitIfEmpty{});
  v("weight_transfer", c.weight_transfer, OnlyWhen{c.engine == EngineKind::remote, "only used with engine: remote"},
    TextRule{[](const std::string& s) { return one_of(s, {"reload", "disk"}); },
             "expected reload or disk (vLLM's NCCL transfer needs a CUDA trainer)", true});
  v("group_size", c.group_size, at_least(1));
  v("max_tokens", c.max_tokens, at_least(1));
  v("temperature", c.temperature, at_least(0));
  v("top_p", c.top_p, within("(0, 1]", [](double x) { return x > 0 && x <= 1; }));
  v("top_k", c.top_k, Bound{[](double x) { return x >= -1; }, "must be >= 1, or -1 or 0 for no limit"});
  v("min_p", c.min_p, within("[0, 1)", [](double x) { return x >= 0 && x < 1; }));
  v("max_batch", c.max_batch, at_least(1));
  v("max_seq_len", c.max_seq_len);
  v("partial_rollouts", c.partial_rollouts,
    OnlyWhen{c.engine == EngineKind::builtin, "only used with engine: builtin (a server's batch takes new weights once it is done)"});
  v("threads", c.threads, at_least(0, "0: LibTorch's default"));
  v("stop", c.stop);
  v("ignore_eos", c.ignore_eos);
}

// `kind` may be left out when plugin or url says it (config_parse.cpp infers it).
void fields(auto& v, Of<RewardSection> auto& c) {
  v("name", c.name, Required{"a unique name (metrics report reward/<name>/mean)"}, not_empty());
  v("kind", c.kind);
  v("weight", c.weight);
  v("answer_key", c.answer_key);
  v("plugin", c.plugin, OmitIfEmpty{});
  v("url", c.url, OmitIfEmpty{});
  v("timeout_s", c.timeout_s, above(0));
  v("retries", c.retries, within("[0, 100]", [](double x) { return x >= 0 && x <= 100; }));
  v("backoff_s", c.backoff_s, at_least(0));
  v("max_batch", c.max_batch, at_least(0, "0: one request per batch"));
}

void fields(auto& v, Of<TeacherSection> auto& c) {
  v("path", c.path, Required{"the teacher: a Hugging Face folder or a .gguf file with the student's tokenizer"}, not_empty());
}

// Read over defaults set from trainer.loss.beta and model.path.
void fields(auto& v, Of<ReferenceSection> auto& c) {
  v("enabled", c.enabled);
  v("path", c.path, not_empty("must not be empty (absent: model.path)"));
}

inline bool masks(rl::CorrectionMode m) {
  return m == rl::CorrectionMode::token_mask || m == rl::CorrectionMode::sequence_mask;
}

void fields(auto& v, Of<rl::Correction> auto& c) {
  v("mode", c.mode);
  v("low", c.low, OnlyWhen{masks(c.mode), "only used with mode token_mask or sequence_mask (the others only cap)"},
    within("[0, 1] (a ratio of 1 is on-policy and always kept)", [](double x) { return x >= 0 && x <= 1; }));
  v("high", c.high, at_least(1, "a bound below 1 would down-weight or drop on-policy tokens"));
}

// buffer <= generator.max_tokens is checked across sections (config_parse.cpp).
void fields(auto& v, Of<rl::Overlong> auto& c) {
  const std::string only = "only used with mode: penalty";
  v("mode", c.mode);
  v("buffer", c.buffer, OnlyWhen{c.mode == rl::OverlongMode::penalty, only}, Required{"the tokens before max_tokens over which the penalty ramps up"}, at_least(1));
  v("factor", c.factor, OnlyWhen{c.mode == rl::OverlongMode::penalty, only}, above(0));
}

// clip: [epsilon, epsilon_high] (or the two keys) and correction are read and written around
// this table.
void fields(auto& v, Of<LossSection> auto& c) {
  v("kind", c.kind);
  v("objective", c.objective);
  v("aggregation", c.aggregation);
  v("beta", c.beta, at_least(0, "0: no KL, no reference"));
  v("distill", c.distill, at_least(0, "0: no teacher term"));
  v("label_smoothing", c.label_smoothing, within("[0, 0.5)", [](double x) { return x >= 0 && x < 0.5; }));
  v("gamma", c.gamma, within("(0, 1]", [](double x) { return x > 0 && x <= 1; }));
  v("lambda", c.lambda, within("[0, 1]", [](double x) { return x >= 0 && x <= 1; }));
  v("value_clip", c.value_clip, at_least(0, "0: no clipping"));
  v("vf_coef", c.vf_coef, above(0));
  v("whiten_advantages", c.whiten_advantages);
}

// Read over lr = trainer.lr, its default.
void fields(auto& v, Of<SftWarmupSection> auto& c) {
  v("path", c.path, Required{"a JSONL file of prompt/completion pairs"}, not_empty());
  v("prompt", c.prompt, not_empty("must name the JSONL field holding the prompt"));
  v("completion", c.completion, not_empty("must name the JSONL field holding the completion"));
  v("steps", c.steps, Required{"optimizer steps of the supervised stage"}, at_least(1));
  v("lr", c.lr, above(0));
}

// trainer.loss and trainer.sft_warmup are sections of their own.
void fields(auto& v, Of<TrainerSection> auto& c) {
  v("batch_groups", c.batch_groups, at_least(1));
  v("steps", c.steps, at_least(1));
  v("lr", c.lr, above(0));
  v("weight_decay", c.weight_decay, at_least(0));
  v("warmup_steps", c.warmup_steps,
    within("[0, trainer.steps = " + fmt(c.steps) + "]", [&c](double x) { return x >= 0 && x <= c.steps; }));
  v("min_lr_ratio", c.min_lr_ratio, within("[0, 1]", [](double x) { return x >= 0 && x <= 1; }));
  v("max_grad_norm", c.max_grad_norm, at_least(0, "0: no clipping"));
  v("micro_batch", c.micro_batch, at_least(0, "0: the whole batch at once"));
  v("num_iterations", c.num_iterations, at_least(1));
  v("logprob_chunk", c.logprob_chunk, at_least(1));
  v("advantage", c.advantage);
  v("scale_rewards", c.scale_rewards, OnlyWhen{c.advantage == rl::Advantage::group, "only used with advantage: group"});
  v("dynamic_sampling", c.dynamic_sampling);
  v("dynamic_sampling_rounds", c.dynamic_sampling_rounds, OnlyWhen{c.dynamic_sampling, "only used with dynamic_sampling: true"},
    at_least(1));
  v("reuse_behaviour_logprobs", c.reuse_behaviour_logprobs);
  v("threads", c.threads, at_least(0, "0: LibTorch's default"));
  v("batch_size", c.batch_size, at_least(1));
  v("max_length", c.max_length, at_least(2));
  v("packing", c.packing);
  v("activation_checkpointing", c.activation_checkpointing);
  v("eval_every", c.eval_every, at_least(0, "0: only at the end"));
}

void fields(auto& v, Of<AsyncSection> auto& c) {
  v("max_staleness", c.max_staleness, at_least(0, "0: synchronous, on-policy"));
  // Generators then hold weights up to k - 1 versions old: with k > eta + 1 no rollout would
  // ever be fresh enough, and the run would stall.
  v("sync_every", c.sync_every, at_least(1),
    Bound{[&c](double k) { return k <= c.max_staleness + 1; },
          "must be <= async.max_staleness + 1 = " + fmt(c.max_staleness + 1) +
              " (generators would fall further behind than max_staleness allows)"});
}

void fields(auto& v, Of<ClusterSection> auto& c) {
  v("generator_processes", c.generator_processes, at_least(0, "0: generators in the run's own process"));
  v("join_timeout_s", c.join_timeout_s, above(0));
  v("restarts", c.restarts, at_least(0, "0: a worker that dies is not replaced"));
  v("reward_processes", c.reward_processes, at_least(0, "0: the reward in the run's own process"));
  v("reference_processes", c.reference_processes, at_least(0, "0: the reference in the run's own process"));
  v("lost_groups", c.lost_groups,
    TextRule{[](const std::string& s) { return one_of(s, {"retry", "fail"}); },
             "expected retry (score them on another worker) or fail", true});
  v("answer_timeout_s", c.answer_timeout_s, above(0));
  v("listen", c.listen, OmitIfEmpty{}, TextRule{is_listen_address, "expected HOST:PORT (port 0: any free one)", true});
  v("weight_transport", c.weight_transport,
    TextRule{[](const std::string& s) { return one_of(s, {"auto", "http"}); },
             "expected auto (shared memory on the trainer's host, HTTP from others) or http", true});
}

void fields(auto& v, Of<ParallelSection> auto& c) {
  v("trainer_ranks", c.trainer_ranks, at_least(1, "1: one process"));
  v("sharding", c.sharding);
  v("timeout_s", c.timeout_s, above(0));
  v("prefetch", c.prefetch);
}

// Read over dir = runs/<config file stem>, its default.
void fields(auto& v, Of<RunSection> auto& c) {
  v("dir", c.dir, not_empty());
  v("checkpoint_every", c.checkpoint_every, at_least(0, "0: only at the end"));
  v("log_every", c.log_every, at_least(1));
  v("seed", c.seed);
  v("deterministic", c.deterministic);
  v("dashboard", c.dashboard, OmitIfEmpty{},
    TextRule{is_listen_address, "expected HOST:PORT, e.g. 127.0.0.1:8265 (port 0: any free one)", true});
}

}  // namespace troupe::cfg
