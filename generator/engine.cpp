// Continuous batching: a request's n samples share one prefill into free slots, then every
// running sequence decodes one token per step() until it stops and frees its slot. The KV
// cache is allocated once; a step attends only over slots [0, highest busy slot]. A prompt's
// keys and values are held once for its samples (PrefixSharing::shared) and freed with the last.
#include "generator/engine.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <set>

#include <torch/torch.h>

#include "kernels/batch_invariant.hpp"
#include "kernels/gumbel_max.hpp"
#include "kernels/parallel.hpp"
#include "policy/error.hpp"
#include "policy/seed.hpp"

namespace troupe {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::abort: return "abort";
  }
  return "?";
}

struct Engine::Sequence {
  uint64_t request_id;
  int64_t index;
  std::shared_ptr<const std::vector<int32_t>> prompt;
  std::shared_ptr<const SamplingParams> params;
  std::shared_ptr<const std::vector<int32_t>> stop_ids;
  uint64_t seed;  // of the noise: `generator` on the CPU, hashed with the token index elsewhere
  at::Generator generator;
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::vector<int64_t> versions;  // [ids] the version that sampled each
  int64_t cached = 0;  // tokens whose keys/values are cached; ids.back() is not yet
  // With PrefixSharing::shared, the prompt's keys/values, held once for the request's samples;
  // the slot then holds positions [base, cached) at [0, cached - base). Without, base is 0.
  std::shared_ptr<const SharedKV> prefix;
  int64_t base = 0;
  bool stale = false;  // the slot's keys/values predate a weight update
  int64_t slot = -1;
  int64_t min_version = 0, max_version = 0;
  std::optional<int32_t> stop_token;
  std::optional<std::string> stop_string;
  size_t stop_text_end = 0;  // text length to keep when a stop string matched
};

namespace {

// A sequence's noise stream for sampling on the CPU. On an accelerator the sampler draws
// hashed noise from (seed, token index) instead (hashed_gumbel), for the whole batch at once.
at::Generator sample_generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

}  // namespace

Engine::Engine(Transformer model, std::optional<Tokenizer> tokenizer, EngineOptions options)
    : model_(std::move(model)), tokenizer_(std::move(tokenizer)), options_(options),
      default_generator_(at::make_generator<at::CPUGeneratorImpl>(options.seed)) {
  if (options_.max_batch < 1) throw Error("engine: max_batch must be at least 1");
  if (options_.max_seq_len < 2) throw Error("engine: max_seq_len must be at least 2");
  const auto& c = model_->config();
  for (int64_t id : c.eos_token_ids) eos_ids_.push_back(static_cast<int32_t>(id));
  if (tokenizer_ && tokenizer_->eos_id()) eos_ids_.push_back(*tokenizer_->eos_id());
  auto weight = model_->lm_head_weight();
  cache_ = KVCache::allocate(c, options_.max_batch, options_.max_seq_len, weight.options());
  slots_.resize(options_.max_batch);
  prefix_ = options_.prefix;
  const bool flash = weight.is_cpu() && (weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16);
  if (prefix_ == PrefixSharing::shared && (!flash || options_.batch_invariant)) prefix_ = PrefixSharing::copy;
  decode_ = options_.decode;
  if (decode_ == DecodeMode::automatic) decode_ = weight.is_cuda() ? DecodeMode::graphs : DecodeMode::eager;
  if (decode_ != DecodeMode::eager) {
    // Fixed shapes read each slot's own keys: no shared prefixes, no batch-invariant kernels.
    if (options_.batch_invariant) throw Error("engine: batch-invariant kernels decode eagerly, not with fixed-shape steps");
    if (prefix_ == PrefixSharing::shared) prefix_ = PrefixSharing::copy;
  }
  model_->eval();
  model_->keep_fused_weights(true);  // weights change only through update_weights, between steps
  model_->set_fused_kernels(true);   // inference only
  if (options_.batch_invariant) model_->set_batch_invariant(true);
  model_->set_weight_format(options_.weights);
  torch::NoGradGuard no_grad;
  model_->prepare_weights(weight.scalar_type());  // quantized here, not in the first decode step
  if (decode_ != DecodeMode::eager)
    static_decode_ = std::make_unique<StaticDecode>(*model_, cache_, options_.max_batch, options_.max_seq_len,
                                                    /*capture=*/decode_ == DecodeMode::graphs);
}

