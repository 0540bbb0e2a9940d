// The actors of the async GRPO graph and the controller that wires them. Each actor wraps one
// component (Engine, CombinedReward, Trainer) and adds only messaging, versions and failure
// handling; the blocking ones (generator, reward, reference, trainer) run detached.
#include "actors/graph.hpp"

#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <variant>

#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "policy/seed.hpp"

namespace troupe {

using namespace caf;
using Clock = std::chrono::steady_clock;

void add_message_types(actor_system_config& config) {
  config.add_message_type<PromptItem>("troupe::PromptItem");
  config.add_message_type<PromptBatch>("troupe::PromptBatch");
  config.add_message_type<RolloutGroup>("troupe::RolloutGroup");
  config.add_message_type<TensorRecord>("troupe::TensorRecord");
  config.add_message_type<WeightsUpdate>("troupe::WeightsUpdate");
  config.add_message_type<StepReport>("troupe::StepReport");
}

std::vector<TensorRecord> to_records(const std::map<std::string, torch::Tensor>& tensors) {
  std::vector<TensorRecord> out;
  for (const auto& [name, t] : tensors) {
    auto c = t.detach().cpu().contiguous();
    TensorRecord r{name, static_cast<int8_t>(c.scalar_type()), c.sizes().vec(), {}};
    const char* p = static_cast<const char*>(c.data_ptr());
    r.bytes.assign(p, p + c.nbytes());
    out.push_back(std::move(r));
  }
  return out;
}

std::map<std::string, torch::Tensor> from_records(const std::vector<TensorRecord>& records) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& r : records) {
    auto dtype = static_cast<c10::ScalarType>(r.dtype);
    auto t = torch::empty(r.shape, torch::dtype(dtype));
    if (static_cast<size_t>(t.nbytes()) != r.bytes.size())
      throw Error("weights update: tensor '" + r.name + "' has " + std::to_string(r.bytes.size()) +
                  " bytes for its shape and dtype, expected " + std::to_string(t.nbytes()));
    std::memcpy(t.data_ptr(), r.bytes.data(), r.bytes.size());
    out[r.name] = t;
  }
  return out;
}

