// The actor graph's protocol: every message as a plain struct with CAF inspect() overloads, and
// every actor's typed handle naming what it takes and answers, so the compiler checks each send
// and the same messages cross a process boundary (CAF's middleman) unchanged. Weight bytes do
// not travel here: WeightsReady carries only where the trainer left them (actors/weight_plane.hpp).
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
using join_atom = caf::atom_constant<caf::atom("join")>;
using done_atom = caf::atom_constant<caf::atom("done")>;
using go_atom = caf::atom_constant<caf::atom("go")>;
using stop_atom = caf::atom_constant<caf::atom("stop")>;
using refill_atom = caf::atom_constant<caf::atom("refill")>;

// One prompt handed to a generator.
struct PromptItem {
  uint64_t id = 0;             // the data source's id for the prompt
  int64_t batch = 0;           // the credit batch it belongs to: trained at step `batch`
  std::vector<int32_t> ids;    // [P] prompt token ids
  std::string text;            // the prompt as the model sees it (rewards get it)
  std::string metadata;        // JSON: the dataset line's fields (e.g. the answer)
  int64_t ticket = 0;          // hand-out number, unique within a run: the prompt's place in the
                               // data stream (batch * batch_groups + i without dynamic sampling)
};

struct PromptBatch {
  std::vector<PromptItem> prompts;  // [N]
};

// "Weights of version v are ready": a safetensors file every generator on the trainer's host
// can map, and (when the run listens for workers) the URL the trainer serves it at.
struct WeightsReady {
  int64_t version = 0;  // the trainer's version after the step that made them
  std::string path;     // the file, in shared memory when the host has room for it
  int64_t bytes = 0;    // the tensors' bytes (the file's data section)
  double write_s = 0;   // the trainer's time to write them
  std::string url;      // http://host:port/vN.safetensors; empty: not served
  std::string host;     // the trainer's machine (its boot id): elsewhere, the file is fetched by url
};

// A generator has loaded version `version` (the controller then frees older files).
struct WeightsLoaded {
  int64_t generator = 0;
  int64_t version = 0;
  double load_s = 0;
  double requantize_s = 0;  // of load_s, the part spent requantizing (generator.weights int8, int4)
};

// What a generator or the trainer is doing, for the dashboard (runs/NAME/status.json): sent to
// the controller when it changes. `groups` counts the groups it has sent on (a generator) or
// taken in (the trainer) since it started, so the controller knows how many are between them.
struct ActorBusy {
  std::string actor;   // "generator 0", "trainer"
  std::string state;   // generating, loading weights, training, checkpointing, waiting
  int64_t queue = 0;   // prompts it holds unfinished (a generator), groups buffered (the trainer)
  int64_t groups = 0;
};

// A trained batch: the step's metrics as metrics.jsonl stores them, and its tickets.
struct StepReport {
  int64_t step = 0;
  std::string json;
  std::vector<int64_t> trained, failed;  // tickets
  std::vector<int64_t> filtered;         // tickets whose rewards tied (dynamic sampling): not trained
};

// A worker process went away (dead, or silent past the heartbeat timeout): the run's process
// kills it if it is one of its own, and its supervisor starts a replacement.
struct WorkerLost {
  int64_t pid = 0;
};

// What a run ends with, sent by the controller to whoever waits for the graph.
struct RunSummary {
  std::string error;                 // the failing actor and why; empty when the run completed
  int64_t steps = 0;
  std::vector<std::string> metrics;  // every step's metrics as JSON
  std::vector<int64_t> issued, trained, failed;  // tickets
  std::vector<int64_t> filtered;                 // tickets not trained: their rewards tied
};

