// `troupe serve`: vLLM's OpenAI-compatible HTTP API (completions, chat, tokenize, weight
// updates from disk, streaming, /metrics) over one batched Engine. No TLS, no multi-model
// routing, no NCCL weight transfer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace troupe {

struct ServeOptions {
  std::string model;              // Hugging Face folder or .gguf file
  std::string served_model_name;  // the name clients pass as "model"; empty: `model` as given
  std::string host = "127.0.0.1"; // loopback unless asked: the API can rewrite the weights
  int port = 8000;                // 0: any free port (the listening line says which)
  std::string api_key;            // non-empty: every route but GET /health needs "Authorization: Bearer KEY"
  std::string dtype = "float32";  // float32, bfloat16 or float16
  std::string device = "cpu";     // cpu or cuda[:N]
  int64_t max_batch = 32;         // engine decode slots shared by all clients
  int64_t max_seq_len = 2048;     // prompt + completion tokens per sequence
  uint64_t seed = 0;              // for requests without their own seed
  // Limits on one request; over them is a 400 (413 for the body) naming the flag to change.
  size_t max_request_bytes = size_t{8} << 20;
  int64_t max_n = 16;             // also capped by max_batch
  int64_t max_tokens = 4096;      // also capped by max_seq_len - prompt length
  int64_t max_prompts = 256;      // prompts in one batched /v1/completions request
  // Slow and numerous clients: a request's headers and body must arrive within this many seconds
  // (else 408); at most this many connections are open, each with its own thread (past it the
  // oldest idle one is closed, or the new one is answered 503).
  int64_t request_timeout_s = 30;
  int64_t max_connections = 512;
};

// Routes (vLLM 0.33.0's names, fields and answers): GET /health, /v1/models, /is_paused,
// /weight_info, /get_world_size, /metrics (Prometheus text: vllm:num_requests_running and
// _waiting, vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total by
// finished_reason, and histograms vllm:time_to_first_token_seconds,
// vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds; it needs the API key like
// every route but /health); POST /v1/completions, /v1/chat/completions (both with "stream": true
// and stream_options.include_usage as vLLM streams; a client that disconnects mid-stream has its
// request aborted, which frees its slots), /tokenize,
// /detokenize, and the weight sync of a trainer:
//   /pause?mode=wait|keep (wait: admitted requests finish, new ones get 503 until /resume;
//   keep: running sequences freeze, new ones queue; mode=abort, vLLM's default, is refused),
//   /resume, /reset_prefix_cache (nothing outlives a request here: always {"success": true}),
//   /init_weight_transfer_engine {"init_info": {}}, /start_weight_update,
//   /update_weights {"update_info": {"path": DIR}}, /finish_weight_update {"weight_version": "N"}
//   (vLLM's weight-transfer protocol with its shared-disk backend; NCCL's init_info is checked,
//   then refused), /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}},
//   /update_weight_version {"new_version": "N"}.
// DIR is an absolute folder of .safetensors; its tensors are checked and staged, then copied
// between two decode steps together with the new version (integers here: vLLM's version strings
// must be digits).
// RL extension: every choice carries "troupe": {"min_version", "max_version"}, the policy versions
// of the weights that produced its tokens. Log-probs ("logprobs") are the behaviour log-probs:
// log-softmax(logits / temperature) (temperature 1 when greedy), before top-k/top-p/min-p
// truncation; top_logprobs lists only the sampled token.
//
// HTTP limits: headers over 64 KiB get 431, a body over max_request_bytes 413 (chunked ones too),
// a compressed body (Content-Encoding) 415, a JSON body nested deeper than 64 levels 400.
// A client that goes away mid-generation has its request aborted, streamed or not.
//
// Loads the model, binds, prints "troupe serve: listening on http://HOST:PORT" on stdout and
// serves until SIGINT or SIGTERM, then fails in-flight requests, stops, and returns 0.
// Throws Error when it cannot start (bad model, bad option, port in use).
int serve(const ServeOptions& options);

}  // namespace troupe