namespace {

// What the actors report back to run_graph; written under the mutex, read after shutdown.
struct Outcome {
  std::mutex mu;
  std::string error;
  int64_t steps = 0;
  std::vector<nlohmann::json> metrics;
  std::vector<int64_t> issued, trained, failed;  // tickets
};

// An exception inside an actor ends that actor with an error naming it; the controller, which
// monitors every actor, then shuts the graph down and run_graph returns the message.
template <class Self>
void report_failures(Self* self, std::shared_ptr<Outcome> outcome, std::string who) {
  self->set_exception_handler([outcome, who](scheduled_actor*, std::exception_ptr& p) -> error {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(p);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    std::lock_guard lock(outcome->mu);
    if (outcome->error.empty()) outcome->error = who + ": " + what;
    return make_error(sec::runtime_error, who + ": " + what);
  });
}

behavior data_actor(event_based_actor* self, const GraphSpec* spec, std::shared_ptr<Outcome> outcome) {
  report_failures(self, outcome, "data");
  return {[=](next_atom, int64_t n, int64_t batch) {
    PromptBatch out{spec->next_prompts(n)};
    if (static_cast<int64_t>(out.prompts.size()) != n)
      throw Error("the data source returned " + std::to_string(out.prompts.size()) + " prompts, " + std::to_string(n) + " were asked for");
    std::lock_guard lock(outcome->mu);
    for (int64_t i = 0; i < n; ++i) {
      out.prompts[i].batch = batch;
      out.prompts[i].ticket = batch * n + i;
      outcome->issued.push_back(out.prompts[i].ticket);
    }
    return out;
  }};
}

// LibTorch keeps the intra-op thread count per thread (OpenMP's and MKL's per-thread settings),
// but a thread's first parallel call resets it from the process-wide value; that first call is
// made here, before this thread's own count is set.
void use_threads(int64_t n) {
  if (n <= 0) return;
  (void)at::get_num_threads();
  at::set_num_threads(static_cast<int>(n));
}

struct Pending {
  PromptItem prompt;
  std::vector<Completion> completions;
  int64_t done = 0;
};

struct RemoteGeneratorState {
  std::unique_ptr<RemoteEngine> engine;
};

struct GeneratorState {
  std::unique_ptr<Engine> engine;
  std::map<uint64_t, Pending> pending;  // engine request id -> the prompt and its finished samples
  bool stepping = false;
  // Deterministic mode: what arrived while the engine was busy, applied in arrival order once
  // it is idle, so each batch meets exactly the weights sent before it.
  std::deque<std::variant<PromptBatch, WeightsUpdate>> deferred;
};

// The weights a generator or the trainer continues from: the checkpoint's (merged, for LoRA).
std::map<std::string, torch::Tensor> checkpoint_weights(const GraphResume& r) {
  return read_safetensors(safetensors::Checkpoint::open_dir(r.dir));
}

// Each prompt's samples come from its own seed, so they depend on the run's seed and the
// prompt's ticket, not on which generator drew it or what was batched alongside.
SamplingParams sampling_for(const GraphSpec& spec, const PromptItem& p) {
  SamplingParams params = spec.sampling;
  params.seed = mix_seed(spec.seed, static_cast<uint64_t>(p.ticket));
  return params;
}

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

behavior generator_actor(stateful_actor<GeneratorState>* self, const GraphSpec* spec, actor next,
                         std::shared_ptr<Outcome> outcome, int64_t index) {
  report_failures(self, outcome, "generator " + std::to_string(index));
  use_threads(spec->generator_threads);
  self->state.engine = std::make_unique<Engine>(spec->make_policy(), spec->tokenizer, spec->engine);
  if (spec->resume) self->state.engine->update_weights(checkpoint_weights(*spec->resume), spec->resume->policy_version);
  // Steps go through the mailbox, so weight updates are applied between decode steps.
  auto kick = [=] {
    if (!self->state.stepping) {
      self->state.stepping = true;
      self->send(self, step_atom::value);
    }
  };
  auto admit = [=](PromptBatch& batch) {
    for (auto& p : batch.prompts) {
      auto id = self->state.engine->add_request(p.ids, sampling_for(*spec, p));
      Pending pending{std::move(p), std::vector<Completion>(spec->sampling.n), 0};
      self->state.pending.emplace(id, std::move(pending));
    }
    kick();
  };
  auto busy = [=] { return spec->deterministic && (self->state.engine->has_work() || !self->state.deferred.empty()); };
  // Deterministic mode, once idle: weights and prompts in arrival order, up to the next batch.
  auto drain = [=] {
    auto& st = self->state;
    while (!st.deferred.empty() && !st.engine->has_work()) {
      auto next_item = std::move(st.deferred.front());
      st.deferred.pop_front();
      if (auto* update = std::get_if<WeightsUpdate>(&next_item)) {
        st.engine->update_weights(from_records(update->tensors), update->version);
      } else {
        admit(std::get<PromptBatch>(next_item));
      }
    }
  };
  return {
      [=](PromptBatch& batch) {
        if (busy()) {
          self->state.deferred.emplace_back(std::move(batch));
        } else {
          admit(batch);
        }
      },
      [=](step_atom) {
        auto& st = self->state;
        for (auto& c : st.engine->step()) {
          auto it = st.pending.find(c.request_id);
          if (it == st.pending.end()) continue;
          if (c.finish_reason == FinishReason::abort) throw Error("a generation was aborted");
          it->second.completions[c.index] = std::move(c);
          if (++it->second.done == spec->sampling.n) {
            self->send(next, make_group(it->second));
            st.pending.erase(it);
          }
        }
        if (!st.engine->has_work()) drain();
        if (st.engine->has_work()) {
          self->send(self, step_atom::value);
        } else {
          st.stepping = false;
        }
      },
      [=](WeightsUpdate& update) {
        if (busy()) {
          self->state.deferred.emplace_back(std::move(update));
        } else {
          self->state.engine->update_weights(from_records(update.tensors), update.version);
        }
      },
  };
}

// A generator driving a vLLM-compatible server: each prompt batch is one blocking generate()
// (the server batches the requests itself), so weight updates land between batches, never
// inside one; they reach the server as a safetensors folder through its disk endpoints.
behavior remote_generator_actor(stateful_actor<RemoteGeneratorState>* self, const GraphSpec* spec, actor next,
                                std::shared_ptr<Outcome> outcome, int64_t index) {
  report_failures(self, outcome, "generator " + std::to_string(index));
  self->state.engine = std::make_unique<RemoteEngine>(spec->remote_url, spec->remote, spec->tokenizer);
  self->state.engine->wait_healthy(spec->remote.connect_timeout_s);
  auto push = [=](const std::map<std::string, torch::Tensor>& weights, int64_t version) {
    auto dir = std::filesystem::absolute(spec->weights_dir / ("generator_" + std::to_string(index)));
    std::filesystem::create_directories(dir);
    self->state.engine->update_weights(weights, version, dir);
  };
  // The server loaded its model from its own files; the run starts from the trainer's
  // weights (which may differ, e.g. after an SFT warm-up), so version 0 is pushed first.
  if (spec->resume) {
    push(checkpoint_weights(*spec->resume), spec->resume->policy_version);
  } else {
    push(state_dict(*spec->make_policy()), 0);
  }
  return {
      [=](PromptBatch& batch) {
        std::vector<std::vector<int32_t>> prompts;
        for (const auto& p : batch.prompts) prompts.push_back(p.ids);
        auto completions = self->state.engine->generate(prompts, spec->sampling);
        std::vector<Pending> pending;
        for (auto& p : batch.prompts) pending.push_back({std::move(p), std::vector<Completion>(spec->sampling.n), 0});
        for (auto& c : completions) pending.at(c.request_id).completions.at(c.index) = std::move(c);
        for (auto& p : pending) self->send(next, make_group(p));
      },
      [=](const WeightsUpdate& update) { push(from_records(update.tensors), update.version); },
  };
}

behavior reward_actor(event_based_actor* self, const GraphSpec* spec, actor next, std::shared_ptr<Outcome> outcome) {
  report_failures(self, outcome, "reward");
  return {[=](RolloutGroup& g) {
    auto metadata = nlohmann::json::parse(g.metadata, nullptr, /*allow_exceptions=*/false);
    if (metadata.is_discarded()) metadata = nullptr;
    std::string prompt = spec->tokenizer ? spec->tokenizer->decode(g.prompt_ids) : "";
    std::vector<RewardSample> samples;
    for (const auto& ids : g.completion_ids)
      samples.push_back({prompt, spec->tokenizer ? spec->tokenizer->decode(ids, /*skip_special_tokens=*/true) : "", metadata});
    // A reward that throws (a plugin's bug, a reward service that is down, slow past its
    // retries or answering garbage) fails this group only: it travels on marked failed, so the
    // trainer counts it against its batch and the run goes on.
    try {
      auto scores = spec->reward->score_all(samples);
      g.reward = std::move(scores.total);
      for (auto& c : scores.components) g.rewards[c.name] = std::move(c.scores);
    } catch (const std::exception& e) {
      g.error = std::string("reward: ") + e.what();
      std::cerr << "troupe: prompt " << g.prompt_id << " (batch " << g.batch << ") failed, not trained on: " << g.error
                << std::endl;
    }
    self->send(next, std::move(g));
  }};
}

struct ReferenceState {
  Transformer model{nullptr};
};

behavior reference_actor(stateful_actor<ReferenceState>* self, const GraphSpec* spec, actor next,
                         std::shared_ptr<Outcome> outcome) {
  report_failures(self, outcome, "reference");
  use_threads(spec->trainer_threads);
  self->state.model = spec->make_policy();
  self->state.model->eval();
  return {[=](RolloutGroup& g) {
    if (g.error.empty()) g.reference_logprobs = completion_logprobs(*self->state.model, g, spec->trainer.logprob_chunk);
    self->send(next, std::move(g));
  }};
}

struct TrainerState {
  std::unique_ptr<Trainer> trainer;  // grpo
  std::unique_ptr<PpoTrainer> ppo;   // ppo: the policy with its value head
  // The policy version counts trained batches (steps), whatever num_iterations optimizer
  // steps each one takes, so max_staleness is in the same unit as the credits.
  int64_t policy_version = 0;
  int64_t version() const { return policy_version; }
  Transformer& model() { return ppo ? ppo->model() : trainer->model(); }
  std::ofstream failures;  // run_dir/failures.jsonl: one line per failed group
  std::map<int64_t, std::vector<RolloutGroup>> buffer;  // credit batch -> its finished groups
  int64_t next_batch = 0;
  Clock::time_point idle_since = Clock::now();
  // Checkpoints whose weights are written but whose outstanding rollouts are still arriving.
  struct PendingCheckpoint {
    std::filesystem::path dir;
    int64_t step = 0, policy_version = 0;
    int64_t begin = 0, end = 0;  // the batches released before the checkpoint and not yet trained
    std::vector<RolloutGroup> groups;
  };
  std::vector<PendingCheckpoint> pending_checkpoints;
};

// Metrics of a step; `m` is empty when every group failed, and the loss and rewards are then null.
nlohmann::json step_metrics(const std::optional<StepMetrics>& m, const std::vector<RolloutGroup>& groups,
                            int64_t trained_at, double step_s, double wait_s) {
  nlohmann::json j;
  std::map<std::string, std::pair<double, int64_t>> by_name;
  double staleness_sum = 0;
  int64_t staleness_max = 0, completion_tokens = 0;
  for (const auto& g : groups) {
    int64_t oldest = *std::min_element(g.min_version.begin(), g.min_version.end());
    staleness_sum += trained_at - oldest;
    staleness_max = std::max(staleness_max, trained_at - oldest);
    for (const auto& [name, scores] : g.rewards)
      for (double s : scores) {
        by_name[name].first += s;
        by_name[name].second += 1;
      }
    for (const auto& c : g.completion_ids) completion_tokens += c.size();
  }
  if (m) {
    j["reward/mean"] = m->reward_mean;
    for (const auto& [name, sum] : by_name) j["reward/" + name + "/mean"] = sum.first / std::max<int64_t>(sum.second, 1);
    j["loss"] = m->loss;
    j["kl"] = m->kl;
    j["clip_fraction"] = m->clip_fraction;
    j["behaviour_weight/mean"] = m->behaviour_weight;
    j["grad_norm"] = m->grad_norm;
    j["lr"] = m->lr;
  } else {
    for (const char* key : {"reward/mean", "loss", "kl", "clip_fraction", "behaviour_weight/mean", "grad_norm", "lr"})
      j[key] = nullptr;
  }
  j["staleness/mean"] = groups.empty() ? 0.0 : staleness_sum / groups.size();
  j["staleness/max"] = staleness_max;
  j["time/step_s"] = step_s;
  j["time/generate_wait_s"] = wait_s;
  j["tokens_per_s"] = completion_tokens / std::max(step_s + wait_s, 1e-9);
  j["completion_tokens"] = completion_tokens;
  return j;
}

// Rollout groups as msgpack (doubles hold floats exactly), for the groups a checkpoint keeps.
nlohmann::json to_json(const RolloutGroup& g) {
  return {{"prompt_id", g.prompt_id}, {"batch", g.batch}, {"prompt_ids", g.prompt_ids},
          {"completion_ids", g.completion_ids}, {"behaviour_logprobs", g.behaviour_logprobs},
          {"reference_logprobs", g.reference_logprobs}, {"min_version", g.min_version},
          {"max_version", g.max_version}, {"truncated", g.truncated}, {"rewards", g.rewards},
          {"reward", g.reward}, {"metadata", g.metadata}, {"ticket", g.ticket}, {"error", g.error}};
}

RolloutGroup group_from_json(const nlohmann::json& j) {
  RolloutGroup g;
  j.at("prompt_id").get_to(g.prompt_id);
  j.at("batch").get_to(g.batch);
  j.at("prompt_ids").get_to(g.prompt_ids);
  j.at("completion_ids").get_to(g.completion_ids);
  j.at("behaviour_logprobs").get_to(g.behaviour_logprobs);
  j.at("reference_logprobs").get_to(g.reference_logprobs);
  j.at("min_version").get_to(g.min_version);
  j.at("max_version").get_to(g.max_version);
  j.at("truncated").get_to(g.truncated);
  j.at("rewards").get_to(g.rewards);
  j.at("reward").get_to(g.reward);
  j.at("metadata").get_to(g.metadata);
  j.at("ticket").get_to(g.ticket);
  j.at("error").get_to(g.error);
  if (g.behaviour_logprobs.size() != g.completion_ids.size() || g.min_version.size() != g.completion_ids.size())
    throw Error("a rollout group's per-completion fields disagree in length");
  return g;
}

// The part of a checkpoint that can be written at once: the weights (merged, plus the PEFT
// adapter with LoRA), the optimizer, LibTorch's RNG and PPO's value head. trainer_state.json,
// which marks the checkpoint complete, follows once its outstanding rollouts are in.
void save_weights(const GraphSpec& spec, TrainerState& trainer, const std::filesystem::path& dir) {
  LoadedModel m{spec.model_config, trainer.model(), std::nullopt, nullptr, spec.model_source};
  if (spec.lora) {
    // The exported model has the adapters folded in; the PEFT adapter goes next to it.
    m.model = Transformer(spec.model_config);
    load_weights(*m.model, merged_state_dict(*trainer.model()), "merged LoRA weights");
    save_peft_adapter(*trainer.model(), *spec.lora, dir / "adapter", spec.model_source.string());
  }
  save_hf_dir(m, dir);
  if (trainer.ppo) {
    trainer.ppo->save_value_head(dir / "value_head.safetensors");
    trainer.ppo->save_state(dir / "optimizer.pt");
  } else {
    trainer.trainer->save_state(dir / "optimizer.pt");
  }
  torch::save(at::detail::getDefaultCPUGenerator().get_state(), (dir / "rng.pt").string());
}

void finish_checkpoint(const GraphSpec& spec, TrainerState::PendingCheckpoint& c) {
  std::sort(c.groups.begin(), c.groups.end(), [](const auto& a, const auto& b) { return a.ticket < b.ticket; });
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& g : c.groups) groups.push_back(to_json(g));
  auto bytes = nlohmann::json::to_msgpack(groups);
  std::ofstream(c.dir / "rollouts.msgpack", std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  nlohmann::json state{{"recipe", spec.recipe}, {"model", spec.model_source.string()}, {"step", c.step},
                       {"policy_version", c.policy_version}, {"rollout_batches", {c.begin, c.end}},
                       {"rollouts", "rollouts.msgpack"}};
  // Written to a side file and renamed, so that a kill mid-write leaves no half file behind.
  std::ofstream(c.dir / "trainer_state.json.part") << state.dump(2) << "\n";
  std::filesystem::rename(c.dir / "trainer_state.json.part", c.dir / "trainer_state.json");
}

// Copies the groups pending checkpoints wait for; finishes those that have them all.
void keep_for_checkpoints(const GraphSpec& spec, TrainerState& st, const RolloutGroup* g) {
  for (auto& c : st.pending_checkpoints)
    if (g && g->batch >= c.begin && g->batch < c.end) c.groups.push_back(*g);
  std::erase_if(st.pending_checkpoints, [&](auto& c) {
    if (static_cast<int64_t>(c.groups.size()) < (c.end - c.begin) * spec.batch_groups) return false;
    finish_checkpoint(spec, c);
    return true;
  });
}

// Batches released before step `step` reported and not trained by then: [step, end). With
// sync_every k the controller keeps eta - k + 2 batches out (see the credits there).
int64_t outstanding_end(const GraphSpec& spec, int64_t step) {
  return std::min(spec.steps, step + spec.max_staleness - spec.sync_every + 1);
}

double mean_reward(const std::vector<RolloutGroup>& groups) {
  double sum = 0;
  int64_t n = 0;
  for (const auto& g : groups)
    for (double r : g.reward) {
      sum += r;
      ++n;
    }
  return n ? sum / n : 0.0;
}

// Online DPO's pairs: per group, the completion with the highest total reward is chosen and
// the one with the lowest rejected (the first of each among ties); a group whose rewards all
// tie says nothing about preference and gives none. The reference log-probs, summed over each
// completion, come from the reference actor.
std::vector<dpo::Pair> preference_pairs(const std::vector<RolloutGroup>& groups) {
  std::vector<dpo::Pair> pairs;
  auto sequence = [](const RolloutGroup& g, size_t i) {
    sft::Sequence s;
    s.ids = g.prompt_ids;
    s.ids.insert(s.ids.end(), g.completion_ids[i].begin(), g.completion_ids[i].end());
    s.loss_mask.assign(g.prompt_ids.size(), 0);
    s.loss_mask.resize(s.ids.size(), 1);
    return s;
  };
  auto reference = [](const RolloutGroup& g, size_t i) {
    if (g.reference_logprobs.size() != g.completion_ids.size())
      throw Error("online_dpo: prompt " + std::to_string(g.prompt_id) + " has no reference log-probs (is the reference actor on?)");
    double sum = 0;
    for (float x : g.reference_logprobs[i]) sum += x;
    return sum;
  };
  for (const auto& g : groups) {
    auto [lo, hi] = std::minmax_element(g.reward.begin(), g.reward.end());
    if (g.reward.empty() || *lo == *hi) continue;
    size_t chosen = hi - g.reward.begin(), rejected = lo - g.reward.begin();
    if (g.completion_ids[chosen].empty() || g.completion_ids[rejected].empty()) continue;
    dpo::Pair p{sequence(g, chosen), sequence(g, rejected), reference(g, chosen), reference(g, rejected)};
    pairs.push_back(std::move(p));
  }
  return pairs;
}

behavior trainer_actor(stateful_actor<TrainerState>* self, const GraphSpec* spec, actor controller,
                       std::shared_ptr<Outcome> outcome) {
  report_failures(self, outcome, "trainer");
  use_threads(spec->trainer_threads);
  auto policy = spec->make_policy();
  if (spec->ppo) {
    if (spec->lora) throw Error("ppo with LoRA adapters is not supported yet");
    self->state.ppo = std::make_unique<PpoTrainer>(policy, *spec->ppo, spec->seed);
  } else if (spec->lora) {
    attach_lora(*policy, *spec->lora, spec->seed);
    self->state.trainer = std::make_unique<Trainer>(policy, spec->trainer, lora_parameters(*policy));
  } else {
    self->state.trainer = std::make_unique<Trainer>(policy, spec->trainer);
  }
  if (!spec->run_dir.empty()) {
    std::filesystem::create_directories(spec->run_dir);
    self->state.failures.open(spec->run_dir / "failures.jsonl", std::ios::app);
  }
  if (spec->resume) {
    const auto& r = *spec->resume;
    auto& st = self->state;
    if (spec->lora) {
      load_peft_adapter(*policy, r.dir / "adapter");
    } else {
      load_weights(*policy, checkpoint_weights(r), r.dir.string());
    }
    if (st.ppo) {
      st.ppo->load_value_head(r.dir / "value_head.safetensors");
      st.ppo->load_state(r.dir / "optimizer.pt");
    } else {
      st.trainer->load_state(r.dir / "optimizer.pt");
    }
    torch::Tensor rng;
    torch::load(rng, (r.dir / "rng.pt").string());
    auto generator = at::detail::getDefaultCPUGenerator();  // a handle: set_state needs a non-const one
    generator.set_state(rng);
    st.policy_version = r.policy_version;
    st.next_batch = r.step;
    std::lock_guard lock(outcome->mu);
    for (const auto& g : r.groups) {
      st.buffer[g.batch].push_back(g);
      outcome->issued.push_back(g.ticket);
    }
  }
  auto train_ready = [=] {
    auto& st = self->state;
    for (auto it = st.buffer.find(st.next_batch);
         it != st.buffer.end() && static_cast<int64_t>(it->second.size()) >= spec->batch_groups;
         it = st.buffer.find(st.next_batch)) {
      // A batch is complete when every group handed out for it has come back, trained or failed.
      // In ticket order, so the step does not depend on the order groups arrived in.
      std::sort(it->second.begin(), it->second.end(), [](const auto& a, const auto& b) { return a.ticket < b.ticket; });
      std::vector<RolloutGroup> groups, failed;
      for (auto& g : it->second) (g.error.empty() ? groups : failed).push_back(std::move(g));
      st.buffer.erase(it);
      const int64_t t = st.version();
      const int64_t step = st.next_batch + 1;
      // The bound the credits were sized for: a group made by version v trains at t - v <= eta.
      for (const auto& g : groups) {
        int64_t v = *std::min_element(g.min_version.begin(), g.min_version.end());
        if (t - v > spec->max_staleness)
          throw Error("prompt " + std::to_string(g.prompt_id) + " was generated by policy version " + std::to_string(v) +
                      " but would train at version " + std::to_string(t) + ", beyond max_staleness " +
                      std::to_string(spec->max_staleness));
      }
      for (const auto& g : failed) {
        if (st.failures.is_open())
          st.failures << nlohmann::json{{"step", step}, {"prompt_id", g.prompt_id}, {"ticket", g.ticket}, {"error", g.error}}
                             .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                      << "\n" << std::flush;
      }
      auto start = Clock::now();
      double wait_s = std::chrono::duration<double>(start - st.idle_since).count();
      // With every group of the batch failed there is nothing to learn from: the step passes
      // without an optimizer step, so the version (and the weights generators hold) stay put.
      std::optional<StepMetrics> metrics;
      nlohmann::json extra = nlohmann::json::object();
      if (!groups.empty() && st.ppo) {
        auto p = st.ppo->step(groups);
        metrics = StepMetrics{.loss = p.loss, .kl = p.kl, .clip_fraction = p.clip_fraction,
                              .behaviour_weight = p.behaviour_weight, .grad_norm = p.grad_norm, .lr = p.lr,
                              .reward_mean = p.reward_mean, .tokens = p.tokens, .sequences = p.sequences};
        extra = {{"policy_loss", p.policy_loss}, {"value_loss", p.value_loss},
                 {"value_clip_fraction", p.value_clip_fraction}, {"explained_variance", p.explained_variance},
                 {"returns/mean", p.returns_mean}, {"values/mean", p.values_mean}};
      } else if (!groups.empty() && spec->online_dpo) {
        auto pairs = preference_pairs(groups);
        if (!pairs.empty()) {
          auto d = st.trainer->dpo_step(pairs);
          // kl: the mean log pi/pi_ref of the paired completions (a sequence-level estimate).
          const double beta = spec->trainer.dpo.beta;
          metrics = StepMetrics{.loss = d.loss, .kl = (d.reward_chosen + d.reward_rejected) / (2 * beta),
                                .grad_norm = d.grad_norm, .lr = d.lr, .reward_mean = mean_reward(groups)};
          extra = {{"rewards/accuracies", d.accuracy}, {"rewards/margins", d.margin}, {"rewards/chosen", d.reward_chosen},
                   {"rewards/rejected", d.reward_rejected}};
        }
        extra["pairs"] = pairs.size();
      } else if (!groups.empty()) {
        metrics = st.trainer->grpo_step(groups);
      }
      if (metrics) ++st.policy_version;
      // Weights go out before the report: the controller forwards them to the generators
      // ahead of the prompts it releases in answer, so new prompts meet new weights.
      if (metrics && step % spec->sync_every == 0 && step < spec->steps)
        self->send(controller, WeightsUpdate{st.version(), to_records(merged_state_dict(*st.model()))});
      if (!spec->run_dir.empty() &&
          (step == spec->steps || (spec->checkpoint_every > 0 && step % spec->checkpoint_every == 0))) {
        TrainerState::PendingCheckpoint c{spec->run_dir / "checkpoints" / ("step_" + std::to_string(step)), step,
                                          st.version(), step, outstanding_end(*spec, step), {}};
        save_weights(*spec, st, c.dir);
        for (const auto& [batch, held] : st.buffer)
          if (batch >= c.begin && batch < c.end) c.groups.insert(c.groups.end(), held.begin(), held.end());
        st.pending_checkpoints.push_back(std::move(c));
        keep_for_checkpoints(*spec, st, nullptr);
      }
      st.idle_since = Clock::now();
      double step_s = std::chrono::duration<double>(st.idle_since - start).count();
      auto j = step_metrics(metrics, groups, t, step_s, wait_s);
      j["step"] = step;
      j["policy_version"] = st.version();
      j.update(extra);
      j["rollouts/trained"] = groups.size();
      j["rollouts/failed"] = failed.size();
      {
        std::lock_guard lock(outcome->mu);
        for (const auto& g : groups) outcome->trained.push_back(g.ticket);
        for (const auto& g : failed) outcome->failed.push_back(g.ticket);
      }
      self->send(controller, StepReport{step, j.dump()});
      ++st.next_batch;
    }
  };
  if (spec->resume) train_ready();
  return {[=](RolloutGroup& g) {
    keep_for_checkpoints(*spec, self->state, &g);
    self->state.buffer[g.batch].push_back(std::move(g));
    train_ready();
  }};
}

struct ControllerState {
  actor data;
  std::vector<actor> generators;
  std::vector<actor> all;
  int64_t issued = 0;  // credit batches handed out
  bool shutting_down = false;
  std::ofstream metrics;
};

std::string progress_line(const nlohmann::json& j, int64_t steps) {
  char buf[320];
  const auto failed = j["rollouts/failed"].get<int64_t>();
  if (j["loss"].is_null() && failed == 0) {
    std::snprintf(buf, sizeof buf, "step %lld/%lld  v%lld  no preference pairs (every group's rewards tied), no update",
                  (long long)j["step"].get<int64_t>(), (long long)steps, (long long)j["policy_version"].get<int64_t>());
    return buf;
  }
  if (j["loss"].is_null()) {
    std::snprintf(buf, sizeof buf, "step %lld/%lld  v%lld  all %lld groups failed, no update (see failures.jsonl)",
                  (long long)j["step"].get<int64_t>(), (long long)steps, (long long)j["policy_version"].get<int64_t>(),
                  (long long)failed);
    return buf;
  }
  int n = std::snprintf(buf, sizeof buf, "step %lld/%lld  v%lld  reward %.3f  loss %+.4f  kl %.4f  stale %.2f/%lld  wait %.1fs  train %.1fs  %.0f tok/s",
                (long long)j["step"].get<int64_t>(), (long long)steps, (long long)j["policy_version"].get<int64_t>(),
                j["reward/mean"].get<double>(), j["loss"].get<double>(), j["kl"].get<double>(),
                j["staleness/mean"].get<double>(), (long long)j["staleness/max"].get<int64_t>(),
                j["time/generate_wait_s"].get<double>(), j["time/step_s"].get<double>(), j["tokens_per_s"].get<double>());
  if (failed > 0 && n > 0 && n < static_cast<int>(sizeof buf))
    std::snprintf(buf + n, sizeof buf - n, "  %lld failed", (long long)failed);
  return buf;
}

behavior controller_actor(stateful_actor<ControllerState>* self, const GraphSpec* spec, std::shared_ptr<Outcome> outcome,
                          actor waiter) {
  auto shutdown = [=] {
    auto& st = self->state;
    if (st.shutting_down) return;
    st.shutting_down = true;
    for (const auto& a : st.all) self->send_exit(a, exit_reason::user_shutdown);
    self->send(waiter, tick_atom::value);
    self->quit();
  };
  self->set_down_handler([=](down_msg& dm) {
    if (self->state.shutting_down) return;
    std::lock_guard lock(outcome->mu);
    if (outcome->error.empty())
      outcome->error = "an actor stopped unexpectedly: " + (dm.reason ? to_string(dm.reason) : std::string("normal exit"));
    shutdown();
  });
  report_failures(self, outcome, "controller");

  auto& st = self->state;
  if (!spec->run_dir.empty()) {
    std::filesystem::create_directories(spec->run_dir);
    st.metrics.open(spec->run_dir / "metrics.jsonl", std::ios::app);
  }
  // Downstream first, so each actor is spawned knowing where to send. The trainer's weights
  // come back through the controller, which forwards them to the generators.
  auto trainer = self->spawn<detached>(trainer_actor, spec, actor{self}, outcome);
  auto after_reward = trainer;
  if (spec->reference) after_reward = self->spawn<detached>(reference_actor, spec, trainer, outcome);
  auto reward = self->spawn<detached>(reward_actor, spec, after_reward, outcome);
  for (int64_t i = 0; i < spec->generators; ++i)
    st.generators.push_back(spec->remote_url.empty()
                                ? self->spawn<detached>(generator_actor, spec, reward, outcome, i)
                                : self->spawn<detached>(remote_generator_actor, spec, reward, outcome, i));
  st.data = self->spawn<detached>(data_actor, spec, outcome);
  st.all = st.generators;
  for (const auto& a : {trainer, reward, st.data}) st.all.push_back(a);
  if (spec->reference) st.all.push_back(after_reward);
  for (const auto& a : st.all) self->monitor(a);

  // Credits: batch k is released once step k - eta - 1 has reported, so at most (eta + 1)
  // batches are in flight or buffered and every group trains within eta versions. Weights
  // sent only every sync_every steps lag by up to sync_every - 1 versions, paid for in credits.
  auto release = [=] {
    auto& st = self->state;
    const int64_t k = st.issued++;
    self->request(st.data, infinite, next_atom::value, spec->batch_groups, k).then([=](PromptBatch& batch) {
      auto& st = self->state;
      // Spread the batch over the generators by ticket, so each one's share does not depend
      // on how many batches came before (a resumed run splits as the original did).
      std::vector<PromptBatch> parts(st.generators.size());
      for (auto& p : batch.prompts) parts[p.ticket % parts.size()].prompts.push_back(std::move(p));
      for (size_t g = 0; g < parts.size(); ++g)
        if (!parts[g].prompts.empty()) self->send(st.generators[g], std::move(parts[g]));
    });
  };
  // Resuming after step s, batches [s, first_new_batch) come from the checkpoint; what step s's
  // report released comes next, generated anew by the checkpoint's weights.
  const int64_t start = spec->resume ? spec->resume->step : 0;
  st.issued = spec->resume ? spec->resume->first_new_batch : 0;
  while (st.issued < std::min(spec->steps, start + spec->max_staleness - spec->sync_every + 2)) release();
  self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);

