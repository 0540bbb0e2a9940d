#include <iostream>

#include <nlohmann/json.hpp>

#include "actors/actor_util.hpp"
#include "actors/stage_actors.hpp"
#include "policy/error.hpp"

namespace troupe {

namespace {

// Scores every completion of a group. A reward that throws (a plugin's bug, a reward service
// that is down, slow past its retries or answering garbage) fails this group only: it travels
// on marked failed, so the trainer counts it against its batch and the run goes on.
void score(const CombinedReward& reward, const std::optional<Tokenizer>& tokenizer, RolloutGroup& g) {
  auto metadata = nlohmann::json::parse(g.metadata, nullptr, /*allow_exceptions=*/false);
  if (metadata.is_discarded()) metadata = nullptr;
  std::string prompt = tokenizer ? tokenizer->decode(g.prompt_ids) : "";
  std::vector<RewardSample> samples;
  for (const auto& ids : g.completion_ids)
    samples.push_back({prompt, tokenizer ? tokenizer->decode(ids, /*skip_special_tokens=*/true) : "", metadata});
  try {
    auto scores = reward.score_all(samples);
    g.reward = std::move(scores.total);
    for (auto& c : scores.components) g.rewards[c.name] = std::move(c.scores);
  } catch (const std::exception& e) {
    g.error = std::string("reward: ") + e.what();
    std::cerr << "troupe: prompt " << g.prompt_id << " (batch " << g.batch << ") failed, not trained on: " << g.error
              << std::endl;
  }
}

rollout_sink::behavior_type reward_stage(rollout_sink::pointer self, std::shared_ptr<const CombinedReward> reward,
                                         std::optional<Tokenizer> tokenizer, rollout_sink next) {
  name_failures(self, "reward");
  return {[=](RolloutGroup& g) {
    if (g.error.empty()) score(*reward, tokenizer, g);  // a group failed upstream passes on as it is
    self->send(next, std::move(g));
  }};
}

stage_worker::behavior_type reward_worker(stage_worker::pointer self, std::shared_ptr<const CombinedReward> reward,
                                          std::optional<Tokenizer> tokenizer) {
  name_failures(self, "reward");
  return {[=](RolloutGroup& g) -> RolloutGroup {
    score(*reward, tokenizer, g);
    return std::move(g);
  }};
}

}  // namespace

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(RewardSpec, name, kind, weight, answer_key, plugin, url, timeout_s, retries, backoff_s,
                                   max_batch)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(RewardStageSpec, rewards, tokenizer)

nlohmann::json to_json(const RewardStageSpec& spec) { return spec; }

RewardStageSpec reward_stage_spec_from_json(const nlohmann::json& j) {
  return spec_from_json<RewardStageSpec>(j, "reward stage spec");
}

stage_worker spawn_reward_worker(caf::actor_system& system, const RewardStageSpec& spec) {
  auto reward = std::make_shared<const CombinedReward>(make_combined_reward(spec.rewards));
  std::optional<Tokenizer> tokenizer;
  if (!spec.tokenizer.empty()) tokenizer = Tokenizer::load(spec.tokenizer);
  return system.spawn<caf::detached>(reward_worker, std::move(reward), std::move(tokenizer));
}

rollout_sink spawn_reward(caf::actor_system& system, std::shared_ptr<const CombinedReward> reward,
                          std::optional<Tokenizer> tokenizer, rollout_sink next) {
  return system.spawn<caf::detached>(reward_stage, std::move(reward), std::move(tokenizer), std::move(next));
}

}  // namespace troupe
