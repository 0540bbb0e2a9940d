// The controller actor (actors/controller.cpp).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "actors/graph.hpp"
#include "actors/progress_line.hpp"
#include "actors/protocol.hpp"

namespace troupe {

// Spawns the whole graph and runs it; sends the RunSummary to `waiter` when the run ends (its
// steps done, a stop request, or a failed actor).
controller_actor spawn_controller(caf::actor_system& system, const GraphSpec* spec, caf::actor waiter);


}  // namespace troupe
