// The controller: spawns and monitors the graph, hands out prompt credits, forwards weight
// notices to every generator (and the newest to each one that joins), frees weight files no
// generator needs, writes metrics.jsonl and the progress line, and ends the run. Accounting
// (issued, trained, failed tickets) arrives in messages and leaves in the RunSummary.
#include "actors/controller.hpp"

#include <fstream>
#include <iostream>

#include "actors/actor_util.hpp"
#include "actors/stage_actors.hpp"
#include "actors/trainer_actor.hpp"
#include "actors/weight_plane.hpp"

namespace troupe {

using namespace caf;

namespace {

struct Generator {
  generator_actor handle;
  int64_t loaded = -1;  // the newest version it has loaded
};

struct ControllerState {
  const GraphSpec* spec = nullptr;
  actor waiter;
  data_actor data;
  rollout_sink sink;                 // where generators send groups: the reward actor
  std::vector<Generator> generators;  // by index
  int64_t expected_generators = 0;
  std::vector<actor> all;            // every actor to stop at the end
  int64_t issued_batches = 0;
  bool started = false, shutting_down = false;
  std::map<int64_t, WeightsReady> notices;  // versions on the weight plane, newest last
  double load_s = 0;                         // slowest generator load since the last report
  RunSummary summary;
  std::ofstream metrics;
  std::chrono::steady_clock::time_point began = std::chrono::steady_clock::now();
};

using Self = controller_actor::stateful_pointer<ControllerState>;

void finish(Self self, std::string error) {
  auto& st = self->state;
  if (st.shutting_down) return;
  st.shutting_down = true;
  if (st.summary.error.empty()) st.summary.error = std::move(error);
  for (const auto& a : st.all) self->send_exit(a, exit_reason::user_shutdown);
  for (const auto& g : st.generators)
    if (g.handle) self->send_exit(g.handle, exit_reason::user_shutdown);
  anon_send(st.waiter, std::move(st.summary));
  self->quit();
}

// Batch k goes out once step k - eta - 1 has reported, so at most (eta + 1) batches are in
// flight or buffered and every group trains within eta versions. Weights sent only every
// sync_every steps lag by up to sync_every - 1 versions, paid for in credits.
void release(Self self) {
  auto& st = self->state;
  const int64_t k = st.issued_batches++;
  self->request(st.data, infinite, next_atom::value, st.spec->batch_groups, k).then([=](PromptBatch& batch) {
    auto& st = self->state;
    // Spread the batch over the generators by ticket, so each one's share does not depend on
    // how many batches came before (a resumed run splits as the original did).
    std::vector<PromptBatch> parts(st.generators.size());
    for (auto& p : batch.prompts) {
      st.summary.issued.push_back(p.ticket);
      parts[p.ticket % parts.size()].prompts.push_back(std::move(p));
    }
    for (size_t g = 0; g < parts.size(); ++g)
      if (!parts[g].prompts.empty()) self->send(st.generators[g].handle, std::move(parts[g]));
  });
}

// Once every generator is there and holds the starting weights' notice, the first credits go out.
void start_when_ready(Self self) {
  auto& st = self->state;
  if (st.started || st.notices.empty() || static_cast<int64_t>(st.generators.size()) < st.expected_generators) return;
  for (const auto& g : st.generators)
    if (!g.handle) return;
  st.started = true;
  // Resuming after step s, batches [s, first_new_batch) come from the checkpoint; what step s's
  // report released comes next, generated anew by the checkpoint's weights.
  const auto* spec = st.spec;
  const int64_t start = spec->resume ? spec->resume->step : 0;
  st.issued_batches = spec->resume ? spec->resume->first_new_batch : 0;
  while (st.issued_batches < std::min(spec->steps, start + spec->max_staleness - spec->sync_every + 2)) release(self);
}

// A version every generator has loaded something newer than can go (the newest always stays,
// for a generator that joins later).
void free_unneeded(ControllerState& st) {
  int64_t oldest_loaded = std::numeric_limits<int64_t>::max();
  for (const auto& g : st.generators) oldest_loaded = std::min(oldest_loaded, g.loaded);
  while (st.notices.size() > 1 && st.notices.begin()->first < oldest_loaded) {
    free_weights(st.notices.begin()->second);
    st.notices.erase(st.notices.begin());
  }
}

void add_generator(Self self, int64_t index, generator_actor g) {
  auto& st = self->state;
  if (index >= static_cast<int64_t>(st.generators.size())) st.generators.resize(index + 1);
  st.generators[index].handle = g;
  self->monitor(g);
  // A generator takes the newest weights before any prompt.
  if (!st.notices.empty()) self->send(g, st.notices.rbegin()->second);
}

void report(Self self, const StepReport& r) {
  auto& st = self->state;
  auto j = nlohmann::json::parse(r.json);
  j["time/weights_load_s"] = st.load_s;
  st.load_s = 0;
  auto line = j.dump();
  if (st.metrics.is_open()) st.metrics << line << "\n" << std::flush;
  if (!st.spec->quiet) std::cout << progress_line(j, st.spec->steps) << std::endl;
  if (st.spec->on_step) st.spec->on_step(j);
  st.summary.steps = r.step;
  st.summary.metrics.push_back(std::move(line));
  st.summary.trained.insert(st.summary.trained.end(), r.trained.begin(), r.trained.end());
  st.summary.failed.insert(st.summary.failed.end(), r.failed.begin(), r.failed.end());
}

// Downstream first, so each actor is spawned knowing where to send.
void spawn_graph(Self self) {
  auto& st = self->state;
  const GraphSpec& spec = *st.spec;
  auto& system = self->system();
  auto trainer = spawn_trainer(system, &spec, self);
  rollout_sink after_reward = trainer;
  if (spec.reference) {
    after_reward = spawn_reference(system, spec.make_policy(), spec.trainer_threads, spec.trainer.logprob_chunk, trainer);
    st.all.push_back(actor_cast<actor>(after_reward));
  }
  st.sink = spawn_reward(system, spec.reward, spec.tokenizer, after_reward);
  st.data = spawn_data(system, spec.next_prompts);
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
      g = spawn_generator(system, generator_spec(spec), st.sink, self, i);
    }
    add_generator(self, i, g);
  }
}

