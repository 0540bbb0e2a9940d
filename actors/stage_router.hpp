// A stage between generators and trainer (reward, reference) placed in worker processes
// (cluster.reward_processes, cluster.reference_processes). The router stays in the run's
// process and takes groups like any sink: it hands each to the live worker with the fewest
// groups, keeps a copy until the answer is back, and passes the answer on. A worker that dies
// (SIGKILL, heartbeat timeout) or does not answer within answer_timeout_s loses only the groups
// it held: they are retried on another worker, or wait for one to join (retry), or travel on
// marked failed (fail, or a group that 3 workers went away holding). With no worker for
// join_timeout_s the router stops, with its name, and the run ends with that error.
#pragma once

#include <string>

#include "actors/protocol.hpp"

namespace troupe {

struct StageRouterSpec {
  std::string name;             // "reward" or "reference": in log lines and errors
  rollout_sink next;            // where answered groups go
  bool retry = true;            // cluster.lost_groups: retry, or fail
  double join_timeout_s = 120;  // with no live worker this long, the router stops
  double answer_timeout_s = 600;
  caf::actor on_lost;  // told WorkerLost{pid} for each worker that goes away
};

stage_router spawn_stage_router(caf::actor_system& system, StageRouterSpec spec);

}  // namespace troupe
