// Data parallelism over trainer ranks, applied to a Trainer from outside (the Trainer is
// written for one replica): gradients reduced in flat per-block buffers, clipped by the global
// norm, AdamW stepped on the whole model (none) or on this rank's shard with fp32 master
// weights (zero1, zero2), parameters gathered back; or parameters themselves sharded (zero3),
// each decoder layer gathered for its forward pass and again for its backward pass.
// Collectives are c10d's (process_group.hpp).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/process_group.hpp"
#include "trainer/trainer.hpp"

namespace troupe {

enum class Sharding {
  none,   // every rank keeps everything; gradients all-reduced (DDP)
  zero1,  // optimizer state and fp32 master weights sharded; gradients all-reduced
  zero2,  // + gradients reduce-scattered: each rank keeps only its shard of them
  zero3,  // + parameters sharded: a decoder layer is whole only while it computes (Trainer's
          //   layer-by-layer trunk, which recomputes each layer in backward); the embedding,
          //   final norm and head are whole for the duration of a step
};

// The modes by name ("none", "zero1", ...), as configs, layout.json and bench_sft write them;
// sharding_of throws Error for any other name.
std::string_view name_of(Sharding mode);
Sharding sharding_of(std::string_view name);

// What one rank holds for training, in bytes (metrics.jsonl's memory/* keys).
struct MemoryBytes {
  int64_t params = 0;     // the model's trained parameters (full on every rank)
  int64_t grads = 0;      // gradients kept between backward and the step
  int64_t optimizer = 0;  // AdamW moments, plus fp32 master weights when sharded
};

// The part [begin, end) of n items that `rank` of `ranks` takes: contiguous, in rank order, sizes
// differing by at most one (token counts are global, so uneven parts stay exact).
std::pair<int64_t, int64_t> rank_share(int64_t n, int rank, int ranks);

class DataParallel {
 public:
  // `named` are the parameters the Trainer optimizes, with their Hugging Face names; they are
  // grouped into one flat buffer per transformer block (the embedding, each model.layers.N,
  // then the rest), in that order on every rank, each padded to a multiple of the world size.
  DataParallel(std::shared_ptr<ProcessGroup> group, Sharding mode,
               std::vector<std::pair<std::string, at::Tensor>> named, const OptimizerConfig& config);
  ~DataParallel();

  // One optimizer step from the parameters' local gradients (each rank's share of a loss
  // already divided by global counts, so the global gradient is their sum): reduce, clip to
  // max_grad_norm by the global norm, AdamW at `lr`, gather. Clears the gradients. Returns
  // the global gradient norm before clipping.
  double step(double lr);

  double sum(double local) { return group_->sum(local); }
  void all_reduce_sum(at::Tensor& t) { group_->all_reduce_sum(t); }
  void barrier() { group_->barrier(); }
  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  Sharding mode() const { return mode_; }
  MemoryBytes memory() const;

  // zero3. A step's collectives must line up on every rank: the Trainer runs as many
  // forward/backward passes on each (max_passes), empty ones where a rank has run out.
  // gather_layer also starts gathering the layer expected next (the next one up in a forward
  // pass, down in the backward pass's recomputation), which the next call then only waits for.
  bool shards_parameters() const { return mode_ == Sharding::zero3; }
  void set_prefetch(bool on) { prefetch_on_ = on; }  // on by default (troupe run decides: parallel.prefetch)
  void begin_step();                 // the embedding, norm and head whole until step() ends
  void gather_layer(int64_t layer);  // decoder layer `layer`'s parameters whole
  void release_layer(int64_t layer);
  // A layer's parameter gradients from one backward pass (`params` and `grads` side by side,
  // undefined grads as zeros), reduce-scattered and added to its shard's gradient.
  void reduce_layer_grads(int64_t layer, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads);
  int64_t max_passes(int64_t local);
  // Every parameter whole for a scope: evaluation, exports, loading weights (after which
  // reshard() takes the shards from the loaded parameters). No-ops unless zero3.
  void gather_all();
  void release_all();
  void reshard();

  // Optimizer state: this rank's shard (rank R writes optimizer.rankR.pt) plus, from rank 0,
  // layout.json: the mode, world size, version and every block's parameters and sizes. load
  // reads the files of every rank it needs, so a checkpoint resumes at another world size.
  void save_state(const std::filesystem::path& dir, int64_t version) const;
  int64_t load_state(const std::filesystem::path& dir);

  struct Block;

 private:
  double step_replicated(double lr);
  double step_sharded(double lr);
  void gather_block(size_t b);
  void release_block(size_t b);
  void prefetch_after(int64_t layer);
  void drop_prefetch();  // waits for a prefetch in flight and forgets it
  size_t block_of_layer(int64_t layer) const;
  // A block's parameters (or their gradients, zeros where undefined) as one fp32 buffer.
  at::Tensor flatten(const Block& b, bool grads) const;

  std::shared_ptr<ProcessGroup> group_;
  Sharding mode_;
  OptimizerConfig config_;
  std::vector<Block> blocks_;
  std::vector<at::Tensor> params_;                 // every trained parameter, in block order
  std::vector<std::string> names_;                 // their names
  std::vector<size_t> trainer_index_;              // [k] params_[k]'s place in original_
  std::vector<at::Tensor> original_;               // the same, in the trainer's order
  std::vector<at::Tensor> masters_;                // sharded: [block] this rank's fp32 slice
  std::unique_ptr<Optimizer> replicated_;          // none: over original_, fp32 masters of bf16 ones
  std::unique_ptr<torch::optim::AdamW> optimizer_;  // zero: over masters_
  std::vector<std::vector<int64_t>> shapes_;       // zero3: each parameter's shape, [param]
  struct Prefetch {
    size_t block = SIZE_MAX;     // the block being gathered, if any
    at::Tensor full;             // its whole flat buffer, once waited for
    std::function<void()> wait;
  } prefetch_;
  int64_t last_layer_ = -1;  // the layer gathered last, and which way the layers were walked
  int direction_ = -1;
  bool prefetch_on_ = true;
};

// Shards `trainer` over `group`: the parameters it optimizes, with the model's names for them.
void shard_trainer(Trainer& trainer, std::shared_ptr<ProcessGroup> group, Sharding mode, const OptimizerConfig& optimizer);

}  // namespace troupe