controller_actor::behavior_type controller(Self self, const GraphSpec* spec, actor waiter) {
  auto& st = self->state;
  st.spec = spec;
  st.waiter = waiter;
  self->set_down_handler([=](down_msg& dm) {
    if (self->state.shutting_down) return;
    std::string why = dm.reason ? reason_text(dm.reason) : "normal exit";
    finish(self, "an actor stopped unexpectedly: " + why);
  });
  name_failures(self, "controller");
  if (!spec->run_dir.empty()) {
    std::filesystem::create_directories(spec->run_dir);
    st.metrics.open(spec->run_dir / "metrics.jsonl", std::ios::app);
  }
  if (spec->resume)
    for (const auto& g : spec->resume->groups) st.summary.issued.push_back(g.ticket);
  spawn_graph(self);
  self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
  return {
      [=](const WeightsReady& notice) {
        auto& st = self->state;
        st.notices[notice.version] = notice;
        for (const auto& g : st.generators)
          if (g.handle) self->send(g.handle, notice);
        start_when_ready(self);
      },
      [=](const WeightsLoaded& loaded) {
        auto& st = self->state;
        if (loaded.generator < 0 || loaded.generator >= static_cast<int64_t>(st.generators.size())) return;
        st.generators[loaded.generator].loaded = std::max(st.generators[loaded.generator].loaded, loaded.version);
        st.load_s = std::max(st.load_s, loaded.load_s);
        free_unneeded(st);
      },
      [=](const StepReport& r) {
        report(self, r);
        auto& st = self->state;
        if (r.step >= st.spec->steps) {
          finish(self, "");
        } else if (st.issued_batches < st.spec->steps) {
          release(self);
        }
      },
      [=](tick_atom) {
        auto& st = self->state;
        if (st.spec->stop_requested && st.spec->stop_requested->load()) {
          finish(self, "stopped on request after step " + std::to_string(st.summary.steps));
          return;
        }
        auto waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - st.began).count();
        if (!st.started && st.spec->generator_processes > 0 && waited > st.spec->worker_join_timeout_s) {
          finish(self, std::to_string(st.generators.size()) + " of " + std::to_string(st.expected_generators) +
                           " generator workers joined within cluster.join_timeout_s = " +
                           std::to_string(st.spec->worker_join_timeout_s) + " s");
          return;
        }
        self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
      },
      [=](join_atom) -> result<int64_t, std::string, rollout_sink> {
        auto& st = self->state;
        if (st.started || static_cast<int64_t>(st.generators.size()) >= st.expected_generators)
          return make_error(sec::runtime_error, "the run has all the generators it asked for");
        int64_t index = static_cast<int64_t>(st.generators.size());
        st.generators.emplace_back();  // the slot, filled when the worker's generator joins
        return {index, to_json(generator_spec(*st.spec)).dump(), st.sink};
      },
      [=](join_atom, int64_t index, generator_actor g) {
        auto& st = self->state;
        if (index < 0 || index >= static_cast<int64_t>(st.generators.size()) || st.generators[index].handle) return;
        add_generator(self, index, g);
        std::cout << "troupe run: generator " << index << " joined from another process" << std::endl;
        start_when_ready(self);
      },
  };
}

}  // namespace

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
  int n = std::snprintf(buf, sizeof buf,
                        "step %lld/%lld  v%lld  reward %.3f  loss %+.4f  kl %.4f  stale %.2f/%lld  wait %.1fs  train %.1fs  %.0f tok/s",
                        (long long)j["step"].get<int64_t>(), (long long)steps, (long long)j["policy_version"].get<int64_t>(),
                        j["reward/mean"].get<double>(), j["loss"].get<double>(), j["kl"].get<double>(),
                        j["staleness/mean"].get<double>(), (long long)j["staleness/max"].get<int64_t>(),
                        j["time/generate_wait_s"].get<double>(), j["time/step_s"].get<double>(), j["tokens_per_s"].get<double>());
  if (failed > 0 && n > 0 && n < static_cast<int>(sizeof buf))
    std::snprintf(buf + n, sizeof buf - n, "  %lld failed", (long long)failed);
  return buf;
}

controller_actor spawn_controller(actor_system& system, const GraphSpec* spec, actor waiter) {
  return system.spawn(controller, spec, std::move(waiter));
}

}  // namespace troupe