int64_t Engine::decode_graphs() const { return static_decode_ ? static_decode_->graphs() : 0; }

Engine::~Engine() = default;

const ModelConfig& Engine::config() const { return model_->config(); }

int64_t Engine::running() const {
  return std::count_if(slots_.begin(), slots_.end(), [](const auto& s) { return s != nullptr; });
}

int64_t Engine::waiting() const { return static_cast<int64_t>(waiting_.size()); }

void Engine::each_running(const std::function<void(uint64_t, int64_t, const std::vector<int32_t>&, const std::vector<float>&)>& f) const {
  for (const auto& seq : slots_)
    if (seq) f(seq->request_id, seq->index, seq->ids, seq->logprobs);
}

bool Engine::has_work() const { return running() > 0 || !waiting_.empty() || !finished_.empty(); }

std::vector<int32_t> Engine::stop_ids_for(const SamplingParams& params) const {
  std::vector<int32_t> ids = params.stop_token_ids;
  if (!params.ignore_eos) ids.insert(ids.end(), eos_ids_.begin(), eos_ids_.end());
  return ids;
}

uint64_t Engine::add_request(std::vector<int32_t> prompt, SamplingParams params) {
  const int64_t vocab = config().vocab_size;
  auto bad = [](const std::string& what) { throw Error("generation request: " + what); };
  if (prompt.empty()) bad("the prompt is empty");
  for (int32_t id : prompt)
    if (id < 0 || id >= vocab) bad("prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  for (int32_t id : params.stop_token_ids)
    if (id < 0 || id >= vocab) bad("stop token id " + std::to_string(id) + " is outside the vocabulary");
  if (params.n < 1 || params.n > options_.max_batch)
    bad("n = " + std::to_string(params.n) + " must be between 1 and max_batch (" + std::to_string(options_.max_batch) + ")");
  if (params.max_tokens < 1) bad("max_tokens must be at least 1");
  if (static_cast<int64_t>(prompt.size()) + params.max_tokens > options_.max_seq_len)
    bad("prompt (" + std::to_string(prompt.size()) + " tokens) + max_tokens (" + std::to_string(params.max_tokens) +
        ") exceeds max_seq_len " + std::to_string(options_.max_seq_len));
  if (!(params.temperature >= 0)) bad("temperature must be >= 0");
  if (!(params.top_p > 0 && params.top_p <= 1)) bad("top_p must be in (0, 1]");
  if (!(params.min_p >= 0 && params.min_p <= 1)) bad("min_p must be in [0, 1]");
  if (params.top_k < -1) bad("top_k must be -1 (off) or positive");
  if (!params.stop.empty() && !tokenizer_) bad("stop strings need a tokenizer");
  for (const auto& s : params.stop)
    if (s.empty()) bad("stop strings must not be empty");

  const uint64_t id = next_request_id_++;
  auto shared_prompt = std::make_shared<const std::vector<int32_t>>(std::move(prompt));
  auto shared_params = std::make_shared<const SamplingParams>(params);
  auto stop_ids = std::make_shared<const std::vector<int32_t>>(stop_ids_for(params));
  for (int64_t i = 0; i < params.n; ++i) {
    auto seq = std::make_unique<Sequence>();
    seq->request_id = id;
    seq->index = i;
    seq->prompt = shared_prompt;
    seq->params = shared_params;
    seq->stop_ids = stop_ids;
    uint64_t base = params.seed ? *params.seed : default_generator_.get<at::CPUGeneratorImpl>()->random64();
    seq->seed = mix_seed(base, i);
    seq->generator = sample_generator(seq->seed);
    waiting_.push_back(std::move(seq));
  }
  return id;
}

void Engine::abort(uint64_t request_id) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if ((*it)->request_id == request_id) {
      finished_.push_back(finish(**it, FinishReason::abort));
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& slot : slots_) {
    if (slot && slot->request_id == request_id) {
      finished_.push_back(finish(*slot, FinishReason::abort));
      slot.reset();
    }
  }
}

