// troupe serve's request reading (see server_request.hpp): vLLM's fields and checks, one by one.
#include "generator/server_request.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <iostream>
#include <span>

#include "policy/error.hpp"

namespace troupe::serve_request {

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw HttpError(400, "BadRequestError", param, message);
}

[[noreturn]] void conflict(const std::string& message) { throw HttpError(409, "ConflictError", "", message); }

json error_body(int status, const std::string& type, const std::string& message, const std::string& param) {
  return {{"error",
           {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)}, {"code", status}}}};
}

const json* field(const json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::string type_name(const json& v) { return v.type_name(); }

// An integer, or a float with no fractional part (pydantic accepts 16.0 for an int); bools and
// strings are wrong types, even "16".
std::optional<int64_t> int_field(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      bad(key, std::string("`") + key + "` is out of range");
    return v->get<int64_t>();
  }
  if (v->is_number_float()) {
    double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18) return static_cast<int64_t>(d);
  }
  bad(key, std::string("`") + key + "` must be an integer, got " + type_name(*v) + " " + v->dump());
}

std::optional<double> number_field(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(key, std::string("`") + key + "` must be a number, got " + type_name(*v) + " " + v->dump());
  return v->get<double>();
}

std::optional<bool> bool_field(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad(key, std::string("`") + key + "` must be a boolean, got " + type_name(*v) + " " + v->dump());
  return v->get<bool>();
}

std::optional<std::string> string_field(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) bad(key, std::string("`") + key + "` must be a string, got " + type_name(*v));
  return v->get<std::string>();
}

// A boolean query parameter, read as FastAPI reads one: true/false, 1/0, yes/no, on/off.
bool query_flag(const json& query, const char* key, bool fallback) {
  auto v = string_field(query, key);
  if (!v) return fallback;
  std::string s = *v;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  bad(key, std::string("`") + key + "` must be a boolean (true or false), got '" + *v + "'");
}

// vLLM's weight versions are strings; troupe's are integers (every choice's min/max_version), so
// a version here is a non-negative integer or a string of digits. `key` must be present.
int64_t version_field(const json& body, const char* key) {
  const json& v = body.at(key);
  const std::string message = std::string("`") + key +
                              "` must be a non-negative integer or a string of digits (troupe's versions are "
                              "integers), got " + v.dump();
  if (v.is_string()) {
    const auto& digits = v.get_ref<const std::string&>();
    if (digits.empty() || digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) bad(key, message);
    return std::stoll(digits);
  }
  if (!v.is_number()) bad(key, message);
  auto n = int_field(body, key);
  if (*n < 0) bad(key, message);
  return *n;
}

// Runs field checks on a nested object; their errors name the field in full ("init_info.world_size").
void nested(const std::string& prefix, const std::function<void()>& check) {
  try {
    check();
  } catch (const HttpError& e) {
    throw HttpError(e.status, e.type, e.param.empty() ? prefix : prefix + "." + e.param, prefix + ": " + e.what());
  }
}

// Standard base64 (RFC 4648, not URL-safe), strictly, as vLLM decodes nccl_unique_id_b64.
std::optional<std::string> base64_decode(const std::string& text) {
  static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out;
  uint32_t bits = 0;
  int count = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '=') {
      if (i + 2 < text.size() || (i + 1 < text.size() && text[i + 1] != '=')) return std::nullopt;
      break;  // padding: the last one or two characters only
    }
    const char* d = text[i] ? std::strchr(digits, text[i]) : nullptr;
    if (!d) return std::nullopt;
    bits = (bits << 6) | static_cast<uint32_t>(d - digits);
    count += 6;
    if (count >= 8) {
      count -= 8;
      out += static_cast<char>((bits >> count) & 0xFF);
    }
  }
  return out;
}

