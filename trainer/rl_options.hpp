// The RL policy loss's choices as plain data: objective, aggregation, clipping, KL, advantage
// estimator and importance correction. The run config reads and writes these structs as they
// are (actors/config_tables.hpp), so each key is declared once; trainer/ acts on them. No
// LibTorch here, so that the config library stays torch-free.
#pragma once

#include <cstdint>
#include <span>

#include "policy/named.hpp"

namespace troupe::rl {

// The per-token policy-gradient term (trainer/objective.hpp has one file per objective).
enum class Objective { grpo, gspo, cispo };
// How the token losses become one number: grpo: mean over each sequence's tokens, then over
// sequences; dr_grpo: sum / (sequences x max_completion_length); dapo: mean over all tokens.
enum class Aggregation { grpo, dr_grpo, dapo };
// How rewards become per-completion advantages (trainer/advantage.hpp).
// none: no reward term (distillation alone; rewards are then only reported).
enum class Advantage { group, rloo, reinforce_pp, reinforce_pp_baseline, none };
// group advantages: divide by the group's std, the whole batch's, or nothing (Dr. GRPO).
enum class ScaleRewards { group, batch, none };
// The behaviour weight w = pi_prox / mu per token (trainer/correction.hpp); none: w = 1.
enum class CorrectionMode { token_truncate, token_mask, sequence_truncate, sequence_mask, none };
// Completions that run into generator.max_tokens (trainer.overlong).
enum class OverlongMode { none, mask, penalty };

inline constexpr Named<Objective> kObjectives[] = {
    {"grpo", Objective::grpo}, {"gspo", Objective::gspo}, {"cispo", Objective::cispo}};
inline constexpr Named<Aggregation> kAggregations[] = {
    {"grpo", Aggregation::grpo}, {"dr_grpo", Aggregation::dr_grpo}, {"dapo", Aggregation::dapo}};
inline constexpr Named<Advantage> kAdvantages[] = {{"group", Advantage::group},
                                                   {"rloo", Advantage::rloo},
                                                   {"reinforce_pp", Advantage::reinforce_pp},
                                                   {"reinforce_pp_baseline", Advantage::reinforce_pp_baseline},
                                                   {"none", Advantage::none}};
inline constexpr Named<ScaleRewards> kScaleRewards[] = {
    {"group", ScaleRewards::group}, {"batch", ScaleRewards::batch}, {"none", ScaleRewards::none}};
inline constexpr Named<CorrectionMode> kCorrectionModes[] = {{"token_truncate", CorrectionMode::token_truncate},
                                                             {"token_mask", CorrectionMode::token_mask},
                                                             {"sequence_truncate", CorrectionMode::sequence_truncate},
                                                             {"sequence_mask", CorrectionMode::sequence_mask},
                                                             {"none", CorrectionMode::none}};
inline constexpr Named<OverlongMode> kOverlongModes[] = {
    {"none", OverlongMode::none}, {"mask", OverlongMode::mask}, {"penalty", OverlongMode::penalty}};
constexpr std::span<const Named<Objective>> names_of(Objective) { return kObjectives; }
constexpr std::span<const Named<Aggregation>> names_of(Aggregation) { return kAggregations; }
constexpr std::span<const Named<Advantage>> names_of(Advantage) { return kAdvantages; }
constexpr std::span<const Named<ScaleRewards>> names_of(ScaleRewards) { return kScaleRewards; }
constexpr std::span<const Named<CorrectionMode>> names_of(CorrectionMode) { return kCorrectionModes; }
constexpr std::span<const Named<OverlongMode>> names_of(OverlongMode) { return kOverlongModes; }

// trainer.loss.correction. The weight is pi_prox / mu: the trainer's weights at the start of
// the step over the policy that sampled the token. Truncating modes cap it at `high`; masking
// modes drop the token (weight 0) when it falls outside [low, high]. Sequence modes take one
// ratio per completion, the geometric mean of its tokens' ratios, for each of its tokens. none
// weights every token 1: the samples are taken as the proximal policy's (no correction at all).
struct Correction {
  CorrectionMode mode = CorrectionMode::token_truncate;
  double low = 0.0;   // masking modes: the lowest ratio kept
  double high = 5.0;  // the cap (truncating modes) or the highest ratio kept (masking modes)
  bool operator==(const Correction&) const = default;
};

// trainer.overlong. mask: a completion cut at max_tokens carries no loss (DAPO's overlong
// filtering). penalty: DAPO's soft overlong punishment, added to the completion's reward:
//   0 for L <= max_tokens - buffer, then -factor x (L - (max_tokens - buffer)) / buffer,
// which reaches -factor at max_tokens (advantage.hpp: overlong_penalty).
struct Overlong {
  OverlongMode mode = OverlongMode::none;
  int64_t buffer = 0;     // penalty: the last tokens before max_tokens over which it ramps up
  double factor = 1.0;    // penalty: its size at max_tokens
  // Not a key: generator.max_tokens.
  int64_t max_tokens = 0;
  bool operator==(const Overlong&) const = default;
};

// The policy-gradient part of trainer.loss, as the trainer takes it.
struct PolicyLoss {
  Objective objective = Objective::grpo;
  Aggregation aggregation = Aggregation::dapo;
  double epsilon = 0.2;        // lower clip: ratio >= 1 - epsilon
  double epsilon_high = 0.28;  // upper clip: ratio <= 1 + epsilon_high (DAPO's clip-higher)
  double beta = 0.0;           // weight of the k3 KL to the reference
  Correction correction;
  // On-policy distillation: the teacher's per-token reverse KL joins the advantage,
  //   A_t += distill x (log pi_teacher(t) - log mu(t)),
  // the teacher's log-probs arriving where the reference's do (the reference actor holds it).
  double distill = 0.0;
  // Not a key: generator.max_tokens, Dr. GRPO's constant normaliser (tokens per sequence).
  int64_t max_completion_length = 0;
  bool operator==(const PolicyLoss&) const = default;
};

}  // namespace troupe::rl