std::vector<Completion> Engine::step() {
  torch::NoGradGuard no_grad;
  for (auto& seq : slots_)
    if (seq && seq->stale) refill(*seq);
  admit();
  decode();
  std::vector<Completion> done;
  done.swap(finished_);
  return done;
}

// Fills free slots from the queue, the samples of one request together so they share a prefill.
void Engine::admit() {
  while (!waiting_.empty()) {
    std::vector<int64_t> free;
    for (int64_t s = 0; s < options_.max_batch; ++s)
      if (!slots_[s]) free.push_back(s);
    if (free.empty()) return;
    std::vector<Sequence*> group;
    const uint64_t request = waiting_.front()->request_id;
    while (!waiting_.empty() && waiting_.front()->request_id == request && group.size() < free.size()) {
      auto& slot = slots_[free[group.size()]];
      slot = std::move(waiting_.front());
      waiting_.pop_front();
      slot->slot = free[group.size()];
      group.push_back(slot.get());
    }
    prefill(group);
  }
}

namespace {

// The rows to sample: each one's parameters and the source of its noise, which depends on the
// sequence alone (its seed and how many tokens it has), never on the batch around it.
struct Draws {
  std::vector<const SamplingParams*> params;
  std::vector<at::Generator*> generators;  // the CPU's noise: each sequence's own stream
  std::vector<uint64_t> seeds;             // an accelerator's: hashed from (seed, token index)
  std::vector<int64_t> counters;
};

template <class Sequence>
void add_draw(Draws& draws, Sequence& seq) {
  draws.params.push_back(seq.params.get());
  draws.generators.push_back(&seq.generator);
  draws.seeds.push_back(seq.seed);
  draws.counters.push_back(static_cast<int64_t>(seq.ids.size()));
}

// Whether a row's draw is cut to its top-k / top-p / min-p tokens (greedy rows never are).
bool truncates(const SamplingParams& p) { return p.temperature > 0 && (p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0); }

// The CPU's sampler: each row on its own, spread over the intra-op threads, from its bf16 or
// float32 logits to its id and log-prob, in buffers of one row that stay in cache. No [R, V]
// tensor is made: at 128 rows x 49152 tokens each one is 25 MB of fresh pages per step, and
// their page faults cost more than the sampling. Each row's values are those of the batched
// ops (log_softmax row by row, the same noise), so its samples are too.
std::pair<std::vector<int32_t>, std::vector<float>> sample_rows_cpu(const torch::Tensor& logits, Draws& draws,
                                                                     bool invariant) {
  const auto& params = draws.params;
  const int64_t R = static_cast<int64_t>(params.size());
  std::vector<int32_t> ids(R);
  std::vector<float> logprobs(R);
  kernels::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const SamplingParams& p = *params[r];
      const bool sampled = p.temperature > 0;
      // Greedy rows report log-probs at temperature 1: the distribution whose mode they take.
      const float temperature = sampled ? p.temperature : 1.0f;
      auto x = torch::empty({logits.size(1)}, torch::kFloat32).copy_(logits[r]);  // (V), logits stay as they are
      // Batch-invariant: the log-softmax the trainer's recomputation runs (kernels/).
      auto logp = invariant ? kernels::bi_log_softmax(x.unsqueeze(0), torch::full({1}, temperature)).squeeze(0)
                            : x.div_(temperature).log_softmax(0);
      // Gumbel-max: argmax(log p + g), g = -log(-log(u)), draws exactly from p; u comes from
      // the sequence's own generator, so the draw does not depend on the batch or the thread.
      // Tokens cut by top-k / top-p / min-p score -inf. One pass, no noise tensor (kernels/).
      int64_t id = 0;
      if (sampled) {
        auto kept = truncates(p) ? logp.masked_fill(truncate_rows(logp.exp().unsqueeze(0), {&p}).squeeze(0) == 0,
                                                    -std::numeric_limits<float>::infinity())
                                 : logp;
        id = kernels::gumbel_max(kept, *draws.generators[r]);
      } else {
        id = logp.argmax().item<int64_t>();
      }
      ids[r] = static_cast<int32_t>(id);
      logprobs[r] = logp[id].item<float>();
    }
  });
  return {std::move(ids), std::move(logprobs)};
}

