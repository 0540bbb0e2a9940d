// Rewards by kind, from a small spec: the built-ins (math_answer, format), a plugin loaded by
// path, an HTTP service; and their weighted sum. Parsing the YAML into RewardSpec is the config's job.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reward/sample.hpp"

namespace troupe {

struct RewardSpec {
  std::string name = "";              // metrics report reward/<name>/mean; unique within a run
  std::string kind = "";              // math_answer, format, plugin or http; empty: plugin if `plugin` is
                                      // set, http if `url` is
  double weight = 1.0;                // the total reward is sum of weight * score (may be negative or 0)
  std::string answer_key = "answer";  // math_answer: the metadata field holding the reference
  std::string plugin = "";            // plugin: path of the shared library
  std::string url = "";               // http: where to POST batches (reward/http_reward.hpp)
  double timeout_s = 30.0;            // http: connect/send/read timeout per attempt
  int retries = 2;                    // http: extra attempts on connection errors, timeouts and 5xx
  double backoff_s = 0.5;             // http: first retry waits this long, then doubling
  int64_t max_batch = 0;              // http: samples per request (0: one request per batch)

  // The kind after the defaults above; throws troupe::Error for an unknown or missing kind.
  std::string resolved_kind() const;
  // Throws troupe::Error naming the reward and the bad field.
  void validate() const;
};

// The built-in kinds, for help texts and error messages.
const std::vector<std::string>& builtin_reward_kinds();

// Validates the spec and builds the reward; plugins are loaded and checked here.
std::unique_ptr<RewardFn> make_reward(const RewardSpec& spec);

struct WeightedReward {
  std::string name;
  double weight = 1.0;
  std::shared_ptr<const RewardFn> fn;
};

struct RewardComponent {
  std::string name;
  double weight = 1.0;
  std::vector<double> scores;  // [N] unweighted, as the reward returned them
};

struct RewardScores {
  std::vector<double> total;                // [N] sum over components of weight * score
  std::vector<RewardComponent> components;  // in the order the rewards were given
};

// Several rewards as one: score() and score_batch() return the weighted total; score_all()
// also returns each component, for reward/<name>/mean. A component that throws fails the call.
class CombinedReward : public RewardFn {
 public:
  // Throws troupe::Error on no parts, an empty or repeated name, a null reward or a non-finite weight.
  explicit CombinedReward(std::vector<WeightedReward> parts);
  double score(const RewardSample& sample) const override;
  std::vector<double> score_batch(std::span<const RewardSample> samples) const override;
  RewardScores score_all(std::span<const RewardSample> samples) const;
  const std::vector<WeightedReward>& parts() const { return parts_; }

 private:
  std::vector<WeightedReward> parts_;
};

// make_reward for each spec, combined with the specs' weights.
CombinedReward make_combined_reward(const std::vector<RewardSpec>& specs);

}  // namespace troupe
