// RemoteEngine: vLLM's /v1/completions and weight-sync routes (vLLM 0.33.0) over cpp-httplib,
// with retries and answers checked field by field. It never guesses token ids from text.
#include "generator/remote_engine.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <mutex>
#include <thread>

#include <httplib.h>
#include <torch/cuda.h>

#include "policy/error.hpp"
#include "policy/safetensors.hpp"

namespace troupe {
namespace fs = std::filesystem;
using json = nlohmann::json;

struct RemoteEngine::Reply {
  int status = 0;
  std::string body;
  std::string transport_error;  // set when no HTTP answer came back
};

namespace {

std::string excerpt(const std::string& s, size_t max = 300) {
  return s.size() <= max ? s : s.substr(0, max) + "...";
}

// The message inside an error body: OpenAI's {"error": {"message"}}, FastAPI's {"detail"},
// or the first bytes of whatever came back.
std::string server_message(const std::string& body) {
  auto j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object()) {
    if (j.contains("error") && j["error"].is_object() && j["error"].contains("message")) return j["error"]["message"].dump();
    for (const char* key : {"error", "detail", "message"})
      if (j.contains(key)) return j[key].is_string() ? j[key].get<std::string>() : excerpt(j[key].dump());
  }
  return body.empty() ? "(empty body)" : excerpt(body);
}

std::string describe(httplib::Error error, const RemoteOptions& o) {
  switch (error) {
    case httplib::Error::Connection: return "cannot connect (connection refused or host unreachable)";
    case httplib::Error::ConnectionTimeout:
      return "no connection within " + std::to_string(o.connect_timeout_s) + " s";
    case httplib::Error::Read:
      return "no complete answer within " + std::to_string(o.timeout_s) + " s (timed out, or the server closed the connection)";
    case httplib::Error::Write: return "sending the request failed (the server closed the connection)";
    default: return httplib::to_string(error);
  }
}

void set_timeout(httplib::Client& client, double seconds, void (httplib::Client::*setter)(time_t, time_t)) {
  auto whole = static_cast<time_t>(seconds);
  (client.*setter)(whole, static_cast<time_t>((seconds - whole) * 1e6));
}

// The dtypes weight sync carries: safetensors' code, and torch's attribute name (vLLM's dtype_names).
struct WireDtype {
  torch::ScalarType type;
  safetensors::Dtype file;
  const char* torch_name;
};
const WireDtype kWireDtypes[] = {
    {torch::kFloat32, safetensors::Dtype::F32, "float32"}, {torch::kBFloat16, safetensors::Dtype::BF16, "bfloat16"},
    {torch::kFloat16, safetensors::Dtype::F16, "float16"}, {torch::kFloat64, safetensors::Dtype::F64, "float64"},
    {torch::kInt64, safetensors::Dtype::I64, "int64"},     {torch::kInt32, safetensors::Dtype::I32, "int32"},
};

const WireDtype& wire_dtype(const torch::Tensor& t, const std::string& name) {
  for (const auto& d : kWireDtypes)
    if (d.type == t.scalar_type()) return d;
  throw Error("update_weights: tensor '" + name + "' has dtype " + c10::toString(t.scalar_type()) +
              ", which weight sync does not carry (float32, bfloat16, float16, float64, int64, int32)");
}

// Writes the tensors as a safetensors folder at `dir`; returns its absolute path, as the server needs.
fs::path write_checkpoint(const std::map<std::string, torch::Tensor>& weights, const fs::path& dir) {
  const fs::path abs = fs::absolute(dir).lexically_normal();
  fs::create_directories(abs);
  std::vector<torch::Tensor> keep;  // owns the CPU copies while the writer reads them
  std::vector<safetensors::TensorRef> refs;
  for (const auto& [name, tensor] : weights) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    keep.push_back(t);
    refs.push_back({name, wire_dtype(t, name).file, t.sizes().vec(), t.data_ptr(), t.nbytes()});
  }
  safetensors::write_dir(abs, refs);
  return abs;
}

// Standard base64 (RFC 4648, not URL-safe), which vLLM requires of nccl_unique_id_b64.
std::string base64(const std::string& bytes) {
  static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t n = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) n |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) n |= static_cast<uint8_t>(bytes[i + 2]);
    out += digits[(n >> 18) & 63];
    out += digits[(n >> 12) & 63];
    out += i + 1 < bytes.size() ? digits[(n >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? digits[n & 63] : '=';
  }
  return out;
}

