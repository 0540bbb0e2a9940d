#include "generator/static_decode.hpp"

#include <algorithm>
#include <iostream>

#include <torch/torch.h>

#ifdef TROUPE_CUDA_GRAPHS
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "policy/error.hpp"

namespace troupe {

#ifdef TROUPE_CUDA_GRAPHS
struct StaticDecode::Graph {
  at::cuda::CUDAGraph graph;
  torch::Tensor logits;  // written by each replay, in the graphs' memory pool
};

// What capturing needs beside the graphs: a stream of its own (a pool stream is shared with the
// rest of the process, whose work would be recorded into the graph), and one memory pool for all
// the graphs, as vLLM does: they replay one at a time on one stream, each keeping its output.
struct StaticDecode::Capture {
  c10::DeviceIndex device = 0;
  cudaStream_t raw = nullptr;
  at::cuda::MempoolId_t pool;
  explicit Capture(c10::DeviceIndex d) : device(d), pool(at::cuda::graph_pool_handle()) {
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  }
  ~Capture() {
    if (raw) cudaStreamDestroy(raw);
  }
  c10::cuda::CUDAStream stream() const { return c10::cuda::getStreamFromExternal(raw, device); }
};

namespace {

// Undoes a capture that threw between capture_begin and capture_end: ends the stream's capture
// (else this thread may make no unsafe CUDA call again) and the allocator's routing of this
// stream's allocations to the pool, which CUDAGraph's destructor leaves as they are.
void abandon_capture(cudaStream_t stream, c10::DeviceIndex device, at::cuda::MempoolId_t pool) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream, &partial);
    if (partial) cudaGraphDestroy(partial);
  }
  (void)cudaGetLastError();
  try {  // capture_end already did this (and hands the pool back itself) if capture_end threw after it
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
  } catch (...) {
    return;
  }
  try {
    at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool);
  } catch (...) {
  }
  // The failed graph's share of the pool, which its destructor does not hand back.
  c10::cuda::CUDACachingAllocator::releasePool(device, pool);
}

}  // namespace
#else
struct StaticDecode::Graph {};
struct StaticDecode::Capture {};
#endif

std::vector<int64_t> StaticDecode::batch_sizes(int64_t max_batch) {
  std::vector<int64_t> sizes;
  for (int64_t s : {1, 2, 4})
    if (s < max_batch) sizes.push_back(s);
  for (int64_t s = 8; s < max_batch; s += 8) sizes.push_back(s);
  sizes.push_back(max_batch);
  return sizes;
}

int64_t StaticDecode::span_for(int64_t need, int64_t max_seq_len) {
  int64_t span = 16;
  while (span < need) span *= 2;
  return std::min(span, max_seq_len);
}

StaticDecode::StaticDecode(TransformerImpl& model, KVCache& cache, int64_t max_batch, int64_t max_seq_len, bool capture)
    : model_(model), cache_(cache), max_seq_len_(max_seq_len), capture_(capture), sizes_(batch_sizes(max_batch)) {
  const auto device = model_.lm_head_weight().device();
#ifdef TROUPE_CUDA_GRAPHS
  if (capture_ && !device.is_cuda())
    throw Error("CUDA graphs need the model on a CUDA device, it is on " + device.str());
  if (capture_) capture_state_ = std::make_unique<Capture>(device.index());
#else
  if (capture_) throw Error("CUDA graphs: this troupe was built without CUDA");
#endif
  TORCH_CHECK(cache_.capacity() == max_seq_len && cache_.k[0].size(0) == max_batch, "StaticDecode: the cache is [",
              cache_.k[0].size(0), ", ..., ", cache_.capacity(), ", ...], expected [", max_batch, ", ..., ", max_seq_len, ", ...]");
  auto longs = torch::TensorOptions().dtype(torch::kLong).device(device);
  ids_ = torch::zeros({max_batch, 1}, longs);
  positions_ = torch::zeros({max_batch, 1}, longs);
  write_ = torch::zeros({max_batch}, longs);
  key_index_ = torch::arange(max_seq_len, longs);
  // The inputs are staged in one host buffer, pinned on a GPU so their copy does not block; a
  // step's sampled ids come back to the host before the next step overwrites it.
  staging_ = torch::zeros({3 * max_batch}, torch::kLong);
  if (device.is_cuda()) staging_ = staging_.pin_memory();
}

StaticDecode::~StaticDecode() {
  graphs_.clear();  // before their stream and pool
  capture_state_.reset();
}

