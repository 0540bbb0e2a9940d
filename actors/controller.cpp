// The controller: spawns and monitors the graph, hands out prompt credits, forwards weight
// notices to every generator (and the newest to each one that joins), frees weight files no
// generator needs, writes metrics.jsonl, samples.jsonl, TensorBoard's tb/ and the progress line,
// and ends the run. Accounting (issued, trained, filtered, failed tickets) arrives in messages
// and leaves in the RunSummary.
#include "actors/controller.hpp"

#include <cmath>
#include <deque>
#include <optional>
#include <variant>
#include <fstream>
#include <iostream>

#include <torch/torch.h>

#include "actors/actor_util.hpp"
#include "actors/generator_pool.hpp"
#include "actors/recipe_run.hpp"
#include "actors/run_status.hpp"
#include "actors/stage_actors.hpp"
#include "actors/stage_router.hpp"
#include "actors/tensorboard.hpp"
#include "actors/trainer_actor.hpp"
#include "actors/weight_plane.hpp"
#include "policy/lora.hpp"

namespace troupe {

using namespace caf;

namespace {

struct ControllerState {
  const GraphSpec* spec = nullptr;
  actor waiter;
  data_actor data;
  rollout_sink sink;   // where generators send groups: the reward actor (or its router)
  trainer_actor trainer;
  // Stages in worker processes: their routers, and what a joining worker builds (JSON).
  std::map<std::string, std::pair<stage_router, std::string>> stages;
  std::unique_ptr<WeightStore> reference_weights;  // the starting policy, for reference workers
  // What goes to the generators, in order: weight notices and releases' prompts (empty until
  // the data actor answers; std::deque keeps the slot's address while it waits).
  std::deque<std::variant<WeightsReady, std::optional<PromptBatch>>> outbox;
  GeneratorPool pool;
  std::optional<Pace> pace;  // from the controller's start
  bool colour = colour_terminal();
  int64_t expected_generators = 0;  // live before the first credits go out
  std::vector<actor> all;           // every actor to stop at the end
  int64_t issued_batches = 0;
  bool started = false, shutting_down = false;
  bool stopping = false;  // a stop was asked for: waiting for the trainer's checkpoint
  std::map<int64_t, WeightsReady> notices;  // versions on the weight plane, newest last
  double load_s = 0;                         // slowest generator load since the last report
  double requantize_s = 0;                   // slowest requantization since the last report
  RunSummary summary;
  std::ofstream metrics, samples;  // run_dir/metrics.jsonl, samples.jsonl (a few completions per step)
  std::unique_ptr<RunBoard> board;  // run_dir/tb: the same, for TensorBoard
  // run_dir/status.json for the dashboard: what each generator and the trainer said they do
  // (ActorBusy), the groups sent by generators since lost, and an actor that failed.
  std::optional<RunStatus> status;
  std::map<std::string, ActorBusy> busy;
  int64_t groups_from_lost = 0;
  std::map<std::string, std::string> failed;  // actor -> why
  int64_t ticks = 0;
  using Clock = std::chrono::steady_clock;
  Clock::time_point began = Clock::now();
  Clock::time_point none_live_since = Clock::now();  // when the last generator went away
  std::string last_loss;                             // why the last one went away
};

using Self = controller_actor::stateful_pointer<ControllerState>;

// The graph as the dashboard shows it: each generator, the reward (and reference) stage with the
// groups between the generators and the trainer, and the trainer.
std::vector<ActorStatus> graph_status(const ControllerState& st) {
  std::vector<ActorStatus> out;
  int64_t sent = st.groups_from_lost;
  auto said = [&](ActorStatus& a, const char* before) {
    if (auto it = st.failed.find(a.name); it != st.failed.end()) {
      a.state = "failed";
      a.detail = it->second;
    } else if (auto it = st.busy.find(a.name); it != st.busy.end()) {
      a.state = it->second.state;
      a.queue = it->second.queue;
    } else {
      a.state = before;
    }
  };
  const auto& slots = st.pool.slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& g = slots[i];
    ActorStatus a{.name = "generator " + std::to_string(i)};
    said(a, "starting");
    if (auto it = st.busy.find(a.name); it != st.busy.end()) sent += it->second.groups;
    if (!g.live && !g.reserved) {
      a.state = "failed";
      a.detail = st.last_loss;
    } else if (g.loaded >= 0) {
      a.detail = "weights v" + std::to_string(g.loaded);
    }
    if (g.remote()) a.detail += (a.detail.empty() ? "" : ", ") + std::string("worker pid ") + std::to_string(g.pid);
    out.push_back(std::move(a));
  }
  auto trainer = st.busy.find("trainer");
  const int64_t received = trainer == st.busy.end() ? 0 : trainer->second.groups;
  ActorStatus reward{.name = st.spec->reference ? "reward + reference" : "reward"};
  reward.queue = std::max<int64_t>(0, sent - received);
  said(reward, "waiting");
  if (reward.state != "failed") reward.state = reward.queue > 0 ? "scoring" : "waiting";
  const int64_t workers = st.spec->reward_processes + st.spec->reference_processes;
  if (workers > 0) reward.detail = "in " + std::to_string(workers) + " worker processes";
  out.push_back(std::move(reward));
  ActorStatus t{.name = "trainer"};
  said(t, "starting");
  if (t.state != "failed") t.detail = "step " + std::to_string(st.summary.steps) + " of " + std::to_string(st.spec->steps);
  out.push_back(std::move(t));
  return out;
}

void write_status(ControllerState& st) {
  if (st.status) st.status->running(st.summary.steps, graph_status(st));
}

// Which of the graph's actors `who` is, for the dashboard; empty when none.
std::string actor_name(const ControllerState& st, const actor_addr& who) {
  if (who == st.trainer.address()) return "trainer";
  if (who == st.sink.address()) return st.spec->reference ? "reward + reference" : "reward";
  for (size_t i = 0; i < st.pool.slots().size(); ++i)
    if (st.pool.slots()[i].handle.address() == who) return "generator " + std::to_string(i);
  return st.spec->reference ? "reward + reference" : "";  // the reference actor, downstream of the reward
}

void finish(Self self, std::string error) {
  auto& st = self->state;
  if (st.shutting_down) return;
  st.shutting_down = true;
  write_status(st);  // the last view, with the actor that failed (run.cpp then writes the end)
  if (st.summary.error.empty()) st.summary.error = std::move(error);
  for (const auto& a : st.all) self->send_exit(a, exit_reason::user_shutdown);
  for (const auto& g : st.pool.slots())
    if (g.handle) self->send_exit(g.handle, exit_reason::user_shutdown);
  anon_send(st.waiter, std::move(st.summary));
  self->quit();
}

void send_all(Self self, GeneratorPool::Sends sends) {
  for (auto& [g, batch] : sends) self->send(g, std::move(batch));
}

// Generators see prompts and weight notices in the order the controller decided on them: a
// notice that arrives while a release's prompts are still on their way from the data actor
// waits behind them (deterministic runs depend on it: batch k meets the weights of its turn).
void flush(Self self) {
  auto& st = self->state;
  while (!st.outbox.empty()) {
    auto& front = st.outbox.front();
    if (auto* notice = std::get_if<WeightsReady>(&front)) {
      for (const auto& g : st.pool.slots())
        if (g.live) self->send(g.handle, *notice);
    } else if (auto* batch = std::get_if<std::optional<PromptBatch>>(&front); batch && *batch) {
      send_all(self, st.pool.assign(std::move((*batch)->prompts)));
    } else {
      return;  // prompts not here yet
    }
    st.outbox.pop_front();
  }
}

// The data stream's next n prompts, for batch `batch`, in the outbox's order.
void draw(Self self, int64_t n, int64_t batch_index) {
  auto& st = self->state;
  st.outbox.emplace_back(std::optional<PromptBatch>());
  auto* slot = &std::get<std::optional<PromptBatch>>(st.outbox.back());
  self->request(st.data, infinite, next_atom::value, n, batch_index).then([=](PromptBatch& batch) {
    auto& st = self->state;
    if (st.spec->keep_history)
      for (const auto& p : batch.prompts) st.summary.issued.push_back(p.ticket);
    // Spread over the generators by ticket (at flush), so each one's share does not depend on
    // how many batches came before (a resumed run splits as the original did).
    *slot = std::move(batch);
    flush(self);
  }, [=](error& e) { finish(self, "data: " + reason_text(e)); });
}

// Batch k goes out once step k - eta - 1 has reported, so at most (eta + 1) batches are in
// flight or buffered and every group trains within eta versions. Weights sent only every
// sync_every steps lag by up to sync_every - 1 versions, paid for in credits. (Dynamic
// sampling's refills take the places of filtered groups: they add no credit.)
void release(Self self) {
  auto& st = self->state;
  draw(self, st.spec->batch_groups, st.issued_batches++);
}

// Once the generators asked for are there, the first credits go out (each generator has been
// sent the newest weights' notice when it joined, so its prompts meet them).
void start_when_ready(Self self) {
  auto& st = self->state;
  if (st.started || st.notices.empty() || st.pool.live() < st.expected_generators) return;
  st.started = true;
  // Resuming after step s, batches [s, first_new_batch) come from the checkpoint; what step s's
  // report released comes next, generated anew by the checkpoint's weights.
  // A resumed trainer may have trained (and reported) its first batch before the workers joined.
  const auto* spec = st.spec;
  const int64_t start = std::max(spec->resume ? spec->resume->step : 0, st.summary.steps);
  st.issued_batches = spec->resume ? spec->resume->first_new_batch : 0;
  while (st.issued_batches < std::min(spec->steps, start + spec->max_staleness - spec->sync_every + 2)) release(self);
  self->send(st.trainer, go_atom::value);
}

// A version every live generator has loaded something newer than can go (the newest always
// stays, for a generator that joins later).
void free_unneeded(ControllerState& st) {
  const int64_t oldest_loaded = st.pool.oldest_loaded();
  while (st.notices.size() > 1 && st.notices.begin()->first < oldest_loaded) {
    free_weights(st.notices.begin()->second);
    st.notices.erase(st.notices.begin());
  }
}

// A generator takes the newest weights before any prompt, then whatever waited for one.
// `pid`: its worker process, 0 for one in this process.
void add_generator(Self self, int64_t index, generator_actor g, int64_t pid) {
  auto& st = self->state;
  st.pool.join(index, g, pid);
  self->monitor(g);
  if (!st.notices.empty()) self->send(g, st.notices.rbegin()->second);
  if (st.started) send_all(self, st.pool.take_held());
}

// A generator in a worker process went away: its prompts go to the others (or wait for one to
// join); the run fails only if none is back within cluster.join_timeout_s.
bool lose_generator(Self self, const down_msg& dm) {
  auto& st = self->state;
  GeneratorPool::Sends resend;
  for (size_t i = 0; i < st.pool.slots().size(); ++i) {
    const auto& s = st.pool.slots()[i];
    if (!s.live || s.handle.address() != dm.source) continue;
    if (!s.remote()) return false;  // an in-process generator failing is a bug: the run stops
    const auto held = s.held.size();
    std::vector<PromptItem> given_up;
    anon_send(st.waiter, WorkerLost{s.pid});  // a hung one is killed, and so replaced
    if (auto it = st.busy.find("generator " + std::to_string(i)); it != st.busy.end()) {
      st.groups_from_lost += it->second.groups;  // a replacement in this slot counts from 0
      st.busy.erase(it);
    }
    st.pool.lose(dm.source, resend, given_up);
    st.last_loss = "generator " + std::to_string(i) + " went away (" + (dm.reason ? reason_text(dm.reason) : "normal exit") + ")";
    std::cerr << "troupe run: " << st.last_loss << "; its " << held - given_up.size() << " unfinished prompts go to "
              << st.pool.live() << " other generators" << (st.pool.live() == 0 ? " once one joins" : "") << std::endl;
    for (const auto& p : given_up)
      self->send(st.sink, failed_group(p, "given up: " + std::to_string(GeneratorPool::kMaxHolders) +
                                              " generators went away while holding this prompt; the last: " + st.last_loss));
    if (st.pool.live() == 0) st.none_live_since = ControllerState::Clock::now();
    send_all(self, std::move(resend));
    return true;
  }
  return false;
}

void report(Self self, const StepReport& r) {
  auto& st = self->state;
  auto j = nlohmann::json::parse(r.json);
  // The trainer's few decoded samples travel in the report; they go to samples.jsonl, not metrics.
  nlohmann::json samples = j.contains("samples") ? std::move(j["samples"]) : nlohmann::json::array();
  j.erase("samples");
  j["time/weights_load_s"] = st.load_s;
  j["time/weights_requantize_s"] = st.requantize_s;
  st.load_s = st.requantize_s = 0;
  j["generators/live"] = st.pool.live();
  j["generators/prompts"] = st.pool.take_handed();
  auto line = j.dump();
  if (st.metrics.is_open()) st.metrics << line << "\n" << std::flush;
  if (st.board) st.board->metrics(j);
  if (st.samples.is_open() && !samples.empty()) {
    nlohmann::json shown = {{"step", r.step}, {"samples", std::move(samples)}};
    st.samples << shown.dump() << "\n" << std::flush;
    st.board->samples(shown);
  }
  if (!st.spec->quiet) std::cout << progress_line(j, st.spec->steps, st.pace->tick(r.step), st.colour) << std::endl;
  st.summary.steps = r.step;
  write_status(st);  // the dashboard's step moves with metrics.jsonl
  if (st.spec->on_step) st.spec->on_step(j);
  if (st.spec->keep_history) {
    st.summary.metrics.push_back(std::move(line));
    st.summary.trained.insert(st.summary.trained.end(), r.trained.begin(), r.trained.end());
    st.summary.failed.insert(st.summary.failed.end(), r.failed.begin(), r.failed.end());
    st.summary.filtered.insert(st.summary.filtered.end(), r.filtered.begin(), r.filtered.end());
  }
  st.pool.done(r.trained);
  st.pool.done(r.failed);
  st.pool.done(r.filtered);
}

// A stage placed in worker processes: its router in this process, and the spec workers build.
rollout_sink add_stage(Self self, const std::string& name, nlohmann::json built, rollout_sink next) {
  auto& st = self->state;
  const GraphSpec& spec = *st.spec;
  auto router = spawn_stage_router(self->system(), {name, std::move(next), spec.retry_lost_groups, spec.worker_join_timeout_s,
                                                    spec.stage_answer_timeout_s, st.waiter});
  st.stages[name] = {router, built.dump()};
  return actor_cast<rollout_sink>(router);
}

// The reference: the starting policy, in this process or (written once to the weight plane)
// in reference workers.
rollout_sink spawn_reference_stage(Self self, rollout_sink next) {
  auto& st = self->state;
  const GraphSpec& spec = *st.spec;
  const auto& make = spec.make_reference ? spec.make_reference : spec.make_policy;
  if (spec.reference_processes == 0)
    return spawn_reference(self->system(), make(), spec.trainer_threads, spec.trainer.logprob_chunk, spec.trainer.temperature,
                           next);
  auto weights = merged_state_dict(*make());
  int64_t bytes = 0;
  for (const auto& [name, t] : weights) bytes += t.numel() * t.element_size();
  st.reference_weights = std::make_unique<WeightStore>(spec.run_dir.empty() ? std::filesystem::path() : spec.run_dir / "weights",
                                                       bytes, spec.listen_address().first);
  const auto written = st.reference_weights->write(weights, 0);
  const auto& source = spec.make_reference ? spec.reference_source : spec.model_source;
  ReferenceStageSpec r{.model = source.string(), .weights = written.path, .url = written.url, .host = written.host,
                       .dtype = spec.model_dtype, .device = spec.generator_device, .threads = spec.trainer_threads,
                       .logprob_chunk = spec.trainer.logprob_chunk, .temperature = spec.trainer.temperature};
  return add_stage(self, "reference", to_json(r), std::move(next));
}

// Downstream first, so each actor is spawned knowing where to send.
void spawn_graph(Self self) {
  auto& st = self->state;
  const GraphSpec& spec = *st.spec;
  auto& system = self->system();
  auto trainer = spawn_trainer(system, &spec, self);
  st.trainer = trainer;
  rollout_sink after_reward = actor_cast<rollout_sink>(trainer);
  if (spec.reference) {
    after_reward = spawn_reference_stage(self, after_reward);
    st.all.push_back(actor_cast<actor>(after_reward));
  }
  if (spec.reward_processes > 0)
    st.sink = add_stage(self, "reward", to_json(RewardStageSpec{spec.reward_specs, spec.tokenizer_path.string()}), after_reward);
  else
    st.sink = spawn_reward(system, spec.reward, spec.tokenizer, after_reward);
  st.data = spawn_data(system, spec.next_prompts,
                       spec.resume ? spec.resume->first_new_batch * spec.batch_groups + spec.resume->refilled : 0);
  for (const auto& a : {actor_cast<actor>(trainer), actor_cast<actor>(st.sink), actor_cast<actor>(st.data)}) st.all.push_back(a);
  for (const auto& a : st.all) self->monitor(a);
  if (spec.generator_processes > 0) {
    st.expected_generators = spec.generator_processes;
    return;  // worker processes join (join_atom)
  }
  st.expected_generators = spec.generators;
  for (int64_t i = 0; i < spec.generators; ++i) {
    generator_actor g;
    if (!spec.remote_url.empty()) {
      RemoteGeneratorSpec r{spec.remote_url, spec.remote, spec.tokenizer, spec.sampling, spec.weights_dir.string()};
      g = spawn_remote_generator(system, std::move(r), st.sink, self, i);
    } else {
      // In this process: the tokenizer the graph loaded already is the one tokenizer_path names.
      g = spawn_generator(system, generator_spec(spec), st.sink, self, i,
                          spec.tokenizer_path.empty() ? std::nullopt : spec.tokenizer);
    }
    add_generator(self, st.pool.reserve(), g, /*pid=*/0);
  }
}

// Every 200 ms: a stop request, and workers that do not come.
void tick(Self self) {
  auto& st = self->state;
  if (st.spec->stop_requested && st.spec->stop_requested->load() && !st.stopping) {
    // With a run folder the trainer checkpoints after the step in progress first (stop_atom back).
    if (st.spec->run_dir.empty()) {
      finish(self, "stopped on request after step " + std::to_string(st.summary.steps));
      return;
    }
    st.stopping = true;
    self->send(st.trainer, stop_atom::value);
  }
  const auto now = ControllerState::Clock::now();
  const double limit = st.spec->worker_join_timeout_s;
  if (!st.started && st.spec->generator_processes > 0 && std::chrono::duration<double>(now - st.began).count() > limit) {
    finish(self, std::to_string(st.pool.live()) + " of " + std::to_string(st.expected_generators) +
                     " generator workers joined within cluster.join_timeout_s = " + std::to_string(limit) + " s");
    return;
  }
  if (st.started && st.pool.live() == 0 && std::chrono::duration<double>(now - st.none_live_since).count() > limit) {
    finish(self, "no generator for cluster.join_timeout_s = " + std::to_string(limit) + " s after the last one went away (" +
                     st.last_loss + "); " + std::to_string(st.pool.unfinished()) + " prompts unfinished");
    return;
  }
  if (++st.ticks % 5 == 0) write_status(st);  // about once a second
  self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
}

// A generator worker joins with the generator it built, in the slot it was given.
void join_generator(Self self, int64_t index, generator_actor g, int64_t pid) {
  auto& st = self->state;
  if (!st.pool.has(index) || st.pool.at(index).live) {
    self->send_exit(g, make_error(sec::runtime_error, "generator slot " + std::to_string(index) + " is not free"));
    return;
  }
  add_generator(self, index, g, pid);
  std::cout << "troupe run: generator " << index << " joined from another process (" << st.pool.live() << " live";
  if (!st.notices.empty()) std::cout << ", sent weights v" << st.notices.rbegin()->first;
  std::cout << ")" << std::endl;
  start_when_ready(self);
}

// Handlers for failures, the metrics file, the graph, and its end with the controller's.
void start(Self self) {
  auto& st = self->state;
  const GraphSpec* spec = st.spec;
  st.pace.emplace(spec->steps);
  self->set_down_handler([=](down_msg& dm) {
    if (self->state.shutting_down || lose_generator(self, dm)) return;
    std::string why = dm.reason ? reason_text(dm.reason) : "normal exit";
    if (auto name = actor_name(self->state, dm.source); !name.empty()) self->state.failed[name] = why;
    finish(self, "an actor stopped unexpectedly: " + why);
  });
  // An exception here ends the run with a summary like any other failure.
  self->set_exception_handler([=](scheduled_actor*, std::exception_ptr& p) -> error {
    const std::string what = "controller: " + describe(p);
    finish(self, what);
    return make_error(sec::runtime_error, what);
  });
  if (!spec->run_dir.empty()) {
    std::filesystem::create_directories(spec->run_dir);
    st.metrics.open(spec->run_dir / "metrics.jsonl", std::ios::app);
    // Resuming, samples.jsonl is cut back to the checkpoint's step as metrics.jsonl was (run.cpp);
    // tb/ is then made again from both, so it shows exactly what they hold.
    if (spec->resume) recipe::keep_steps_up_to(spec->run_dir / "samples.jsonl", spec->resume->step);
    st.samples.open(spec->run_dir / "samples.jsonl", std::ios::app);
    st.status.emplace(spec->run_dir, spec->recipe, spec->steps);
    write_status(st);
    try {
      st.board = std::make_unique<RunBoard>(spec->run_dir);
    } catch (const std::exception& e) {
      finish(self, e.what());
      return;
    }
  }
  if (spec->resume && spec->keep_history)
    for (const auto& g : spec->resume->groups) st.summary.issued.push_back(g.ticket);
  spawn_graph(self);
  // However the controller ends, the actors it spawned end with it (workers watch it themselves).
  std::vector<actor> local = st.all;
  for (const auto& g : st.pool.slots())
    if (g.handle) local.push_back(actor_cast<actor>(g.handle));
  self->attach_functor([local](const error&) {
    for (const auto& a : local) anon_send_exit(a, exit_reason::user_shutdown);
  });
  self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
}

controller_actor::behavior_type controller(Self self, const GraphSpec* spec, actor waiter) {
  self->state.spec = spec;
  self->state.waiter = waiter;
  start(self);
  return {
      [=](const WeightsReady& notice) {
        auto& st = self->state;
        st.notices[notice.version] = notice;
        st.outbox.emplace_back(notice);
        flush(self);
        start_when_ready(self);
      },
      [=](const WeightsLoaded& loaded) {
        auto& st = self->state;
        st.pool.loaded(loaded.generator, loaded.version);
        st.load_s = std::max(st.load_s, loaded.load_s);
        st.requantize_s = std::max(st.requantize_s, loaded.requantize_s);
        free_unneeded(st);
      },
      [=](const StepReport& r) {
        report(self, r);
        auto& st = self->state;
        if (r.step >= st.spec->steps) {
          finish(self, "");
        } else if (st.started && st.issued_batches < st.spec->steps) {
          release(self);
        }
      },
      [=](tick_atom) { tick(self); },
      [=](ActorBusy& busy) {
        auto name = busy.actor;
        self->state.busy[name] = std::move(busy);
      },
      // The trainer's next batch lacks n groups (dynamic sampling filtered them): n more prompts.
      // In deterministic and finish modes they queue behind prompts already sent (later batches),
      // which keeps the order fixed at the price of the trainer waiting that much longer.
      [=](refill_atom, int64_t batch, int64_t n) {
        if (!self->state.shutting_down) draw(self, n, batch);
      },
      [=](stop_atom, int64_t step) {
        finish(self, "stopped on request after step " + std::to_string(step) + " (checkpoint " +
                         (self->state.spec->run_dir / "checkpoints" / ("step_" + std::to_string(step))).string() + ")");
      },
      // A worker process asks to join, at the start or in the middle of the run (elastic).
      [=](join_atom) -> result<int64_t, std::string, rollout_sink> {
        auto& st = self->state;
        return {st.pool.reserve(), to_json(generator_spec(*st.spec)).dump(), st.sink};
      },
      // A reward or reference worker asks what to build and where to join.
      [=](join_atom, const std::string& role) -> result<std::string, stage_router> {
        auto& st = self->state;
        auto it = st.stages.find(role);
        if (it == st.stages.end())
          return make_error(sec::runtime_error, "this run places no " + role + " in worker processes");
        return {it->second.second, it->second.first};
      },
      [=](join_atom, int64_t index, generator_actor g, int64_t pid) { join_generator(self, index, g, pid); },
  };
}

}  // namespace

controller_actor spawn_controller(actor_system& system, const GraphSpec* spec, actor waiter) {
  return system.spawn(controller, spec, std::move(waiter));
}

}  // namespace troupe
