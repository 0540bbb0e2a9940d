#include "actors/generator_actor.hpp"

#include <deque>
#include <map>
#include <variant>

#include <torch/torch.h>

#include "actors/actor_util.hpp"
#include "actors/weight_plane.hpp"
#include "policy/checkpoint.hpp"
#include "policy/dtype.hpp"
#include "policy/error.hpp"
#include "policy/seed.hpp"

namespace troupe {

using namespace caf;

// What crosses to a worker process: the sampling and engine settings a generator uses (a
// prompt's own seed is set per ticket), and the rest of the spec. Enums by name.
void to_json(nlohmann::json& j, PartialRollouts p) { j = std::string(to_string(p)); }
void from_json(const nlohmann::json& j, PartialRollouts& p) {
  auto value = from_name<PartialRollouts>(j.get<std::string>());
  if (!value) throw Error("partial_rollouts: unknown mode " + j.dump());
  p = *value;
}
void to_json(nlohmann::json& j, WeightFormat w) { j = std::string(to_string(w)); }
void from_json(const nlohmann::json& j, WeightFormat& w) {
  auto value = from_name<WeightFormat>(j.get<std::string>());
  if (!value) throw Error("weights: unknown format " + j.dump());
  w = *value;
}
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(EngineOptions, max_batch, max_seq_len, partial_rollouts, batch_invariant, weights, seed)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(SamplingParams, n, temperature, top_p, top_k, min_p, max_tokens, stop_token_ids, stop,
                                   include_stop_str_in_output, ignore_eos)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(GeneratorSpec, model, tokenizer, dtype, device, engine, sampling, seed, deterministic,
                                   threads, weights_over_http)

nlohmann::json to_json(const GeneratorSpec& spec) { return spec; }

GeneratorSpec generator_spec_from_json(const nlohmann::json& j) { return spec_from_json<GeneratorSpec>(j, "generator spec"); }

namespace {

struct Pending {
  PromptItem prompt;
  std::vector<Completion> completions;
  int64_t done = 0;
};

RolloutGroup make_group(Pending& p) {
  RolloutGroup g;
  g.prompt_id = p.prompt.id;
  g.batch = p.prompt.batch;
  g.prompt_ids = p.prompt.ids;
  g.metadata = p.prompt.metadata;
  g.ticket = p.prompt.ticket;
  for (auto& c : p.completions) {
    g.completion_ids.push_back(std::move(c.ids));
    g.behaviour_logprobs.push_back(std::move(c.logprobs));
    g.min_version.push_back(c.min_version);
    g.max_version.push_back(c.max_version);
    g.truncated.push_back(c.finish_reason == FinishReason::length);
  }
  return g;
}

struct GeneratorState {
  GeneratorSpec spec;
  rollout_sink next;
  controller_actor controller;
  int64_t index = 0;
  std::unique_ptr<Engine> engine;
  std::map<uint64_t, Pending> pending;  // engine request id -> the prompt and its finished samples
  bool stepping = false;
  // What arrived while it had to wait (see waits()), applied in arrival order: in deterministic
  // mode once the engine is idle, so each batch meets exactly the weights sent before it; with
  // partial_rollouts finish, a notice once the sequences in progress are done.
  std::deque<std::variant<PromptBatch, WeightsReady>> deferred;
  bool said_http = false;  // the first version fetched over HTTP is logged
  double busy_s = 0;       // decode time not yet handed to a group (RolloutGroup::generate_s)
  int64_t groups_sent = 0;  // failed ones included
  ActorBusy told;           // what the controller was last told (the dashboard's view)
};

using Self = generator_actor::stateful_pointer<GeneratorState>;

// Tells the controller what it does now ("generating" or "waiting" unless `state` says), when
// that changed.
void tell_busy(Self self, std::string state = "") {
  auto& st = self->state;
  if (state.empty()) state = st.engine->has_work() ? "generating" : "waiting";
  auto queue = static_cast<int64_t>(st.pending.size());
  for (const auto& d : st.deferred)
    if (const auto* b = std::get_if<PromptBatch>(&d)) queue += static_cast<int64_t>(b->prompts.size());
  ActorBusy now{"generator " + std::to_string(st.index), std::move(state), queue, st.groups_sent};
  if (now.state == st.told.state && now.queue == st.told.queue && now.groups == st.told.groups) return;
  st.told = now;
  self->send(st.controller, std::move(now));
}

void kick(Self self) {
  if (self->state.stepping) return;
  self->state.stepping = true;
  self->send(self, step_atom::value);
}

// Each prompt's samples come from its own seed, so they depend on the run's seed and the
// prompt's ticket, not on which generator drew it or what was batched alongside.
void admit(Self self, PromptBatch& batch) {
  auto& st = self->state;
  for (auto& p : batch.prompts) {
    SamplingParams params = st.spec.sampling;
    params.seed = mix_seed(st.spec.seed, static_cast<uint64_t>(p.ticket));
    uint64_t id = 0;
    try {
      id = st.engine->add_request(p.ids, params);
    } catch (const Error& e) {
      // A prompt the engine cannot take (too long for max_seq_len, ids outside the vocabulary)
      // fails alone: reported, never trained, and the generator goes on.
      self->send(st.next, failed_group(p, "generator " + std::to_string(st.index) + ": " + e.what()));
      ++st.groups_sent;
      continue;
    }
    st.pending.emplace(id, Pending{std::move(p), std::vector<Completion>(st.spec.sampling.n), 0});
  }
  kick(self);
  tell_busy(self);
}

void load(Self self, const WeightsReady& notice) {
  auto start = std::chrono::steady_clock::now();
  auto& st = self->state;
  const bool fetched = st.spec.weights_over_http || notice.host != this_host();
  if (fetched && !st.said_http)
    std::cout << "troupe: generator " << st.index << " takes weights over HTTP from " << notice.url << std::endl;
  st.said_http = st.said_http || fetched;
  tell_busy(self, "loading weights");
  st.engine->update_weights(read_weights(notice, st.spec.weights_over_http), notice.version);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  self->send(self->state.controller, WeightsLoaded{self->state.index, notice.version, s, st.engine->requantize_seconds()});
  tell_busy(self);
}

// Whether a notice (or prompts) must wait for what the engine holds. Deterministic mode: both
// wait until the engine is idle, so each batch meets exactly the weights sent before it.
// partial_rollouts finish: a notice waits until the sequences in progress are done, and prompts
// that come after it wait behind it. Otherwise nothing waits.
bool waits(const GeneratorState& st, bool notice) {
  if (!st.deferred.empty()) return true;  // behind what already waits, in arrival order
  if (!st.engine->has_work()) return false;
  return st.spec.deterministic || (notice && st.spec.engine.partial_rollouts == PartialRollouts::finish);
}

// What waited, in arrival order, as far as the engine's state allows.
void drain(Self self) {
  auto& st = self->state;
  while (!st.deferred.empty()) {
    const bool notice = std::holds_alternative<WeightsReady>(st.deferred.front());
    if (st.engine->has_work() && (st.spec.deterministic || notice)) return;
    auto item = std::move(st.deferred.front());
    st.deferred.pop_front();
    if (auto* notice = std::get_if<WeightsReady>(&item)) {
      load(self, *notice);
    } else {
      admit(self, std::get<PromptBatch>(item));
    }
  }
}

// One decode step for every running sequence; steps go through the mailbox, so weight notices
// are handled between decode steps.
void step(Self self) {
  auto& st = self->state;
  const auto start = std::chrono::steady_clock::now();
  auto finished = st.engine->step();
  st.busy_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<RolloutGroup> groups;
  for (auto& c : finished) {
    auto it = st.pending.find(c.request_id);
    if (it == st.pending.end()) continue;
    if (c.finish_reason == FinishReason::abort) throw Error("a generation was aborted");
    it->second.completions[c.index] = std::move(c);
    if (++it->second.done == st.spec.sampling.n) {
      groups.push_back(make_group(it->second));
      st.pending.erase(it);
    }
  }
  // The decode time since the last group sent is shared by the groups finished now.
  for (auto& g : groups) {
    g.generate_s = st.busy_s / static_cast<double>(groups.size());
    self->send(st.next, std::move(g));
    ++st.groups_sent;
  }
  if (!groups.empty()) st.busy_s = 0;
  if (!st.engine->has_work()) drain(self);
  if (st.engine->has_work()) {
    self->send(self, step_atom::value);
  } else {
    st.stepping = false;
  }
  tell_busy(self);
}

generator_actor::behavior_type generator(Self self, GeneratorSpec spec, rollout_sink next, controller_actor controller,
                                         int64_t index, std::optional<Tokenizer> tokenizer) {
  name_failures(self, "generator " + std::to_string(index));
  use_threads(spec.threads);
  auto& st = self->state;
  const torch::Device device(spec.device);
  auto model = load_model(spec.model, {.dtype = choose_dtype(spec.dtype, device, "generator dtype").dtype,
                                       .device = device, .tokenizer = false});
  if (!tokenizer && !spec.tokenizer.empty()) tokenizer = Tokenizer::load(spec.tokenizer);
  st.engine = std::make_unique<Engine>(model.model, std::move(tokenizer), spec.engine);
  st.spec = std::move(spec);
  st.next = std::move(next);
  st.controller = std::move(controller);
  st.index = index;
  return {
      [=](step_atom) { step(self); },
      [=](PromptBatch& batch) {
        if (waits(self->state, false)) {
          self->state.deferred.emplace_back(std::move(batch));
          tell_busy(self);
        } else {
          admit(self, batch);
        }
      },
      [=](const WeightsReady& notice) {
        if (waits(self->state, true)) {
          self->state.deferred.emplace_back(notice);
        } else {
          load(self, notice);
        }
      },
  };
}

struct RemoteState {
  RemoteGeneratorSpec spec;
  std::unique_ptr<RemoteEngine> engine;
  int64_t groups_sent = 0;
};

generator_actor::behavior_type remote_generator(generator_actor::stateful_pointer<RemoteState> self, RemoteGeneratorSpec spec,
                                                rollout_sink next, controller_actor controller, int64_t index) {
  name_failures(self, "generator " + std::to_string(index));
  self->state.engine = std::make_unique<RemoteEngine>(spec.url, spec.options, spec.tokenizer);
  self->state.engine->wait_healthy(spec.options.connect_timeout_s);
  self->state.spec = std::move(spec);
  return {
      [=](step_atom) {},
      [=](PromptBatch& batch) {
        const auto& sampling = self->state.spec.sampling;
        std::vector<std::vector<int32_t>> prompts;
        for (const auto& p : batch.prompts) prompts.push_back(p.ids);
        const std::string name = "generator " + std::to_string(index);
        auto& sent = self->state.groups_sent;
        self->send(controller, ActorBusy{name, "generating", static_cast<int64_t>(prompts.size()), sent});
        const auto start = std::chrono::steady_clock::now();
        auto completions = self->state.engine->generate(prompts, sampling);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::vector<Pending> pending;
        for (auto& p : batch.prompts) pending.push_back({std::move(p), std::vector<Completion>(sampling.n), 0});
        for (auto& c : completions) pending.at(c.request_id).completions.at(c.index) = std::move(c);
        for (auto& p : pending) {
          auto g = make_group(p);
          g.generate_s = seconds / static_cast<double>(pending.size());
          self->send(next, std::move(g));
          ++sent;
        }
        self->send(controller, ActorBusy{name, "waiting", 0, sent});
      },
      // The server loaded its model from its own files; the run starts from the trainer's
      // weights (which may differ, e.g. after an SFT warm-up), so version 0 arrives first too.
      [=](const WeightsReady& notice) {
        auto start = std::chrono::steady_clock::now();
        auto dir = std::filesystem::absolute(std::filesystem::path(self->state.spec.weights_dir) /
                                             ("generator_" + std::to_string(index)));
        std::filesystem::create_directories(dir);
        self->state.engine->update_weights(read_weights(notice), notice.version, dir);
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        self->send(controller, WeightsLoaded{index, notice.version, s});
      },
  };
}

}  // namespace

generator_actor spawn_generator(actor_system& system, GeneratorSpec spec, rollout_sink next, controller_actor controller,
                                int64_t index, std::optional<Tokenizer> tokenizer) {
  return system.spawn<detached>(generator, std::move(spec), std::move(next), std::move(controller), index,
                                std::move(tokenizer));
}

generator_actor spawn_remote_generator(actor_system& system, RemoteGeneratorSpec spec, rollout_sink next,
                                       controller_actor controller, int64_t index) {
  return system.spawn<detached>(remote_generator, std::move(spec), std::move(next), std::move(controller), index);
}

}  // namespace troupe
