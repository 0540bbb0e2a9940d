// DPO's pieces: the preference pairs of dpo_data.hpp, the frozen reference model's log-probs
// per pair (optionally cached on disk), and the sigmoid loss with label smoothing and TRL's
// metrics. Trainer::dpo_step wires them to the policy.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <torch/types.h>

#include "trainer/dpo_data.hpp"
#include "trainer/sft.hpp"

namespace troupe {
class TransformerImpl;
}

namespace troupe::dpo {

struct ReferenceOptions {
  int64_t batch_pairs = 8;  // pairs per forward pass
  int64_t chunk = 128;      // positions per LM-head chunk
  // When set: read the log-probs from this file if it exists, else compute and write them.
  std::filesystem::path cache;
  // Stored in the cache and compared on reading, e.g. the reference model's path; the pairs'
  // token ids are compared through a fingerprint, so a changed dataset is caught too.
  std::string model_id;
};

// Fills ref_chosen and ref_rejected of every pair from the frozen `reference` (no gradient,
// eval mode). A cache from other pairs or another model_id is an Error naming the file.
void compute_reference(TransformerImpl& reference, std::span<Pair> pairs, const ReferenceOptions& options = {});

// The summed log-probs of each sequence's trained tokens under `model`: [N] float64, no
// gradient. One row per sequence, batch_size sequences per forward pass.
std::vector<double> sequence_logprobs(TransformerImpl& model, std::span<const sft::Sequence> sequences,
                                      int64_t batch_size = 8, int64_t chunk = 128);

struct LossConfig {
  double beta = 0.1;             // strength of the KL to the reference
  double label_smoothing = 0.0;  // cDPO: the chance that a preference label is flipped, in [0, 0.5)
};

// All [B], one per pair: summed response log-probs under the policy (with gradient) and the reference.
struct LossInputs {
  torch::Tensor chosen, rejected;
  torch::Tensor ref_chosen, ref_rejected;
};

// TRL's metric names in comments; rewards are beta x (log pi - log pi_ref), means over the pairs.
struct LossOutput {
  torch::Tensor loss;           // scalar, to backward: mean over the pairs
  double reward_chosen = 0;     // rewards/chosen
  double reward_rejected = 0;   // rewards/rejected
  double accuracy = 0;          // rewards/accuracies: share of pairs with chosen reward > rejected reward
  double margin = 0;            // rewards/margins: mean of chosen - rejected reward
  double logps_chosen = 0;      // logps/chosen: mean summed policy log-prob
  double logps_rejected = 0;    // logps/rejected
};

// With h = (chosen - ref_chosen) - (rejected - ref_rejected) and ls = label_smoothing:
//   loss = mean over pairs of -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)
// TRL's loss_type "sigmoid".
LossOutput loss(const LossInputs& in, const LossConfig& config);

}  // namespace troupe::dpo
