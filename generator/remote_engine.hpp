// A client for vLLM-compatible HTTP servers (vLLM, `troupe serve`, llama.cpp's with options):
// generation through /v1/completions with token-id prompts, returning the same Completion as the
// built-in Engine, and weight sync through vLLM 0.33.0's routes. No streaming, no chat.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "generator/engine.hpp"
#include "generator/sampling.hpp"
#include "policy/tokenizer.hpp"

namespace troupe {

// The data plane of weight_transfer = "nccl", owned by the caller (troupe links no NCCL): a
// communicator whose rank 0 is this process and whose ranks 1.. are the server's workers.
struct NcclSender {
  std::string unique_id;  // the 128 raw bytes of the caller's ncclGetUniqueId
  // Joins as rank 0 of world_size (ncclCommInitRank), then vLLM's warm-up, a one-element float32
  // all_reduce (sum). Runs while /init_weight_transfer_engine is in flight, which it unblocks.
  std::function<void(int64_t world_size)> connect;
  // Broadcasts one tensor from rank 0, in update_info.names order, while /update_weights is in
  // flight. It gets the tensor as given (contiguous); moving it to the communicator's device is its job.
  std::function<void(const torch::Tensor&)> broadcast;
};

struct RemoteOptions {
  std::string api_key;            // sent as "Authorization: Bearer KEY" when not empty
  std::string model;              // the request's "model" field; empty leaves it out (one-model servers)
  double connect_timeout_s = 5;   // per try
  double timeout_s = 600;         // read/write timeout of one try: a long generation must fit
  int tries = 3;                  // attempts per call; retried on connection errors and 5xx, never on 4xx
  double backoff_s = 0.25;        // wait before the second try; doubles for each later one
  int max_concurrent = 8;         // requests in flight during generate(): one request per prompt
  int logprobs = 0;               // the request's "logprobs": 0 asks only for the sampled token's
  nlohmann::json extra = nlohmann::json::object();  // merged over every completion request body

  // For servers that are not vLLM. Each needs a tokenizer and checks what it relies on, so a
  // mismatch is an Error, never silently different token ids.
  // Send prompts as text (llama.cpp servers reject token ids). Each prompt must re-encode to
  // the same ids, and the server's usage.prompt_tokens (or prompt_token_ids) must agree.
  bool text_prompts = false;
  // Servers that do not return choices[i].token_ids: map each logprobs.tokens string to the one
  // vocabulary id that decodes to it; a string no id (or several) decodes to is an Error.
  bool ids_from_logprob_tokens = false;
  // Servers that ignore "n": send n requests of one sample each (seeds seed, seed+1, ...).
  bool one_sample_per_request = false;

  // How update_weights hands weights over, in vLLM 0.33.0's routes (all need the server started
  // with VLLM_SERVER_DEV_MODE=1):
  //   "reload"  vLLM's disk reload, POST /collective_rpc {"method": "reload_weights", "kwargs":
  //             {"weights_path": DIR}}: any vLLM, on CPU or GPU, with no weight-transfer config;
  //             and troupe serve.
  //   "disk"    vLLM's weight-transfer protocol (init, start, update, finish) with the shared-disk
  //             backend, update_info {"path": DIR}: troupe serve, and a vLLM with
  //             --weight-transfer-config '{"backend": "disk"}' (in vLLM's source after 0.33.0;
  //             0.33.0 itself has no file backend).
  //   "nccl"    the same protocol with vLLM's NCCL backend: names, dtype_names and shapes over
  //             HTTP, the bytes through `nccl`. Needs a CUDA device; troupe serve refuses it.
  std::string weight_transfer = "reload";
  NcclSender nccl;  // for weight_transfer = "nccl" only
};

class RemoteEngine {
 public:
  // base_url: "http://host:port", optionally with a path prefix ("http://host/vllm").
  explicit RemoteEngine(std::string base_url, RemoteOptions options = {},
                        std::optional<Tokenizer> tokenizer = std::nullopt);

  // One probe, no retries: GET /health answers 200 (servers without /health: GET /v1/models).
  bool health() const;
  // Polls health() until it answers or timeout_s passes; the Error names the URL and last problem.
  void wait_healthy(double timeout_s) const;