// Handles. A generator sends groups to a rollout sink: the reward actor, then the reference
// (when there is one) and the trainer, each forwarding to the next.
using rollout_sink = caf::typed_actor<caf::reacts_to<RolloutGroup>>;
using data_actor = caf::typed_actor<caf::replies_to<next_atom, int64_t, int64_t>::with<PromptBatch>>;
// step: the generator's own decode loop, through its mailbox so notices land between steps.
using generator_actor = caf::typed_actor<caf::reacts_to<PromptBatch>, caf::reacts_to<WeightsReady>, caf::reacts_to<step_atom>>;
// A reward or reference stage in a worker process: takes a group and answers with it scored.
using stage_worker = caf::typed_actor<caf::replies_to<RolloutGroup>::with<RolloutGroup>>;
// The run's end of a stage placed in worker processes (actors/stage_router.hpp): it takes groups
// like any sink, hands each to a live worker and passes the answer on; workers join it.
// Joins carry the worker's pid: one on this host that goes silent is killed, so it is replaced.
using stage_router = caf::typed_actor<caf::reacts_to<RolloutGroup>, caf::reacts_to<join_atom, stage_worker, int64_t>,
                                      caf::reacts_to<tick_atom>>;
using controller_actor =
    caf::typed_actor<caf::reacts_to<WeightsReady>, caf::reacts_to<WeightsLoaded>, caf::reacts_to<StepReport>,
                     caf::reacts_to<tick_atom>, caf::reacts_to<ActorBusy>,
                     // a worker process asks what to build: its index, the GeneratorSpec as JSON, the sink
                     caf::replies_to<join_atom>::with<int64_t, std::string, rollout_sink>,
                     // and then joins with the generator it built
                     caf::reacts_to<join_atom, int64_t, generator_actor, int64_t>,
                     // a reward or reference worker asks what to build (its role): the spec as
                     // JSON and the router it joins
                     caf::replies_to<join_atom, std::string>::with<std::string, stage_router>,
                     // the trainer's checkpoint after a stop request is complete (at that step)
                     caf::reacts_to<stop_atom, int64_t>,
                     // dynamic sampling: n more prompts for batch `batch` (its filtered groups' places)
                     caf::reacts_to<refill_atom, int64_t, int64_t>>;
// go: the generators are there and the first prompts are out; a resumed trainer trains the
// checkpoint's buffered batches only then, so its next version follows those prompts.
// stop: a stop was asked for (Ctrl-C): checkpoint after the step in progress and train no more.
// tick: its own timer, to keep other trainer ranks waiting on it alive (actors/trainer_ranks.hpp).
using trainer_actor = caf::typed_actor<caf::reacts_to<RolloutGroup>, caf::reacts_to<go_atom>, caf::reacts_to<stop_atom>,
                                        caf::reacts_to<tick_atom>>;

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
           x.reward, x.metadata, x.ticket, x.error, x.generate_s);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WeightsReady& x) {
  return f(caf::meta::type_name("WeightsReady"), x.version, x.path, x.bytes, x.write_s, x.url, x.host);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WeightsLoaded& x) {
  return f(caf::meta::type_name("WeightsLoaded"), x.generator, x.version, x.load_s, x.requantize_s);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ActorBusy& x) {
  return f(caf::meta::type_name("ActorBusy"), x.actor, x.state, x.queue, x.groups);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, StepReport& x) {
  return f(caf::meta::type_name("StepReport"), x.step, x.json, x.trained, x.failed, x.filtered);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WorkerLost& x) {
  return f(caf::meta::type_name("WorkerLost"), x.pid);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, RunSummary& x) {
  return f(caf::meta::type_name("RunSummary"), x.error, x.steps, x.metrics, x.issued, x.trained, x.failed, x.filtered);
}

// A prompt that could not be generated: it travels to the trainer marked failed, so its ticket is
// reported (failures.jsonl, rollouts/failed) and its batch still completes.
inline RolloutGroup failed_group(const PromptItem& p, std::string error) {
  RolloutGroup g;
  g.prompt_id = p.id;
  g.batch = p.batch;
  g.prompt_ids = p.ids;
  g.metadata = p.metadata;
  g.ticket = p.ticket;
  g.error = std::move(error);
  return g;
}

// Registers the types above with a system config (needed to cross process boundaries), and
// sets the middleman's safety settings (version check at the handshake, heartbeats, timeouts).
void add_message_types(caf::actor_system_config& config);

// The text of an actor's exit reason: the message it failed with, without CAF's wrapping.
std::string reason_text(const caf::error& reason);

}  // namespace troupe
