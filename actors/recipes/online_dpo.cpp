// Online DPO: per group, the completion with the highest total reward is chosen and the one
// with the lowest rejected (the first of each among ties), against the reference actor's
// log-probs, with trainer.dpo's beta and label smoothing. A group whose rewards all tie says
// nothing about preference and gives no pair; a batch without pairs makes no update.
#include "actors/graph.hpp"
#include "actors/rl_recipe.hpp"
#include "policy/error.hpp"

namespace troupe {

namespace {

sft::Sequence sequence(const RolloutGroup& g, size_t i) {
  sft::Sequence s;
  s.ids = g.prompt_ids;
  s.ids.insert(s.ids.end(), g.completion_ids[i].begin(), g.completion_ids[i].end());
  s.loss_mask.assign(g.prompt_ids.size(), 0);
  s.loss_mask.resize(s.ids.size(), 1);
  return s;
}

double reference_logprob(const RolloutGroup& g, size_t i) {
  if (g.reference_logprobs.size() != g.completion_ids.size())
    throw Error("online_dpo: prompt " + std::to_string(g.prompt_id) + " has no reference log-probs (is the reference actor on?)");
  double sum = 0;
  for (float x : g.reference_logprobs[i]) sum += x;
  return sum;
}

std::vector<dpo::Pair> preference_pairs(const std::vector<RolloutGroup>& groups) {
  std::vector<dpo::Pair> pairs;
  for (const auto& g : groups) {
    auto [lo, hi] = std::minmax_element(g.reward.begin(), g.reward.end());
    if (g.reward.empty() || *lo == *hi) continue;
    size_t chosen = hi - g.reward.begin(), rejected = lo - g.reward.begin();
    if (g.completion_ids[chosen].empty() || g.completion_ids[rejected].empty()) continue;
    pairs.push_back({sequence(g, chosen), sequence(g, rejected), reference_logprob(g, chosen), reference_logprob(g, rejected)});
  }
  return pairs;
}

class OnlineDpo final : public RlRecipe {
 public:
  OnlineDpo(std::unique_ptr<Trainer> trainer, double beta) : trainer_(std::move(trainer)), beta_(beta) {}
  std::optional<RlUpdate> train(const std::vector<RolloutGroup>& groups, nlohmann::json& extra) override {
    auto pairs = preference_pairs(groups);
    extra["pairs"] = pairs.size();
    if (pairs.empty()) return std::nullopt;  // on every rank: each has the whole batch
    auto d = trainer_->dpo_step(my_share(pairs));
    RlUpdate u;
    // kl: the mean log pi/pi_ref of the paired completions (a sequence-level estimate).
    u.metrics = StepMetrics{.loss = d.loss, .kl = (d.reward_chosen + d.reward_rejected) / (2 * beta_),
                            .grad_norm = d.grad_norm, .lr = d.lr, .reward_mean = mean_reward(groups)};
    u.extra = {{"rewards/accuracies", d.accuracy}, {"rewards/margins", d.margin}, {"rewards/chosen", d.reward_chosen},
               {"rewards/rejected", d.reward_rejected}, {"pairs", pairs.size()}};
    return u;
  }
  Transformer& model() override { return trainer_->model(); }
  // Each trainer rank its part of the pairs (dpo_step divides by the count over every rank).
  std::vector<dpo::Pair> my_share(std::vector<dpo::Pair> pairs) const {
    const DataParallel* dp = trainer_->data_parallel();
    if (!dp) return pairs;
    auto [begin, end] = rank_share(static_cast<int64_t>(pairs.size()), dp->rank(), dp->size());
    return {std::make_move_iterator(pairs.begin() + begin), std::make_move_iterator(pairs.begin() + end)};
  }
  void save_state(const std::filesystem::path& dir) override { trainer_->save_state(dir / "optimizer.pt"); }
  void load_state(const std::filesystem::path& dir) override { trainer_->load_state(dir / "optimizer.pt"); }
  DataParallel* data_parallel() override { return trainer_->data_parallel(); }

 private:
  std::unique_ptr<Trainer> trainer_;
  double beta_;
};

}  // namespace

std::unique_ptr<RlRecipe> make_online_dpo(Transformer policy, const GraphSpec& spec) {
  return std::make_unique<OnlineDpo>(make_policy_trainer(std::move(policy), spec, spec.trainer), spec.trainer.dpo.beta);
}

}  // namespace troupe