// An accelerator's sampler: the same for the whole batch at once, in a fixed number of ops.
// Everything runs on the logits' device; only the R ids and log-probs come back to the host.
std::pair<std::vector<int32_t>, std::vector<float>> sample_rows_batched(const torch::Tensor& logits, Draws& draws) {
  const auto& params = draws.params;
  const int64_t R = static_cast<int64_t>(params.size());
  auto l = logits.to(torch::kFloat32);  // (R, V)
  const auto device = l.device();
  // Greedy rows report log-probs at temperature 1: the distribution whose mode they take.
  std::vector<float> temperature(R);
  std::vector<uint8_t> sampled(R, 0);
  bool any_sampled = false, any_cut = false;
  for (int64_t r = 0; r < R; ++r) {
    const SamplingParams& p = *params[r];
    temperature[r] = p.temperature > 0 ? p.temperature : 1.0f;
    sampled[r] = p.temperature > 0;
    any_sampled |= p.temperature > 0;
    any_cut |= truncates(p);
  }
  // non_blocking: a small pageable copy is staged at once, without waiting for the forward pass.
  auto temperatures = torch::tensor(temperature).to(device, /*non_blocking=*/true).unsqueeze(1);  // (R, 1)
  auto logp = (l / temperatures).log_softmax(-1);                                                  // (R, V)
  // Gumbel-max as on the CPU, but each op is a kernel launch: the noise of every row comes from
  // one hash of (seed, token index) over the whole batch, and lands on the sampled rows only;
  // the truncation runs on the whole batch in a fixed number of ops.
  auto scores = logp.clone();
  if (any_cut) scores.masked_fill_(truncate_rows(logp.exp(), params) == 0, -std::numeric_limits<float>::infinity());
  if (any_sampled) {
    auto noise = hashed_gumbel(draws.seeds, draws.counters, scores.size(1), device);
    auto sampled_rows = torch::tensor(torch::ArrayRef<uint8_t>(sampled)).to(torch::kBool).to(device, /*non_blocking=*/true);
    scores = torch::where(sampled_rows.unsqueeze(1), scores + noise, scores);
  }
  auto ids_t = scores.argmax(-1);                                                   // (R)
  auto picked = logp.gather(1, ids_t.unsqueeze(1)).squeeze(1).cpu().contiguous();  // (R)
  auto ids_i32 = ids_t.to(torch::kInt32).cpu().contiguous();
  return {std::vector<int32_t>(ids_i32.data_ptr<int32_t>(), ids_i32.data_ptr<int32_t>() + R),
          std::vector<float>(picked.data_ptr<float>(), picked.data_ptr<float>() + R)};
}

// logits [R, V] of the rows to sample -> (ids [R], log-probs [R]).
std::pair<std::vector<int32_t>, std::vector<float>> sample_rows(const torch::Tensor& logits, Draws& draws,
                                                                 bool invariant) {
  return logits.device().is_cpu() ? sample_rows_cpu(logits, draws, invariant) : sample_rows_batched(logits, draws);
}

}  // namespace

