// What troupe serve reads from a request body: vLLM's fields, validated one by one into typed
// values (the sampling fields, prompts, chat messages), and vLLM's error bodies for bad ones. No
// LibTorch and no HTTP here: tests/fuzz builds it on its own. Generation is server.cpp's.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "generator/sampling_params.hpp"
#include "policy/chat_template.hpp"
#include "policy/tokenizer.hpp"

namespace troupe::serve_request {

using json = nlohmann::json;

// vLLM's cap on requested log-probs (its --max-logprobs default).
constexpr int64_t kMaxLogprobs = 20;

// ---------------------------------------------------------------------------------------
// Errors: vLLM's ErrorResponse, {"error": {"message", "type", "param", "code"}}.

struct HttpError : std::runtime_error {
  HttpError(int status, std::string type, std::string param, const std::string& message)
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)) {}
  int status;
  std::string type;
  std::string param;  // the request field at fault; empty for none
};

[[noreturn]] void bad(const std::string& param, const std::string& message);  // 400 BadRequestError
// A request that is well formed but out of turn (finish before start, start twice): 409.
[[noreturn]] void conflict(const std::string& message);
json error_body(int status, const std::string& type, const std::string& message, const std::string& param);

// ---------------------------------------------------------------------------------------
// Reading typed fields. Absent and null both mean "use the default", as in vLLM's pydantic
// models; a wrong type is a 400 naming the field.

const json* field(const json& body, const char* key);
std::string type_name(const json& v);
// An integer, or a float with no fractional part (pydantic accepts 16.0 for an int); bools and
// strings are wrong types, even "16".
std::optional<int64_t> int_field(const json& body, const char* key);
std::optional<double> number_field(const json& body, const char* key);
std::optional<bool> bool_field(const json& body, const char* key);
std::optional<std::string> string_field(const json& body, const char* key);
// A boolean query parameter, read as FastAPI reads one: true/false, 1/0, yes/no, on/off.
bool query_flag(const json& query, const char* key, bool fallback);
// vLLM's weight versions are strings; troupe's are integers, so a version here is a non-negative
// integer or a string of digits. `key` must be present.
int64_t version_field(const json& body, const char* key);
// Runs field checks on a nested object; their errors name the field in full ("init_info.world_size").
void nested(const std::string& prefix, const std::function<void()>& check);
// Standard base64 (RFC 4648, not URL-safe), strictly, as vLLM decodes nccl_unique_id_b64.
std::optional<std::string> base64_decode(const std::string& text);
// A list of token ids, each in [0, vocab).
std::vector<int32_t> token_ids(const json& v, const std::string& param, int64_t vocab);
// A request body: a JSON object (or nothing, where allow_empty), nested at most 64 deep.
json parse_body(const std::string& text, bool allow_empty = false);

// Fields troupe knows but does not implement: a value other than the neutral ones is rejected,
// because silently ignoring (say) a penalty would change what is sampled.
struct Unsupported {
  const char* name;
  std::vector<json> neutral;
};

void check_fields(const json& body, const char* route, const std::vector<std::string>& supported,
                  const std::vector<Unsupported>& unsupported);
extern const std::vector<Unsupported> kUnsupportedSampling, kUnsupportedChat;
extern const std::vector<std::string> kSamplingFields;
std::vector<std::string> with(std::vector<std::string> a, std::initializer_list<const char*> more);
std::vector<Unsupported> with(std::vector<Unsupported> a, std::initializer_list<Unsupported> more);

// One request's sampling fields, validated, plus the response options that go with them.

struct Sampling {
  SamplingParams params;
  bool max_tokens_given = false;
  std::vector<int32_t> requested_stop_ids;  // the client's own stop_token_ids (for stop_reason)
  bool logprobs = false;
  int64_t top_logprobs = 0;
  bool return_token_ids = false;
  bool tokens_as_ids = false;
  bool stream = false;         // server-sent events instead of one JSON answer
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
};

// The limits of one request (ServeOptions' fields of the same names).
struct RequestLimits {
  int64_t max_n = 16, max_batch = 32, max_tokens = 4096, max_seq_len = 2048, max_prompts = 256;
};

// A generation request as the engine takes it.
struct GenerationRequest {
  Sampling sampling;
  std::vector<std::vector<int32_t>> prompts;  // [prompt] token ids, each within the vocabulary
};

// Reads the requests of one served model. The tokenizer and chat template, either absent, are
// the caller's and must outlive it.
class RequestReader {
 public:
  RequestReader(RequestLimits limits, std::string model_label, std::string model_name, int64_t vocab_size,
                const Tokenizer* tokenizer, const ChatTemplate* chat_template, std::string chat_template_error,
                std::vector<int32_t> end_of_turn_ids);

  GenerationRequest completion(const json& body) const;  // /v1/completions
  GenerationRequest chat(const json& body) const;        // /v1/chat/completions: one prompt
  json tokenize(const json& body) const;                 // /tokenize's answer
  json detokenize(const json& body) const;               // /detokenize's answer
  void check_model(const json& body) const;              // "model", when given, is ours (else 404)

  const Tokenizer& tokenizer(const char* param) const;   // or a 400 naming `param`: send token ids
  const ChatTemplate& chat_template() const;             // or a 400 on "messages"

 private:
  Sampling parse_sampling(const json& body, bool chat) const;
  void parse_lengths(const json& body, bool chat, Sampling& s) const;
  void parse_distribution(const json& body, SamplingParams& p) const;
  void parse_stops(const json& body, Sampling& s) const;
  void parse_logprobs(const json& body, bool chat, Sampling& s) const;
  void parse_stream(const json& body, Sampling& s) const;
  void fit_max_tokens(Sampling& s, int64_t prompt_tokens, const char* prompt_param) const;
  std::vector<std::vector<int32_t>> parse_prompts(const json& body) const;
  std::vector<ChatMessage> parse_messages(const json& body) const;
  void check_vocab(const std::vector<int32_t>& ids, const char* param) const;

  RequestLimits limits_;
  std::string model_label_;   // the model as given on the command line, for messages
  std::string model_name_;    // the name clients pass as "model"
  int64_t vocab_size_;
  const Tokenizer* tokenizer_;
  const ChatTemplate* chat_template_;
  std::string chat_template_error_;
  std::vector<int32_t> end_of_turn_ids_;  // stop ids of a turn's end, unless ignore_eos
};

}  // namespace troupe::serve_request