  // One completion per prompt and sample, ordered by prompt, then sample index; request_id is
  // the prompt's position. Log-probs are whatever the server reports for the sampled token:
  // vLLM reports the raw model distribution unless started with --logprobs-mode
  // processed_logprobs (after temperature and truncation); llama.cpp's servers report raw.
  // Versions come from the answer when the server reports them (troupe serve's "troupe" field),
  // else they are the last version this client pushed.
  std::vector<Completion> generate(const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params);

  // Pushes the tensors (HF names, their own dtypes) as policy `version`, inside vLLM's window:
  // POST /pause?mode=wait (running requests finish, new ones get 503, which generate() retries),
  // the load, POST /reset_prefix_cache, POST /resume. The load, by options.weight_transfer:
  //   reload: `dir` gets a safetensors folder; /collective_rpc reload_weights from it, then
  //           /update_weight_version {"new_version": "N"}.
  //   disk:   `dir` likewise; /init_weight_transfer_engine {"init_info": {}} on the first push
  //           only, then /start_weight_update, /update_weights {"update_info": {"path": dir}},
  //           /finish_weight_update {"weight_version": "N"}.
  //   nccl:   `dir` is unused; the first push sends /init_weight_transfer_engine with
  //           nccl_unique_id_b64, rank_offset 1 and world_size 1 + GET /get_world_size while
  //           nccl.connect runs; then start, update {"names", "dtype_names", "shapes"} while
  //           nccl.broadcast sends each tensor, finish.
  // The folder must be readable by the server at the same path. Each step is tried once: a
  // repeated start or update would open or fill another session. A failed push leaves the
  // server paused (vLLM's loads are not transactional, so its weights may be half new).
  void update_weights(const std::map<std::string, torch::Tensor>& weights, int64_t version,
                      const std::filesystem::path& dir);
  int64_t version() const { return version_; }  // the last version pushed (0 before any)

  const std::string& base_url() const { return base_url_; }
  const RemoteOptions& options() const { return options_; }

  // One call with the retry policy above; returns the parsed JSON answer. Public for callers
  // that need another endpoint (/v1/models, /pause) and for tests.
  nlohmann::json post(const std::string& path, const nlohmann::json& body) const;
  nlohmann::json get(const std::string& path) const;

 private:
  struct Reply;
  Reply send(const std::string& method, const std::string& path, const std::string& body) const;
  std::string call(const std::string& method, const std::string& path, const std::string& body, int tries) const;
  std::string sync_post(const std::string& path, const nlohmann::json& body) const;
  void post_during(const std::string& path, const nlohmann::json& body, const std::function<void()>& work) const;
  void sync_window(const std::function<void()>& load) const;
  void sync_reload(const std::filesystem::path& dir, int64_t version) const;
  void sync_disk(const std::filesystem::path& dir, int64_t version);
  void init_nccl();
  void sync_nccl(const std::map<std::string, torch::Tensor>& weights, int64_t version);
  nlohmann::json completion_body(const std::vector<int32_t>& prompt, const SamplingParams& params,
                                 int64_t n, std::optional<uint64_t> seed) const;
  std::vector<Completion> complete(uint64_t request_id, const std::vector<int32_t>& prompt,
                                   const SamplingParams& params) const;
  std::vector<Completion> parse_completions(const nlohmann::json& answer, const std::string& url,
                                            uint64_t request_id, const std::vector<int32_t>& prompt,
                                            const SamplingParams& params, int64_t n) const;
  std::vector<int32_t> ids_from_tokens(const nlohmann::json& tokens, const std::string& url,
                                       const std::string& where) const;

  std::string base_url_;      // as given, without a trailing slash: used in messages
  std::string host_;          // scheme://host:port for the HTTP client
  std::string prefix_;        // path prefix put before every endpoint ("" or "/vllm")
  RemoteOptions options_;
  std::optional<Tokenizer> tokenizer_;
  std::map<std::string, int32_t> id_of_piece_;  // decode({id}) -> id; -1 where several ids share it
  int64_t version_ = 0;
  bool transfer_ready_ = false;  // /init_weight_transfer_engine answered (disk and nccl: once)
};

}  // namespace troupe