  return {
      [=](const WeightsUpdate& update) {
        for (const auto& g : self->state.generators) self->send(g, update);
      },
      [=](const StepReport& report) {
        auto& st = self->state;
        auto j = nlohmann::json::parse(report.json);
        if (st.metrics.is_open()) st.metrics << report.json << "\n" << std::flush;
        if (!spec->quiet) std::cout << progress_line(j, spec->steps) << std::endl;
        if (spec->on_step) spec->on_step(j);
        {
          std::lock_guard lock(outcome->mu);
          outcome->steps = report.step;
          outcome->metrics.push_back(j);
        }
        if (report.step >= spec->steps) {
          shutdown();
        } else if (st.issued < spec->steps) {
          release();
        }
      },
      [=](tick_atom) {
        if (spec->stop_requested && spec->stop_requested->load()) {
          {
            std::lock_guard lock(outcome->mu);
            if (outcome->error.empty()) outcome->error = "stopped on request after step " + std::to_string(outcome->steps);
          }
          shutdown();
          return;
        }
        self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
      },
  };
}

}  // namespace

GraphResume read_graph_checkpoint(const std::filesystem::path& dir) {
  auto file = dir / "trainer_state.json";
  auto state = nlohmann::json::parse(std::ifstream(file), nullptr, false);
  const char* expected = " (expected step, policy_version, rollout_batches and rollouts from an RL run's checkpoint)";
  if (state.is_discarded() || !state.is_object() || !state.contains("rollout_batches") || !state.contains("rollouts"))
    throw Error(file.string() + ": not a checkpoint of the actor graph" + expected);
  GraphResume r;
  r.dir = dir;
  try {
    r.step = state.at("step").get<int64_t>();
    r.policy_version = state.at("policy_version").get<int64_t>();
    r.first_new_batch = state.at("rollout_batches").at(1).get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(file.string() + ": " + e.what() + expected);
  }
  auto rollouts = dir / state["rollouts"].get<std::string>();
  std::ifstream in(rollouts, std::ios::binary);
  if (!in) throw Error(rollouts.string() + ": cannot open the checkpoint's buffered rollouts");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto groups = nlohmann::json::from_msgpack(bytes, true, false);
  if (groups.is_discarded() || !groups.is_array()) throw Error(rollouts.string() + ": not a msgpack array of rollout groups");
  for (size_t i = 0; i < groups.size(); ++i) {
    try {
      r.groups.push_back(group_from_json(groups[i]));
    } catch (const std::exception& e) {
      throw Error(rollouts.string() + ": group " + std::to_string(i) + ": " + e.what());
    }
    if (r.groups.back().batch < r.step || r.groups.back().batch >= r.first_new_batch)
      throw Error(rollouts.string() + ": group " + std::to_string(i) + " belongs to batch " +
                  std::to_string(r.groups.back().batch) + ", outside the checkpoint's rollout_batches");
  }
  return r;
}