namespace {

// Keys and values of `tokens` written into `view` (its k and v: [1, n_kv, >= T, hd] per layer),
// at positions [0, T). Returns the hidden states [1, T, H].
torch::Tensor fill(TransformerImpl& model, KVCache view, const std::vector<int32_t>& tokens) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  auto device = model.lm_head_weight().device();
  auto ids = torch::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), torch::kLong).to(device).unsqueeze(0);
  auto positions = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(device)).unsqueeze(0);
  return model.forward(ids, positions, {}, &view);
}

// The same into `slot` of the cache: the forward writes straight into the slot's rows.
torch::Tensor fill_slot(TransformerImpl& model, KVCache& cache, int64_t slot, const std::vector<int32_t>& tokens) {
  KVCache view;
  for (size_t l = 0; l < cache.k.size(); ++l) {
    view.k.push_back(cache.k[l].narrow(0, slot, 1));
    view.v.push_back(cache.v[l].narrow(0, slot, 1));
  }
  return fill(model, std::move(view), tokens);
}

}  // namespace

// After a weight update, a continuing sequence's cache is recomputed under the new weights,
// so every token it samples from then on comes from exactly the new policy.
// A sequence that shared its prompt's keys then holds them in its own slot.
void Engine::refill(Sequence& seq) {
  seq.prefix.reset();
  seq.base = 0;
  std::vector<int32_t> tokens = *seq.prompt;
  tokens.insert(tokens.end(), seq.ids.begin(), seq.ids.end() - 1);
  fill_slot(*model_, cache_, seq.slot, tokens);
  seq.stale = false;
}

void Engine::prefill(std::vector<Sequence*> group) {
  const auto& prompt = *group.front()->prompt;
  const int64_t P = static_cast<int64_t>(prompt.size());
  const int64_t n = static_cast<int64_t>(group.size());
  torch::Tensor logits;  // (n, V)
  if (prefix_ == PrefixSharing::separate) {
    std::vector<torch::Tensor> rows;
    for (Sequence* seq : group) rows.push_back(model_->logits(fill_slot(*model_, cache_, seq->slot, prompt).select(1, P - 1)));
    logits = torch::cat(rows);
  } else if (prefix_ == PrefixSharing::shared && n > 1) {
    auto kv = std::make_shared<SharedKV>();
    const auto& c = model_->config();
    for (size_t l = 0; l < cache_.k.size(); ++l) {
      kv->k.push_back(torch::empty({1, c.num_key_value_heads, P, c.head_dim}, cache_.k[l].options()));
      kv->v.push_back(torch::empty({1, c.num_key_value_heads, P, c.head_dim}, cache_.v[l].options()));
    }
    auto hidden = fill(*model_, KVCache{.k = kv->k, .v = kv->v}, prompt);  // (1, P, H)
    logits = model_->logits(hidden.select(1, P - 1)).expand({n, -1});
    for (Sequence* seq : group) {
      seq->prefix = kv;
      seq->base = P;
    }
  } else {
    const int64_t first = group.front()->slot;
    auto hidden = fill_slot(*model_, cache_, first, prompt);  // (1, P, H)
    logits = model_->logits(hidden.select(1, P - 1)).expand({n, -1});
    for (int64_t i = 1; i < n; ++i) {
      for (size_t l = 0; l < cache_.k.size(); ++l) {
        cache_.k[l][group[i]->slot].narrow(1, 0, P).copy_(cache_.k[l][first].narrow(1, 0, P));
        cache_.v[l][group[i]->slot].narrow(1, 0, P).copy_(cache_.v[l][first].narrow(1, 0, P));
      }
    }
  }
  Draws draws;
  for (Sequence* seq : group) add_draw(draws, *seq);
  auto [next, logprobs] = sample_rows(logits, draws, model_->batch_invariant());
  for (size_t i = 0; i < group.size(); ++i) {
    Sequence& seq = *group[i];
    seq.cached = P;
    seq.min_version = seq.max_version = version_;
    seq.ids.push_back(next[i]);
    seq.logprobs.push_back(logprobs[i]);
    seq.versions.push_back(version_);
    if (check_finished(seq)) {
      finished_.push_back(finish(seq, seq.stop_token || seq.stop_string ? FinishReason::stop : FinishReason::length));
      slots_[seq.slot].reset();
    }
  }
}

