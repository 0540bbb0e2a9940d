// The controller actor (actors/controller.cpp), and the progress line it prints per step.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "actors/graph.hpp"
#include "actors/protocol.hpp"

namespace troupe {

// Spawns the whole graph and runs it; sends the RunSummary to `waiter` when the run ends (its
// steps done, a stop request, or a failed actor).
controller_actor spawn_controller(caf::actor_system& system, const GraphSpec* spec, caf::actor waiter);

std::string progress_line(const nlohmann::json& metrics, int64_t steps);

}  // namespace troupe
