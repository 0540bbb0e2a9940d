// The reward factory, the built-in reward kinds and the weighted combination.
#include "reward/registry.hpp"

#include <cmath>
#include <set>

#include "policy/error.hpp"
#include "reward/http_reward.hpp"
#include "reward/math.hpp"
#include "reward/plugin_reward.hpp"

namespace troupe {
namespace {

// The reference lives in the sample's metadata (the dataset's answer field, string or number).
class MathAnswerReward : public RewardFn {
 public:
  explicit MathAnswerReward(std::string answer_key) : key_(std::move(answer_key)) {}
  double score(const RewardSample& s) const override {
    auto it = s.metadata.is_object() ? s.metadata.find(key_) : s.metadata.end();
    if (!s.metadata.is_object() || it == s.metadata.end())
      throw Error("math_answer reward: the sample's metadata has no '" + key_ +
                  "' field (the data's answer field; set the reward's answer_key if it is named otherwise)");
    if (it->is_string()) return math_answer_reward(s.completion, it->get_ref<const std::string&>());
    if (it->is_number()) return math_answer_reward(s.completion, it->dump());
    throw Error("math_answer reward: metadata field '" + key_ + "' is " + it->dump() + ", not a string or number");
  }

 private:
  std::string key_;
};

class FormatReward : public RewardFn {
 public:
  double score(const RewardSample& s) const override { return format_reward(s.completion); }
};

std::string known_kinds() {
  std::string s;
  for (const auto& k : builtin_reward_kinds()) s += k + ", ";
  return s + "plugin or http";
}

}  // namespace

const std::vector<std::string>& builtin_reward_kinds() {
  static const std::vector<std::string> kinds = {"math_answer", "format"};
  return kinds;
}

std::string RewardSpec::resolved_kind() const {
  std::string where = "reward '" + name + "'";
  if (kind.empty()) {
    if (!plugin.empty() && !url.empty()) throw Error(where + ": both plugin and url are set; give kind or keep one");
    if (!plugin.empty()) return "plugin";
    if (!url.empty()) return "http";
    throw Error(where + ": no kind (expected " + known_kinds() + ")");
  }
  for (const auto& k : builtin_reward_kinds())
    if (kind == k) return kind;
  if (kind == "plugin" || kind == "http") return kind;
  throw Error(where + ": unknown kind '" + kind + "' (expected " + known_kinds() + ")");
}

void RewardSpec::validate() const {
  if (name.empty()) throw Error("reward with kind '" + kind + "': name is empty (metrics report reward/<name>/mean)");
  std::string where = "reward '" + name + "'";
  std::string k = resolved_kind();
  if (!std::isfinite(weight)) throw Error(where + ": weight " + std::to_string(weight) + " is not a finite number");
  if (k == "math_answer" && answer_key.empty()) throw Error(where + ": answer_key is empty");
  if (k == "plugin" && plugin.empty()) throw Error(where + ": kind plugin needs plugin: PATH to a shared library");
  if (k == "http" && url.empty()) throw Error(where + ": kind http needs url: http://host:port/path");
}

std::unique_ptr<RewardFn> make_reward(const RewardSpec& spec) {
  spec.validate();
  std::string k = spec.resolved_kind();
  if (k == "math_answer") return std::make_unique<MathAnswerReward>(spec.answer_key);
  if (k == "format") return std::make_unique<FormatReward>();
  if (k == "plugin") return std::make_unique<PluginReward>(spec.plugin);
  return std::make_unique<HttpReward>(HttpRewardOptions{.url = spec.url,
                                                        .timeout_s = spec.timeout_s,
                                                        .retries = spec.retries,
                                                        .backoff_s = spec.backoff_s,
                                                        .max_batch = spec.max_batch});
}

CombinedReward::CombinedReward(std::vector<WeightedReward> parts) : parts_(std::move(parts)) {
  if (parts_.empty()) throw Error("rewards: at least one reward is needed");
  std::set<std::string> names;
  for (const auto& p : parts_) {
    if (p.name.empty()) throw Error("rewards: a reward has an empty name");
    if (!names.insert(p.name).second) throw Error("rewards: the name '" + p.name + "' is used twice (names must be unique)");
    if (!p.fn) throw Error("reward '" + p.name + "': no reward function");
    if (!std::isfinite(p.weight)) throw Error("reward '" + p.name + "': weight is not a finite number");
  }
}

double CombinedReward::score(const RewardSample& sample) const { return score_all({&sample, 1}).total.at(0); }

std::vector<double> CombinedReward::score_batch(std::span<const RewardSample> samples) const {
  return score_all(samples).total;
}

RewardScores CombinedReward::score_all(std::span<const RewardSample> samples) const {
  RewardScores out;
  out.total.assign(samples.size(), 0.0);
  for (const auto& p : parts_) {
    auto scores = p.fn->score_batch(samples);
    if (scores.size() != samples.size())
      throw Error("reward '" + p.name + "': " + std::to_string(scores.size()) + " scores for " +
                  std::to_string(samples.size()) + " samples");
    for (size_t i = 0; i < scores.size(); ++i) out.total[i] += p.weight * scores[i];
    out.components.push_back({p.name, p.weight, std::move(scores)});
  }
  return out;
}

CombinedReward make_combined_reward(const std::vector<RewardSpec>& specs) {
  std::vector<WeightedReward> parts;
  for (const auto& s : specs) parts.push_back({s.name, s.weight, make_reward(s)});
  return CombinedReward(std::move(parts));
}

}  // namespace troupe
