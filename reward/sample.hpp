// What a reward sees (one completion of one prompt) and the interface every reward implements.
// Header-only and free of LibTorch and CAF, so plugins can include it without linking troupe.
#pragma once

#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace troupe {

struct RewardSample {
  std::string prompt = "";            // the prompt text as the model saw it (after the chat template)
  std::string completion = "";        // the generated text, without the prompt
  nlohmann::json metadata = nullptr;  // the prompt's data fields, e.g. {"answer": "... #### 18"}; may be null
};

// A reward scores samples. Rewards hold no per-call state, so built-in and HTTP rewards may be
// called from several threads at once; a plugin is as thread-safe as the plugin's function.
class RewardFn {
 public:
  virtual ~RewardFn() = default;
  virtual double score(const RewardSample& sample) const = 0;
  // One score per sample, in order. Overridden where a batch is cheaper (one HTTP request).
  virtual std::vector<double> score_batch(std::span<const RewardSample> samples) const {
    std::vector<double> scores;
    scores.reserve(samples.size());
    for (const auto& s : samples) scores.push_back(score(s));
    return scores;
  }
};

}  // namespace troupe
