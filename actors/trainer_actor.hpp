// The trainer actor (actors/trainer_actor.cpp): a rollout sink that trains complete batches.
#pragma once

#include "actors/graph.hpp"
#include "actors/protocol.hpp"

namespace troupe {

// `spec` outlives the actor (run_graph holds it). The trainer first writes the starting weights
// (version 0, or the checkpoint's) to the weight plane and sends their notice to `controller`.
trainer_actor spawn_trainer(caf::actor_system& system, const GraphSpec* spec, controller_actor controller);

}  // namespace troupe
