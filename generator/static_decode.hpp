// Decode steps over a few fixed shapes, so that on a GPU each shape is captured once as a CUDA
// graph and every later step of that shape is one graph replay instead of hundreds of kernel
// launches (what vLLM does for decoding). A step's rows are padded up to the next batch size of
// batch_sizes(max_batch) and its keys to the next power-of-two span, so the graphs are few and
// attention still reads little more than the live keys. The inputs live in static buffers that
// each step overwrites, and each graph writes its logits into a buffer of its own.
// Without capture (the CPU, tests) the same fixed-shape step runs eagerly, op by op; so do all
// later steps, with a warning, when a capture fails.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "policy/transformer.hpp"

namespace troupe {

class StaticDecode {
 public:
  // cache: the engine's KV cache, [max_batch, nkv, max_seq_len, hd] per layer; rows of the step
  // are its slots [0, rows). capture: replay CUDA graphs (the model must be on a CUDA device,
  // in a build with CUDA; else Error).
  StaticDecode(TransformerImpl& model, KVCache& cache, int64_t max_batch, int64_t max_seq_len, bool capture);
  ~StaticDecode();
  StaticDecode(const StaticDecode&) = delete;
  StaticDecode& operator=(const StaticDecode&) = delete;

  // One decode step for slots [0, rows): each one's token, its position, and where its new
  // key goes in its own slot (keys [0, write] are attended). Free rows decode a dummy token at
  // write 0 of their own slot, as the engine's eager step does. Returns logits [padded rows, V],
  // rows [0, rows) meaningful, valid until the next step.
  torch::Tensor step(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                     const std::vector<int64_t>& write);
  // Drops the captured graphs (the next steps capture again), e.g. after the weights changed:
  // a graph holds the addresses of every buffer it read when it was captured.
  void clear();
  int64_t graphs() const { return static_cast<int64_t>(graphs_.size()); }

  // The padded batch sizes: 1, 2, 4, then multiples of 8 (vLLM's capture sizes), up to
  // max_batch, which is always one.
  static std::vector<int64_t> batch_sizes(int64_t max_batch);
  // The padded key span for keys [0, need): the next power of two from 16, at most max_seq_len.
  static int64_t span_for(int64_t need, int64_t max_seq_len);

 private:
  struct Graph;    // a captured step (CUDA builds)
  struct Capture;  // the stream and memory pool the graphs are captured with
  torch::Tensor forward(int64_t size, int64_t span);  // the fixed-shape step on the static inputs
  torch::Tensor capture(int64_t size, int64_t span);  // captures it, then replays it from now on

  TransformerImpl& model_;
  KVCache& cache_;
  int64_t max_seq_len_;
  bool capture_;
  std::vector<int64_t> sizes_;
  torch::Tensor ids_, positions_, write_, key_index_;  // [max_batch, 1], [max_batch, 1], [max_batch], [max_seq_len]
  torch::Tensor staging_;  // [3 * max_batch] on the host: a step's tokens, positions and writes, `size` each
  std::unique_ptr<Capture> capture_state_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Graph>> graphs_;  // (size, span)
};

}  // namespace troupe
