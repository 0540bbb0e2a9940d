// `troupe run`: a RunConfig becomes a GraphSpec (models, data, rewards, trainer settings) and
// runs; the run folder gets the resolved config, metrics.jsonl and checkpoints.
#pragma once

#include <atomic>

#include "actors/config.hpp"
#include "actors/graph.hpp"

namespace troupe {

// Runs the recipe the config names (grpo today). Errors in the config's files (model, data,
// plugins) throw troupe::Error before any actor starts; failures inside the graph come back in
// the result.
GraphResult run_config(const RunConfig& config, const std::atomic<bool>* stop_requested = nullptr);

}  // namespace troupe
