#include "actors/stage_router.hpp"

#include <algorithm>
#include <chrono>
#include <deque>
#include <iostream>
#include <map>
#include <vector>

#include "actors/actor_util.hpp"

namespace troupe {

using namespace caf;

namespace {

using Clock = std::chrono::steady_clock;

struct Worker {
  stage_worker handle;
  bool live = false;
  int64_t pid = 0;   // its process
  int64_t held = 0;  // groups sent, not yet answered
};

struct InFlight {
  RolloutGroup group;  // the copy kept until the answer is back
  size_t worker = 0;
  uint64_t attempt = 0;  // which request's answer counts (a timed-out one's late answer does not)
};

struct RouterState {
  StageRouterSpec spec;
  std::vector<Worker> workers;
  std::map<int64_t, InFlight> in_flight;  // ticket -> group
  std::deque<RolloutGroup> waiting;       // while no worker is live
  std::map<int64_t, int> lost_with;       // ticket -> workers that went away holding it
  uint64_t attempts = 0;
  Clock::time_point none_live_since = Clock::now();
};

using Self = stage_router::stateful_pointer<RouterState>;

bool any_live(const RouterState& st) {
  return std::any_of(st.workers.begin(), st.workers.end(), [](const Worker& w) { return w.live; });
}
constexpr int kMaxHolders = 3;

void dispatch(Self self, RolloutGroup g);

// A group its worker lost: tried again elsewhere, or passed on failed.
void lost(Self self, RolloutGroup g, const std::string& why) {
  auto& st = self->state;
  if (st.spec.retry && ++st.lost_with[g.ticket] < kMaxHolders) {
    dispatch(self, std::move(g));
    return;
  }
  g.error = st.spec.name + ": " + why;
  std::cerr << "troupe run: prompt " << g.prompt_id << " (batch " << g.batch << ") failed, not trained on: " << g.error
            << std::endl;
  self->send(st.spec.next, std::move(g));
}

void answered(Self self, int64_t ticket, uint64_t attempt, RolloutGroup* answer, const std::string& why) {
  auto& st = self->state;
  auto it = st.in_flight.find(ticket);
  if (it == st.in_flight.end() || it->second.attempt != attempt) return;  // handled already
  InFlight f = std::move(it->second);
  st.in_flight.erase(it);
  --st.workers[f.worker].held;
  if (answer) {
    self->send(st.spec.next, std::move(*answer));
  } else {
    lost(self, std::move(f.group), why);
  }
}

void dispatch(Self self, RolloutGroup g) {
  auto& st = self->state;
  size_t best = st.workers.size();
  for (size_t i = 0; i < st.workers.size(); ++i)
    if (st.workers[i].live && (best == st.workers.size() || st.workers[i].held < st.workers[best].held)) best = i;
  if (best == st.workers.size()) {
    st.waiting.push_back(std::move(g));
    return;
  }
  const int64_t ticket = g.ticket;
  const uint64_t attempt = ++st.attempts;
  ++st.workers[best].held;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(st.spec.answer_timeout_s * 1000));
  self->request(st.workers[best].handle, timeout, g)
      .then([=](RolloutGroup& answer) { answered(self, ticket, attempt, &answer, ""); },
            [=](error& e) {
              answered(self, ticket, attempt, nullptr,
                       "its " + self->state.spec.name + " process did not answer (" + reason_text(e) + ")");
            });
  st.in_flight[ticket] = {std::move(g), best, attempt};
}

void join(Self self, stage_worker w, int64_t pid) {
  auto& st = self->state;
  self->monitor(w);
  st.workers.push_back({std::move(w), true, pid, 0});
  std::cout << "troupe run: " << st.spec.name << " worker " << st.workers.size() - 1 << " joined from another process"
            << std::endl;
  auto waiting = std::move(st.waiting);
  st.waiting.clear();
  for (auto& g : waiting) dispatch(self, std::move(g));
}

// A worker went away: what it held goes to the others (or waits for one to join), or fails.
void lose(Self self, const down_msg& dm) {
  auto& st = self->state;
  for (size_t i = 0; i < st.workers.size(); ++i) {
    auto& w = st.workers[i];
    if (!w.live || w.handle.address() != dm.source) continue;
    w.live = false;
    anon_send(st.spec.on_lost, WorkerLost{w.pid});  // a hung one is killed, and so replaced
    const std::string why = st.spec.name + " worker " + std::to_string(i) + " went away (" +
                            (dm.reason ? reason_text(dm.reason) : "normal exit") + ")";
    std::vector<RolloutGroup> held;
    for (auto it = st.in_flight.begin(); it != st.in_flight.end();) {
      if (it->second.worker != i) {
        ++it;
        continue;
      }
      held.push_back(std::move(it->second.group));
      it = st.in_flight.erase(it);
    }
    w.held = 0;
    if (!any_live(st)) st.none_live_since = Clock::now();
    std::cerr << "troupe run: " << why << " holding " << held.size() << " groups; "
              << (st.spec.retry ? "they are scored again" : "they fail") << std::endl;
    for (auto& g : held) lost(self, std::move(g), why);
  }
}

stage_router::behavior_type router(Self self, StageRouterSpec spec) {
  name_failures(self, spec.name);
  self->state.spec = std::move(spec);
  self->set_down_handler([=](down_msg& dm) { lose(self, dm); });
  self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
  return {
      [=](RolloutGroup& g) {
        if (!g.error.empty()) {
          self->send(self->state.spec.next, std::move(g));  // failed upstream: passes on as it is
        } else {
          dispatch(self, std::move(g));
        }
      },
      [=](join_atom, stage_worker& w, int64_t pid) { join(self, std::move(w), pid); },
      [=](tick_atom) {
        auto& st = self->state;
        const double idle = std::chrono::duration<double>(Clock::now() - st.none_live_since).count();
        if (!any_live(st) && idle > st.spec.join_timeout_s) {
          const std::string what = "no " + st.spec.name + " worker process for cluster.join_timeout_s = " +
                                   std::to_string(st.spec.join_timeout_s) + " s; " + std::to_string(st.waiting.size()) +
                                   " groups waiting";
          self->quit(make_error(sec::runtime_error, what));
          return;
        }
        self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
      },
  };
}

}  // namespace

stage_router spawn_stage_router(actor_system& system, StageRouterSpec spec) {
  return system.spawn(router, std::move(spec));
}

}  // namespace troupe