GraphResult run_graph(const GraphSpec& spec) {
  if (!spec.make_policy || !spec.next_prompts || !spec.reward) throw Error("run_graph: the spec needs a policy, a data source and a reward");
  if (spec.batch_groups < 1 || spec.steps < 1 || spec.generators < 1 || spec.max_staleness < 0 || spec.sync_every < 1)
    throw Error("run_graph: batch_groups, steps, generators and sync_every must be >= 1 and max_staleness >= 0");
  if (!spec.remote_url.empty() && spec.generators != 1)
    throw Error("run_graph: a remote generator drives one server; got " + std::to_string(spec.generators) +
                " generators for " + spec.remote_url);
  if (!spec.remote_url.empty() && spec.weights_dir.empty())
    throw Error("run_graph: a remote generator needs weights_dir, where the server reads new weights");
  if (spec.sync_every > spec.max_staleness + 1)
    throw Error("run_graph: sync_every " + std::to_string(spec.sync_every) + " would break max_staleness " +
                std::to_string(spec.max_staleness) + " (needs sync_every <= max_staleness + 1)");
  // Generators hold the checkpoint's weights only at steps where weights were sent.
  if (spec.checkpoint_every % spec.sync_every != 0)
    throw Error("run_graph: checkpoint_every " + std::to_string(spec.checkpoint_every) + " must be a multiple of sync_every " +
                std::to_string(spec.sync_every));
  if (spec.resume) {
    const auto& r = *spec.resume;
    if (r.step >= spec.steps) throw Error(r.dir.string() + ": the checkpoint is at step " + std::to_string(r.step) +
                                          ", the run has only " + std::to_string(spec.steps) + " steps: nothing to do");
    if (r.first_new_batch != outstanding_end(spec, r.step) ||
        static_cast<int64_t>(r.groups.size()) != (r.first_new_batch - r.step) * spec.batch_groups)
      throw Error(r.dir.string() + ": the checkpoint holds " + std::to_string(r.groups.size()) + " rollout groups of batches [" +
                  std::to_string(r.step) + ", " + std::to_string(r.first_new_batch) + "), which does not match this run's " +
                  "trainer.steps, trainer.batch_groups, async.max_staleness and async.sync_every");
  }
  auto outcome = std::make_shared<Outcome>();
  {
    actor_system_config config;
    add_message_types(config);
    actor_system system{config};
    scoped_actor self{system};
    system.spawn(controller_actor, &spec, outcome, actor{self});
    self->receive([](tick_atom) {});
  }  // the system waits here for every actor to finish
  GraphResult r;
  r.error = outcome->error;
  r.steps = outcome->steps;
  r.metrics = outcome->metrics;
  r.issued = outcome->issued;
  r.trained = outcome->trained;
  r.failed = outcome->failed;
  r.ok = r.error.empty() && r.steps == spec.steps;
  return r;
}

}  // namespace troupe
