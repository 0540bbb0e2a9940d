// The trainer actor: buffers rollout groups by credit batch, trains each complete batch in
// ticket order with the run's RL recipe, checks the staleness bound, writes each new version
// to the weight plane and tells the controller, checkpoints, and reports every step with its
// trained, filtered and failed tickets (and a few decoded samples, for samples.jsonl). With
// dynamic sampling it filters groups whose rewards tie and asks the controller for prompts to
// take their places.
#include "actors/trainer_actor.hpp"

#include <chrono>
#include <fstream>
#include <set>

#include <torch/torch.h>

#include "actors/actor_util.hpp"
#include "actors/graph_checkpoint.hpp"
#include "actors/rl_recipe.hpp"
#include "actors/trainer_ranks.hpp"
#include "actors/weight_plane.hpp"
#include "policy/error.hpp"
#include "policy/lora.hpp"

namespace troupe {

using namespace caf;
using Clock = std::chrono::steady_clock;

namespace {

struct TrainerActorState {
  const GraphSpec* spec = nullptr;
  controller_actor controller;
  std::unique_ptr<RlRecipe> recipe;
  std::unique_ptr<WeightStore> weights;
  std::unique_ptr<PendingCheckpoints> checkpoints;
  std::unique_ptr<RankChannel> ranks;  // to trainer ranks 1..N-1, when there are any
  // Trained batches that changed the weights: max_staleness counts in this unit, whatever
  // optimizer steps each batch takes.
  int64_t policy_version = 0;
  int64_t published_version = -1;  // the newest version on the weight plane
  std::ofstream failures;  // run_dir/failures.jsonl: one line per failed group
  std::map<int64_t, std::vector<RolloutGroup>> buffer;  // credit batch -> its finished groups
  int64_t next_batch = 0;
  // Dynamic sampling: prompts drawn for a batch beyond its batch_groups, and in how many rounds;
  // and such prompts drawn in the whole run (checkpointed: the data cursor counts them).
  std::map<int64_t, int64_t> refills, rounds;
  int64_t refilled = 0;
  // The tickets of the buffered batches: a prompt re-issued after its generator went away may
  // come back twice (the first copy was already on its way); the second is dropped. A batch
  // trains only once every group handed out for it is back, so a group of a trained batch is
  // such a second copy too, and a trained batch's tickets leave the set (a long run holds none).
  std::set<int64_t> arrived;
  int64_t duplicates = 0;  // dropped since the last step
  bool started = false;    // the controller said go
  bool stop_asked = false;  // checkpoint at the next step that can be resumed from, then train no more
  int64_t stop_at = -1;     // that step, once trained
  Clock::time_point idle_since = Clock::now();
  int64_t received = 0;  // groups taken in, duplicates left out (the dashboard's count)
};

using Self = trainer_actor::stateful_pointer<TrainerActorState>;

// A group dynamic sampling filters: every completion scored alike, so no advantage to learn from.
// Judged on the rewards before overlong shaping, as DAPO's filter judges accuracy.
bool rewards_tie(const RolloutGroup& g) {
  return g.error.empty() && std::adjacent_find(g.reward.begin(), g.reward.end(), std::not_equal_to<>()) == g.reward.end();
}

// Metrics of a step; `m` is empty when nothing was trained, and the loss and rewards are then null.
// Rewards are the batch's as sampled: the trained groups and the filtered ones.
nlohmann::json step_metrics(const std::optional<StepMetrics>& m, const std::vector<RolloutGroup>& groups,
                            const std::vector<RolloutGroup>& filtered, int64_t trained_at, double step_s, double wait_s) {
  nlohmann::json j;
  std::map<std::string, std::pair<double, int64_t>> by_name;
  double staleness_sum = 0, reward_sum = 0, generate_s = 0;
  int64_t staleness_max = 0, completion_tokens = 0, completions = 0, mixed = 0;
  for (const auto& g : groups) {
    int64_t oldest = *std::min_element(g.min_version.begin(), g.min_version.end());
    staleness_sum += trained_at - oldest;
    staleness_max = std::max(staleness_max, trained_at - oldest);
    for (int64_t i = 0; i < g.size(); ++i) mixed += g.min_version[i] != g.max_version[i];
  }
  for (const auto* list : {&groups, &filtered})
    for (const auto& g : *list) {
      for (const auto& [name, scores] : g.rewards)
        for (double s : scores) {
          by_name[name].first += s;
          by_name[name].second += 1;
        }
      for (double r : g.reward) reward_sum += r;
      generate_s += g.generate_s;
      completions += g.size();
      for (const auto& c : g.completion_ids) completion_tokens += c.size();
    }
  if (m) {
    j["reward/mean"] = filtered.empty() ? m->reward_mean : reward_sum / completions;
    for (const auto& [name, sum] : by_name) j["reward/" + name + "/mean"] = sum.first / std::max<int64_t>(sum.second, 1);
    j["loss"] = m->loss;
    j["kl"] = m->kl;
    j["clip_fraction"] = m->clip_fraction;
    j["behaviour_weight/mean"] = m->behaviour_weight;
    j["grad_norm"] = m->grad_norm;
    j["lr"] = m->lr;
    if (m->overlong_penalty) j["overlong/penalty_mean"] = *m->overlong_penalty;  // added to the rewards for the advantages
    if (m->teacher_kl) j["distill/reverse_kl"] = *m->teacher_kl;                // the student's tokens under the teacher
    if (const auto& c = m->correction) {
      j["correction/masked_fraction"] = c->masked_fraction;
      j["correction/truncated_fraction"] = c->truncated_fraction;
      const char* names[] = {"correction/ratio_min", "correction/ratio_p05", "correction/ratio_p50", "correction/ratio_p95",
                             "correction/ratio_max"};
      for (int i = 0; i < 5; ++i) j[names[i]] = c->ratio_quantiles[i];
      // null when no completion of the step was sampled wholly at the trainer's version
      j["mismatch/kl"] = c->mismatch_tokens > 0 ? nlohmann::json(c->mismatch_kl) : nlohmann::json();
      j["mismatch/tokens"] = c->mismatch_tokens;
    }
  } else {
    for (const char* key : {"reward/mean", "loss", "kl", "clip_fraction", "behaviour_weight/mean", "grad_norm", "lr"})
      j[key] = nullptr;
    // Nothing trained, but the filtered groups were scored all the same.
    if (completions > 0) {
      j["reward/mean"] = reward_sum / completions;
      for (const auto& [name, sum] : by_name) j["reward/" + name + "/mean"] = sum.first / std::max<int64_t>(sum.second, 1);
    }
  }
  j["staleness/mean"] = groups.empty() ? 0.0 : staleness_sum / groups.size();
  j["staleness/max"] = staleness_max;
  j["rollouts/mixed_versions"] = mixed;  // trained completions sampled by more than one version (partial_rollouts continue)
  j["time/step_s"] = step_s;
  j["time/generate_wait_s"] = wait_s;
  j["time/generate_s"] = generate_s;  // generator seconds behind the step's groups, summed over generators
  j["tokens_per_s"] = completion_tokens / std::max(step_s + wait_s, 1e-9);
  j["completion_tokens"] = completion_tokens;
  return j;
}

// What a run shows of a step's rollouts (samples.jsonl, TensorBoard's text): the first completion of
// each of the first kShownSamples groups (trained ones first, then filtered), decoded here and only
// these, as the reward decodes them. Nothing without a run folder.
constexpr size_t kShownSamples = 2;
nlohmann::json shown_samples(const GraphSpec& spec, const std::vector<RolloutGroup>& groups,
                             const std::vector<RolloutGroup>& filtered) {
  auto out = nlohmann::json::array();
  if (spec.run_dir.empty() || !spec.tokenizer) return out;
  for (const auto* list : {&groups, &filtered})
    for (const auto& g : *list) {
      if (out.size() == kShownSamples) return out;
      if (g.size() == 0) continue;
      auto rewards = nlohmann::json::object();
      for (const auto& [name, scores] : g.rewards)
        if (!scores.empty()) rewards[name] = scores[0];
      out.push_back({{"prompt_id", g.prompt_id},
                     {"prompt", spec.tokenizer->decode(g.prompt_ids)},
                     {"completion", spec.tokenizer->decode(g.completion_ids[0], /*skip_special_tokens=*/true)},
                     {"reward", g.reward.empty() ? nlohmann::json() : nlohmann::json(g.reward[0])},
                     {"rewards", std::move(rewards)}});
    }
  return out;
}

// The current weights (adapters merged) to the weight plane, and the notice to the controller,
// which forwards it to every generator ahead of the prompts it releases next.
WeightsReady publish(Self self) {
  auto& st = self->state;
  if (st.ranks) st.ranks->send({RankCommand::Op::publish});
  WholeWeights whole(st.recipe->data_parallel());
  auto weights = merged_state_dict(*st.recipe->model());
  if (!st.weights) {
    // Made with the first version: its size says whether shared memory has room for two.
    int64_t bytes = 0;
    for (const auto& [name, t] : weights) bytes += t.nbytes();
    const GraphSpec& spec = *st.spec;
    st.weights = std::make_unique<WeightStore>(spec.run_dir.empty() ? std::filesystem::path() : spec.run_dir / "weights",
                                               bytes, spec.listens() ? spec.listen_address().first : "");
  }
  auto notice = st.weights->write(weights, st.policy_version);
  st.published_version = st.policy_version;
  self->send(st.controller, notice);
  return notice;
}

// The bound the credits were sized for: a group made by version v trains at t only if t - v <= eta.
void check_staleness(const GraphSpec& spec, const std::vector<RolloutGroup>& groups, int64_t t) {
  for (const auto& g : groups) {
    int64_t v = *std::min_element(g.min_version.begin(), g.min_version.end());
    if (t - v > spec.max_staleness)
      throw Error("prompt " + std::to_string(g.prompt_id) + " was generated by policy version " + std::to_string(v) +
                  " but would train at version " + std::to_string(t) + ", beyond max_staleness " +
                  std::to_string(spec.max_staleness));
  }
}

void log_failures(TrainerActorState& st, const std::vector<RolloutGroup>& failed, int64_t step) {
  if (!st.failures.is_open()) return;
  for (const auto& g : failed)
    st.failures << nlohmann::json{{"step", step}, {"prompt_id", g.prompt_id}, {"ticket", g.ticket}, {"error", g.error}}
                       .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                << "\n" << std::flush;
}

// Tells the controller what the trainer does (the dashboard's view): `state`, with the groups
// buffered for later batches.
void tell_busy(Self self, const char* state) {
  auto& st = self->state;
  int64_t buffered = 0;
  for (const auto& [batch, groups] : st.buffer) buffered += static_cast<int64_t>(groups.size());
  self->send(st.controller, ActorBusy{"trainer", state, buffered, st.received});
}

// Once the stop checkpoint is complete (its outstanding groups all in), the controller ends the run.
void tell_stopped(Self self) {
  auto& st = self->state;
  for (int64_t step : st.checkpoints->take_finished())
    if (step == st.stop_at) self->send(st.controller, stop_atom::value, step);
}

// Trains batch st.next_batch (complete: every group handed out for it is back, trained or failed).
void train_batch(Self self, std::vector<RolloutGroup> batch) {
  auto& st = self->state;
  const GraphSpec& spec = *st.spec;
  // In ticket order, so the step does not depend on the order groups arrived in.
  std::sort(batch.begin(), batch.end(), [](const auto& a, const auto& b) { return a.ticket < b.ticket; });
  std::vector<RolloutGroup> groups, failed, filtered;
  for (auto& g : batch) {
    st.arrived.erase(g.ticket);
    if (!g.error.empty())
      failed.push_back(std::move(g));
    else if (spec.dynamic_sampling && rewards_tie(g))
      filtered.push_back(std::move(g));
    else
      groups.push_back(std::move(g));
  }
  const int64_t t = st.policy_version;
  const int64_t step = st.next_batch + 1;
  check_staleness(spec, groups, t);
  log_failures(st, failed, step);
  auto start = Clock::now();
  double wait_s = std::chrono::duration<double>(start - st.idle_since).count();
  tell_busy(self, "training");
  // With every group of the batch failed there is nothing to learn from: the step passes
  // without an update, so the version (and the weights generators hold) stay put.
  std::optional<RlUpdate> update;
  nlohmann::json extra = nlohmann::json::object();
  if (!groups.empty()) {
    if (st.ranks) st.ranks->send({RankCommand::Op::train, groups});
    update = st.recipe->train(groups, extra);
  }
  if (update) {
    ++st.policy_version;
    extra.update(update->extra);
  }
  std::optional<WeightsReady> sent;
  // At every sync step, whatever changed since the last one (the update may have come at an
  // earlier step of the interval, this one training nothing).
  if (step % spec.sync_every == 0 && step < spec.steps && st.policy_version > st.published_version) sent = publish(self);
  // A stop request checkpoints at a sync step (the generators hold those weights on resume).
  const bool stop_here = st.stop_asked && st.stop_at < 0 && step % spec.sync_every == 0;
  if (stop_here) st.stop_at = step;
  if (!spec.run_dir.empty() &&
      (step == spec.steps || stop_here || (spec.checkpoint_every > 0 && step % spec.checkpoint_every == 0))) {
    if (st.ranks) st.ranks->send({RankCommand::Op::checkpoint, {}, checkpoint_dir(spec, step)});
    st.checkpoints->start(*st.recipe, step, st.policy_version, st.buffer, st.refilled);
  }
  st.idle_since = Clock::now();
  double step_s = std::chrono::duration<double>(st.idle_since - start).count();
  auto j = step_metrics(update ? std::optional(update->metrics) : std::nullopt, groups, filtered, t, step_s, wait_s);
  j["step"] = step;
  j["policy_version"] = st.policy_version;
  j.update(extra);
  j["rollouts/trained"] = groups.size();
  j["rollouts/failed"] = failed.size();
  if (spec.dynamic_sampling) {
    j["rollouts/filtered"] = filtered.size();
    j["dynamic_sampling/rounds"] = st.rounds[st.next_batch];  // refills this batch took
    if (update) j["reward/trained_mean"] = update->metrics.reward_mean;  // ties left out
  }
  j["rollouts/duplicates_dropped"] = st.duplicates;
  st.duplicates = 0;
  if (sent) {
    j["weights/bytes"] = sent->bytes;
    j["time/weights_write_s"] = sent->write_s;
  }
  j["samples"] = shown_samples(spec, groups, filtered);  // the controller takes them out of the metrics
  // A completion cut by max_tokens can end mid-character: invalid UTF-8 becomes U+FFFD, not an exception.
  StepReport report{.step = step, .json = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)};
  for (const auto& g : groups) report.trained.push_back(g.ticket);
  for (const auto& g : failed) report.failed.push_back(g.ticket);
  for (const auto& g : filtered) report.filtered.push_back(g.ticket);
  self->send(st.controller, std::move(report));
  st.refills.erase(st.next_batch);
  st.rounds.erase(st.next_batch);
  ++st.next_batch;
  tell_stopped(self);
  tell_busy(self, "waiting");
}

int64_t refills_of(const TrainerActorState& st, int64_t b) {
  auto it = st.refills.find(b);
  return it == st.refills.end() ? 0 : it->second;
}

// Dynamic sampling: the groups batch `b` still lacks once every group handed out for it is back
// (its filtered groups not yet replaced), or 0 when it trains as it is: full, or out of rounds.
int64_t lacking(const TrainerActorState& st, int64_t b, const std::vector<RolloutGroup>& arrived) {
  if (!st.spec->dynamic_sampling) return 0;
  auto rounds = st.rounds.find(b);
  if (rounds != st.rounds.end() && rounds->second >= st.spec->dynamic_sampling_rounds) return 0;
  return std::count_if(arrived.begin(), arrived.end(), rewards_tie) - refills_of(st, b);
}

// Trains the next batch while it is complete. Refills are asked for the next batch only, after
// the previous step's report: the data stream's order (and so a deterministic run) does not
// depend on timing, and a checkpoint knows every prompt drawn before it (graph_checkpoint.hpp).
void train_ready(Self self) {
  auto& st = self->state;
  while (st.stop_at < 0) {
    const int64_t b = st.next_batch;
    auto it = st.buffer.find(b);
    const int64_t handed_out = st.spec->batch_groups + refills_of(st, b);
    if (it == st.buffer.end() || static_cast<int64_t>(it->second.size()) < handed_out) return;
    if (const int64_t n = lacking(st, b, it->second); n > 0) {
      st.refills[b] += n;
      st.rounds[b] += 1;
      st.refilled += n;
      self->send(st.controller, refill_atom::value, b, n);
      return;
    }
    auto batch = std::move(it->second);
    st.buffer.erase(it);
    train_batch(self, std::move(batch));
  }
}

// The checkpoint's weights (or adapter), recipe state, RNG, version and buffered groups.
void restore(TrainerActorState& st, const GraphResume& r) {
  restore_recipe(*st.recipe, *st.spec, r);
  st.policy_version = r.policy_version;
  st.next_batch = r.step;
  st.refilled = r.refilled;
  for (const auto& g : r.groups) {
    st.buffer[g.batch].push_back(g);
    st.arrived.insert(g.ticket);
  }
}

trainer_actor::behavior_type trainer(Self self, const GraphSpec* spec, controller_actor controller) {
  name_failures(self, "trainer");
  use_threads(spec->trainer_threads);
  auto& st = self->state;
  st.spec = spec;
  st.controller = std::move(controller);
  st.recipe = make_rl_recipe(spec->recipe, spec->make_policy(), *spec);
  if (spec->trainer_group && spec->trainer_group->size() > 1) {
    st.ranks = std::make_unique<RankChannel>(spec->trainer_group, st.recipe->model()->lm_head_weight().device());
    self->delayed_send(self, st.ranks->keepalive_interval(), tick_atom::value);
  }
  st.checkpoints = std::make_unique<PendingCheckpoints>(*spec);
  if (!spec->run_dir.empty()) {
    std::filesystem::create_directories(spec->run_dir);
    st.failures.open(spec->run_dir / "failures.jsonl", std::ios::app);
  }
  if (spec->resume) restore(st, *spec->resume);
  // Generators start from these weights: nothing is generated before they arrive.
  publish(self);
  return {[=](stop_atom) { self->state.stop_asked = true; },
          [=](tick_atom) {
            // While the batch fills: the other ranks wait for a command no longer than their timeout.
            self->state.ranks->keep_alive();
            self->delayed_send(self, self->state.ranks->keepalive_interval(), tick_atom::value);
          },
          [=](go_atom) {
    self->state.started = true;
    train_ready(self);
  },
  [=](RolloutGroup& g) {
    if (g.batch < self->state.next_batch || !self->state.arrived.insert(g.ticket).second) {
      ++self->state.duplicates;
      return;
    }
    self->state.checkpoints->add(g);
    tell_stopped(self);
    self->state.buffer[g.batch].push_back(std::move(g));
    ++self->state.received;
    if (self->state.started) train_ready(self);
    tell_busy(self, "waiting");  // for the next group, or the rest of a batch
  }};
}

}  // namespace

trainer_actor spawn_trainer(actor_system& system, const GraphSpec* spec, controller_actor controller) {
  return system.spawn<detached>(trainer, spec, std::move(controller));
}

}  // namespace troupe
