// The messages the actor graph exchanges, as plain structs with CAF inspect() overloads, so
// the same types cross a process boundary (CAF's middleman) unchanged. Tensors travel as
// (dtype, shape, bytes) records.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <caf/all.hpp>

#include "trainer/rollout.hpp"

namespace troupe {

using step_atom = caf::atom_constant<caf::atom("step")>;
using tick_atom = caf::atom_constant<caf::atom("tick")>;
using next_atom = caf::atom_constant<caf::atom("next")>;

// One prompt handed to a generator.
struct PromptItem {
  uint64_t id = 0;             // the data source's id for the prompt
  int64_t batch = 0;           // the credit batch it belongs to: trained at step `batch`
  std::vector<int32_t> ids;    // [P] prompt token ids
  std::string text;            // the prompt as the model sees it (rewards get it)
  std::string metadata;        // JSON: the dataset line's fields (e.g. the answer)
  int64_t ticket = 0;          // hand-out number, unique within a run (batch * batch_groups + i)
};

struct PromptBatch {
  std::vector<PromptItem> prompts;  // [N]
};

// One tensor as bytes: dtype is a c10::ScalarType code, bytes are contiguous row-major.
struct TensorRecord {
  std::string name;            // HF parameter name
  int8_t dtype = 0;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};

struct WeightsUpdate {
  int64_t version = 0;               // the trainer's version after the step that made them
  std::vector<TensorRecord> tensors; // every parameter, or the changed subset
};

// A trainer step's metrics, as the JSON object metrics.jsonl stores.
struct StepReport {
  int64_t step = 0;
  std::string json;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PromptItem& x) {
  return f(caf::meta::type_name("PromptItem"), x.id, x.batch, x.ids, x.text, x.metadata, x.ticket);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PromptBatch& x) {
  return f(caf::meta::type_name("PromptBatch"), x.prompts);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, RolloutGroup& x) {
  return f(caf::meta::type_name("RolloutGroup"), x.prompt_id, x.batch, x.prompt_ids, x.completion_ids,
           x.behaviour_logprobs, x.reference_logprobs, x.min_version, x.max_version, x.truncated, x.rewards,
           x.reward, x.metadata, x.ticket, x.error);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, TensorRecord& x) {
  return f(caf::meta::type_name("TensorRecord"), x.name, x.dtype, x.shape, x.bytes);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WeightsUpdate& x) {
  return f(caf::meta::type_name("WeightsUpdate"), x.version, x.tensors);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, StepReport& x) {
  return f(caf::meta::type_name("StepReport"), x.step, x.json);
}

// Registers the types above with a system config (needed to cross process boundaries).
void add_message_types(caf::actor_system_config& config);

}  // namespace troupe
