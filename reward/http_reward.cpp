// The HTTP reward client (cpp-httplib). A fresh client per request keeps score_batch thread-safe.
#include "reward/http_reward.hpp"

#include <chrono>
#include <cmath>
#include <thread>

#include <httplib.h>

#include "policy/error.hpp"

namespace troupe {
namespace {

std::string snippet(const std::string& body) {
  constexpr size_t kMax = 200;
  return body.size() <= kMax ? body : body.substr(0, kMax) + "...";
}

void set_timeouts(httplib::Client& client, double seconds) {
  auto us = std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
  time_t sec = static_cast<time_t>(us.count() / 1000000), usec = static_cast<time_t>(us.count() % 1000000);
  client.set_connection_timeout(sec, usec);
  client.set_read_timeout(sec, usec);
  client.set_write_timeout(sec, usec);
}

}  // namespace

HttpReward::HttpReward(HttpRewardOptions options) : options_(std::move(options)) {
  const std::string& url = options_.url;
  size_t scheme_end = url.find("://");
  std::string scheme = scheme_end == std::string::npos ? "" : url.substr(0, scheme_end);
  if (scheme != "http" && scheme != "https")
    throw Error("reward url '" + url + "': expected http://host[:port]/path or https://...");
  size_t host_start = scheme_end + 3;
  size_t path_start = url.find('/', host_start);
  if (path_start == host_start || host_start == url.size())
    throw Error("reward url '" + url + "': no host");
  origin_ = url.substr(0, path_start);
  path_ = path_start == std::string::npos ? "/" : url.substr(path_start);
  if (!(options_.timeout_s > 0) || !std::isfinite(options_.timeout_s))
    throw Error("reward url '" + url + "': timeout " + std::to_string(options_.timeout_s) + " must be > 0 seconds");
  if (options_.retries < 0) throw Error("reward url '" + url + "': retries must be >= 0");
  if (!(options_.backoff_s >= 0) || !std::isfinite(options_.backoff_s))
    throw Error("reward url '" + url + "': backoff must be >= 0 seconds");
  if (options_.max_batch < 0) throw Error("reward url '" + url + "': max_batch must be >= 0 (0: no limit)");
}

double HttpReward::score(const RewardSample& sample) const { return post({&sample, 1}).at(0); }

std::vector<double> HttpReward::score_batch(std::span<const RewardSample> samples) const {
  size_t chunk = options_.max_batch > 0 ? static_cast<size_t>(options_.max_batch) : samples.size();
  std::vector<double> scores;
  scores.reserve(samples.size());
  for (size_t i = 0; i < samples.size(); i += chunk) {
    auto part = post(samples.subspan(i, std::min(chunk, samples.size() - i)));
    scores.insert(scores.end(), part.begin(), part.end());
  }
  return scores;
}

std::vector<double> HttpReward::post(std::span<const RewardSample> samples) const {
  const std::string& url = options_.url;
  nlohmann::json batch = nlohmann::json::array();
  for (const auto& s : samples)
    batch.push_back({{"prompt", s.prompt}, {"completion", s.completion}, {"metadata", s.metadata}});
  std::string body =
      nlohmann::json{{"samples", std::move(batch)}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);

  httplib::Client client(origin_);
  if (!client.is_valid()) throw Error(url + ": cannot make an HTTP client for this address");
  set_timeouts(client, options_.timeout_s);

  std::string problem;
  const int attempts = options_.retries + 1;
  for (int attempt = 1; attempt <= attempts; ++attempt) {
    if (attempt > 1)
      std::this_thread::sleep_for(std::chrono::duration<double>(options_.backoff_s * std::pow(2.0, attempt - 2)));
    auto res = client.Post(path_, body, "application/json");
    if (!res) {
      problem = "request failed (" + httplib::to_string(res.error()) + ")";
      continue;
    }
    if (res->status >= 500) {
      problem = "HTTP " + std::to_string(res->status) + ": " + snippet(res->body);
      continue;
    }
    if (res->status < 200 || res->status >= 300)
      throw Error(url + ": HTTP " + std::to_string(res->status) + " from the reward service: " + snippet(res->body));

    auto reply = nlohmann::json::parse(res->body, nullptr, /*allow_exceptions=*/false);
    if (reply.is_discarded()) throw Error(url + ": the reply is not JSON: " + snippet(res->body));
    auto it = reply.is_object() ? reply.find("scores") : reply.end();
    if (!reply.is_object() || it == reply.end() || !it->is_array())
      throw Error(url + ": the reply has no \"scores\" array: " + snippet(res->body));
    if (it->size() != samples.size())
      throw Error(url + ": the reply has " + std::to_string(it->size()) + " scores for " +
                  std::to_string(samples.size()) + " samples");
    std::vector<double> scores;
    scores.reserve(samples.size());
    for (size_t i = 0; i < it->size(); ++i) {
      const auto& v = (*it)[i];
      if (!v.is_number() || !std::isfinite(v.get<double>()))
        throw Error(url + ": scores[" + std::to_string(i) + "] is " + v.dump() + ", not a finite number");
      scores.push_back(v.get<double>());
    }
    return scores;
  }
  throw Error(url + ": " + problem + " after " + std::to_string(attempts) +
              (attempts == 1 ? " attempt" : " attempts") + "; is the reward service running and reachable?");
}

}  // namespace troupe
