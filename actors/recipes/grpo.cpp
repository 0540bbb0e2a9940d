// GRPO (DAPO's clip-higher and token-level aggregation by default): group-relative advantages
// and the decoupled-PPO clipped loss, num_iterations optimizer passes over each batch.
#include "actors/graph.hpp"
#include "actors/rl_recipe.hpp"

namespace troupe {

namespace {

class Grpo final : public RlRecipe {
 public:
  explicit Grpo(std::unique_ptr<Trainer> trainer) : trainer_(std::move(trainer)) {}
  std::optional<RlUpdate> train(const std::vector<RolloutGroup>& groups, nlohmann::json&) override {
    return RlUpdate{trainer_->grpo_step(groups)};
  }
  Transformer& model() override { return trainer_->model(); }
  void save_state(const std::filesystem::path& dir) override { trainer_->save_state(dir / "optimizer.pt"); }
  void load_state(const std::filesystem::path& dir) override { trainer_->load_state(dir / "optimizer.pt"); }
  DataParallel* data_parallel() override { return trainer_->data_parallel(); }

 private:
  std::unique_ptr<Trainer> trainer_;
};

}  // namespace

std::unique_ptr<RlRecipe> make_grpo_with(Transformer policy, const GraphSpec& spec, TrainerConfig config) {
  return std::make_unique<Grpo>(make_policy_trainer(std::move(policy), spec, std::move(config)));
}

std::unique_ptr<RlRecipe> make_grpo(Transformer policy, const GraphSpec& spec) {
  return make_grpo_with(std::move(policy), spec, spec.trainer);
}

}  // namespace troupe
