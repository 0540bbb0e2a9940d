// Rank 0's commands to the other trainer ranks, and the followers' loop; see trainer_ranks.hpp.
#include "actors/trainer_ranks.hpp"

#include <algorithm>
#include <iostream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "actors/actor_util.hpp"
#include "actors/graph.hpp"
#include "actors/graph_checkpoint.hpp"
#include "actors/rl_recipe.hpp"
#include "policy/error.hpp"
#include "trainer/data_parallel.hpp"

namespace troupe {

namespace {

constexpr const char* kOps[] = {"train", "publish", "checkpoint", "idle", "stop"};  // in Op order

std::vector<uint8_t> encode(const RankCommand& c) {
  nlohmann::json j{{"op", kOps[static_cast<int>(c.op)]}, {"dir", c.dir.string()}};
  auto& groups = j["groups"] = nlohmann::json::array();
  for (const auto& g : c.groups) groups.push_back(to_json(g));
  return nlohmann::json::to_msgpack(j);
}

RankCommand decode(const std::vector<uint8_t>& bytes) {
  const auto j = nlohmann::json::from_msgpack(bytes);
  RankCommand c;
  const auto op = j.at("op").get<std::string>();
  const auto* found = std::find(std::begin(kOps), std::end(kOps), op);
  if (found == std::end(kOps)) throw Error("a trainer rank command with an unknown op '" + op + "' (another troupe build?)");
  c.op = static_cast<RankCommand::Op>(found - std::begin(kOps));
  c.dir = j.at("dir").get<std::string>();
  for (const auto& g : j.at("groups")) c.groups.push_back(group_from_json(g));
  return c;
}

}  // namespace

RankChannel::RankChannel(std::shared_ptr<ProcessGroup> group, c10::Device device)
    : group_(std::move(group)), device_(device), last_sent_(std::chrono::steady_clock::now()) {}

RankChannel::~RankChannel() {
  if (group_->rank() != 0) return;
  try {
    send({RankCommand::Op::stop});
  } catch (const std::exception& e) {
    std::cerr << "troupe run: could not tell the other trainer ranks to stop: " << e.what() << std::endl;
  }
}

// The length, then the bytes: two broadcasts from rank 0, on the group's device (NCCL's are CUDA tensors).
void RankChannel::send(const RankCommand& command) {
  auto bytes = encode(command);
  auto size = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64).to(device_);
  group_->broadcast(size, 0);
  auto payload = torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8).to(device_);
  group_->broadcast(payload, 0);
  last_sent_ = std::chrono::steady_clock::now();
}

RankCommand RankChannel::receive() {
  try {
    auto size = torch::zeros({1}, torch::TensorOptions(torch::kInt64).device(device_));
    group_->broadcast(size, 0);
    auto payload = torch::empty({size.cpu().item<int64_t>()}, torch::TensorOptions(torch::kUInt8).device(device_));
    group_->broadcast(payload, 0);
    payload = payload.cpu().contiguous();
    const auto* data = payload.data_ptr<uint8_t>();
    return decode(std::vector<uint8_t>(data, data + payload.numel()));
  } catch (const Error& e) {
    throw Error("trainer rank " + std::to_string(group_->rank()) +
                ": no word from rank 0 (the run's trainer, which runs the graph): " + e.what());
  }
}

std::chrono::milliseconds RankChannel::keepalive_interval() const { return group_->timeout() / 4; }

void RankChannel::keep_alive() {
  if (std::chrono::steady_clock::now() - last_sent_ >= keepalive_interval()) send({RankCommand::Op::idle});
}

WholeWeights::WholeWeights(DataParallel* dp) : dp_(dp) {
  if (dp_) dp_->gather_all();
}

WholeWeights::~WholeWeights() {
  if (!dp_) return;
  try {
    dp_->release_all();
  } catch (const std::exception& e) {  // a prefetch that failed in flight: its error is the one to see
    std::cerr << "troupe: " << e.what() << std::endl;
  }
}

void follow_trainer(const GraphSpec& spec) {
  use_threads(spec.trainer_threads);
  auto recipe = make_rl_recipe(spec.recipe, spec.make_policy(), spec);
  if (spec.resume) restore_recipe(*recipe, spec, *spec.resume);
  RankChannel channel(spec.trainer_group, recipe->model()->lm_head_weight().device());
  for (;;) {
    auto command = channel.receive();
    switch (command.op) {
      case RankCommand::Op::train: {
        nlohmann::json extra;
        recipe->train(command.groups, extra);
        break;
      }
      case RankCommand::Op::publish: {
        WholeWeights whole(recipe->data_parallel());  // while rank 0 copies them out
        break;
      }
      case RankCommand::Op::checkpoint: {
        { WholeWeights whole(recipe->data_parallel()); }  // while rank 0 writes the model
        save_rank_state(*recipe, command.dir);
        break;
      }
      case RankCommand::Op::idle: break;
      case RankCommand::Op::stop: return;
    }
  }
}

}  // namespace troupe
