// A checkpoint's rollouts.msgpack (rollouts_from_msgpack) on arbitrary bytes. Groups that load
// hold what the trainer indexes by (one entry per completion in the per-completion fields, one
// log-prob per token) and write back to the same bytes. Errors must be troupe::Error.
#include "actors/rollout_io.hpp"
#include "policy/error.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<troupe::RolloutGroup> groups;
  try {
    groups = troupe::rollouts_from_msgpack(std::span<const uint8_t>(data, size), "rollouts.msgpack");
  } catch (const troupe::Error&) {
    return 0;
  }
  for (const auto& g : groups) {
    const size_t n = g.completion_ids.size();
    if (g.behaviour_logprobs.size() != n || g.min_version.size() != n || g.max_version.size() != n)
      fail("a group's per-completion fields disagree in length");
    if (!g.reference_logprobs.empty() && g.reference_logprobs.size() != n) fail("reference log-probs for other completions");
    if (!g.truncated.empty() && g.truncated.size() != n) fail("truncated flags for other completions");
    if (g.error.empty() && g.reward.size() != n) fail("a scored group's rewards are not one per completion");
    for (const auto& [name, scores] : g.rewards)
      if (scores.size() != n) fail("reward '" + name + "' is not one score per completion");
    for (size_t i = 0; i < n; ++i) {
      if (g.behaviour_logprobs[i].size() != g.completion_ids[i].size()) fail("behaviour log-probs not one per token");
      if (!g.reference_logprobs.empty() && g.reference_logprobs[i].size() != g.completion_ids[i].size())
        fail("reference log-probs not one per token");
    }
  }
  const std::vector<uint8_t> bytes = troupe::rollouts_to_msgpack(groups);
  const std::vector<uint8_t> again = troupe::rollouts_to_msgpack(troupe::rollouts_from_msgpack(bytes, "rewritten"));
  if (again != bytes) fail("groups written back and read again are not the same");
  return 0;
}
