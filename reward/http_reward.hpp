// A reward computed by an HTTP service. The protocol, one POST per batch:
//   request:  {"samples": [{"prompt": "...", "completion": "...", "metadata": {...}}, ...]}
//   reply:    {"scores": [1.0, 0.0, ...]}   one finite number per sample, in order, status 2xx
// Connection errors, timeouts and 5xx replies are retried with exponential backoff; 4xx replies
// and malformed answers are not (they would fail again). Every failure names the URL.
#pragma once

#include <cstdint>
#include <string>

#include "reward/sample.hpp"

namespace troupe {

struct HttpRewardOptions {
  std::string url = "";     // http://host[:port][/path] or https://...; path defaults to "/"
  double timeout_s = 30.0;  // each of connect, send and read, per attempt
  int retries = 2;          // extra attempts after a connection error, a timeout or a 5xx reply
  double backoff_s = 0.5;   // wait before retry k (1-based): backoff_s * 2^(k-1)
  int64_t max_batch = 0;    // samples per request; 0 sends the whole batch in one request
};

class HttpReward : public RewardFn {
 public:
  // Throws troupe::Error when the URL or an option is invalid. Does not contact the service.
  explicit HttpReward(HttpRewardOptions options);
  double score(const RewardSample& sample) const override;
  std::vector<double> score_batch(std::span<const RewardSample> samples) const override;
  const std::string& url() const { return options_.url; }

 private:
  std::vector<double> post(std::span<const RewardSample> samples) const;
  HttpRewardOptions options_;
  std::string origin_;  // scheme://host[:port]
  std::string path_;    // /path
};

}  // namespace troupe
