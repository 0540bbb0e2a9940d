// Rollout groups as JSON and as the msgpack of a checkpoint's rollouts.msgpack (and of the
// trainer ranks' commands). Plain data and nlohmann only: no LibTorch, no CAF.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/rollout.hpp"

namespace troupe {

nlohmann::json to_json(const RolloutGroup& g);
// Throws Error naming the field for one that is missing, of another type or out of its type's
// range, and for fields that disagree in shape: behaviour log-probs, versions, truncated flags,
// reference log-probs (when any) and rewards (unless the group failed) hold one entry per
// completion, and each completion's log-probs one per token. The trainer indexes by them.
RolloutGroup group_from_json(const nlohmann::json& j);

std::vector<uint8_t> rollouts_to_msgpack(std::span<const RolloutGroup> groups);
// A msgpack array of groups; errors name `origin` (the file) and the group. Nesting deeper than
// rollout groups ever do is refused before it is parsed (the msgpack reader recurses per level).
std::vector<RolloutGroup> rollouts_from_msgpack(std::span<const uint8_t> bytes, const std::string& origin);

}  // namespace troupe