void StaticDecode::clear() { graphs_.clear(); }

torch::Tensor StaticDecode::forward(int64_t size, int64_t span) {
  auto [view, mask] = cache_.per_row(size, write_.narrow(0, 0, size), span, key_index_);
  auto hidden = model_.forward(ids_.narrow(0, 0, size), positions_.narrow(0, 0, size), mask, &view);  // (size, 1, H)
  return model_.logits(hidden.select(1, 0));                                                            // (size, V)
}

torch::Tensor StaticDecode::step(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                                 const std::vector<int64_t>& write) {
  const int64_t rows = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(rows >= 1 && rows <= sizes_.back() && positions.size() == tokens.size() && write.size() == tokens.size(),
              "StaticDecode::step: ", tokens.size(), " tokens, ", positions.size(), " positions, ", write.size(),
              " writes for at most ", sizes_.back(), " rows");
  const int64_t last = *std::max_element(write.begin(), write.end());
  // Checked here: out of range inside a graph is a device-side assert that ends the CUDA context.
  TORCH_CHECK(*std::min_element(write.begin(), write.end()) >= 0 && last < max_seq_len_, "StaticDecode::step: a write index ",
              last, " outside the cache's ", max_seq_len_, " positions");
  const int64_t size = *std::lower_bound(sizes_.begin(), sizes_.end(), rows);
  const int64_t span = span_for(last + 1, max_seq_len_);
  // The padding rows' inputs are zeros: a dummy token at write 0 of their own (free) slots.
  auto host = staging_.narrow(0, 0, 3 * size).view({3, size});  // contiguous, so it copies as it is
  host.zero_();
  std::copy(tokens.begin(), tokens.end(), host[0].data_ptr<int64_t>());
  std::copy(positions.begin(), positions.end(), host[1].data_ptr<int64_t>());
  std::copy(write.begin(), write.end(), host[2].data_ptr<int64_t>());
  auto staged = host.to(ids_.device(), /*non_blocking=*/true);
  ids_.narrow(0, 0, size).copy_(staged[0].unsqueeze(1));
  positions_.narrow(0, 0, size).copy_(staged[1].unsqueeze(1));
  write_.narrow(0, 0, size).copy_(staged[2]);
  if (!capture_) return forward(size, span);
#ifdef TROUPE_CUDA_GRAPHS
  auto found = graphs_.find({size, span});
  if (found == graphs_.end()) {
    try {
      return capture(size, span);
    } catch (const std::exception& e) {
      // A stated fallback, not a failed rollout: the same steps, op by op.
      std::cerr << "troupe: warning: capturing a CUDA graph of the decode step failed, decoding eagerly from now on: "
                << e.what() << std::endl;
      capture_ = false;
      graphs_.clear();
      return forward(size, span);
    }
  }
  found->second->graph.replay();
  return found->second->logits;
#else
  return {};  // unreachable: the constructor refused capture
#endif
}

torch::Tensor StaticDecode::capture(int64_t size, int64_t span) {
#ifdef TROUPE_CUDA_GRAPHS
  auto graph = std::make_unique<Graph>();
  const auto current = c10::cuda::getCurrentCUDAStream();
  // Capture runs on its own stream, after everything queued so far (the inputs' copies).
  const auto side = capture_state_->stream();
  at::cuda::CUDAEvent inputs_ready;
  inputs_ready.record(current);
  inputs_ready.block(side);
  torch::Tensor logits;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    // An eager step first: lazy set-up (cuBLAS handles and workspaces) happens outside the
    // capture. It writes the same keys the replay writes again.
    logits = forward(size, span);
    // Thread-local capture: other actors of the process may use the GPU meanwhile.
    graph->graph.capture_begin(capture_state_->pool, cudaStreamCaptureModeThreadLocal);
    try {
      graph->logits = forward(size, span);
      graph->graph.capture_end();
    } catch (...) {
      graph->logits = torch::Tensor();
      abandon_capture(capture_state_->raw, capture_state_->device, capture_state_->pool);
      throw;
    }
  }
  at::cuda::CUDAEvent captured;
  captured.record(side);
  captured.block(current);
  graphs_.emplace(std::make_pair(size, span), std::move(graph));
  logits.record_stream(current);  // made on the capture stream, read on the current one
  return logits;  // this step's logits, from the eager step (capturing computes nothing)
#else
  (void)size;
  (void)span;
  throw Error("CUDA graphs: this troupe was built without CUDA");
#endif
}

}  // namespace troupe
