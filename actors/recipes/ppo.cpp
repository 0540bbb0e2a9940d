// PPO: a value head on the policy's trunk, GAE advantages, the clipped policy loss and a
// clipped value loss (trainer/ppo.hpp); the checkpoint adds the value head.
#include "actors/graph.hpp"
#include "actors/rl_recipe.hpp"
#include "policy/error.hpp"
#include "trainer/ppo.hpp"

namespace troupe {

namespace {

class Ppo final : public RlRecipe {
 public:
  explicit Ppo(std::unique_ptr<PpoTrainer> ppo) : ppo_(std::move(ppo)) {}
  std::optional<RlUpdate> train(const std::vector<RolloutGroup>& groups, nlohmann::json&) override {
    auto p = ppo_->step(groups);
    RlUpdate u;
    u.metrics = StepMetrics{.loss = p.loss, .kl = p.kl, .clip_fraction = p.clip_fraction,
                            .behaviour_weight = p.behaviour_weight, .grad_norm = p.grad_norm, .lr = p.lr,
                            .reward_mean = p.reward_mean, .tokens = p.tokens, .sequences = p.sequences};
    u.extra = {{"policy_loss", p.policy_loss}, {"value_loss", p.value_loss},
               {"value_clip_fraction", p.value_clip_fraction}, {"explained_variance", p.explained_variance},
               {"returns/mean", p.returns_mean}, {"values/mean", p.values_mean}};
    return u;
  }
  Transformer& model() override { return ppo_->model(); }
  void save_state(const std::filesystem::path& dir) override {
    // The head is whole on every rank (zero3 is refused); rank 0 writes it.
    if (!ppo_->data_parallel() || ppo_->data_parallel()->rank() == 0) ppo_->save_value_head(dir / "value_head.safetensors");
    ppo_->save_state(dir / "optimizer.pt");
  }
  void load_state(const std::filesystem::path& dir) override {
    ppo_->load_value_head(dir / "value_head.safetensors");
    ppo_->load_state(dir / "optimizer.pt");
  }
  DataParallel* data_parallel() override { return ppo_->data_parallel(); }

 private:
  std::unique_ptr<PpoTrainer> ppo_;
};

}  // namespace

std::unique_ptr<RlRecipe> make_ppo(Transformer policy, const GraphSpec& spec) {
  if (spec.lora) throw Error("ppo with LoRA adapters is not supported yet");
  if (!spec.ppo) throw Error("recipe ppo needs the spec's ppo settings");
  auto ppo = std::make_unique<PpoTrainer>(policy, *spec.ppo, spec.seed);
  if (spec.trainer_group) ppo->shard(spec.trainer_group, spec.sharding);
  return std::make_unique<Ppo>(std::move(ppo));
}

}  // namespace troupe