void check_weight_transfer(const RemoteOptions& o, const std::string& url) {
  const std::string& w = o.weight_transfer;
  if (w != "reload" && w != "disk" && w != "nccl")
    throw Error(url + ": weight_transfer must be reload, disk or nccl, got '" + w + "'");
  if (w != "nccl") return;
  if (!torch::cuda::is_available())
    throw Error(url + ": NCCL weight transfer needs a CUDA device, and none is visible; on CPU use "
                      "weight_transfer = \"reload\" (any vLLM) or \"disk\"");
  if (!o.nccl.connect || !o.nccl.broadcast)
    throw Error(url + ": weight_transfer = \"nccl\" needs nccl.connect and nccl.broadcast, the caller's NCCL "
                      "communicator (troupe links no NCCL)");
  if (o.nccl.unique_id.size() != 128)
    throw Error(url + ": nccl.unique_id must hold the 128 bytes of an ncclUniqueId, got " +
                std::to_string(o.nccl.unique_id.size()));
}

// Field access that names what is missing or mistyped: "URL: the answer has no 'choices[0].text'".
struct Fields {
  const std::string& url;

  [[noreturn]] void fail(const std::string& what) const { throw Error(url + ": " + what); }

  const json* find(const json& obj, const std::string& key) const {
    if (!obj.is_object()) return nullptr;
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  const json& need(const json& obj, const std::string& where, const std::string& key) const {
    if (const json* v = find(obj, key)) return *v;
    fail("the answer has no '" + where + key + "'");
  }
  const json& array(const json& obj, const std::string& where, const std::string& key) const {
    const json& v = need(obj, where, key);
    if (!v.is_array()) fail("the answer's '" + where + key + "' is not an array: " + excerpt(v.dump(), 80));
    return v;
  }
  std::string string(const json& obj, const std::string& where, const std::string& key) const {
    const json& v = need(obj, where, key);
    if (!v.is_string()) fail("the answer's '" + where + key + "' is not a string: " + excerpt(v.dump(), 80));
    return v.get<std::string>();
  }
  int64_t integer(const json& v, const std::string& name) const {
    if (!v.is_number_integer()) fail("the answer's '" + name + "' is not an integer: " + excerpt(v.dump(), 80));
    return v.get<int64_t>();
  }
  std::vector<int32_t> ids(const json& v, const std::string& name) const {
    if (!v.is_array()) fail("the answer's '" + name + "' is not an array of token ids");
    std::vector<int32_t> out;
    for (size_t i = 0; i < v.size(); ++i) {
      int64_t id = integer(v[i], name + "[" + std::to_string(i) + "]");
      if (id < 0 || id > INT32_MAX) fail("the answer's '" + name + "[" + std::to_string(i) + "]' is not a token id: " + std::to_string(id));
      out.push_back(static_cast<int32_t>(id));
    }
    return out;
  }
  std::vector<float> numbers(const json& v, const std::string& name) const {
    std::vector<float> out;
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_number())
        fail("the answer's '" + name + "[" + std::to_string(i) + "]' is not a number: " + excerpt(v[i].dump(), 80));
      out.push_back(v[i].get<float>());
    }
    return out;
  }
};

FinishReason parse_finish_reason(const std::string& s, const Fields& f, const std::string& where) {
  if (s == "stop") return FinishReason::stop;
  if (s == "length") return FinishReason::length;
  if (s == "abort") return FinishReason::abort;
  f.fail("the answer's '" + where + "finish_reason' is '" + s + "', expected stop, length or abort");
}

}  // namespace

