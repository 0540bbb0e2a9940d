// `troupe serve`: vLLM's routes, fields and error bodies over one EngineLoop (many clients, one
// batch), every field validated here first, streaming as vLLM streams, and /metrics under vLLM's
// metric names. No penalties or beam search: rejected, not ignored.
#include "generator/server.hpp"

#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <iostream>
#include <list>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "generator/engine_loop.hpp"
#include "generator/server_request.hpp"
#include "policy/chat_template.hpp"
#include "policy/checkpoint.hpp"
#include "policy/dtype.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"

namespace troupe {

namespace {

using namespace serve_request;  // the request reader's types and field helpers
using json = nlohmann::json;
namespace fs = std::filesystem;

// vLLM clamps -inf log-probs to this so the JSON stays valid.
constexpr double kMinLogprob = -9999.0;

// ---------------------------------------------------------------------------------------
// Sending answers and vLLM's error bodies (serve_request::error_body).

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  // `replace`: a stray invalid byte in echoed input must not turn a reply into an exception.
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, int status, const std::string& type, const std::string& message,
                const std::string& param = "") {
  send_json(res, status, error_body(status, type, message, param));
}

// ---------------------------------------------------------------------------------------
// Small helpers for the responses.

std::string random_hex(size_t chars) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdef";
  std::string s;
  while (s.size() < chars) {
    uint64_t r = rng();
    for (int i = 0; i < 16 && s.size() < chars; ++i, r >>= 4) s += digits[r & 15];
  }
  return s;
}

int64_t now_seconds() { return static_cast<int64_t>(std::time(nullptr)); }