void Engine::decode() {
  int64_t rows = 0;
  for (int64_t s = 0; s < options_.max_batch; ++s)
    if (slots_[s]) rows = s + 1;
  if (rows == 0) return;
  auto device = model_->lm_head_weight().device();
  auto long_opts = torch::TensorOptions().dtype(torch::kLong);
  // Free rows in [0, rows) decode a dummy token at position 0 of their own slot: cheaper
  // than gathering the busy rows' caches, and harmless since a prefill overwrites the slot.
  // A row's slot holds its positions from `base` on (its prompt's are shared, or base is 0),
  // so each row reads its own keys [0, own length] and its group's prefix once for the group.
  std::vector<int64_t> tokens(rows, 0), positions(rows, 0), own(rows, 0), busy;
  Draws draws;
  std::map<const SharedKV*, std::vector<int64_t>> groups;
  int64_t span = 1;
  for (int64_t s = 0; s < rows; ++s) {
    if (!slots_[s]) continue;
    const Sequence& seq = *slots_[s];
    tokens[s] = seq.ids.back();
    positions[s] = seq.cached;
    own[s] = seq.cached - seq.base;
    span = std::max(span, own[s] + 1);
    if (seq.prefix) groups[seq.prefix.get()].push_back(s);
    busy.push_back(s);
    add_draw(draws, *slots_[s]);
  }
  // Every host-to-device copy happens here, before the forward pass is queued: a blocking copy
  // later would wait for the device to finish it.
  auto busy_rows = torch::tensor(busy, long_opts).to(device);  // (A)
  torch::Tensor logits;                                        // (A, V)
  if (static_decode_) {
    logits = static_decode_->step(tokens, positions, own).index_select(0, busy_rows);
  } else {
    auto ids = torch::tensor(tokens, long_opts).to(device).unsqueeze(1);  // (R, 1)
    auto position = torch::tensor(positions, long_opts).to(device);        // (R)
    auto write = torch::tensor(own, long_opts).to(device);                 // (R)
    auto [view, mask] = cache_.per_row(rows, write, span, torch::arange(span, long_opts.device(device)));
    for (const auto& [kv, members] : groups) view.prefixes.push_back({kv, torch::tensor(members, long_opts).to(device)});
    auto hidden = model_->forward(ids, position.unsqueeze(1), mask, &view);  // (R, 1, H)
    logits = model_->logits(hidden.select(1, 0).index_select(0, busy_rows));
  }
  auto [next, logprobs] = sample_rows(logits, draws, model_->batch_invariant());
  for (size_t i = 0; i < busy.size(); ++i) {
    Sequence& seq = *slots_[busy[i]];
    seq.cached += 1;
    seq.ids.push_back(next[i]);
    seq.logprobs.push_back(logprobs[i]);
    seq.versions.push_back(version_);
    seq.min_version = std::min(seq.min_version, version_);
    seq.max_version = std::max(seq.max_version, version_);
    if (check_finished(seq)) {
      finished_.push_back(finish(seq, seq.stop_token || seq.stop_string ? FinishReason::stop : FinishReason::length));
      slots_[busy[i]].reset();
    }
  }
}

bool Engine::check_finished(Sequence& seq) {
  const SamplingParams& p = *seq.params;
  const int32_t last = seq.ids.back();
  if (std::find(seq.stop_ids->begin(), seq.stop_ids->end(), last) != seq.stop_ids->end()) {
    seq.stop_token = last;
    return true;
  }
  if (!p.stop.empty()) {
    // Decoding the whole completion each step is quadratic but cheap at RL lengths, and
    // it is the only way to see stop strings that span token boundaries.
    std::string text = tokenizer_->decode(seq.ids, /*skip_special_tokens=*/true);
    size_t best = std::string::npos;
    const std::string* match = nullptr;
    for (const auto& s : p.stop) {
      size_t at = text.find(s);
      if (at != std::string::npos && at < best) {
        best = at;
        match = &s;
      }
    }
    if (match) {
      seq.stop_string = *match;
      seq.stop_text_end = best + (p.include_stop_str_in_output ? match->size() : 0);
      return true;
    }
  }
  return static_cast<int64_t>(seq.ids.size()) >= p.max_tokens;
}

