// Trainer ranks in the actor graph (parallel.trainer_ranks, or an outside launcher). Rank 0
// runs the whole graph, and its trainer actor trains its share of each batch; ranks 1..N-1 run
// follow_trainer, which builds the same recipe and takes part in the same collectives. What a
// follower does next comes from rank 0 as a command, broadcast over the ranks' own c10d group
// (msgpack bytes), in the order rank 0 does it: train this batch, publish the weights (zero3
// gathers the parameters for that), checkpoint into this folder, nothing (a keepalive while
// rank 0 waits for rollouts, so that a follower's wait is bounded by parallel.timeout_s and a
// hung rank 0 is an error, not a hang), stop.
#pragma once

#include <chrono>
#include <filesystem>
#include <memory>
#include <vector>

#include <c10/core/Device.h>

#include "trainer/rollout.hpp"

namespace troupe {

class DataParallel;
class ProcessGroup;
struct GraphSpec;

struct RankCommand {
  enum class Op { train, publish, checkpoint, idle, stop };
  Op op = Op::idle;
  std::vector<RolloutGroup> groups;  // train: the whole batch without its failed groups, in ticket order
  std::filesystem::path dir;         // checkpoint: the folder each rank writes its shard into
};

class RankChannel {
 public:
  RankChannel(std::shared_ptr<ProcessGroup> group, c10::Device device);
  // Rank 0's end tells the followers to stop (best effort: they may be gone already).
  ~RankChannel();
  void send(const RankCommand& command);  // rank 0
  RankCommand receive();                  // ranks 1..N-1; throws Error naming rank 0 past the timeout
  // Rank 0: a keepalive when nothing was sent for a quarter of the group's timeout.
  void keep_alive();
  std::chrono::milliseconds keepalive_interval() const;

 private:
  std::shared_ptr<ProcessGroup> group_;
  c10::Device device_;
  std::chrono::steady_clock::time_point last_sent_;
};

// zero3's parameters whole for a scope, on every rank at once (publishing or checkpointing the
// weights); nothing for the other modes or one trainer.
class WholeWeights {
 public:
  explicit WholeWeights(DataParallel* dp);
  ~WholeWeights();
  WholeWeights(const WholeWeights&) = delete;
  WholeWeights& operator=(const WholeWeights&) = delete;

 private:
  DataParallel* dp_;
};

// Ranks 1..N-1 of a graph run: the recipe as rank 0 builds it (from spec.resume too), then rank
// 0's commands until it says stop. Throws Error when rank 0 goes silent or away.
void follow_trainer(const GraphSpec& spec);

}  // namespace troupe