RemoteEngine::RemoteEngine(std::string base_url, RemoteOptions options, std::optional<Tokenizer> tokenizer)
    : options_(std::move(options)), tokenizer_(std::move(tokenizer)) {
  while (!base_url.empty() && base_url.back() == '/') base_url.pop_back();
  base_url_ = base_url;
  auto scheme_end = base_url.find("://");
  std::string scheme = scheme_end == std::string::npos ? "" : base_url.substr(0, scheme_end);
  auto path_start = scheme_end == std::string::npos ? std::string::npos : base_url.find('/', scheme_end + 3);
  host_ = base_url.substr(0, path_start);
  prefix_ = path_start == std::string::npos ? "" : base_url.substr(path_start);
  if ((scheme != "http" && scheme != "https") || host_.size() <= scheme.size() + 3)
    throw Error("remote engine URL '" + base_url + "': expected http://host:port");
  if (options_.tries < 1) throw Error(base_url_ + ": tries must be at least 1, got " + std::to_string(options_.tries));
  if (options_.max_concurrent < 1)
    throw Error(base_url_ + ": max_concurrent must be at least 1, got " + std::to_string(options_.max_concurrent));
  if ((options_.text_prompts || options_.ids_from_logprob_tokens) && !tokenizer_)
    throw Error(base_url_ + ": text_prompts and ids_from_logprob_tokens need the model's tokenizer");
  if (!options_.extra.is_object()) throw Error(base_url_ + ": options.extra must be a JSON object");
  check_weight_transfer(options_, base_url_);
  if (options_.ids_from_logprob_tokens) {
    // Every id's own text, so a server's token strings can be mapped back only where unambiguous.
    for (int32_t id = 0; id < tokenizer_->vocab_size(); ++id) {
      std::string piece;
      try {
        piece = tokenizer_->decode(std::span<const int32_t>(&id, 1));
      } catch (const std::exception&) {
        continue;  // an unused id in a vocabulary with gaps
      }
      auto [it, fresh] = id_of_piece_.emplace(piece, id);
      if (!fresh) it->second = -1;
    }
  }
}

RemoteEngine::Reply RemoteEngine::send(const std::string& method, const std::string& path, const std::string& body) const {
  // A client per call: httplib serializes the requests of one client, and generate() runs
  // several at once.
  httplib::Client client(host_);
  set_timeout(client, options_.connect_timeout_s, &httplib::Client::set_connection_timeout);
  set_timeout(client, options_.timeout_s, &httplib::Client::set_read_timeout);
  set_timeout(client, options_.timeout_s, &httplib::Client::set_write_timeout);
  if (!options_.api_key.empty()) client.set_bearer_token_auth(options_.api_key);
  auto result = method == "GET" ? client.Get(prefix_ + path) : client.Post(prefix_ + path, body, "application/json");
  if (!result) return {0, "", describe(result.error(), options_)};
  return {result->status, result->body, ""};
}

std::string RemoteEngine::call(const std::string& method, const std::string& path, const std::string& body,
                               int tries) const {
  const std::string url = base_url_ + path;
  std::string problem;
  for (int attempt = 1; attempt <= tries; ++attempt) {
    if (attempt > 1)
      std::this_thread::sleep_for(std::chrono::duration<double>(options_.backoff_s * std::pow(2.0, attempt - 2)));
    Reply reply = send(method, path, body);
    if (!reply.transport_error.empty()) {
      problem = reply.transport_error;
      continue;
    }
    if (reply.status >= 500) {  // the server may recover (overloaded, restarting): try again
      problem = "HTTP " + std::to_string(reply.status) + " (" + server_message(reply.body) + ")";
      continue;
    }
    if (reply.status < 200 || reply.status >= 300)  // the request itself is wrong: retrying cannot help
      throw Error(url + ": HTTP " + std::to_string(reply.status) + ": " + server_message(reply.body));
    return reply.body;
  }
  throw Error(url + ": " + problem + " after " + std::to_string(tries) + (tries == 1 ? " try" : " tries"));
}

namespace {
json parse_answer(const std::string& body, const std::string& url) {
  auto j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error(url + ": the answer is not JSON: " + (body.empty() ? "(empty body)" : excerpt(body, 120)));
  return j;
}
}  // namespace

json RemoteEngine::post(const std::string& path, const json& body) const {
  return parse_answer(call("POST", path, body.dump(), options_.tries), base_url_ + path);
}

json RemoteEngine::get(const std::string& path) const {
  return parse_answer(call("GET", path, "", options_.tries), base_url_ + path);
}

bool RemoteEngine::health() const {
  Reply reply = send("GET", "/health", "");
  if (reply.status == 404) reply = send("GET", "/v1/models", "");  // llama-cpp-python has no /health
  return reply.transport_error.empty() && reply.status == 200;
}

