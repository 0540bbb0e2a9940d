// What becomes of the sequences an engine is decoding when new weights arrive
// (generator.partial_rollouts). Names only: the engine implements continue and abort, its owner
// finish (it holds the new weights back until the engine is idle). No LibTorch here.
#pragma once

#include <span>

#include "policy/named.hpp"

namespace troupe {

// continue: they go on under the new weights, their caches recomputed; each token is tagged
//   with the version that sampled it, and staleness counts from the oldest (vLLM-style partial
//   rollouts, as in Kimi k1.5, AReaL and slime).
// finish: they end under the weights they began with; the new weights load once the engine has
//   nothing left, and prompts that arrive meanwhile wait behind them. Each completion has one
//   version; the engine idles for the tail of its longest sequence.
// abort: their tokens are dropped and they start again under the new weights: one version per
//   completion, the dropped tokens' decoding wasted.
enum class PartialRollouts { continue_, finish, abort };

inline constexpr Named<PartialRollouts> kPartialRollouts[] = {
    {"continue", PartialRollouts::continue_}, {"finish", PartialRollouts::finish}, {"abort", PartialRollouts::abort}};
constexpr std::span<const Named<PartialRollouts>> names_of(PartialRollouts) { return kPartialRollouts; }

}  // namespace troupe
