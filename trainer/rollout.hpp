// A rollout group as the trainer consumes it: G completions of one prompt with what RL needs.
// Plain data; actors/messages.hpp adds CAF's inspect() so the same struct crosses processes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace troupe {

struct RolloutGroup {
  uint64_t prompt_id = 0;                              // the data cursor's id for the prompt
  int64_t batch = 0;                                   // the credit batch it was issued in (trained as step `batch`)
  std::vector<int32_t> prompt_ids;                     // [P] prompt token ids
  std::vector<std::vector<int32_t>> completion_ids;    // [G][L_i] completion token ids
  std::vector<std::vector<float>> behaviour_logprobs;  // [G][L_i] log mu(token) recorded while sampling
  std::vector<std::vector<float>> reference_logprobs;  // [G][L_i] log pi_ref(token), empty when KL is off
  std::vector<int64_t> min_version;                    // [G] oldest policy version among a completion's tokens
  std::vector<int64_t> max_version;                    // [G] newest policy version
  std::vector<uint8_t> truncated;                      // [G] 1 when max_tokens ended the completion
  std::map<std::string, std::vector<double>> rewards;  // reward name -> [G] scores
  std::vector<double> reward;                          // [G] weighted total the advantages use
  std::string metadata;                                // the prompt's metadata as JSON (e.g. the answer)
  int64_t ticket = 0;                                  // the hand-out number, unique within a run
  std::string error;                                   // non-empty: the group failed (a reward threw)
                                                       // and is reported, not trained on
  double generate_s = 0;                               // its generator's busy seconds (decode steps or
                                                       // remote calls) since the group it sent before

  int64_t size() const { return static_cast<int64_t>(completion_ids.size()); }
};

}  // namespace troupe
