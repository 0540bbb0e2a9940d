#include "actors/actor_util.hpp"
#include "actors/stage_actors.hpp"
#include "actors/weight_plane.hpp"
#include "policy/checkpoint.hpp"
#include "policy/dtype.hpp"
#include "policy/error.hpp"
#include "trainer/trainer.hpp"

namespace troupe {

namespace {

rollout_sink::behavior_type reference(rollout_sink::pointer self, Transformer model, int64_t threads, int64_t chunk,
                                      double temperature, rollout_sink next) {
  name_failures(self, "reference");
  use_threads(threads);
  model->eval();
  std::shared_ptr<TransformerImpl> impl = model.ptr();
  return {[=](RolloutGroup& g) {
    if (g.error.empty()) g.reference_logprobs = completion_logprobs(*impl, g, chunk, temperature);
    self->send(next, std::move(g));
  }};
}

stage_worker::behavior_type reference_worker(stage_worker::pointer self, ReferenceStageSpec spec) {
  name_failures(self, "reference");
  use_threads(spec.threads);
  const torch::Device device(spec.device);
  auto m = load_model(spec.model, {.dtype = choose_dtype(spec.dtype, device, "reference dtype").dtype, .device = device,
                                   .tokenizer = false});
  load_weights(*m.model, read_weights(WeightsReady{0, spec.weights, 0, 0, spec.url, spec.host}), spec.weights);
  m.model->eval();
  std::shared_ptr<TransformerImpl> impl = m.model.ptr();
  const int64_t chunk = spec.logprob_chunk;
  const double temperature = spec.temperature;
  return {[=](RolloutGroup& g) -> RolloutGroup {
    g.reference_logprobs = completion_logprobs(*impl, g, chunk, temperature);
    return std::move(g);
  }};
}

}  // namespace

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ReferenceStageSpec, model, weights, url, host, dtype, device, threads, logprob_chunk,
                                   temperature)

nlohmann::json to_json(const ReferenceStageSpec& spec) { return spec; }

ReferenceStageSpec reference_stage_spec_from_json(const nlohmann::json& j) {
  return spec_from_json<ReferenceStageSpec>(j, "reference stage spec");
}

stage_worker spawn_reference_worker(caf::actor_system& system, const ReferenceStageSpec& spec) {
  return system.spawn<caf::detached>(reference_worker, spec);
}

rollout_sink spawn_reference(caf::actor_system& system, Transformer model, int64_t threads, int64_t logprob_chunk,
                             double temperature, rollout_sink next) {
  return system.spawn<caf::detached>(reference, std::move(model), threads, logprob_chunk, temperature, std::move(next));
}

}  // namespace troupe
