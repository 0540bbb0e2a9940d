#include "actors/actor_util.hpp"
#include "actors/stage_actors.hpp"
#include "trainer/trainer.hpp"

namespace troupe {

namespace {

rollout_sink::behavior_type reference(rollout_sink::pointer self, Transformer model, int64_t threads, int64_t chunk,
                                      rollout_sink next) {
  name_failures(self, "reference");
  use_threads(threads);
  model->eval();
  std::shared_ptr<TransformerImpl> impl = model.ptr();
  return {[=](RolloutGroup& g) {
    if (g.error.empty()) g.reference_logprobs = completion_logprobs(*impl, g, chunk);
    self->send(next, std::move(g));
  }};
}

}  // namespace

rollout_sink spawn_reference(caf::actor_system& system, Transformer model, int64_t threads, int64_t logprob_chunk,
                             rollout_sink next) {
  return system.spawn<caf::detached>(reference, std::move(model), threads, logprob_chunk, std::move(next));
}

}  // namespace troupe