// A list of token ids, each in [0, vocab).
std::vector<int32_t> token_ids(const json& v, const std::string& param, int64_t vocab) {
  if (!v.is_array()) bad(param, "`" + param + "` must be a list of token ids, got " + type_name(v));
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (const auto& x : v) {
    if (!x.is_number_integer()) bad(param, "`" + param + "` must hold integer token ids, got " + x.dump());
    if (x.is_number_unsigned() ? x.get<uint64_t>() >= static_cast<uint64_t>(vocab)
                               : (x.get<int64_t>() < 0 || x.get<int64_t>() >= vocab))
      bad(param, "token id " + x.dump() + " in `" + param + "` is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
  }
  return ids;
}

// Deeper than any request of the API needs. nlohmann's parser is iterative, but dump() (which
// error messages call on the value at fault) recurses: a body of a million '[' overflowed the stack.
namespace {
constexpr int kMaxJsonDepth = 64;

bool nested_deeper_than(const std::string& text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

}  // namespace

json parse_body(const std::string& text, bool allow_empty) {
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    if (allow_empty) return json::object();
    bad("", "the request body must be a JSON object");
  }
  if (nested_deeper_than(text, kMaxJsonDepth))
    bad("", "the request body nests arrays or objects more than " + std::to_string(kMaxJsonDepth) + " levels deep");
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {  // a syntax error, or a number past double's range (1e309)
    bad("", std::string("invalid JSON: ") + e.what());
  }
  if (!body.is_object()) bad("", "the request body must be a JSON object, got " + type_name(body));
  return body;
}

void check_fields(const json& body, const char* route, const std::vector<std::string>& supported,
                  const std::vector<Unsupported>& unsupported) {
  std::vector<std::string> unknown;
  for (const auto& item : body.items()) {
    const std::string& key = item.key();
    const json& value = item.value();
    if (std::find(supported.begin(), supported.end(), key) != supported.end()) continue;
    auto u = std::find_if(unsupported.begin(), unsupported.end(), [&](const Unsupported& x) { return key == x.name; });
    if (u == unsupported.end()) {
      unknown.push_back(key);
      continue;
    }
    if (value.is_null() || std::find(u->neutral.begin(), u->neutral.end(), value) != u->neutral.end()) continue;
    bad(key, "`" + key + "` = " + value.dump() + " is not supported by troupe serve");
  }
  if (unknown.empty()) return;
  // vLLM's behaviour: extra fields are allowed and logged, not rejected.
  std::string names;
  for (const auto& k : unknown) names += (names.empty() ? "" : ", ") + k;
  std::cerr << "troupe serve: " << route << ": ignoring unknown fields: " << names << std::endl;
}

const std::vector<Unsupported> kUnsupportedSampling = {
    {"echo", {false}},
    {"best_of", {1}},
    {"use_beam_search", {false}},
    {"presence_penalty", {0}},
    {"frequency_penalty", {0}},
    {"repetition_penalty", {1}},
    {"length_penalty", {1}},
    {"min_tokens", {0}},
    {"logit_bias", {json::object()}},
    {"allowed_token_ids", {}},
    {"bad_words", {json::array()}},
    {"prompt_logprobs", {}},
    {"truncate_prompt_tokens", {}},
    {"skip_special_tokens", {true}},
    {"spaces_between_special_tokens", {true}},
    {"response_format", {json{{"type", "text"}}}},
    {"structured_outputs", {}},
    {"guided_json", {}},
    {"guided_regex", {}},
    {"guided_choice", {}},
    {"suffix", {""}},
    {"user", {}},  // accepted for any value: it only labels the caller
    {"request_id", {}},
    {"priority", {0}},
    {"add_special_tokens", {true, false}},  // prompts are encoded as given; no BOS is added either way
};

const std::vector<std::string> kSamplingFields = {
    "model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "return_token_ids", "return_tokens_as_token_ids", "stream", "stream_options"};

std::vector<std::string> with(std::vector<std::string> a, std::initializer_list<const char*> more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::vector<Unsupported> with(std::vector<Unsupported> a, std::initializer_list<Unsupported> more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

namespace {
std::vector<int32_t> render_chat(const ChatTemplate& tmpl, const Tokenizer& tok, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt) {
  std::string text;
  try {
    text = tmpl.render(messages, add_generation_prompt);
  } catch (const Error& e) {
    bad("messages", e.what());
  }
  return tok.encode(text);
}
}  // namespace

RequestReader::RequestReader(RequestLimits limits, std::string model_label, std::string model_name, int64_t vocab_size,
                             const Tokenizer* tokenizer, const ChatTemplate* chat_template, std::string chat_template_error,
                             std::vector<int32_t> end_of_turn_ids)
    : limits_(limits), model_label_(std::move(model_label)), model_name_(std::move(model_name)), vocab_size_(vocab_size),
      tokenizer_(tokenizer), chat_template_(chat_template), chat_template_error_(std::move(chat_template_error)),
      end_of_turn_ids_(std::move(end_of_turn_ids)) {}

const Tokenizer& RequestReader::tokenizer(const char* param) const {
  if (!tokenizer_) bad(param, model_label_ + ": this model has no tokenizer; send token ids");
  return *tokenizer_;
}

const ChatTemplate& RequestReader::chat_template() const {
  if (!chat_template_) bad("messages", chat_template_error_);
  return *chat_template_;
}

GenerationRequest RequestReader::completion(const json& body) const {
  check_fields(body, "/v1/completions", with(kSamplingFields, {"prompt", "logprobs"}), kUnsupportedSampling);
  check_model(body);
  GenerationRequest r{.sampling = parse_sampling(body, /*chat=*/false), .prompts = parse_prompts(body)};
  for (const auto& p : r.prompts) fit_max_tokens(r.sampling, static_cast<int64_t>(p.size()), "prompt");
  return r;
}

GenerationRequest RequestReader::chat(const json& body) const {
  check_fields(body, "/v1/chat/completions",
               with(kSamplingFields, {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt"}),
               kUnsupportedChat);
  check_model(body);
  GenerationRequest r{.sampling = parse_sampling(body, /*chat=*/true)};
  auto messages = parse_messages(body);
  const bool add_generation_prompt = bool_field(body, "add_generation_prompt").value_or(true);
  r.prompts.push_back(render_chat(chat_template(), tokenizer("messages"), messages, add_generation_prompt));
  check_vocab(r.prompts[0], "messages");
  Sampling& s = r.sampling;
  if (!s.max_tokens_given) s.params.max_tokens = limits_.max_tokens;
  fit_max_tokens(s, static_cast<int64_t>(r.prompts[0].size()), "messages");
  return r;
}

void RequestReader::check_model(const json& body) const {
  auto model = string_field(body, "model");
  // vLLM answers an unknown model with 404 NotFoundError.
  if (model && *model != model_name_)
    throw HttpError(404, "NotFoundError", "model", "The model `" + *model + "` does not exist.");
}

Sampling RequestReader::parse_sampling(const json& body, bool chat) const {
  Sampling s;
  parse_lengths(body, chat, s);
  parse_distribution(body, s.params);
  parse_stops(body, s);
  parse_logprobs(body, chat, s);
  s.return_token_ids = bool_field(body, "return_token_ids").value_or(false);
  s.tokens_as_ids = bool_field(body, "return_tokens_as_token_ids").value_or(false);
  parse_stream(body, s);
  return s;
}

void RequestReader::parse_stream(const json& body, Sampling& s) const {
  s.stream = bool_field(body, "stream").value_or(false);
  const json* options = field(body, "stream_options");
  if (!options) return;
  if (!s.stream) bad("stream_options", "Stream options can only be defined when `stream=True`.");
  if (!options->is_object()) bad("stream_options", "`stream_options` must be an object, got " + type_name(*options));
  nested("stream_options", [&] {
    for (const auto& [key, value] : options->items())
      if (key != "include_usage" && key != "continuous_usage_stats") bad(key, "unknown field `" + key + "`");
    s.include_usage = bool_field(*options, "include_usage").value_or(false);
    if (bool_field(*options, "continuous_usage_stats").value_or(false))
      bad("continuous_usage_stats", "`continuous_usage_stats` = true is not supported by troupe serve (the last chunk carries the usage)");
  });
}

void RequestReader::parse_lengths(const json& body, bool chat, Sampling& s) const {
  const int64_t n_limit = std::min(limits_.max_n, limits_.max_batch);
  if (auto n = int_field(body, "n")) {
    if (*n < 1) bad("n", "n must be at least 1, got " + std::to_string(*n));
    if (*n > n_limit)
      bad("n", "n = " + std::to_string(*n) + " exceeds this server's limit of " + std::to_string(n_limit) +
                   " (--max-n, --max-batch)");
    s.params.n = *n;
  }
  auto max_tokens = int_field(body, "max_tokens");
  const char* param = "max_tokens";
  if (chat && !max_tokens) {  // the OpenAI chat API's newer name
    max_tokens = int_field(body, "max_completion_tokens");
    param = "max_completion_tokens";
  }
  if (!max_tokens) return;
  if (*max_tokens < 1) bad(param, std::string(param) + " must be at least 1, got " + std::to_string(*max_tokens));
  if (*max_tokens > limits_.max_tokens)
    bad(param, std::string(param) + " = " + std::to_string(*max_tokens) + " exceeds this server's limit of " +
                   std::to_string(limits_.max_tokens) + " (--max-tokens)");
  s.params.max_tokens = *max_tokens;
  s.max_tokens_given = true;
}

void RequestReader::parse_distribution(const json& body, SamplingParams& p) const {
  if (auto t = number_field(body, "temperature")) {
    if (!(*t >= 0) || !std::isfinite(*t)) bad("temperature", "temperature must be non-negative, got " + std::to_string(*t));
    p.temperature = *t;
  }
  if (auto t = number_field(body, "top_p")) {
    if (!(*t > 0 && *t <= 1)) bad("top_p", "top_p must be in (0, 1], got " + std::to_string(*t));
    p.top_p = *t;
  }
  if (auto k = int_field(body, "top_k")) {
    if (*k < -1) bad("top_k", "top_k must be -1 or 0 (disable), or at least 1, got " + std::to_string(*k));
    p.top_k = *k;
  }
  if (auto m = number_field(body, "min_p")) {
    if (!(*m >= 0 && *m <= 1)) bad("min_p", "min_p must be in [0, 1], got " + std::to_string(*m));
    p.min_p = *m;
  }
  if (auto seed = int_field(body, "seed")) p.seed = static_cast<uint64_t>(*seed);
}

void RequestReader::parse_stops(const json& body, Sampling& s) const {
  SamplingParams& p = s.params;
  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      p.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const auto& x : *stop) {
        if (!x.is_string()) bad("stop", "`stop` must be a string or a list of strings, got " + x.dump() + " in the list");
        p.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "`stop` must be a string or a list of strings, got " + type_name(*stop));
    }
    for (const auto& x : p.stop)
      if (x.empty()) bad("stop", "stop strings must not be empty");
    if (!p.stop.empty()) tokenizer("stop");
  }
  if (const json* ids = field(body, "stop_token_ids")) s.requested_stop_ids = token_ids(*ids, "stop_token_ids", vocab_size_);
  p.include_stop_str_in_output = bool_field(body, "include_stop_str_in_output").value_or(false);
  p.ignore_eos = bool_field(body, "ignore_eos").value_or(false);
  p.stop_token_ids = s.requested_stop_ids;
  if (!p.ignore_eos) p.stop_token_ids.insert(p.stop_token_ids.end(), end_of_turn_ids_.begin(), end_of_turn_ids_.end());
}

// Completions ask with "logprobs": int; chat with "logprobs": bool and "top_logprobs": int.
void RequestReader::parse_logprobs(const json& body, bool chat, Sampling& s) const {
  const std::string range = "[0, " + std::to_string(kMaxLogprobs) + "]";
  if (!chat) {
    if (auto k = int_field(body, "logprobs")) {
      if (*k < 0 || *k > kMaxLogprobs) bad("logprobs", "logprobs must be in " + range + ", got " + std::to_string(*k));
      s.logprobs = true;
      s.top_logprobs = *k;
    }
    return;
  }
  s.logprobs = bool_field(body, "logprobs").value_or(false);
  if (auto k = int_field(body, "top_logprobs")) {
    if (*k < 0 || *k > kMaxLogprobs) bad("top_logprobs", "top_logprobs must be in " + range + ", got " + std::to_string(*k));
    if (*k > 0 && !s.logprobs) bad("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true");
    s.top_logprobs = *k;
  }
}

// Chat without max_tokens may use the rest of the sequence (as vLLM does); with it, the prompt
// and the completion must fit in max_seq_len.
void RequestReader::fit_max_tokens(Sampling& s, int64_t prompt_tokens, const char* prompt_param) const {
  const int64_t room = limits_.max_seq_len - prompt_tokens;
  if (!s.max_tokens_given && room >= 1) s.params.max_tokens = std::min({s.params.max_tokens, room});
  if (prompt_tokens + s.params.max_tokens > limits_.max_seq_len)
    bad(s.max_tokens_given ? "max_tokens" : prompt_param,
        "This model's maximum context length is " + std::to_string(limits_.max_seq_len) + " tokens (--max-seq-len). However, you requested " +
            std::to_string(prompt_tokens + s.params.max_tokens) + " tokens (" + std::to_string(prompt_tokens) + " in the prompt, " +
            std::to_string(s.params.max_tokens) + " in the completion). Please reduce the length of the prompt or completion.");
}

// "prompt": text, token ids, or a list of either (one request per prompt).
std::vector<std::vector<int32_t>> RequestReader::parse_prompts(const json& body) const {
  const json* prompt = field(body, "prompt");
  if (!prompt) bad("prompt", "`prompt` is required: a string, a list of token ids, or a list of either");
  auto encode = [&](const json& text) {
    if (text.get_ref<const std::string&>().empty()) bad("prompt", "the prompt must not be empty");
    auto ids = tokenizer("prompt").encode(text.get<std::string>());
    check_vocab(ids, "prompt");
    return ids;
  };
  auto ids = [&](const json& list) {
    if (list.empty()) bad("prompt", "the prompt must not be empty");
    return token_ids(list, "prompt", vocab_size_);
  };
  if (prompt->is_string()) return {encode(*prompt)};
  if (!prompt->is_array())
    bad("prompt", "`prompt` must be a string, a list of token ids, or a list of either; got " + type_name(*prompt));
  if (prompt->empty()) bad("prompt", "the prompt must not be empty");
  if (std::all_of(prompt->begin(), prompt->end(), [](const json& x) { return x.is_number(); })) return {ids(*prompt)};
  if (static_cast<int64_t>(prompt->size()) > limits_.max_prompts)
    bad("prompt", std::to_string(prompt->size()) + " prompts in one request exceed this server's limit of " +
                      std::to_string(limits_.max_prompts));
  std::vector<std::vector<int32_t>> out;
  for (const auto& x : *prompt) {
    if (x.is_string()) out.push_back(encode(x));
    else if (x.is_array()) out.push_back(ids(x));
    else bad("prompt", "each prompt in the list must be a string or a list of token ids, got " + x.dump());
  }
  return out;
}

// A tokenizer may be larger than the model's embedding (a tiny model with a real tokenizer): text
// that encodes to ids past it cannot be served, and the client should hear which field did it.
void RequestReader::check_vocab(const std::vector<int32_t>& ids, const char* param) const {
  for (int32_t id : ids)
    if (id < 0 || id >= vocab_size_)
      bad(param, std::string("`") + param + "` encodes to token id " + std::to_string(id) + " (" + tokenizer_->decode(std::span<const int32_t>(&id, 1)) +
                     "), outside the model's vocabulary [0, " + std::to_string(vocab_size_) + ")");
}

// OpenAI messages: content is a string, or a list of parts of which only text parts are allowed.
std::vector<ChatMessage> RequestReader::parse_messages(const json& body) const {
  const json* messages = field(body, "messages");
  if (!messages) bad("messages", "`messages` is required: a list of {\"role\", \"content\"} objects");
  if (!messages->is_array() || messages->empty()) bad("messages", "`messages` must be a non-empty list");
  std::vector<ChatMessage> out;
  for (const auto& m : *messages) {
    if (!m.is_object()) bad("messages", "each message must be an object, got " + m.dump());
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) bad("messages", "each message needs a string `role`");
    ChatMessage msg{role->get<std::string>(), ""};
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
    } else if (content->is_string()) {
      msg.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (const auto& part : *content) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
          bad("messages", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported, got " + part.dump());
        msg.content += part["text"].get<std::string>();
      }
    } else {
      bad("messages", "message content must be a string or a list of text parts, got " + type_name(*content));
    }
    out.push_back(std::move(msg));
  }
  return out;
}


const std::vector<Unsupported> kUnsupportedChat = with(
    kUnsupportedSampling, {{"tools", {json::array()}},
                           {"tool_choice", {json("none"), json("auto")}},
                           {"parallel_tool_calls", {true, false}},
                           {"functions", {json::array()}},
                           {"continue_final_message", {false}},
                           {"chat_template", {}},
                           {"chat_template_kwargs", {json::object()}},
                           {"documents", {}},
                           {"reasoning_effort", {}}});

// vLLM's /tokenize: {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}.
json RequestReader::tokenize(const json& body) const {
  check_fields(body, "/tokenize", {"model", "prompt", "messages", "add_generation_prompt", "return_token_strs"},
               {{"add_special_tokens", {true, false}}, {"continue_final_message", {false}}, {"tools", {json::array()}},
                {"chat_template", {}}, {"chat_template_kwargs", {json::object()}}});
  check_model(body);
  const Tokenizer& tok = tokenizer("prompt");
  std::vector<int32_t> ids;
  if (body.contains("messages") && !body["messages"].is_null()) {
    ids = render_chat(chat_template(), tok, parse_messages(body), bool_field(body, "add_generation_prompt").value_or(true));
  } else {
    auto prompt = string_field(body, "prompt");
    if (!prompt) bad("prompt", "`prompt` (a string) or `messages` is required");
    ids = tok.encode(*prompt);
  }
  json strs = nullptr;
  if (bool_field(body, "return_token_strs").value_or(false)) {
    strs = json::array();
    for (int32_t id : ids) strs.push_back(tok.token(id));
  }
  return {{"count", ids.size()}, {"max_model_len", limits_.max_seq_len}, {"tokens", ids}, {"token_strs", strs}};
}

json RequestReader::detokenize(const json& body) const {
  check_fields(body, "/detokenize", {"model", "tokens"}, {});
  check_model(body);
  const Tokenizer& tok = tokenizer("tokens");
  const json* tokens = field(body, "tokens");
  if (!tokens) bad("tokens", "`tokens` (a list of token ids) is required");
  auto ids = token_ids(*tokens, "tokens", tok.vocab_size());
  return {{"prompt", tok.decode(ids)}};
}

}  // namespace troupe::serve_request