void RemoteEngine::wait_healthy(double timeout_s) const {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!health()) {
    if (std::chrono::steady_clock::now() > deadline) {
      Reply last = send("GET", "/health", "");
      std::string why = !last.transport_error.empty() ? last.transport_error : "HTTP " + std::to_string(last.status);
      throw Error(base_url_ + "/health: not healthy after " + std::to_string(timeout_s) + " s: " + why);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

json RemoteEngine::completion_body(const std::vector<int32_t>& prompt, const SamplingParams& params, int64_t n,
                                   std::optional<uint64_t> seed) const {
  json body = {
      {"n", n},
      {"max_tokens", params.max_tokens},
      {"temperature", params.temperature},
      {"top_p", params.top_p},
      {"top_k", params.top_k > 0 ? params.top_k : -1},  // -1: vLLM's "disabled"
      {"min_p", params.min_p},
      {"logprobs", options_.logprobs},
      {"return_token_ids", true},
  };
  body["prompt"] = options_.text_prompts ? json(tokenizer_->decode(prompt)) : json(prompt);
  if (!options_.model.empty()) body["model"] = options_.model;
  if (seed) body["seed"] = *seed;
  // Sent only when set, so servers without these vLLM fields see a plain request.
  if (!params.stop.empty()) body["stop"] = params.stop;
  if (!params.stop_token_ids.empty()) body["stop_token_ids"] = params.stop_token_ids;
  if (params.include_stop_str_in_output) body["include_stop_str_in_output"] = true;
  if (params.ignore_eos) body["ignore_eos"] = true;
  body.update(options_.extra);
  return body;
}

std::vector<Completion> RemoteEngine::complete(uint64_t request_id, const std::vector<int32_t>& prompt,
                                               const SamplingParams& params) const {
  const std::string path = "/v1/completions";
  if (options_.text_prompts && tokenizer_->encode(tokenizer_->decode(prompt)) != prompt)
    throw Error(base_url_ + path + ": prompt " + std::to_string(request_id) +
                " does not re-encode to the same ids, so a server given its text would see other tokens; "
                "use a server that takes token-id prompts (text_prompts = false)");
  if (!options_.one_sample_per_request || params.n == 1) {
    auto answer = post(path, completion_body(prompt, params, params.n, params.seed));
    return parse_completions(answer, base_url_ + path, request_id, prompt, params, params.n);
  }
  std::vector<Completion> out;
  for (int64_t s = 0; s < params.n; ++s) {
    auto seed = params.seed ? std::optional<uint64_t>(*params.seed + s) : std::nullopt;
    auto one = parse_completions(post(path, completion_body(prompt, params, 1, seed)), base_url_ + path, request_id,
                                 prompt, params, 1);
    one[0].index = s;
    out.push_back(std::move(one[0]));
  }
  return out;
}

std::vector<int32_t> RemoteEngine::ids_from_tokens(const json& tokens, const std::string& url,
                                                   const std::string& where) const {
  Fields f{url};
  std::vector<int32_t> ids;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string name = where + "tokens[" + std::to_string(i) + "]";
    if (!tokens[i].is_string()) f.fail("the answer's '" + name + "' is not a string");
    auto it = id_of_piece_.find(tokens[i].get<std::string>());
    if (it == id_of_piece_.end() || it->second < 0)
      f.fail("the answer's '" + name + "' = " + tokens[i].dump() + " is the text of " +
             (it == id_of_piece_.end() ? "no vocabulary id" : "several vocabulary ids") +
             ", so its token id is unknown (the server returns no token_ids)");
    ids.push_back(it->second);
  }
  return ids;
}

std::vector<Completion> RemoteEngine::parse_completions(const json& answer, const std::string& url,
                                                        uint64_t request_id, const std::vector<int32_t>& prompt,
                                                        const SamplingParams& params, int64_t n) const {
  Fields f{url};
  const json& choices = f.array(answer, "", "choices");
  if ((int64_t)choices.size() != n)
    f.fail("asked for " + std::to_string(n) + " samples, the answer has " + std::to_string(choices.size()) +
           " in 'choices'" + (choices.size() == 1 ? " (servers that ignore n need one_sample_per_request)" : ""));
  std::vector<Completion> out(n);
  std::vector<bool> seen(n, false);
  for (size_t i = 0; i < choices.size(); ++i) {
    const json& c = choices[i];
    const std::string where = "choices[" + std::to_string(i) + "].";
    int64_t index = f.find(c, "index") ? f.integer(c["index"], where + "index") : (int64_t)i;
    if (index < 0 || index >= n || seen[index]) f.fail("the answer's '" + where + "index' is " + std::to_string(index));
    seen[index] = true;
    Completion& done = out[index];
    done.request_id = request_id;
    done.index = index;
    done.prompt_ids = prompt;

    // The server must have seen exactly our prompt: its ids when it returns them, else its count.
    if (const json* server_prompt = f.find(c, "prompt_token_ids")) {
      if (f.ids(*server_prompt, where + "prompt_token_ids") != prompt)
        f.fail("the server's '" + where + "prompt_token_ids' differ from the prompt sent");
    } else if (options_.text_prompts) {
      const json* usage = f.find(answer, "usage");
      const json* count = usage ? f.find(*usage, "prompt_tokens") : nullptr;
      if (!count) f.fail("the answer has neither '" + where + "prompt_token_ids' nor 'usage.prompt_tokens' to check the text prompt against");
      if (f.integer(*count, "usage.prompt_tokens") != (int64_t)prompt.size())
        f.fail("the server tokenized the prompt text into " + count->dump() + " tokens, the prompt has " +
               std::to_string(prompt.size()) + " (did it add a BOS token?)");
    }

    done.text = f.string(c, where, "text");
    const json& logprobs = f.need(c, where, "logprobs");
    const json& token_logprobs = f.array(logprobs, where + "logprobs.", "token_logprobs");
    done.logprobs = f.numbers(token_logprobs, where + "logprobs.token_logprobs");
    if (const json* ids = f.find(c, "token_ids")) {
      done.ids = f.ids(*ids, where + "token_ids");
    } else if (options_.ids_from_logprob_tokens) {
      done.ids = ids_from_tokens(f.array(logprobs, where + "logprobs.", "tokens"), url, where + "logprobs.");
    } else {
      f.fail("the answer has no '" + where + "token_ids': the server ignores vLLM's return_token_ids "
             "(llama.cpp's servers do); ids_from_logprob_tokens maps logprobs.tokens through the tokenizer instead");
    }
    if (done.ids.size() != done.logprobs.size())
      f.fail("the answer has " + std::to_string(done.ids.size()) + " token ids but " +
             std::to_string(done.logprobs.size()) + " entries in '" + where + "logprobs.token_logprobs'");

    done.finish_reason = parse_finish_reason(f.string(c, where, "finish_reason"), f, where);
    // vLLM's stop_reason: the stop token id, the stop string, or null for end-of-sequence.
    if (const json* stop_reason = f.find(c, "stop_reason"); stop_reason && done.finish_reason == FinishReason::stop) {
      if (stop_reason->is_number_integer()) done.stop_token = stop_reason->get<int32_t>();
      else if (stop_reason->is_string()) done.stop_string = stop_reason->get<std::string>();
    }
    bool eos_last = !done.ids.empty() && tokenizer_ && tokenizer_->eos_id() == done.ids.back();
    bool listed_last = !done.ids.empty() && std::ranges::count(params.stop_token_ids, done.ids.back()) > 0;
    if (done.finish_reason == FinishReason::stop && !done.stop_token && !done.stop_string && (eos_last || listed_last))
      done.stop_token = done.ids.back();

    // troupe serve reports the versions that produced each choice ("troupe": {min_version,
    // max_version}); for other servers the best knowledge is the version this client last pushed.
    done.min_version = done.max_version = version_;
    if (const json* ext = f.find(c, "troupe")) {
      done.min_version = f.integer(f.need(*ext, where + "troupe.", "min_version"), where + "troupe.min_version");
      done.max_version = f.integer(f.need(*ext, where + "troupe.", "max_version"), where + "troupe.max_version");
    }
  }
  return out;
}

std::vector<Completion> RemoteEngine::generate(const std::vector<std::vector<int32_t>>& prompts,
                                               const SamplingParams& params) {
  if (params.n < 1) throw Error(base_url_ + "/v1/completions: n must be at least 1, got " + std::to_string(params.n));
  std::vector<std::vector<Completion>> results(prompts.size());
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    while (!failed) {  // after one failure the others stop taking prompts
      size_t i = next++;
      if (i >= prompts.size()) return;
      try {
        results[i] = complete(i, prompts[i], params);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> workers;
  size_t count = std::min<size_t>(options_.max_concurrent, prompts.size());
  for (size_t w = 0; w + 1 < count; ++w) workers.emplace_back(work);
  work();
  for (auto& t : workers) t.join();
  if (error) std::rethrow_exception(error);

  std::vector<Completion> out;
  for (auto& r : results) std::move(r.begin(), r.end(), std::back_inserter(out));
  return out;
}

// ---------------------------------------------------------------- weight sync (vLLM 0.33.0)

// One try: a repeated start or update would open or fill another session.
std::string RemoteEngine::sync_post(const std::string& path, const json& body) const {
  return call("POST", path, body.dump(), 1);
}

// vLLM's NCCL routes answer only once rank 0 has joined the collective, so the request runs on
// a thread while `work` (rank 0's side) runs here. NCCL has no timeout: if `work` fails, the
// join waits for the request's read timeout; if the request fails, `work` must give up itself.
void RemoteEngine::post_during(const std::string& path, const json& body, const std::function<void()>& work) const {
  std::exception_ptr request_error, work_error;
  std::thread request([&] {
    try {
      sync_post(path, body);
    } catch (...) {
      request_error = std::current_exception();
    }
  });
  try {
    work();
  } catch (...) {
    work_error = std::current_exception();
  }
  request.join();
  if (work_error) std::rethrow_exception(work_error);
  if (request_error) std::rethrow_exception(request_error);
}

// The window around a load: mode=wait lets running requests finish and turns new ones away, so
// none spans two versions; the prefix cache is reset so none reuses keys of the old weights.
void RemoteEngine::sync_window(const std::function<void()>& load) const {
  sync_post("/pause?mode=wait", json::object());
  load();
  const std::string path = "/reset_prefix_cache", url = base_url_ + path;
  Fields f{url};
  json answer = parse_answer(sync_post(path, json::object()), url);
  const json& success = f.need(answer, "", "success");
  if (!success.is_boolean()) f.fail("the answer's 'success' is not a boolean: " + excerpt(success.dump(), 80));
  if (!success.get<bool>())
    f.fail("the answer's 'success' is false: blocks are still held, so prefixes cached under the old weights may be reused");
  sync_post("/resume", json::object());
}

void RemoteEngine::sync_reload(const fs::path& dir, int64_t version) const {
  sync_window([&] {
    sync_post("/collective_rpc", {{"method", "reload_weights"}, {"kwargs", json{{"weights_path", dir.string()}}}});
    sync_post("/update_weight_version", {{"new_version", std::to_string(version)}});
  });
}

void RemoteEngine::sync_disk(const fs::path& dir, int64_t version) {
  if (!transfer_ready_) {  // the disk backend needs no rendezvous: its init_info has no fields
    sync_post("/init_weight_transfer_engine", {{"init_info", json::object()}});
    transfer_ready_ = true;
  }
  sync_window([&] {
    sync_post("/start_weight_update", json::object());
    sync_post("/update_weights", {{"update_info", json{{"path", dir.string()}}}});
    sync_post("/finish_weight_update", {{"weight_version", std::to_string(version)}});
  });
}

// Rank 0 is this process; the server's workers follow at rank_offset 1.
void RemoteEngine::init_nccl() {
  const std::string path = "/get_world_size", url = base_url_ + path;
  Fields f{url};
  const json answer = get(path);
  const int64_t world_size = 1 + f.integer(f.need(answer, "", "world_size"), "world_size");
  json info = {{"nccl_unique_id_b64", base64(options_.nccl.unique_id)},
               {"rank_offset", 1},
               {"world_size", world_size},
               {"packed", false}};
  post_during("/init_weight_transfer_engine", {{"init_info", info}}, [&] { options_.nccl.connect(world_size); });
  transfer_ready_ = true;
}

void RemoteEngine::sync_nccl(const std::map<std::string, torch::Tensor>& weights, int64_t version) {
  json names = json::array(), dtype_names = json::array(), shapes = json::array();
  std::vector<torch::Tensor> tensors;  // in names order: the server cuts the stream by it
  for (const auto& [name, tensor] : weights) {
    names.push_back(name);
    dtype_names.push_back(wire_dtype(tensor, name).torch_name);
    shapes.push_back(tensor.sizes().vec());
    tensors.push_back(tensor.detach().contiguous());
  }
  json update_info = {{"names", names}, {"dtype_names", dtype_names}, {"shapes", shapes}};
  if (!transfer_ready_) init_nccl();
  sync_window([&] {
    sync_post("/start_weight_update", json::object());
    post_during("/update_weights", {{"update_info", update_info}}, [&] {
      for (const auto& t : tensors) options_.nccl.broadcast(t);
    });
    sync_post("/finish_weight_update", {{"weight_version", std::to_string(version)}});
  });
}

void RemoteEngine::update_weights(const std::map<std::string, torch::Tensor>& weights, int64_t version,
                                  const fs::path& dir) {
  if (options_.weight_transfer == "nccl") sync_nccl(weights, version);
  else if (options_.weight_transfer == "disk") sync_disk(write_checkpoint(weights, dir), version);
  else sync_reload(write_checkpoint(weights, dir), version);
  version_ = version;
}

}  // namespace troupe