Completion Engine::finish(Sequence& seq, FinishReason reason) {
  Completion c;
  c.request_id = seq.request_id;
  c.index = seq.index;
  c.prompt_ids = *seq.prompt;
  c.ids = std::move(seq.ids);
  c.logprobs = std::move(seq.logprobs);
  c.finish_reason = reason;
  c.stop_token = seq.stop_token;
  c.stop_string = seq.stop_string;
  c.min_version = seq.min_version;
  c.max_version = seq.max_version;
  c.versions = std::move(seq.versions);
  if (tokenizer_) {
    c.text = tokenizer_->decode(c.ids, /*skip_special_tokens=*/true);
    if (c.stop_string) c.text.resize(std::min(c.text.size(), seq.stop_text_end));
  }
  return c;
}

std::vector<Completion> Engine::generate(const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params) {
  std::set<uint64_t> mine;
  for (const auto& p : prompts) mine.insert(add_request(p, params));
  std::vector<Completion> out;
  size_t expected = prompts.size() * params.n;
  while (out.size() < expected) {
    if (!has_work()) throw Error("engine: generate ran out of work before its requests finished");
    for (auto& c : step())
      if (mine.count(c.request_id)) out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(), [](const Completion& a, const Completion& b) {
    return std::tie(a.request_id, a.index) < std::tie(b.request_id, b.index);
  });
  return out;
}

void Engine::update_weights(const std::map<std::string, torch::Tensor>& weights, int64_t version) {
  if (options_.partial_rollouts == PartialRollouts::finish && has_work())
    throw Error("weight update: partial_rollouts finish takes new weights only once the engine has no sequence left (" +
                std::to_string(running()) + " running, " + std::to_string(waiting()) + " waiting)");
  auto params = model_->named_parameters(/*recurse=*/true);
  for (const auto& [name, t] : weights) {
    const torch::Tensor* p = params.find(name);
    if (!p) throw Error("weight update: unknown parameter '" + name + "'");
    if (p->sizes() != t.sizes()) {
      std::ostringstream s;
      s << "weight update: '" << name << "' is " << t.sizes() << ", the model has " << p->sizes();
      throw Error(s.str());
    }
  }
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, t] : weights) params[name].copy_(t);
    auto start = std::chrono::steady_clock::now();
    const int requantized = model_->prepare_weights(model_->lm_head_weight().scalar_type());
    // The copies above land in place, where the graphs read the weights; a remade quantized or
    // packed copy is elsewhere, so the graphs are captured again.
    if (requantized && static_decode_) static_decode_->clear();
    requantize_s_ = requantized ? std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() : 0;
  }
  version_ = version;
  if (options_.partial_rollouts != PartialRollouts::abort) {
    for (auto& seq : slots_)
      if (seq) seq->stale = true;
    return;
  }
  // Requeue running sequences at the front, in slot order, so they restart on the new weights.
  for (auto it = slots_.rbegin(); it != slots_.rend(); ++it) {
    if (!*it) continue;
    auto& seq = **it;
    seq.ids.clear();
    seq.logprobs.clear();
    seq.versions.clear();
    seq.cached = 0;
    seq.prefix.reset();
    seq.base = 0;
    seq.slot = -1;
    seq.stop_token.reset();
    seq.stop_string.reset();
    seq.generator = sample_generator(seq.seed);
    waiting_.push_front(std::move(*it));
  }
}

}  // namespace troupe
