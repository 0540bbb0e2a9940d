// The graph's stages between generators and trainer, each in its own file: the data actor hands
// out prompts, the reward actor scores groups, the reference actor adds log pi_ref. Each forwards
// a group to the next sink; a failure inside a reward fails that group only (it travels on,
// marked, and the trainer reports it), any other exception ends the actor with its name.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/protocol.hpp"
#include "policy/tokenizer.hpp"
#include "policy/transformer.hpp"
#include "reward/registry.hpp"

namespace troupe {

// Answers (next, n, batch) with the data stream's next n prompts for batch `batch`, each
// ticketed with its place in the stream, counted from `first_ticket` (a resumed run's cursor).
using PromptSourceFn = std::function<std::vector<PromptItem>(int64_t n)>;
data_actor spawn_data(caf::actor_system& system, PromptSourceFn next_prompts, int64_t first_ticket);

rollout_sink spawn_reward(caf::actor_system& system, std::shared_ptr<const CombinedReward> reward,
                          std::optional<Tokenizer> tokenizer, rollout_sink next);

// `model` is the reference policy (the starting one, or the teacher); `threads` its intra-op
// threads; its log-probs are of logits / temperature, as the trainer's.
rollout_sink spawn_reference(caf::actor_system& system, Transformer model, int64_t threads, int64_t logprob_chunk,
                             double temperature, rollout_sink next);

// The same stages in a worker process (`troupe worker --role reward|reference`), built from
// plain data the controller sends as JSON; each answers a group with it scored.
struct RewardStageSpec {
  std::vector<RewardSpec> rewards;
  std::string tokenizer;  // folder or .gguf the completions are decoded with
};
struct ReferenceStageSpec {
  std::string model;    // the architecture (HF folder or .gguf)
  std::string weights;  // the starting policy, as the run wrote it (safetensors on the weight plane)
  std::string url;      // the same over HTTP, for a worker on another host; empty: not served
  std::string host;     // the run's machine (WeightsReady::host)
  std::string dtype = "float32";
  std::string device = "cpu";
  int64_t threads = 0;
  int64_t logprob_chunk = 0;
  double temperature = 1.0;  // log-probs of logits / temperature (the generators' sampling temperature)
};
nlohmann::json to_json(const RewardStageSpec& spec);
nlohmann::json to_json(const ReferenceStageSpec& spec);
// Both throw Error naming the bad field.
RewardStageSpec reward_stage_spec_from_json(const nlohmann::json& j);
ReferenceStageSpec reference_stage_spec_from_json(const nlohmann::json& j);

stage_worker spawn_reward_worker(caf::actor_system& system, const RewardStageSpec& spec);
stage_worker spawn_reference_worker(caf::actor_system& system, const ReferenceStageSpec& spec);

}  // namespace troupe