size_t utf8_length(const std::string& s) {
  return std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

json utf8_bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

double clamp_logprob(float lp) { return std::max<double>(lp, kMinLogprob); }

std::vector<int64_t> shape_of(const torch::Tensor& t) { return t.sizes().vec(); }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

torch::Device parse_device(const std::string& name) {
  try {
    return torch::Device(name);
  } catch (const std::exception&) {
    throw Error("--device '" + name + "': expected cpu, cuda or cuda:N");
  }
}

class GenerationStream;

// Whether the client of the request this thread serves has closed its connection (defined with
// the connection handling below; false off an HTTP connection thread).
bool client_went_away();

// A generation route's answer: a JSON body, or a stream of server-sent events.
struct Reply {
  Reply(json b) : body(std::move(b)) {}
  Reply(std::shared_ptr<GenerationStream> s) : stream(std::move(s)) {}
  json body;
  std::shared_ptr<GenerationStream> stream;
};

// ---------------------------------------------------------------------------------------
// The service: the routes' logic, independent of the HTTP library.

class Service {
 public:
  Service(const ServeOptions& options, LoadedModel model);

  json health() const;
  json models() const;
  Reply completions(const json& body);
  Reply chat_completions(const json& body);
  std::string metrics() const;
  json tokenize(const json& body) const { return reader_->tokenize(body); }
  json detokenize(const json& body) const { return reader_->detokenize(body); }
  json init_weight_transfer_engine(const json& body) const;
  json start_weight_update(const json& body);
  json update_weights(const json& body);
  json finish_weight_update(const json& body);
  json collective_rpc(const json& body);
  json update_weight_version(const json& body);
  json reset_prefix_cache(const json& query) const;
  json pause(const json& query);
  json resume();
  json is_paused() const;
  json weight_info() const { return {{"weight_version", loop_->version()}}; }
  json world_size() const { return {{"world_size", 1}}; }  // one process, one worker

  bool authorized(const httplib::Request& req) const;
  const ServeOptions& options() const { return options_; }
  void stop() { loop_->stop(); }

 private:
  std::vector<std::vector<Completion>> generate(const std::vector<std::vector<int32_t>>& prompts, const Sampling& s);
  json stop_reason(const Completion& c, const Sampling& s) const;
  std::string token_text(int32_t id, bool as_id) const;
  // Over tokens [0, ids.size()); `offset` is the text offset of the first one, and is advanced.
  json completion_logprobs(std::span<const int32_t> ids, std::span<const float> logprobs, const Sampling& s,
                           size_t& offset) const;
  json chat_logprobs(std::span<const int32_t> ids, std::span<const float> logprobs, const Sampling& s) const;
  void admit();
  void leave();
  void check_nccl_init(const json& info) const;
  std::map<std::string, torch::Tensor> read_update_dir(const std::string& path, const std::string& param) const;
  void apply(std::map<std::string, torch::Tensor> weights, int64_t version);

  friend class GenerationStream;

  ServeOptions options_;
  std::string model_name_;
  ModelConfig config_;
  std::optional<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> chat_template_;
  std::optional<RequestReader> reader_;  // over the members above
  std::map<std::string, std::vector<int64_t>> param_shapes_;  // to check weight updates before staging them
  std::unique_ptr<EngineLoop> loop_;

  std::mutex update_mutex_;
  bool session_ = false;                         // between /start_weight_update and /finish_weight_update
  std::map<std::string, torch::Tensor> staged_;  // tensors of /update_weights, applied at /finish_weight_update

  mutable std::mutex gate_mutex_;   // /pause?mode=wait against generation requests
  std::condition_variable drained_;
  bool rejecting_ = false;          // a mode=wait pause holds: new generation requests get 503
  int64_t in_flight_ = 0;           // generation requests admitted and not yet answered
};

Service::Service(const ServeOptions& options, LoadedModel m)
    : options_(options),
      model_name_(options.served_model_name.empty() ? options.model : options.served_model_name),
      config_(m.config),
      tokenizer_(m.tokenizer) {
  if (options_.max_n < 1) throw Error("--max-n must be at least 1");
  if (options_.max_tokens < 1) throw Error("--max-tokens must be at least 1");
  if (options_.max_prompts < 1) throw Error("max_prompts must be at least 1");
  std::string chat_template_error;  // why chat is unavailable, when it is
  std::vector<int32_t> end_of_turn_ids;
  if (tokenizer_) {
    if (tokenizer_->chat_template()) {
      try {
        chat_template_ = ChatTemplate::detect(*tokenizer_->chat_template(), options.model);
      } catch (const Error& e) {
        chat_template_error = e.what();
      }
    } else {
      chat_template_error = options.model + ": the tokenizer has no chat template; use /v1/completions";
    }
    // The engine stops at the config's and tokenizer's end-of-sequence ids; chat models also
    // end a turn with their template's end-of-turn token, which vLLM gets from generation_config.
    // Ids past the model's vocabulary (a tokenizer larger than the embedding) can never be
    // sampled, so they need no stop.
    for (const char* t : {"<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"})
      if (auto id = tokenizer_->token_id(t); id && *id < m.config.vocab_size) end_of_turn_ids.push_back(*id);
  } else {
    chat_template_error = options.model + ": no tokenizer next to the model; chat needs one";
  }
  reader_.emplace(RequestLimits{.max_n = options_.max_n, .max_batch = options_.max_batch, .max_tokens = options_.max_tokens,
                                .max_seq_len = options_.max_seq_len, .max_prompts = options_.max_prompts},
                  options_.model, model_name_, config_.vocab_size, tokenizer_ ? &*tokenizer_ : nullptr,
                  chat_template_ ? &*chat_template_ : nullptr, std::move(chat_template_error), std::move(end_of_turn_ids));
  for (const auto& p : m.model->named_parameters(/*recurse=*/true)) param_shapes_[p.key()] = shape_of(p.value());
  EngineOptions eo{.max_batch = options.max_batch, .max_seq_len = options.max_seq_len, .seed = options.seed};
  loop_ = std::make_unique<EngineLoop>(std::make_unique<Engine>(m.model, m.tokenizer, eo));
}

bool Service::authorized(const httplib::Request& req) const {
  if (options_.api_key.empty()) return true;
  const std::string expected = "Bearer " + options_.api_key;
  const std::string got = req.get_header_value("Authorization");
  // Constant time in the key's length, so timing does not reveal how much of a guess matched.
  unsigned diff = got.size() != expected.size();
  for (size_t i = 0; i < expected.size(); ++i) diff |= static_cast<unsigned char>(expected[i]) ^ static_cast<unsigned char>(i < got.size() ? got[i] : 0);
  return diff == 0;
}

json Service::health() const {
  if (loop_->stopped()) throw HttpError(503, "ServiceUnavailableError", "", "the engine is shutting down");
  return nullptr;
}

json Service::models() const {
  json card = {{"id", model_name_},
               {"object", "model"},
               {"created", now_seconds()},
               {"owned_by", "troupe"},
               {"root", options_.model},
               {"parent", nullptr},
               {"max_model_len", options_.max_seq_len},
               {"permission", json::array()}};
  return {{"object", "list"}, {"data", json::array({card})}};
}

// Counts a generation request from admission to answer, for /pause?mode=wait; while such a
// pause holds, new ones get vLLM's 503 (RetryableRequestError), which clients retry.
void Service::admit() {
  std::lock_guard lock(gate_mutex_);
  if (rejecting_) throw HttpError(503, "ServiceUnavailableError", "", "Generation is paused. Please retry after it resumes.");
  ++in_flight_;
}

void Service::leave() {
  {
    std::lock_guard lock(gate_mutex_);
    --in_flight_;
  }
  drained_.notify_all();
}

// Runs every prompt as its own engine request, all at once, so they share the batch. A client
// that closes its connection meanwhile has its requests aborted, as vLLM aborts them: their
// slots free at once instead of decoding for nobody.
std::vector<std::vector<Completion>> Service::generate(const std::vector<std::vector<int32_t>>& prompts, const Sampling& s) {
  admit();
  struct Leave {
    Service* service;
    ~Leave() { service->leave(); }
  } answered{this};
  std::vector<std::future<std::vector<Completion>>> futures;
  std::vector<std::shared_ptr<EngineLoop::Watch>> watches;
  for (const auto& p : prompts) {
    watches.push_back(std::make_shared<EngineLoop::Watch>());
    futures.push_back(loop_->submit(p, s.params, watches.back()));
  }
  for (auto& f : futures)
    while (f.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready)
      if (client_went_away()) {
        for (auto& w : watches) loop_->cancel(*w);
        bad("", "the client closed the connection; its request was aborted");  // nobody reads this
      }
  std::vector<std::vector<Completion>> out;
  std::string error;
  for (auto& f : futures) {
    try {
      out.push_back(f.get());
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();  // keep reading: every future must be drained
    }
  }
  if (error.empty()) return out;
  if (loop_->stopped()) throw HttpError(503, "ServiceUnavailableError", "", error);
  bad("", error);
}

json Service::stop_reason(const Completion& c, const Sampling& s) const {
  // vLLM: the stop string or the client's stop token id; null for end-of-sequence and length.
  if (c.stop_string) return *c.stop_string;
  if (c.stop_token && std::count(s.requested_stop_ids.begin(), s.requested_stop_ids.end(), *c.stop_token)) return *c.stop_token;
  return nullptr;
}

std::string Service::token_text(int32_t id, bool as_id) const {
  if (as_id || !tokenizer_) return "token_id:" + std::to_string(id);
  return tokenizer_->decode(std::span<const int32_t>(&id, 1));
}

// The OpenAI completions logprobs object. token_logprobs are the engine's behaviour log-probs:
// log-softmax of logits / temperature (temperature 1 when greedy), before top-k/top-p/min-p.
// top_logprobs holds the sampled token only, whatever `logprobs` asked for.
json Service::completion_logprobs(std::span<const int32_t> ids, std::span<const float> logprobs, const Sampling& s,
                                  size_t& offset) const {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (size_t i = 0; i < ids.size(); ++i) {
    std::string t = token_text(ids[i], s.tokens_as_ids);
    double lp = clamp_logprob(logprobs[i]);
    tokens.push_back(t);
    lps.push_back(lp);
    tops.push_back(json{{t, lp}});
    offsets.push_back(offset);
    offset += utf8_length(t);
  }
  return {{"text_offset", offsets}, {"token_logprobs", lps}, {"tokens", tokens}, {"top_logprobs", tops}};
}

// The chat logprobs object; top_logprobs lists the sampled token only (when top_logprobs > 0).
json Service::chat_logprobs(std::span<const int32_t> ids, std::span<const float> logprobs, const Sampling& s) const {
  json content = json::array();
  for (size_t i = 0; i < ids.size(); ++i) {
    std::string t = token_text(ids[i], s.tokens_as_ids);
    json entry = {{"token", t}, {"logprob", clamp_logprob(logprobs[i])}, {"bytes", utf8_bytes(t)}};
    entry["top_logprobs"] = s.top_logprobs > 0 ? json::array({entry}) : json::array();
    content.push_back(entry);
  }
  return {{"content", content}};
}

json troupe_extension(const Completion& c) {
  // Policy versions of the weights that produced this choice's tokens (RL staleness bookkeeping).
  return {{"min_version", c.min_version}, {"max_version", c.max_version}};
}

json usage(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", nullptr}};
}

// ---------------------------------------------------------------------------------------
// Streaming: server-sent events in vLLM's chunk format, "data: {chunk}\n\n" per chunk, then
// "data: [DONE]\n\n". A chunk per choice carries the tokens sampled since its last chunk; chat
// opens each choice with a {"role": "assistant"} delta; the choice's last chunk has its
// finish_reason; with stream_options.include_usage every chunk has "usage": null and one more
// chunk with no choices carries the usage. An error after the stream began is one
// `data: {"error": ...}` event, then [DONE], as vLLM ends a failed stream.

// How much of a choice's decoded text a stream may show yet: not the U+FFFD at its end (a
// character whose bytes are not all sampled yet) nor a tail that begins a stop string (the
// engine cuts the text where the stop string completes).
size_t releasable(const std::string& text, const std::vector<std::string>& stops) {
  static const std::string replacement = "\xEF\xBF\xBD";
  size_t end = text.size();
  while (end >= replacement.size() && text.compare(end - replacement.size(), replacement.size(), replacement) == 0)
    end -= replacement.size();
  size_t hold = 0;
  for (const auto& stop : stops)
    for (size_t k = std::min(stop.size() - 1, end); k > hold; --k)
      if (text.compare(end - k, k, stop, 0, k) == 0) {
        hold = k;
        break;
      }
  return end - hold;
}

std::string event(const json& chunk) {
  return "data: " + chunk.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

// What the engine's thread hands a stream (EngineLoop::Watch): each choice's tokens so far,
// and its completion once it has finished.
struct StreamFeed {
  struct Choice {
    std::vector<int32_t> ids;
    std::vector<float> logprobs;
    std::optional<Completion> done;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Choice> choices;  // [prompts * n]: prompt r's sample i is choice r * n + i
};

// One streamed request: its prompts run as engine requests that the HTTP thread follows in
// run(). It counts as in flight (for /pause?mode=wait) from construction to destruction;
// destroyed unfinished (the client went away), it cancels its requests, which frees their slots.
class GenerationStream {
 public:
  GenerationStream(Service& service, bool chat, Sampling s, const std::vector<std::vector<int32_t>>& prompts);
  ~GenerationStream();
  GenerationStream(const GenerationStream&) = delete;
  GenerationStream& operator=(const GenerationStream&) = delete;

  // Writes the events through `write` to the end; false when a write failed (the client went away).
  bool run(const std::function<bool(const std::string&)>& write);

 private:
  using Clock = std::chrono::steady_clock;
  struct Sent {                   // one choice, as the client has seen it
    std::vector<int32_t> ids;     // tokens taken from the feed
    std::vector<float> logprobs;
    size_t tokens = 0;            // of `ids`, those already in a chunk
    size_t text = 0;              // bytes of the text already in a chunk
    size_t text_offset = 0;       // completions' logprobs.text_offset of the next token
    bool finished = false;
  };

  json chunk(json choices) const;
  json choice(size_t i, const std::string& text, const Completion* done);
  std::optional<std::string> error();
  void cancel();

  Service& service_;
  bool chat_;
  Sampling s_;
  std::string id_;
  int64_t created_ = now_seconds();
  int64_t prompt_tokens_ = 0;
  std::shared_ptr<StreamFeed> feed_ = std::make_shared<StreamFeed>();
  std::vector<std::shared_ptr<EngineLoop::Watch>> watches_;
  std::vector<std::future<std::vector<Completion>>> futures_;  // emptied (invalid) once read
  std::vector<Sent> sent_;
  bool ended_ = false;  // [DONE] written
};

GenerationStream::GenerationStream(Service& service, bool chat, Sampling s, const std::vector<std::vector<int32_t>>& prompts)
    : service_(service), chat_(chat), s_(std::move(s)), id_((chat ? "chatcmpl-" : "cmpl-") + random_hex(32)) {
  service_.admit();
  const auto n = static_cast<size_t>(s_.params.n);
  feed_->choices.resize(prompts.size() * n);
  sent_.resize(prompts.size() * n);
  for (size_t r = 0; r < prompts.size(); ++r) {
    prompt_tokens_ += static_cast<int64_t>(prompts[r].size());
    auto watch = std::make_shared<EngineLoop::Watch>();
    std::weak_ptr<StreamFeed> feed = feed_;
    watch->tokens = [feed, r, n](int64_t index, const std::vector<int32_t>& ids, const std::vector<float>& logprobs) {
      auto f = feed.lock();
      if (!f) return;
      std::lock_guard lock(f->mutex);
      auto& c = f->choices[r * n + index];
      c.ids.insert(c.ids.end(), ids.begin() + static_cast<std::ptrdiff_t>(std::min(c.ids.size(), ids.size())), ids.end());
      c.logprobs.insert(c.logprobs.end(), logprobs.begin() + static_cast<std::ptrdiff_t>(std::min(c.logprobs.size(), logprobs.size())),
                        logprobs.end());
      f->changed.notify_one();
    };
    watch->done = [feed, r, n](const Completion& c) {
      auto f = feed.lock();
      if (!f) return;
      std::lock_guard lock(f->mutex);
      f->choices[r * n + c.index].done = c;
      f->changed.notify_one();
    };
    futures_.push_back(service_.loop_->submit(prompts[r], s_.params, watch));
    watches_.push_back(std::move(watch));
  }
}

GenerationStream::~GenerationStream() {
  if (!ended_) cancel();
  service_.leave();
}

void GenerationStream::cancel() {
  for (auto& w : watches_) service_.loop_->cancel(*w);
}

json GenerationStream::chunk(json choices) const {
  json c = {{"id", id_},
            {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", service_.model_name_},
            {"choices", std::move(choices)}};
  if (s_.include_usage) c["usage"] = nullptr;
  return c;
}

// Choice i's tokens since its last chunk, with `text`; the last one (`done`) also says why it ended.
json GenerationStream::choice(size_t i, const std::string& text, const Completion* done) {
  Sent& sent = sent_[i];
  const std::span<const int32_t> ids(sent.ids.data() + sent.tokens, sent.ids.size() - sent.tokens);
  const std::span<const float> logprobs(sent.logprobs.data() + sent.tokens, sent.logprobs.size() - sent.tokens);
  json c = {{"index", i}};
  if (chat_) {
    c["delta"] = {{"content", text}};
    c["logprobs"] = s_.logprobs ? service_.chat_logprobs(ids, logprobs, s_) : json(nullptr);
  } else {
    c["text"] = text;
    c["logprobs"] = s_.logprobs ? service_.completion_logprobs(ids, logprobs, s_, sent.text_offset) : json(nullptr);
  }
  c["finish_reason"] = done ? json(finish_reason_name(done->finish_reason)) : json(nullptr);
  c["stop_reason"] = done ? service_.stop_reason(*done, s_) : json(nullptr);
  if (s_.return_token_ids) c["token_ids"] = json(std::vector<int32_t>(ids.begin(), ids.end()));
  if (done) c["troupe"] = troupe_extension(*done);
  sent.tokens = sent.ids.size();
  sent.text += text.size();
  return c;
}

// Why the requests failed, once one has (the engine's Error, or the server shutting down).
std::optional<std::string> GenerationStream::error() {
  for (auto& f : futures_) {
    if (!f.valid() || f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
    try {
      f.get();  // completions: the feed has them already (Watch::done)
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
  }
  return std::nullopt;
}

bool GenerationStream::run(const std::function<bool(const std::string&)>& write) {
  auto last_write = Clock::now();
  auto send = [&](const std::string& text) {
    last_write = Clock::now();
    return write(text);
  };
  if (chat_)
    for (size_t i = 0; i < sent_.size(); ++i)
      if (!send(event(chunk(json::array({{{"index", i},
                                          {"delta", {{"role", "assistant"}, {"content", ""}}},
                                          {"logprobs", nullptr},
                                          {"finish_reason", nullptr}}})))))
        return false;
  int64_t completion_tokens = 0;
  size_t open = sent_.size();
  while (open > 0) {
    std::vector<std::optional<Completion>> done(sent_.size());
    {
      std::unique_lock lock(feed_->mutex);
      feed_->changed.wait_for(lock, std::chrono::milliseconds(20));
      for (size_t i = 0; i < sent_.size(); ++i) {
        auto& from = feed_->choices[i];
        auto& to = sent_[i];
        if (to.finished) continue;
        to.ids.insert(to.ids.end(), from.ids.begin() + static_cast<std::ptrdiff_t>(to.ids.size()), from.ids.end());
        to.logprobs.insert(to.logprobs.end(), from.logprobs.begin() + static_cast<std::ptrdiff_t>(to.logprobs.size()),
                           from.logprobs.end());
        done[i] = std::move(from.done);
        from.done.reset();
      }
    }
    for (size_t i = 0; i < sent_.size(); ++i) {
      Sent& sent = sent_[i];
      if (sent.finished) continue;
      if (done[i]) {
        const Completion& c = *done[i];
        sent.ids = c.ids;  // the completion is the truth: the feed may lack its last tokens
        sent.logprobs = c.logprobs;
        sent.tokens = std::min(sent.tokens, sent.ids.size());
        const std::string rest = c.text.substr(std::min(sent.text, c.text.size()));
        sent.finished = true;
        --open;
        completion_tokens += static_cast<int64_t>(c.ids.size());
        if (!send(event(chunk(json::array({choice(i, rest, &c)}))))) return false;
        continue;
      }
      if (sent.ids.size() == sent.tokens || !service_.tokenizer_) continue;
      const std::string text = service_.tokenizer_->decode(sent.ids, /*skip_special_tokens=*/true);
      const size_t end = releasable(text, s_.params.stop);
      if (end <= sent.text) continue;  // nothing new to show yet: the tokens wait for the next chunk
      if (!send(event(chunk(json::array({choice(i, text.substr(sent.text, end - sent.text), nullptr)}))))) return false;
    }
    if (open == 0) break;
    if (auto why = error()) {
      const int status = service_.loop_->stopped() ? 503 : 400;
      send(event(error_body(status, status == 503 ? "ServiceUnavailableError" : "BadRequestError", *why, "")));
      ended_ = true;
      return send("data: [DONE]\n\n");
    }
    // Nothing to say for a while (queued, or text held back): an SSE comment, which clients
    // skip, tells whether the client is still there; a failed write cancels the request.
    if (Clock::now() - last_write > std::chrono::seconds(1) && !send(": waiting\n\n")) return false;
  }
  if (s_.include_usage) {
    json last = chunk(json::array());
    last["usage"] = usage(prompt_tokens_, completion_tokens);
    if (!send(event(last))) return false;
  }
  ended_ = true;
  return send("data: [DONE]\n\n");
}

Reply Service::completions(const json& body) {
  auto [s, prompts] = reader_->completion(body);
  if (s.stream) return std::make_shared<GenerationStream>(*this, /*chat=*/false, s, prompts);
  auto results = generate(prompts, s);

  json choices = json::array();
  int64_t prompt_tokens = 0, completion_tokens = 0;
  for (size_t r = 0; r < results.size(); ++r) {
    prompt_tokens += static_cast<int64_t>(prompts[r].size());
    for (const Completion& c : results[r]) {
      completion_tokens += static_cast<int64_t>(c.ids.size());
      size_t offset = 0;
      json choice = {{"index", static_cast<int64_t>(r) * s.params.n + c.index},
                     {"text", c.text},
                     {"logprobs", s.logprobs ? completion_logprobs(c.ids, c.logprobs, s, offset) : json(nullptr)},
                     {"finish_reason", finish_reason_name(c.finish_reason)},
                     {"stop_reason", stop_reason(c, s)},
                     {"token_ids", s.return_token_ids ? json(c.ids) : json(nullptr)},
                     {"prompt_logprobs", nullptr},
                     {"prompt_token_ids", s.return_token_ids ? json(c.prompt_ids) : json(nullptr)},
                     {"troupe", troupe_extension(c)}};
      choices.push_back(std::move(choice));
    }
  }
  json out = {{"id", "cmpl-" + random_hex(32)},
              {"object", "text_completion"},
              {"created", now_seconds()},
              {"model", model_name_},
              {"choices", choices},
              {"system_fingerprint", nullptr},
              {"usage", usage(prompt_tokens, completion_tokens)}};
  return out;
}

Reply Service::chat_completions(const json& body) {
  auto request = reader_->chat(body);
  const Sampling& s = request.sampling;
  const auto& prompt = request.prompts.front();
  if (s.stream) return std::make_shared<GenerationStream>(*this, /*chat=*/true, s, std::vector<std::vector<int32_t>>{prompt});
  auto results = generate({prompt}, s);

  json choices = json::array();
  int64_t completion_tokens = 0;
  for (const Completion& c : results.front()) {
    completion_tokens += static_cast<int64_t>(c.ids.size());
    json choice = {{"index", c.index},
                   {"message", {{"role", "assistant"}, {"content", c.text}, {"reasoning_content", nullptr}, {"tool_calls", json::array()}}},
                   {"logprobs", s.logprobs ? chat_logprobs(c.ids, c.logprobs, s) : json(nullptr)},
                   {"finish_reason", finish_reason_name(c.finish_reason)},
                   {"stop_reason", stop_reason(c, s)},
                   {"token_ids", s.return_token_ids ? json(c.ids) : json(nullptr)},
                   {"troupe", troupe_extension(c)}};
    choices.push_back(std::move(choice));
  }
  json out = {{"id", "chatcmpl-" + random_hex(32)},
              {"object", "chat.completion"},
              {"created", now_seconds()},
              {"model", model_name_},
              {"choices", choices},
              {"system_fingerprint", nullptr},
              {"usage", usage(static_cast<int64_t>(prompt.size()), completion_tokens)},
              {"prompt_logprobs", nullptr},
              {"prompt_token_ids", s.return_token_ids ? json(prompt) : json(nullptr)}};
  return out;
}

// Prometheus' text format (0.0.4) under vLLM's metric names, each labelled with the served model
// name as vLLM labels them. No Debian package offers a C++ Prometheus client, so the few lines of
// the format are written here. Samples are counted per choice (vLLM's n > 1 child requests).
std::string Service::metrics() const {
  const LoopStats st = loop_->stats();
  std::string model;  // a label value escapes backslash, quote and newline
  for (char c : model_name_) model += c == '\n' ? std::string("\\n") : c == '\\' || c == '"' ? std::string("\\") + c : std::string(1, c);
  const std::string label = "model_name=\"" + model + "\"";
  std::string out;
  auto number = [](double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  auto head = [&](const char* name, const char* type, const char* help) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  auto sample = [&](const std::string& name, const std::string& labels, double v) {
    out += name + "{" + labels + "} " + number(v) + "\n";
  };
  head("vllm:num_requests_running", "gauge", "Number of sequences in decode slots.");
  sample("vllm:num_requests_running", label, static_cast<double>(st.running));
  head("vllm:num_requests_waiting", "gauge", "Number of samples waiting for a decode slot.");
  sample("vllm:num_requests_waiting", label, static_cast<double>(st.waiting));
  head("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed (once per prompt).");
  sample("vllm:prompt_tokens_total", label, static_cast<double>(st.prompt_tokens));
  head("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.");
  sample("vllm:generation_tokens_total", label, static_cast<double>(st.generation_tokens));
  head("vllm:request_success_total", "counter", "Count of finished samples, by finish reason.");
  for (const char* reason : {"stop", "length", "abort"}) {
    auto it = st.finished.find(reason);
    sample("vllm:request_success_total", label + ",finished_reason=\"" + reason + "\"",
           static_cast<double>(it == st.finished.end() ? 0 : it->second));
  }
  auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    head(name, "histogram", help);
    int64_t cumulative = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cumulative += h.counts[i];
      sample(std::string(name) + "_bucket", label + ",le=\"" + number(h.bounds[i]) + "\"", static_cast<double>(cumulative));
    }
    sample(std::string(name) + "_bucket", label + ",le=\"+Inf\"", static_cast<double>(h.count));
    sample(std::string(name) + "_sum", label, h.sum);
    sample(std::string(name) + "_count", label, static_cast<double>(h.count));
  };
  histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", st.time_to_first_token);
  histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", st.inter_token_latency);
  histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", st.e2e_latency);
  return out;
}

// ---------------------------------------------------------------------------------------
// Weight updates with vLLM 0.33.0's routes, from a folder of .safetensors, two ways: vLLM's
// weight-transfer protocol with the shared-disk backend (init_info {}, update_info {"path": DIR},
// as vLLM's `disk` backend after 0.33.0) and vLLM's disk reload (/collective_rpc reload_weights).
// Tensors are checked and staged first, then copied between two decode steps together with the
// new version, so no token is ever labelled with a version it did not come from. NCCL's
// init_info is checked, then refused: its bytes need a CUDA device and an NCCL receiver.

const std::vector<std::string> kNcclInitFields = {"master_address", "master_port", "rank_offset",
                                                  "world_size", "nccl_unique_id_b64", "packed",
                                                  "packed_buffer_size_bytes", "packed_num_buffers"};

// vLLM's NCCLWeightTransferInitInfo (nccl_common.py), field by field, so a client learns what is
// wrong with its request before it learns that troupe serve cannot take it.
void Service::check_nccl_init(const json& info) const {
  nested("init_info", [&] {
    for (const char* key : {"rank_offset", "world_size"})
      if (!int_field(info, key)) bad(key, std::string("`") + key + "` is required by the nccl backend");
    if (*int_field(info, "world_size") < 2)
      bad("world_size", "`world_size` counts the trainer's ranks and the server's, so it is at least 2");
    for (const char* key : {"master_port", "packed_buffer_size_bytes", "packed_num_buffers"}) int_field(info, key);
    bool_field(info, "packed");
    auto uid = string_field(info, "nccl_unique_id_b64");
    const bool tcp = string_field(info, "master_address") || int_field(info, "master_port");
    if (uid && tcp) bad("nccl_unique_id_b64", "pass `nccl_unique_id_b64` or `master_address` and `master_port`, not both");
    if (!uid && !(field(info, "master_address") && field(info, "master_port")))
      bad("nccl_unique_id_b64", "need `nccl_unique_id_b64`, or both `master_address` and `master_port`");
    if (!uid) return;
    auto bytes = base64_decode(*uid);
    if (!bytes) bad("nccl_unique_id_b64", "`nccl_unique_id_b64` is not valid standard base64 (URL-safe base64 is not accepted)");
    if (bytes->size() != 128)
      bad("nccl_unique_id_b64", "`nccl_unique_id_b64` must decode to the 128 bytes of an ncclUniqueId, got " +
                                    std::to_string(bytes->size()));
  });
  const std::string instead = "; send init_info {} and update_info {\"path\": DIR} (the disk backend), or use /collective_rpc reload_weights";
  if (options_.device.rfind("cpu", 0) == 0)
    bad("init_info", "/init_weight_transfer_engine: NCCL weight transfer needs a CUDA device, and troupe serve runs on " +
                         options_.device + instead);
  bad("init_info", "/init_weight_transfer_engine: troupe serve has no NCCL receiver" + instead);
}

// init_info {} is the disk backend, which needs no rendezvous; NCCL's fields are checked, then refused.
json Service::init_weight_transfer_engine(const json& body) const {
  check_fields(body, "/init_weight_transfer_engine", {"init_info"}, {});
  const json* info = field(body, "init_info");
  if (!info) bad("init_info", "Missing 'init_info' in request body: {} for the disk backend");
  if (!info->is_object()) bad("init_info", "`init_info` must be an object, got " + type_name(*info));
  for (const auto& [key, value] : info->items())
    if (std::find(kNcclInitFields.begin(), kNcclInitFields.end(), key) == kNcclInitFields.end())
      bad("init_info." + key, "`init_info." + key + "` is a field of neither the disk backend (init_info {}) nor the nccl backend");
  if (!info->empty()) check_nccl_init(*info);
  return {{"message", "Weight transfer initialized"}};
}

// As vLLM: no pause here (that is /pause's), and one session at a time.
json Service::start_weight_update(const json& body) {
  check_fields(body, "/start_weight_update", {}, {{"is_checkpoint_format", {true}}});
  std::lock_guard lock(update_mutex_);
  if (session_) conflict("/start_weight_update: a weight update is already active; call /finish_weight_update first");
  session_ = true;
  staged_.clear();
  return {{"message", "Weight update started"}};
}

std::map<std::string, torch::Tensor> Service::read_update_dir(const std::string& path, const std::string& param) const {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) bad(param, param + ": '" + path + "' is not a directory (send a folder of .safetensors files)");
  std::map<std::string, torch::Tensor> weights;
  try {
    weights = read_safetensors(safetensors::Checkpoint::open_dir(path));
  } catch (const std::exception& e) {
    bad(param, param + ": " + e.what());
  }
  std::map<std::string, torch::Tensor> kept;
  for (auto& [name, t] : weights) {
    // As transformers does on load: rotary tables are recomputed, a tied head is the embedding.
    if (name.ends_with("rotary_emb.inv_freq") || (name == "lm_head.weight" && config_.tie_word_embeddings)) continue;
    auto it = param_shapes_.find(name);
    if (it == param_shapes_.end()) bad(param, param + ": " + path + ": tensor '" + name + "' is not a parameter of the served model");
    if (shape_of(t) != it->second)
      bad(param, param + ": " + path + ": tensor '" + name + "' has shape " + shape_str(shape_of(t)) + ", the model's is " +
                     shape_str(it->second));
    if (!t.is_floating_point()) bad(param, param + ": " + path + ": tensor '" + name + "' is not floating point");
    kept.emplace(name, std::move(t));
  }
  if (kept.empty()) bad(param, param + ": " + path + ": no model parameters in the folder");
  return kept;
}

// The disk backend's update_info, {"path": an absolute folder}; vLLM's nccl fields are named as such.
std::string disk_update_path(const json& body) {
  const json* info = field(body, "update_info");
  if (!info) bad("update_info", "Missing 'update_info' in request body: {\"path\": DIR} for the disk backend");
  if (!info->is_object())
    bad("update_info", "`update_info` must be an object like {\"path\": \"/abs/dir\"} (troupe serve runs one worker), got " +
                           type_name(*info));
  for (const auto& [key, value] : info->items()) {
    if (key == "path") continue;
    if (key == "names" || key == "dtype_names" || key == "shapes")
      bad("update_info." + key, "`update_info." + key + "` belongs to the nccl backend, whose bytes need a CUDA device; "
                                "troupe serve takes {\"path\": DIR} (the disk backend)");
    bad("update_info." + key, "`update_info." + key + "` is not a field of the disk backend ({\"path\": DIR})");
  }
  const json* path = field(*info, "path");
  if (!path || !path->is_string() || path->get_ref<const std::string&>().empty())
    bad("update_info.path", "`update_info.path` must be a folder of .safetensors files, as a string");
  if (!fs::path(path->get<std::string>()).is_absolute())
    bad("update_info.path", "`update_info.path` must be an absolute path, got '" + path->get<std::string>() + "'");
  return path->get<std::string>();
}

// One checkpoint per session, as vLLM's disk backend; a folder that fails its checks ends the session.
json Service::update_weights(const json& body) {
  check_fields(body, "/update_weights", {"update_info"}, {});
  const std::string path = disk_update_path(body);
  std::lock_guard lock(update_mutex_);
  if (!session_) conflict("/update_weights: no weight update is active; call /start_weight_update first");
  if (!staged_.empty()) {
    session_ = false;
    staged_.clear();
    conflict("/update_weights: the disk backend takes one checkpoint per update session; the session is closed");
  }
  try {
    staged_ = read_update_dir(path, "update_info.path");
  } catch (...) {
    session_ = false;
    throw;
  }
  return {{"message", "Weights updated"}, {"tensors", staged_.size()}};
}

void Service::apply(std::map<std::string, torch::Tensor> weights, int64_t version) {
  try {
    loop_->update_weights(std::move(weights), version).get();
  } catch (const Error& e) {  // the engine checks before copying: the old weights are intact
    if (loop_->stopped()) throw HttpError(503, "ServiceUnavailableError", "", e.what());
    bad("", e.what());
  }
}

// Without a weight_version the version still moves (vLLM's stays): a new policy needs a new label.
json Service::finish_weight_update(const json& body) {
  check_fields(body, "/finish_weight_update", {"weight_version"}, {});
  const int64_t version = field(body, "weight_version") ? version_field(body, "weight_version") : loop_->version() + 1;
  std::map<std::string, torch::Tensor> weights;
  {
    std::lock_guard lock(update_mutex_);
    if (!session_) conflict("/finish_weight_update: no weight update is active; call /start_weight_update first");
    session_ = false;
    weights.swap(staged_);
  }
  if (weights.empty())
    conflict("/finish_weight_update: no checkpoint was loaded in this session (/update_weights goes between start and finish)");
  const size_t count = weights.size();
  apply(std::move(weights), version);
  return {{"message", "Weight update finished"}, {"weight_version", version}, {"tensors", count}};
}

// vLLM's /collective_rpc for the one method a trainer needs of it: reload_weights from a folder.
// The version moves by one (vLLM's stays until /update_weight_version), as at finish.
json Service::collective_rpc(const json& body) {
  check_fields(body, "/collective_rpc", {"method", "args", "kwargs", "timeout"}, {});
  auto method = string_field(body, "method");
  if (!method) bad("method", "Missing 'method' in request body");
  if (*method != "reload_weights") bad("method", "/collective_rpc: troupe serve runs only reload_weights, got '" + *method + "'");
  const json* args = field(body, "args");
  if (args && !(args->is_array() && args->empty()))
    bad("args", "/collective_rpc reload_weights: `args` must be empty; pass weights_path in `kwargs`");
  number_field(body, "timeout");  // checked only: a reload is not cut short
  const json* kwargs = field(body, "kwargs");
  if (!kwargs || !kwargs->is_object()) bad("kwargs", "`kwargs` must be an object holding weights_path");
  std::string path;
  nested("kwargs", [&] {
    for (const auto& [key, value] : kwargs->items())
      if (key != "weights_path" && key != "is_checkpoint_format")
        bad(key, "`" + key + "` is not an argument of reload_weights from disk (weights_path, is_checkpoint_format)");
    if (!bool_field(*kwargs, "is_checkpoint_format").value_or(true))
      bad("is_checkpoint_format", "troupe serve reloads checkpoint-format (Hugging Face) tensors only");
    auto p = string_field(*kwargs, "weights_path");
    if (!p || p->empty()) bad("weights_path", "`weights_path` is required: troupe serve reloads from a folder of .safetensors only");
    if (!fs::path(*p).is_absolute()) bad("weights_path", "`weights_path` must be an absolute path, got '" + *p + "'");
    path = *p;
  });
  {
    std::lock_guard lock(update_mutex_);
    if (session_) conflict("/collective_rpc reload_weights: a weight update is active; call /finish_weight_update first");
  }
  apply(read_update_dir(path, "kwargs.weights_path"), loop_->version() + 1);
  return {{"results", json::array({nullptr})}};  // one worker; reload_weights returns None
}

json Service::update_weight_version(const json& body) {
  check_fields(body, "/update_weight_version", {"new_version"}, {});
  if (!field(body, "new_version")) bad("new_version", "`new_version` is required");
  apply({}, version_field(body, "new_version"));  // the weights stay; the label of the tokens to come moves
  return {{"success", true}, {"new_version", body.at("new_version")}};
}

// Nothing to reset: troupe's KV cache holds running sequences only, so no prefix outlives its
// request. The flags are checked all the same.
json Service::reset_prefix_cache(const json& query) const {
  check_fields(query, "/reset_prefix_cache", {"reset_running_requests", "reset_external"}, {});
  query_flag(query, "reset_running_requests", false);
  query_flag(query, "reset_external", false);
  return {{"success", true}};
}

// vLLM's /pause?mode=: "wait" lets admitted requests finish and answers new ones 503 until
// /resume; "keep" freezes running sequences in their slots and queues new requests. "abort",
// vLLM's default, is refused: the engine loop cannot cut requests short.
json Service::pause(const json& query) {
  check_fields(query, "/pause", {"mode", "clear_cache"}, {});
  const std::string mode = string_field(query, "mode").value_or("abort");
  query_flag(query, "clear_cache", true);  // checked only: no cached block outlives its request
  if (mode == "keep") {
    loop_->pause();
    return {{"status", "paused"}};
  }
  if (mode == "abort")
    bad("mode", "/pause: mode=abort (vLLM's default) is not supported: troupe serve cannot cut running requests short; "
                "use mode=wait (they finish) or mode=keep (they freeze)");
  if (mode != "wait") bad("mode", "/pause: `mode` must be abort, wait or keep, got '" + mode + "'");
  std::unique_lock lock(gate_mutex_);
  rejecting_ = true;
  loop_->resume();  // requests frozen by an earlier keep pause were admitted: they finish too
  drained_.wait(lock, [&] { return in_flight_ == 0; });
  loop_->pause();
  return {{"status", "paused"}};
}

json Service::resume() {
  {
    std::lock_guard lock(gate_mutex_);
    rejecting_ = false;
  }
  loop_->resume();
  return {{"status", "resumed"}};
}

json Service::is_paused() const {
  std::lock_guard lock(gate_mutex_);
  return {{"is_paused", rejecting_ || loop_->paused()}};
}

// ---------------------------------------------------------------------------------------
// Connections. cpp-httplib 0.11 gives each connection a pool thread for as long as it lasts and
// times out each read but not the request, so 64 clients sending a byte a second held every
// thread; and it reads chunked bodies without a limit. Here each connection has a thread of its
// own up to --max-connections; past that a new connection closes the oldest idle one (connected,
// no request yet) or, when none is idle, is answered 503 and closed. A request's headers and body
// must arrive within --request-timeout (408), its headers within kMaxHeaderBytes (431), its body
// within --max-request-bytes (413). Not an event loop: a connection still costs a thread.

constexpr size_t kMaxHeaderBytes = size_t{64} << 10;

using Clock = std::chrono::steady_clock;

// One connection, on the thread that serves it.
struct Connection {
  socket_t sock = INVALID_SOCKET;
  bool idle = false;     // waiting for a request (guarded by Connections::mutex)
  bool evicted = false;  // closed to admit a newer one (guarded by Connections::mutex)
  std::list<Connection*>::iterator at;  // its place in Connections::idle while idle
  enum class Cut { none, timeout, headers, body } cut = Cut::none;  // why its request could not be read
  bool close = false;    // answered without reading the body: nothing after it can be parsed
};

// The connection the current thread serves; null on the accept thread and off HTTP threads.
thread_local Connection* this_connection = nullptr;
// Set on the accept thread while it turns a connection away.
thread_local bool shed_this_connection = false;

bool client_went_away() {
  if (!this_connection) return false;
  pollfd p{this_connection->sock, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;  // nothing to read, not even the end: still there
  if (p.revents & (POLLERR | POLLNVAL)) return true;
  char c;
  const ssize_t n = recv(p.fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// The open connections, shared by the accept thread (admission) and the connection threads.
struct Connections {
  explicit Connections(size_t limit) : limit(limit) {}
  const size_t limit;
  std::mutex mutex;
  std::condition_variable ended;
  size_t open = 0;
  std::list<Connection*> idle;  // oldest first

  // On the accept thread: room for one more connection, evicting the oldest idle one if need be.
  bool admit() {
    std::lock_guard lock(mutex);
    if (open >= limit) {
      if (idle.empty()) return false;
      Connection* oldest = idle.front();
      idle.pop_front();
      oldest->idle = false;
      oldest->evicted = true;
      ::shutdown(oldest->sock, SHUT_RDWR);  // its poll() wakes; its thread closes it
    }
    ++open;
    return true;
  }
  void leave() {
    std::lock_guard lock(mutex);
    --open;
    ended.notify_all();
  }
  void set_idle(Connection& c) {
    std::lock_guard lock(mutex);
    c.idle = true;
    c.at = idle.insert(idle.end(), &c);
  }
  // False when the connection was evicted while idle.
  bool set_busy(Connection& c) {
    std::lock_guard lock(mutex);
    if (c.evicted) return false;
    if (c.idle) idle.erase(c.at);
    c.idle = false;
    return true;
  }
};

// httplib's TaskQueue, one thread per admitted connection; the others are turned away inline.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(std::shared_ptr<Connections> connections) : connections_(std::move(connections)) {}

  void enqueue(std::function<void()> fn) override {
    auto job = std::make_shared<std::function<void()>>(std::move(fn));
    if (connections_->admit()) {
      try {
        std::thread([connections = connections_, job] {
          (*job)();
          connections->leave();
        }).detach();
        return;
      } catch (const std::system_error&) {  // no thread to be had: turn it away like the rest
        connections_->leave();
      }
    }
    shed_this_connection = true;
    (*job)();
    shed_this_connection = false;
  }

  // Every connection thread has ended (the listening socket is closed, so they end soon).
  void shutdown() override {
    std::unique_lock lock(connections_->mutex);
    connections_->ended.wait(lock, [&] { return connections_->open == 0; });
  }

 private:
  std::shared_ptr<Connections> connections_;
};

std::string socket_address(socket_t sock, bool peer, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  auto* a = reinterpret_cast<sockaddr*>(&addr);
  if ((peer ? getpeername(sock, a, &len) : getsockname(sock, a, &len)) != 0) return "";
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(a, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0) return "";
  port = std::atoi(serv);
  return host;
}

// One request's reading, under its deadline and byte limits, and the writing of its answer.
class RequestStream : public httplib::Stream {
 public:
  struct Limits {
    Clock::duration read_timeout, write_timeout;  // each wait
    Clock::time_point deadline;                   // the whole request (headers and body)
    size_t max_body;                              // bytes on the wire after the headers
  };

  RequestStream(Connection& c, Limits limits, const std::atomic<socket_t>& listening)
      : c_(c), limits_(limits), listening_(listening) {}

  bool is_readable() const override { return off_ < size_ || wait(POLLIN); }
  bool is_writable() const override { return wait(POLLOUT) && alive(); }

  ssize_t read(char* ptr, size_t size) override {
    if (off_ == size_) {
      if (!wait(POLLIN)) return -1;
      const size_t cap = headers_done_ ? limits_.max_body : kMaxHeaderBytes;
      const size_t used = headers_done_ ? body_bytes_ : header_bytes_;
      if (used >= cap) {
        c_.cut = headers_done_ ? Connection::Cut::body : Connection::Cut::headers;
        return -1;
      }
      ssize_t n;
      do n = recv(c_.sock, buf_, std::min(sizeof buf_, cap - used), 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      off_ = 0;
      size_ = static_cast<size_t>(n);
      count(size_);
    }
    const size_t k = std::min(size, size_ - off_);
    std::memcpy(ptr, buf_ + off_, k);
    off_ += k;
    return static_cast<ssize_t>(k);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do n = send(c_.sock, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { ip = socket_address(c_.sock, true, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { ip = socket_address(c_.sock, false, port); }
  socket_t socket() const override { return c_.sock; }

 private:
  // Until the socket is ready, in slices so that a stopping server is noticed; reads also end at
  // the request's deadline. A read that runs out of time cuts the request.
  bool wait(short events) const {
    const bool reading = events == POLLIN;
    const auto end = std::min(Clock::now() + (reading ? limits_.read_timeout : limits_.write_timeout),
                              reading ? limits_.deadline : Clock::time_point::max());
    for (;;) {
      if (reading && listening_ == INVALID_SOCKET) return false;
      const auto now = Clock::now();
      if (now >= end) {
        if (reading) c_.cut = Connection::Cut::timeout;
        return false;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - now).count() + 1;
      pollfd p{c_.sock, events, 0};
      const int r = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 100)));
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) return false;
    }
  }

  // httplib's test: a socket with nothing to read is alive; one that reads its end is not.
  bool alive() const {
    pollfd p{c_.sock, POLLIN, 0};
    if (poll(&p, 1, 0) == 0) return true;
    char c;
    return recv(c_.sock, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
  }

  // Counts the bytes received as headers until the blank line that ends them, then as body.
  void count(size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (headers_done_) {
        body_bytes_ += n - i;
        return;
      }
      ++header_bytes_;
      tail_ = (tail_ << 8) | static_cast<unsigned char>(buf_[i]);
      headers_done_ = tail_ == 0x0D0A0D0A;  // \r\n\r\n
    }
  }

  Connection& c_;
  Limits limits_;
  const std::atomic<socket_t>& listening_;
  char buf_[4096];
  size_t off_ = 0, size_ = 0;
  bool headers_done_ = false;
  uint32_t tail_ = 0;
  size_t header_bytes_ = 0, body_bytes_ = 0;
};

// httplib's server with the connection handling above in place of its own.
class GuardedServer : public httplib::Server {
 public:
  GuardedServer(const ServeOptions& o, size_t max_connections)
      : connections_(std::make_shared<Connections>(max_connections)),
        request_timeout_(std::chrono::seconds(o.request_timeout_s)),
        max_body_wire_(o.max_request_bytes + kMaxHeaderBytes),  // room for chunk framing
        max_connections_(max_connections) {
    new_task_queue = [c = connections_] { return new ConnectionThreads(c); };
  }

  // httplib listens with a backlog of 5: a burst of connections overflows it, and each one
  // dropped retries its SYN only after a second (then 3, then 7). Called again, listen() widens it.
  void widen_backlog() { ::listen(svr_sock_, SOMAXCONN); }

 private:
  bool process_and_close_socket(socket_t sock) override {
    if (shed_this_connection) {
      turn_away(sock);
      return false;
    }
    Connection c{.sock = sock};
    this_connection = &c;
    bool ok = false;
    // A request without Content-Length or Transfer-Encoding has an empty body (RFC 9112 6.3);
    // httplib would read one until the connection closes.
    static const std::function<void(httplib::Request&)> empty_body = [](httplib::Request& req) {
      if (!req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) req.set_header("Content-Length", "0");
    };
    for (size_t left = keep_alive_max_count_; left > 0 && await_request(c); --left) {
      const auto now = Clock::now();
      RequestStream stream(c,
                           {.read_timeout = std::chrono::seconds(read_timeout_sec_) + std::chrono::microseconds(read_timeout_usec_),
                            .write_timeout = std::chrono::seconds(write_timeout_sec_) + std::chrono::microseconds(write_timeout_usec_),
                            .deadline = now + request_timeout_,
                            .max_body = max_body_wire_},
                           svr_sock_);
      c.cut = Connection::Cut::none;
      bool closed = false;
      ok = process_request(stream, left == 1, closed, empty_body);
      if (!ok || closed || c.cut != Connection::Cut::none || c.close) break;
    }
    this_connection = nullptr;
    connections_->set_busy(c);  // out of the idle list before the descriptor is closed
    if (c.cut != Connection::Cut::none || c.close) linger(sock);
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  // After an answer to a request that was not read to its end: closed with the rest unread, the
  // socket would send a reset, which can reach the client before the answer does. So the rest is
  // read and dropped for a moment first (Apache's lingering close).
  static void linger(socket_t sock) {
    ::shutdown(sock, SHUT_WR);
    const auto until = Clock::now() + std::chrono::seconds(1);
    size_t dropped = 0;
    char buf[4096];
    while (Clock::now() < until && dropped < (size_t{1} << 20)) {
      pollfd p{sock, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = recv(sock, buf, sizeof buf, 0);
      if (n <= 0) break;
      dropped += static_cast<size_t>(n);
    }
  }

  // Up to the keep-alive timeout for the next request's first byte; false when the wait ran out,
  // the server is stopping or the connection was evicted.
  bool await_request(Connection& c) {
    connections_->set_idle(c);
    const auto until = Clock::now() + std::chrono::seconds(keep_alive_timeout_sec_);
    bool ready = false;
    while (!ready && svr_sock_ != INVALID_SOCKET && Clock::now() < until) {
      pollfd p{c.sock, POLLIN, 0};
      const int r = poll(&p, 1, 100);
      if (r < 0 && errno != EINTR) break;
      ready = r > 0;
    }
    return connections_->set_busy(c) && ready;
  }

  // On the accept thread, so without waiting: a 503 if the socket takes it at once, then close.
  void turn_away(socket_t sock) const {
    const std::string body =
        error_body(503, "ServiceUnavailableError",
                   "too many connections: all " + std::to_string(max_connections_) +
                       " are busy (--max-connections); retry later", "").dump();
    const std::string reply = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: " +
                              std::to_string(body.size()) + "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" + body;
    (void)send(sock, reply.data(), reply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    ::shutdown(sock, SHUT_WR);
    char drain[4096];  // what the client sent already: unread, it would turn the close into a reset
    for (int i = 0; i < 16 && recv(sock, drain, sizeof drain, MSG_DONTWAIT) > 0; ++i) {
    }
    ::close(sock);
  }

  std::shared_ptr<Connections> connections_;
  Clock::duration request_timeout_;
  size_t max_body_wire_;
  size_t max_connections_;
};

// ---------------------------------------------------------------------------------------
// HTTP wiring.

using Route = std::function<Reply(const json& input)>;

// What a route reads: its JSON body (which may be empty), or its query string as an object of strings.
enum class Input { body, body_or_empty, query };

json query_of(const httplib::Request& req) {
  json query = json::object();
  for (const auto& [key, value] : req.params) query[key] = value;
  return query;
}

// Turns every exception into vLLM's error body: a crash in one request must not take the
// server (and everyone else's requests) down.
httplib::Server::Handler json_route(Route route, Input input, size_t max_body) {
  return [route = std::move(route), input, max_body](const httplib::Request& req, httplib::Response& res) {
    try {
      if (req.body.size() > max_body)  // a chunked body (httplib checks only Content-Length)
        throw HttpError(413, "BadRequestError", "", "the request body exceeds " + std::to_string(max_body) + " bytes (--max-request-bytes)");
      json in = input == Input::query ? query_of(req)
                : req.method == "GET" ? json::object()
                                      : parse_body(req.body, input == Input::body_or_empty);
      Reply out = route(in);
      if (out.stream) {
        res.set_chunked_content_provider("text/event-stream", [stream = out.stream](size_t, httplib::DataSink& sink) {
          if (!stream->run([&](const std::string& text) { return sink.write(text.data(), text.size()); })) return false;
          sink.done();
          return true;
        });
        return;
      }
      if (out.body.is_null()) {
        res.status = 200;  // /health: an empty 200, as vLLM answers
        return;
      }
      send_json(res, 200, out.body);
    } catch (const HttpError& e) {
      send_error(res, e.status, e.type, e.what(), e.param);
    } catch (const Error& e) {
      send_error(res, 400, "BadRequestError", e.what());
    } catch (const std::exception& e) {
      std::cerr << "troupe serve: " << req.method << " " << req.path << ": internal error: " << e.what() << std::endl;
      send_error(res, 500, "InternalServerError", e.what());
    }
  };
}

void add_routes(httplib::Server& http, Service& service) {
  Service* s = &service;
  const Input empty_ok = Input::body_or_empty, query = Input::query;
  const size_t limit = service.options().max_request_bytes;
  auto json_route = [limit](Route route, Input input = Input::body) { return troupe::json_route(std::move(route), input, limit); };
  http.Get("/health", json_route([s](const json&) { return s->health(); }));
  http.Get("/v1/models", json_route([s](const json&) { return s->models(); }));
  http.Get("/is_paused", json_route([s](const json&) { return s->is_paused(); }));
  http.Get("/weight_info", json_route([s](const json&) { return s->weight_info(); }));
  http.Get("/get_world_size", json_route([s](const json&) { return s->world_size(); }));
  http.Get("/metrics", [s](const httplib::Request&, httplib::Response& res) {
    res.set_content(s->metrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http.Post("/v1/completions", json_route([s](const json& b) { return s->completions(b); }));
  http.Post("/v1/chat/completions", json_route([s](const json& b) { return s->chat_completions(b); }));
  http.Post("/tokenize", json_route([s](const json& b) { return s->tokenize(b); }));
  http.Post("/detokenize", json_route([s](const json& b) { return s->detokenize(b); }));
  http.Post("/init_weight_transfer_engine", json_route([s](const json& b) { return s->init_weight_transfer_engine(b); }));
  http.Post("/start_weight_update", json_route([s](const json& b) { return s->start_weight_update(b); }, empty_ok));
  http.Post("/update_weights", json_route([s](const json& b) { return s->update_weights(b); }));
  http.Post("/finish_weight_update", json_route([s](const json& b) { return s->finish_weight_update(b); }, empty_ok));
  http.Post("/update_weight_version", json_route([s](const json& b) { return s->update_weight_version(b); }));
  http.Post("/collective_rpc", json_route([s](const json& b) { return s->collective_rpc(b); }));
  http.Post("/reset_prefix_cache", json_route([s](const json& q) { return s->reset_prefix_cache(q); }, query));
  http.Post("/pause", json_route([s](const json& q) { return s->pause(q); }, query));
  http.Post("/resume", json_route([s](const json&) { return s->resume(); }, empty_ok));
}

void configure_http(httplib::Server& http, Service& service) {
  const ServeOptions& o = service.options();  // threads: one per connection (GuardedServer)
  http.set_payload_max_length(o.max_request_bytes);
  // Before the body is read, so that neither reaches it: the answer closes the connection.
  auto refuse = [](httplib::Response& res, int status, const std::string& type, const std::string& message) {
    send_error(res, status, type, message);
    res.set_header("Connection", "close");
    if (this_connection) this_connection->close = true;
    return httplib::Server::HandlerResponse::Handled;
  };
  http.set_pre_routing_handler([&service, refuse](const httplib::Request& req, httplib::Response& res) {
    // httplib would inflate gzip or brotli bodies without a limit (a small bomb fills the memory);
    // vLLM does not decompress request bodies either.
    const std::string encoding = req.get_header_value("Content-Encoding");
    if (!encoding.empty() && strcasecmp(encoding.c_str(), "identity") != 0)
      return refuse(res, 415, "BadRequestError", "Content-Encoding '" + encoding + "' is not supported: send the body uncompressed");
    const std::string transfer = req.get_header_value("Transfer-Encoding");
    if (!transfer.empty() && strcasecmp(transfer.c_str(), "chunked") != 0)  // 400 as uvicorn answers it
      return refuse(res, 400, "BadRequestError", "Transfer-Encoding '" + transfer + "' is not supported (only chunked)");
    if (req.path == "/health" || service.authorized(req)) return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, 401, "AuthenticationError", "Unauthorized: send the server's API key as 'Authorization: Bearer KEY'");
    return httplib::Server::HandlerResponse::Handled;
  });
  // Errors raised by the library itself (unknown route, body too large, unparsable request), and
  // by RequestStream (too slow, headers too large).
  const size_t limit = o.max_request_bytes;
  const std::string in_time = "the request did not arrive in time: all of it within " + std::to_string(o.request_timeout_s) +
                              " s (--request-timeout), each part within " + std::to_string(CPPHTTPLIB_READ_TIMEOUT_SECOND) + " s";
  http.set_error_handler(httplib::Server::HandlerWithResponse([limit, in_time](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const auto cut = this_connection ? this_connection->cut : Connection::Cut::none;
    if (res.status == 413 && req.get_header_value("Content-Type").starts_with("application/x-www-form-urlencoded"))
      send_error(res, 413, "BadRequestError",
                 "a form-urlencoded body is limited to 8192 bytes; send JSON with 'Content-Type: application/json' "
                 "(curl -d sends form-urlencoded unless told)");
    else if (res.status == 413 || cut == Connection::Cut::body)
      send_error(res, 413, "BadRequestError", "the request body exceeds " + std::to_string(limit) + " bytes (--max-request-bytes)");
    else if (cut == Connection::Cut::timeout)
      send_error(res, 408, "RequestTimeoutError", in_time);
    else if (cut == Connection::Cut::headers)
      send_error(res, 431, "BadRequestError", "the request headers exceed " + std::to_string(kMaxHeaderBytes) + " bytes");
    else if (res.status == 404)
      send_error(res, 404, "NotFoundError", "no route " + req.method + " " + req.path);
    else if (res.status == 414)
      send_error(res, 414, "BadRequestError", "the request line exceeds 8192 bytes");
    else if (res.status == 400)
      send_error(res, 400, "BadRequestError",
                 "malformed HTTP request: its request line, headers (at most 8192 bytes a line) or body framing could not be parsed");
    else send_error(res, res.status, "BadRequestError", "HTTP " + std::to_string(res.status));
    if (cut != Connection::Cut::none) res.set_header("Connection", "close");
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    send_error(res, 500, "InternalServerError", "internal error");
  });
  add_routes(http, service);
}

// Why host:port cannot be bound, as the system says it (httplib only says that it failed).
std::string bind_failure(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0) return gai_strerror(rc);
  std::string why = "it could not be bound";
  for (addrinfo* a = found; a; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    const int rc = bind(fd, a->ai_addr, a->ai_addrlen);
    const int err = errno;
    close(fd);
    if (rc != 0) {
      why = std::strerror(err);
      break;
    }
  }
  freeaddrinfo(found);
  return why;
}

// Every connection is a descriptor, and the soft limit is often 1024: raise it to the hard one
// (as vLLM does) and keep the connections within it.
size_t connection_limit(const ServeOptions& o) {
  const auto wanted = static_cast<size_t>(o.max_connections);
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return wanted;
  if (r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
    getrlimit(RLIMIT_NOFILE, &r);
  }
  constexpr rlim_t reserve = 64;  // the model's files, the engine, the listening socket
  if (r.rlim_cur == RLIM_INFINITY || r.rlim_cur >= wanted + reserve) return wanted;
  const size_t fit = r.rlim_cur > 2 * reserve ? static_cast<size_t>(r.rlim_cur - reserve) : 1;
  std::cerr << "troupe serve: --max-connections " << wanted << " lowered to " << fit << ": the process may open "
            << r.rlim_cur << " files (ulimit -n)" << std::endl;
  return fit;
}

LoadedModel load(const ServeOptions& o) {
  if (o.model.empty()) throw Error("--model is required");
  if (o.max_batch < 1) throw Error("--max-batch must be at least 1");
  if (o.max_seq_len < 2) throw Error("--max-seq-len must be at least 2");
  if (o.request_timeout_s < 1) throw Error("--request-timeout must be at least 1 second");
  if (o.max_connections < 1) throw Error("--max-connections must be at least 1");
  LoadOptions lo;
  lo.device = parse_device(o.device);
  auto dtype = choose_dtype(o.dtype, lo.device, "--dtype");
  if (!dtype.note.empty()) std::cerr << "troupe serve: " << dtype.note << std::endl;
  lo.dtype = dtype.dtype;
  return load_model(o.model, lo);
}

}  // namespace

int serve(const ServeOptions& options) {
  // Block the shutdown signals before any thread starts, so that every thread inherits the mask
  // and only sigwait() below sees them (a handler could not safely stop the server).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client that hangs up must not end the process

  std::cerr << "troupe serve: loading " << options.model << std::endl;
  Service service(options, load(options));
  GuardedServer http(options, connection_limit(options));
  configure_http(http, service);
  // SO_REUSEADDR alone: httplib's default adds SO_REUSEPORT, with which a second server would
  // bind the same port silently and take half of its connections.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  const int port = options.port == 0 ? http.bind_to_any_port(options.host) : (http.bind_to_port(options.host, options.port) ? options.port : -1);
  if (port >= 0) http.widen_backlog();
  if (port < 0)
    throw Error("cannot listen on " + options.host + ":" + std::to_string(options.port) + ": " +
                bind_failure(options.host, options.port) + " (another server on port " + std::to_string(options.port) +
                "? choose another --port, or --port 0 for any free one)");
  std::cout << "troupe serve: listening on http://" << options.host << ":" << port << std::endl;

  std::thread listener([&] {
    http.listen_after_bind();
    kill(getpid(), SIGTERM);  // if the listener ever ends on its own, let the main thread shut down
  });
  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::cerr << "troupe serve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM") << ", shutting down" << std::endl;
  service.stop();  // first: requests waiting on the engine fail now instead of holding HTTP threads
  http.stop();
  listener.join();
  return 0;
}

}  // namespace troupe
