// The in-process generation engine: continuous batching over a preallocated KV cache, with
// per-request sampling, behaviour log-probs and policy versions, and weight updates between
// decode steps. Single-threaded: its owner (an actor, the server loop) calls step().
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <torch/types.h>

#include "generator/partial_rollouts.hpp"
#include "generator/sampling.hpp"
#include "generator/static_decode.hpp"
#include "policy/tokenizer.hpp"
#include "policy/transformer.hpp"

namespace troupe {

enum class FinishReason { stop, length, abort };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "abort"

struct Completion {
  uint64_t request_id = 0;
  int64_t index = 0;                // which of the request's n samples
  std::vector<int32_t> prompt_ids;  // [P]
  std::vector<int32_t> ids;         // [L] completion ids; a stop token that ended it is included
  std::vector<float> logprobs;      // [L] log-prob of ids[i] under the distribution sampled from
  FinishReason finish_reason = FinishReason::length;
  std::optional<int32_t> stop_token;       // the stop token id that ended it, if any
  std::optional<std::string> stop_string;  // the stop string that ended it, if any
  std::string text;                 // decoded completion (stop string cut per the params); empty without tokenizer
  int64_t min_version = 0;          // policy versions of the weights that produced its tokens
  int64_t max_version = 0;
  std::vector<int64_t> versions;    // [L] the policy version that sampled ids[i]
};

// How the n samples of a request start from their prompt.
// separate: each sample prefills the prompt in its own slot (what an engine without prefix
//   sharing does; for comparisons).
// copy: one prefill, its keys and values copied into each sample's slot.
// shared: one prefill, its keys and values held once and read by all n samples' decode steps
//   (KVCache::prefixes); each slot holds only its sample's own tokens. Runs on the CPU in float32
//   and bfloat16 without batch-invariant kernels; elsewhere the engine copies instead.
enum class PrefixSharing { separate, copy, shared };

// How decode steps run.
// eager: op by op, at each step's own shape (rows up to the last busy slot, keys up to the
//   longest row).
// graphs: CUDA graphs of a few fixed shapes, captured once and replayed (generator/
//   static_decode.hpp); a CUDA device and a CUDA build, else Error. Prefixes are then copied.
// static_eager: the graphs' fixed shapes, run op by op: what a replay computes, on any device.
// automatic: graphs on a CUDA device, eager elsewhere (vLLM's default; enforce_eager is eager).
enum class DecodeMode { automatic, eager, graphs, static_eager };

struct EngineOptions {
  int64_t max_batch = 32;     // decode slots: sequences generated together
  int64_t max_seq_len = 2048; // prompt + completion tokens a slot holds
  // On update_weights, the sequences in progress (generator/partial_rollouts.hpp): continue
  // under the new weights, or abort (their tokens dropped, requeued). finish: the owner calls
  // update_weights only once has_work() is false; earlier is an Error, nothing copied.
  PartialRollouts partial_rollouts = PartialRollouts::continue_;
  // Batch-invariant kernels (CPU, float32 or float64): each sequence's log-probs are bit for bit
  // those of a full forward pass over it (model.batch_invariant), whatever shares the batch.
  bool batch_invariant = false;
  // The GEMM weights decoding reads (generator.weights): the model's own, or a weight-only int8 /
  // int4 copy, requantized by each update_weights; log-probs are the quantized policy's.
  WeightFormat weights = WeightFormat::full;
  PrefixSharing prefix = PrefixSharing::shared;
  DecodeMode decode = DecodeMode::automatic;
  uint64_t seed = 0;          // for requests without their own seed
};

class Engine {
 public:
  Engine(Transformer model, std::optional<Tokenizer> tokenizer, EngineOptions options = {});
  ~Engine();

  // Queues a request and returns its id. Throws Error for invalid parameters (empty prompt,
  // ids outside the vocabulary, prompt + max_tokens above max_seq_len, n above max_batch, ...).
  uint64_t add_request(std::vector<int32_t> prompt, SamplingParams params);
  // Admits waiting requests into free slots (prefill), then decodes one token for every
  // running sequence. Returns the completions that finished during this step.
  std::vector<Completion> step();
  bool has_work() const;
  // Drops a request (waiting or running); its unfinished samples come back from the next
  // step() with FinishReason::abort.
  void abort(uint64_t request_id);

  // Runs requests to completion (on top of anything already queued) and returns their
  // completions ordered by request, then sample index.
  std::vector<Completion> generate(const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params);

  // Copies new weights in place, name for name (HF names; a subset is fine), and sets the
  // policy version. Call between steps. Unknown names or shapes throw Error before any copy.
  void update_weights(const std::map<std::string, torch::Tensor>& weights, int64_t version);
  int64_t version() const { return version_; }
  // Seconds the last update_weights spent requantizing (a quantized `weights` format), done
  // there rather than in the next decode step; 0 for float weights.
  double requantize_seconds() const { return requantize_s_; }

  const ModelConfig& config() const;
  const std::optional<Tokenizer>& tokenizer() const { return tokenizer_; }
  const EngineOptions& options() const { return options_; }
  PrefixSharing prefix_sharing() const { return prefix_; }  // options().prefix, or copy where shared cannot run
  DecodeMode decode_mode() const { return decode_; }         // options().decode, automatic resolved
  int64_t decode_graphs() const;                             // CUDA graphs captured so far
  int64_t running() const;  // sequences in slots
  int64_t waiting() const;  // samples queued for a slot
  // Calls f(request_id, index, ids, logprobs) for every sequence in a slot, with its tokens so
  // far (streaming and latency metrics read them between steps; nothing is copied here).
  void each_running(const std::function<void(uint64_t request_id, int64_t index, const std::vector<int32_t>& ids,
                                             const std::vector<float>& logprobs)>& f) const;

 private:
  struct Sequence;
  void admit();
  void prefill(std::vector<Sequence*> group);
  void refill(Sequence& seq);
  void decode();
  std::vector<int32_t> stop_ids_for(const SamplingParams& params) const;
  bool check_finished(Sequence& seq);
  Completion finish(Sequence& seq, FinishReason reason);

  Transformer model_;
  std::optional<Tokenizer> tokenizer_;
  EngineOptions options_;
  PrefixSharing prefix_;
  DecodeMode decode_;
  std::vector<int32_t> eos_ids_;
  KVCache cache_;
  std::unique_ptr<StaticDecode> static_decode_;  // graphs and static_eager
  std::vector<std::unique_ptr<Sequence>> slots_;  // [max_batch]; null when free
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<Completion> finished_;              // aborted while waiting, reported by step()
  uint64_t next_request_id_ = 1;
  int64_t version_ = 0;
  double requantize_s_ = 0;
  at::Generator default_generator_;
};

}  // namespace troupe
