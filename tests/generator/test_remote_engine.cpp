// RemoteEngine against servers it shares no code with: a fake vLLM in this file (error paths,
// retries, answer parsing, vLLM 0.33.0's weight-sync routes), llama-cpp-python's server, and
// `troupe serve` (generation, and weights pushed by reload and by the disk backend).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "generator/engine.hpp"
#include "generator/remote_engine.hpp"
#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "tests/test_util.hpp"

using namespace troupe;
namespace fs = std::filesystem;
using json = nlohmann::json;

extern char** environ;

namespace {

// ---------------------------------------------------------------- a fake vLLM server

// Answers every request with `handler(request, response, call number from 1)` and records them.
struct FakeServer {
  using Handler = std::function<void(const httplib::Request&, httplib::Response&, int)>;
  httplib::Server http;
  std::thread thread;
  int port = 0;
  std::mutex mutex;
  std::vector<std::pair<std::string, json>> requests;  // (path, body or null)
  std::vector<json> queries;                           // each request's query parameters, as strings
  std::vector<std::string> authorizations;

  explicit FakeServer(Handler handler) {
    auto record = [this, handler](const httplib::Request& req, httplib::Response& res) {
      int call;
      {
        std::lock_guard lock(mutex);
        requests.emplace_back(req.path, json::parse(req.body, nullptr, false));
        json query = json::object();
        for (const auto& [key, value] : req.params) query[key] = value;
        queries.push_back(query);
        authorizations.push_back(req.get_header_value("Authorization"));
        call = static_cast<int>(requests.size());
      }
      handler(req, res, call);
    };
    http.Post(".*", record);
    http.Get(".*", record);
    port = http.bind_to_any_port("127.0.0.1");
    REQUIRE(port > 0);
    thread = std::thread([this] { http.listen_after_bind(); });
    // stop() is a no-op before the accept loop runs, so wait for it.
    while (!http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeServer() {
    http.stop();
    thread.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port); }
  int calls() {
    std::lock_guard lock(mutex);
    return static_cast<int>(requests.size());
  }
  std::vector<std::string> paths() {
    std::lock_guard lock(mutex);
    std::vector<std::string> out;
    for (const auto& r : requests) out.push_back(r.first);
    return out;
  }
  bool received(const std::string& path) {
    std::lock_guard lock(mutex);
    return std::any_of(requests.begin(), requests.end(), [&](const auto& r) { return r.first == path; });
  }
};

void reply_json(httplib::Response& res, const json& body, int status = 200) {
  res.status = status;
  res.set_content(body.dump(), "application/json");
}

// A vLLM /v1/completions choice with return_token_ids and logprobs = 0.
json vllm_choice(int index, std::vector<int> ids, std::vector<float> logprobs, const std::string& finish,
                 json stop_reason = nullptr) {
  return {{"index", index},
          {"text", "t" + std::to_string(index)},
          {"logprobs", {{"tokens", json::array()}, {"token_logprobs", logprobs}, {"top_logprobs", nullptr}}},
          {"finish_reason", finish},
          {"stop_reason", stop_reason},
          {"token_ids", ids},
          {"prompt_token_ids", nullptr}};
}

// A well-formed answer of n samples: sample s of a prompt is [first + s, 7] with log-probs -0.5, -1.
json vllm_answer(const json& request) {
  json choices = json::array();
  int first = request["prompt"].is_array() ? request["prompt"][0].get<int>() : 0;
  for (int s = request["n"].get<int>() - 1; s >= 0; --s)  // reversed: the client must sort by index
    choices.push_back(vllm_choice(s, {first + s, 7}, {-0.5f, -1.0f}, "length"));
  return {{"id", "cmpl-1"}, {"object", "text_completion"}, {"choices", choices}};
}

// vLLM 0.33.0's weight-sync routes as its source defines them (vllm/entrypoints/rl/online/
// api_router.py, serve/dev/cache and serve/dev/rpc): their answers, and the 400 of its validation
// handler for a missing or mistyped body field. Returns false for any other route.
bool vllm_weight_route(const httplib::Request& req, httplib::Response& res) {
  const json body = req.body.empty() ? json::object() : json::parse(req.body, nullptr, false);
  auto invalid = [&](const std::string& param) {
    reply_json(res, {{"error", {{"message", "1 validation error"}, {"type", "Bad Request"}, {"param", param}, {"code", 400}}}}, 400);
    return true;
  };
  auto member = [&](const char* key) { return body.is_object() && body.contains(key) ? body[key] : json(); };
  const std::string& path = req.path;
  if (path == "/pause") {
    const std::string mode = req.has_param("mode") ? req.get_param_value("mode") : "abort";
    if (mode != "abort" && mode != "wait" && mode != "keep") return invalid("query.mode");
    reply_json(res, {{"status", "paused"}});
  } else if (path == "/resume") {
    reply_json(res, {{"status", "resumed"}});
  } else if (path == "/init_weight_transfer_engine") {
    if (!member("init_info").is_object()) return invalid("body.init_info");
    reply_json(res, {{"message", "Weight transfer initialized"}});
  } else if (path == "/start_weight_update") {
    reply_json(res, {{"message", "Weight update started"}});
  } else if (path == "/update_weights") {
    if (!member("update_info").is_object() && !member("update_info").is_array()) return invalid("body.update_info");
    reply_json(res, {{"message", "Weights updated"}});
  } else if (path == "/finish_weight_update") {
    if (!member("weight_version").is_null() && !member("weight_version").is_string()) return invalid("body.weight_version");
    reply_json(res, {{"message", "Weight update finished"}});
  } else if (path == "/update_weight_version") {
    if (!member("new_version").is_string()) return invalid("body.new_version");
    reply_json(res, {{"success", true}, {"new_version", member("new_version")}});
  } else if (path == "/reset_prefix_cache") {
    reply_json(res, {{"success", true}});
  } else if (path == "/collective_rpc") {
    if (member("method").is_string()) reply_json(res, {{"results", json::array({nullptr})}});
    else reply_json(res, {{"detail", "Missing 'method' in request body"}}, 400);
  } else if (path == "/get_world_size") {
    reply_json(res, {{"world_size", 1}});
  } else {
    return false;
  }
  return true;
}

// A fake vLLM that generates and takes weights.
FakeServer::Handler vllm_with_weight_routes() {
  return [](const httplib::Request& req, httplib::Response& res, int) {
    if (req.path == "/v1/completions") return reply_json(res, vllm_answer(json::parse(req.body)));
    if (!vllm_weight_route(req, res)) res.status = 404;
  };
}

// Two tensors in the dtypes vLLM names "float32" and "bfloat16".
std::map<std::string, torch::Tensor> two_tensors() {
  return {{"model.layers.0.mlp.up_proj.weight", torch::arange(6, torch::kFloat32).reshape({2, 3})},
          {"model.norm.weight", torch::tensor({1.5, -2.0}, torch::kBFloat16)}};
}

// The folder update_weights wrote holds exactly `weights`, dtypes included.
void check_checkpoint(const fs::path& sent, const fs::path& dir, const std::map<std::string, torch::Tensor>& weights) {
  CHECK(sent.is_absolute());
  CHECK(fs::equivalent(sent, dir));
  auto checkpoint = safetensors::Checkpoint::open_dir(sent);
  auto read = read_safetensors(checkpoint);
  REQUIRE(read.size() == weights.size());
  for (const auto& [name, t] : weights) {
    CAPTURE(name);
    CHECK((read.at(name).scalar_type() == t.scalar_type()));
    CHECK(torch::equal(read.at(name), t));
  }
}

// A port nobody listens on (bound, then released).
int unused_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  FAIL("no troupe::Error was thrown");
  return "";
}

// Q4_1 in llama.cpp's quantized arithmetic against float32: per-token log-prob differences seen
// were at most 0.37 nats and 0.08 on average per prompt; a wrong token id costs several nats.
constexpr double kQuantizationNoise = 0.75;
constexpr double kMeanQuantizationNoise = 0.2;

RemoteOptions fast_retries() { return {.tries = 3, .backoff_s = 0.01}; }

// ---------------------------------------------------------------- child processes

// A server started as a separate process (its own process group), stdout and stderr in `log`.
struct ChildProcess {
  pid_t pid = -1;
  fs::path log;

  ChildProcess(std::vector<std::string> argv_s, fs::path log_path) : log(std::move(log_path)) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);  // its children die with it
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    REQUIRE_MESSAGE(rc == 0, "cannot start " << argv_s[0] << ": " << std::strerror(rc));
  }
  ~ChildProcess() {
    if (pid <= 0) return;
    kill(-pid, SIGTERM);
    for (int i = 0; i < 100 && waitpid(pid, nullptr, WNOHANG) == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    kill(-pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  bool running() const { return waitpid(pid, nullptr, WNOHANG) == 0; }
  std::string output() const {
    std::ifstream in(log);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
};

fs::path temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("troupe_test_remote_" + std::to_string(getpid())) / name;
  fs::create_directories(dir);
  return dir;
}

fs::path python() {
  if (const char* p = std::getenv("TROUPE_PYTHON"); p && *p) return p;
  return test::source() / ".venv" / "bin" / "python";
}

// Waits for the child's health, failing with its output if it dies or never answers.
void wait_for(const RemoteEngine& remote, const ChildProcess& child, double seconds) {
  for (int i = 0; i < seconds * 5; ++i) {
    if (remote.health()) return;
    REQUIRE_MESSAGE(child.running(), "the server exited; its output:\n" << child.output());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  FAIL("the server did not answer " << remote.base_url() << " within " << seconds << " s; its output:\n"
                                    << child.output());
}

std::vector<std::vector<int32_t>> smollm2_prompts(const Tokenizer& tok) {
  const std::string chat = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                           "<|im_end|>\n<|im_start|>user\n";
  return {tok.encode(chat + "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
          tok.encode(chat + "Write a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"),
          tok.encode("The three primary colors are"),
          tok.encode("def fibonacci(n):\n")};
}

// log_softmax(logits) of each of `ids` after `prompt`, from one forward pass over both.
std::vector<float> teacher_forced_logprobs(TransformerImpl& model, const std::vector<int32_t>& prompt,
                                           const std::vector<int32_t>& ids) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> all(prompt.begin(), prompt.end());
  all.insert(all.end(), ids.begin(), ids.end());
  const int64_t P = prompt.size(), L = ids.size();
  auto hidden = model.forward(torch::tensor(all).unsqueeze(0), torch::arange((int64_t)all.size()).unsqueeze(0));
  auto logp = model.logits(hidden[0].narrow(0, P - 1, L)).log_softmax(-1);  // (L, V): row t predicts ids[t]
  auto target = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end())).unsqueeze(1);
  auto picked = logp.gather(1, target).squeeze(1).contiguous();
  return std::vector<float>(picked.data_ptr<float>(), picked.data_ptr<float>() + L);
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return k;
}

// After `pusher` pushes `weights` as `version` (and the local engine takes them too), the
// server's greedy tokens and log-probs are the local engine's under the new weights.
struct PushCheck {
  RemoteEngine& pusher;
  RemoteEngine& reader;
  Engine& local;
  const std::vector<std::vector<int32_t>>& prompts;
  const SamplingParams& params;
};

std::vector<Completion> push_and_compare(const PushCheck& c, const std::map<std::string, torch::Tensor>& weights,
                                         int64_t version) {
  c.pusher.update_weights(weights, version, temp_dir("serve") / ("weights_v" + std::to_string(version)));
  c.local.update_weights(weights, version);
  CHECK(c.pusher.version() == version);
  CHECK(c.reader.get("/is_paused")["is_paused"] == false);  // the window closed with /resume
  CHECK(c.reader.get("/weight_info")["weight_version"] == version);
  auto after = c.reader.generate(c.prompts, c.params);
  auto reference = c.local.generate(c.prompts, c.params);
  REQUIRE(after.size() == reference.size());
  for (size_t i = 0; i < after.size(); ++i) {
    CAPTURE(version);
    CAPTURE(i);
    CHECK(after[i].ids == reference[i].ids);
    REQUIRE(after[i].logprobs.size() == reference[i].logprobs.size());
    for (size_t t = 0; t < after[i].logprobs.size(); ++t)
      CHECK(after[i].logprobs[t] == doctest::Approx(reference[i].logprobs[t]).epsilon(1e-3));
    CHECK(after[i].min_version == version);
    CHECK(after[i].max_version == version);
  }
  return after;
}

}  // namespace

// ---------------------------------------------------------------- error paths and parsing

TEST_CASE("a server that is down: the error names the URL and the tries") {
  const std::string url = "http://127.0.0.1:" + std::to_string(unused_port());
  RemoteEngine remote(url, fast_retries());
  CHECK_FALSE(remote.health());
  CHECK(error_of([&] { remote.generate({{1, 2, 3}}, {}); }) ==
        url + "/v1/completions: cannot connect (connection refused or host unreachable) after 3 tries");
  // A weight-sync step is tried once: a second start or update could open or fill another session.
  auto weights_error = error_of([&] { remote.update_weights({{"w", torch::ones({2})}}, 1, temp_dir("down")); });
  CHECK(weights_error == url + "/pause?mode=wait: cannot connect (connection refused or host unreachable) after 1 try");
  CHECK(remote.version() == 0);  // nothing was pushed
  auto waited = error_of([&] { remote.wait_healthy(0.3); });
  CHECK(waited.starts_with(url + "/health: not healthy after"));
}

TEST_CASE("bad URLs and options are refused up front") {
  CHECK(error_of([] { RemoteEngine("localhost:8000"); }).find("expected http://host:port") != std::string::npos);
  CHECK(error_of([] { RemoteEngine("http://"); }).find("expected http://host:port") != std::string::npos);
  CHECK(error_of([] { RemoteEngine("http://h:1", {.tries = 0}); }).find("tries") != std::string::npos);
  CHECK(error_of([] { RemoteEngine("http://h:1", {.text_prompts = true}); }).find("tokenizer") != std::string::npos);
  CHECK(error_of([] { RemoteEngine("http://h:1", {.weight_transfer = "ftp"}); }) ==
        "http://h:1: weight_transfer must be reload, disk or nccl, got 'ftp'");
}

TEST_CASE("a vLLM answer fills Completion like the engine: order, ids, log-probs, stop reasons") {
  FakeServer server([](const httplib::Request& req, httplib::Response& res, int) {
    json request = json::parse(req.body);
    json answer = vllm_answer(request);
    if (request["prompt"][0] == 30) {  // stopped by a stop token and by a stop string
      answer["choices"][0] = vllm_choice(1, {31, 5}, {-0.1f, -0.2f}, "stop", 5);
      answer["choices"][1] = vllm_choice(0, {30, 6}, {-0.3f, -0.4f}, "stop", "xy");
    }
    if (request["prompt"][0] == 40)  // troupe serve's versions
      for (auto& c : answer["choices"]) c["troupe"] = {{"min_version", 3}, {"max_version", 4}};
    reply_json(res, answer);
  });
  RemoteOptions options = fast_retries();
  options.api_key = "secret";
  options.model = "smol";
  options.max_concurrent = 2;
  RemoteEngine remote(server.url() + "/", options);  // a trailing slash is fine
  CHECK(remote.base_url() == server.url());
  SamplingParams params{.n = 2, .temperature = 0.7, .top_p = 0.9, .max_tokens = 5, .stop_token_ids = {5},
                        .stop = {"xy"}, .seed = 11};
  auto out = remote.generate({{20, 1}, {30, 1, 2}, {40}}, params);

  REQUIRE(out.size() == 6);
  for (size_t i = 0; i < out.size(); ++i) {
    CAPTURE(i);
    CHECK(out[i].request_id == i / 2);
    CHECK(out[i].index == (int64_t)(i % 2));
  }
  CHECK(out[0].prompt_ids == std::vector<int32_t>{20, 1});
  CHECK(out[1].ids == std::vector<int32_t>{21, 7});
  CHECK(out[1].logprobs == std::vector<float>{-0.5f, -1.0f});
  CHECK(out[1].finish_reason == FinishReason::length);
  CHECK(out[1].text == "t1");
  CHECK(out[2].stop_string == "xy");
  CHECK_FALSE(out[2].stop_token);
  CHECK(out[3].stop_token == 5);
  CHECK(out[3].finish_reason == FinishReason::stop);
  CHECK(out[0].min_version == 0);
  CHECK(out[0].max_version == 0);
  CHECK(out[4].min_version == 3);
  CHECK(out[5].max_version == 4);

  // What went over the wire: vLLM's field names, token-id prompts, one request per prompt.
  REQUIRE(server.requests.size() == 3);
  for (const auto& [path, body] : server.requests) {
    CHECK(path == "/v1/completions");
    CHECK(body["model"] == "smol");
    CHECK(body["n"] == 2);
    CHECK(body["return_token_ids"] == true);
    CHECK(body["logprobs"] == 0);
    CHECK(body["top_k"] == -1);
    CHECK(body["seed"] == 11);
    CHECK(body["stop"] == json::array({"xy"}));
    CHECK(body["stop_token_ids"] == json::array({5}));
    CHECK(body["prompt"].is_array());
    CHECK_FALSE(body.contains("ignore_eos"));
  }
  for (const auto& a : server.authorizations) CHECK(a == "Bearer secret");
}

TEST_CASE("garbage answers are errors naming the URL and the field") {
  struct Case {
    std::string name;
    std::function<void(httplib::Response&)> answer;
    std::string expected;
  };
  auto with_choice = [](std::function<void(json&)> edit) {
    return [edit](httplib::Response& res) {
      json a = {{"choices", {vllm_choice(0, {1, 2}, {-0.5f, -1.0f}, "length")}}};
      edit(a["choices"][0]);
      reply_json(res, a);
    };
  };
  std::vector<Case> cases = {
      {"not JSON", [](auto& res) { res.set_content("<html>hello</html>", "text/html"); },
       "the answer is not JSON: <html>hello</html>"},
      {"empty body", [](auto& res) { res.set_content("", "application/json"); }, "the answer is not JSON: (empty body)"},
      {"no choices", [](auto& res) { reply_json(res, {{"id", "x"}}); }, "the answer has no 'choices'"},
      {"choices not an array", [](auto& res) { reply_json(res, {{"choices", 3}}); }, "'choices' is not an array"},
      {"no token_ids", with_choice([](json& c) { c.erase("token_ids"); }),
       "the answer has no 'choices[0].token_ids': the server ignores vLLM's return_token_ids"},
      {"token id not an integer", with_choice([](json& c) { c["token_ids"][1] = "two"; }),
       "'choices[0].token_ids[1]' is not an integer"},
      {"negative token id", with_choice([](json& c) { c["token_ids"][0] = -4; }),
       "'choices[0].token_ids[0]' is not a token id: -4"},
      {"no logprobs", with_choice([](json& c) { c["logprobs"] = nullptr; }), "the answer has no 'choices[0].logprobs'"},
      {"no token_logprobs", with_choice([](json& c) { c["logprobs"].erase("token_logprobs"); }),
       "the answer has no 'choices[0].logprobs.token_logprobs'"},
      {"log-prob not a number", with_choice([](json& c) { c["logprobs"]["token_logprobs"][1] = "x"; }),
       "'choices[0].logprobs.token_logprobs[1]' is not a number"},
      {"lengths differ", with_choice([](json& c) { c["logprobs"]["token_logprobs"] = {-1.0}; }),
       "the answer has 2 token ids but 1 entries in 'choices[0].logprobs.token_logprobs'"},
      {"no text", with_choice([](json& c) { c.erase("text"); }), "the answer has no 'choices[0].text'"},
      {"bad finish reason", with_choice([](json& c) { c["finish_reason"] = "tired"; }),
       "'choices[0].finish_reason' is 'tired', expected stop, length or abort"},
      {"prompt ids differ", with_choice([](json& c) { c["prompt_token_ids"] = {9, 9}; }),
       "the server's 'choices[0].prompt_token_ids' differ from the prompt sent"},
      {"bad index", with_choice([](json& c) { c["index"] = 5; }), "the answer's 'choices[0].index' is 5"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    FakeServer server([&](const httplib::Request&, httplib::Response& res, int) { c.answer(res); });
    RemoteEngine remote(server.url(), fast_retries());
    auto message = error_of([&] { remote.generate({{1, 2, 3}}, {.max_tokens = 2}); });
    CHECK(message.starts_with(server.url() + "/v1/completions: "));
    CHECK_MESSAGE(message.find(c.expected) != std::string::npos, message);
    CHECK(server.calls() == 1);  // a garbage answer is not retried
  }
}

TEST_CASE("a server that ignores n is caught, or asked once per sample") {
  FakeServer server([](const httplib::Request& req, httplib::Response& res, int) {
    json request = json::parse(req.body);
    request["n"] = 1;  // like llama-cpp-python: n is dropped
    reply_json(res, vllm_answer(request));
  });
  RemoteEngine plain(server.url(), fast_retries());
  auto message = error_of([&] { plain.generate({{4, 4}}, {.n = 3, .seed = 100}); });
  CHECK(message.find("asked for 3 samples, the answer has 1 in 'choices' (servers that ignore n need "
                     "one_sample_per_request)") != std::string::npos);

  RemoteOptions options = fast_retries();
  options.one_sample_per_request = true;
  RemoteEngine split(server.url(), options);
  int before = server.calls();
  auto out = split.generate({{4, 4}}, {.n = 3, .seed = 100});
  REQUIRE(out.size() == 3);
  CHECK(server.calls() - before == 3);
  for (int s = 0; s < 3; ++s) {
    CHECK(out[s].index == s);
    CHECK(server.requests[before + s].second["seed"] == 100 + s);  // distinct samples, reproducible
    CHECK(server.requests[before + s].second["n"] == 1);
  }
}

TEST_CASE("5xx and timeouts are retried with backoff; 4xx are not") {
  SUBCASE("500, then 200: the second try answers") {
    FakeServer server([](const httplib::Request& req, httplib::Response& res, int call) {
      if (call == 1) return reply_json(res, {{"error", {{"message", "warming up"}}}}, 500);
      reply_json(res, vllm_answer(json::parse(req.body)));
    });
    RemoteEngine remote(server.url(), fast_retries());
    auto out = remote.generate({{3}}, {});
    CHECK(server.calls() == 2);
    REQUIRE(out.size() == 1);
    CHECK(out[0].ids == std::vector<int32_t>{3, 7});
  }
  SUBCASE("503 every time: the last answer is in the error") {
    FakeServer server([](const httplib::Request&, httplib::Response& res, int) {
      reply_json(res, {{"error", {{"message", "overloaded"}}}}, 503);
    });
    RemoteEngine remote(server.url(), fast_retries());
    CHECK(error_of([&] { remote.generate({{3}}, {}); }) ==
          server.url() + "/v1/completions: HTTP 503 (\"overloaded\") after 3 tries");
    CHECK(server.calls() == 3);
  }
  SUBCASE("400: the request is wrong, so it is not sent again") {
    FakeServer server([](const httplib::Request&, httplib::Response& res, int) {
      reply_json(res, {{"error", {{"message", "top_k must be -1 or at least 1"}, {"type", "BadRequestError"}}}}, 400);
    });
    RemoteEngine remote(server.url(), fast_retries());
    CHECK(error_of([&] { remote.generate({{3}}, {}); }) ==
          server.url() + "/v1/completions: HTTP 400: \"top_k must be -1 or at least 1\"");
    CHECK(server.calls() == 1);
  }
  SUBCASE("FastAPI's 422 detail is shown") {
    FakeServer server([](const httplib::Request&, httplib::Response& res, int) {
      reply_json(res, {{"detail", "prompt: Input should be a valid string"}}, 422);
    });
    RemoteEngine remote(server.url(), fast_retries());
    CHECK(error_of([&] { remote.generate({{3}}, {}); }).ends_with("HTTP 422: prompt: Input should be a valid string"));
  }
  SUBCASE("a read timeout is retried and then reported") {
    FakeServer server([](const httplib::Request&, httplib::Response& res, int) {
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      reply_json(res, {});
    });
    RemoteOptions options = fast_retries();
    options.tries = 2;
    options.timeout_s = 0.1;
    RemoteEngine remote(server.url(), options);
    auto message = error_of([&] { remote.generate({{3}}, {}); });
    CHECK(message.find("no complete answer within") != std::string::npos);
    CHECK(message.ends_with("after 2 tries"));
  }
}

TEST_CASE("reload, the default: a safetensors folder, then vLLM's disk reload inside its pause window") {
  FakeServer server(vllm_with_weight_routes());
  RemoteEngine remote(server.url(), fast_retries());
  const auto weights = two_tensors();
  const auto dir = temp_dir("reload") / "v7";
  remote.update_weights(weights, 7, dir);
  CHECK(remote.version() == 7);

  const std::vector<std::string> window = {"/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache",
                                           "/resume"};
  REQUIRE(server.paths() == window);
  CHECK(server.queries[0] == json{{"mode", "wait"}});  // running requests finish; new ones get 503
  for (size_t i = 1; i < window.size(); ++i) CHECK(server.queries[i] == json::object());
  const std::string sent = fs::absolute(dir).lexically_normal().string();  // absolute: the server resolves nothing
  CHECK(server.requests[1].second == json{{"method", "reload_weights"}, {"kwargs", {{"weights_path", sent}}}});
  check_checkpoint(sent, dir, weights);
  CHECK(server.requests[2].second == json{{"new_version", "7"}});  // vLLM's versions are strings
  for (size_t i : {0, 3, 4}) CHECK(server.requests[i].second == json::object());

  // A server that reports no versions: completions carry the version last pushed.
  auto out = remote.generate({{1}}, {});
  CHECK(out[0].min_version == 7);
  CHECK(out[0].max_version == 7);
  remote.update_weights(weights, 8, temp_dir("reload") / "v8");  // every push is the same window
  auto paths = server.paths();
  CHECK(std::vector<std::string>(paths.begin() + 6, paths.end()) == window);
  CHECK(server.requests[8].second == json{{"new_version", "8"}});
}

TEST_CASE("disk: vLLM's weight-transfer protocol, init once, then start, update {path}, finish per push") {
  FakeServer server(vllm_with_weight_routes());
  RemoteOptions options = fast_retries();
  options.weight_transfer = "disk";
  RemoteEngine remote(server.url(), options);
  const auto weights = two_tensors();
  remote.update_weights(weights, 7, temp_dir("disk") / "v7");
  remote.update_weights(weights, 8, temp_dir("disk") / "v8");
  CHECK(remote.version() == 8);

  const std::vector<std::string> push = {"/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                                         "/reset_prefix_cache", "/resume"};
  std::vector<std::string> expected = {"/init_weight_transfer_engine"};
  for (int i = 0; i < 2; ++i) expected.insert(expected.end(), push.begin(), push.end());
  REQUIRE(server.paths() == expected);
  CHECK(server.requests[0].second == json{{"init_info", json::object()}});  // the disk backend has no init fields
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    const size_t at = 1 + round * push.size();
    CHECK(server.queries[at] == json{{"mode", "wait"}});
    CHECK(server.requests[at + 1].second == json::object());
    const fs::path dir = temp_dir("disk") / (round ? "v8" : "v7");
    CHECK(server.requests[at + 2].second == json{{"update_info", {{"path", dir.lexically_normal().string()}}}});
    check_checkpoint(dir, dir, weights);
    CHECK(server.requests[at + 3].second == json{{"weight_version", round ? "8" : "7"}});
    CHECK(server.requests[at + 4].second == json::object());
  }
}

TEST_CASE("nccl: refused without a CUDA device; with one, vLLM's handshake around the caller's broadcasts") {
  RemoteOptions options = fast_retries();
  options.weight_transfer = "nccl";
  if (!torch::cuda::is_available()) {
    CHECK(error_of([&] { RemoteEngine("http://127.0.0.1:1", options); }) ==
          "http://127.0.0.1:1: NCCL weight transfer needs a CUDA device, and none is visible; on CPU use "
          "weight_transfer = \"reload\" (any vLLM) or \"disk\"");
    return;
  }
  CHECK(error_of([&] { RemoteEngine("http://127.0.0.1:1", options); }).find("needs nccl.connect") != std::string::npos);

  // vLLM's init and update answer only once rank 0 has joined and broadcast everything, and
  // rank 0 can do neither before the server is in the call: both sides wait for the other here.
  std::atomic<int64_t> joined{0};
  std::atomic<size_t> sent{0}, updates{0};
  auto wait_until = [](const std::function<bool()>& done) {
    for (int i = 0; i < 1000 && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return done();
  };
  FakeServer server([&](const httplib::Request& req, httplib::Response& res, int) {
    if (req.path == "/init_weight_transfer_engine" && !wait_until([&] { return joined != 0; })) return reply_json(res, {}, 500);
    if (req.path == "/update_weights") {
      const size_t want = 2 * ++updates;  // both tensors of this push
      if (!wait_until([&] { return sent >= want; })) return reply_json(res, {}, 500);
    }
    if (!vllm_weight_route(req, res)) res.status = 404;
  });
  std::vector<torch::Tensor> broadcasts;
  bool concurrent = true;
  for (int i = 0; i < 128; ++i) options.nccl.unique_id += static_cast<char>((i * 37 + 11) % 256);
  options.nccl.connect = [&](int64_t world_size) {
    concurrent = concurrent && wait_until([&] { return server.received("/init_weight_transfer_engine"); });
    joined = world_size;
  };
  options.nccl.broadcast = [&](const torch::Tensor& t) {
    concurrent = concurrent && wait_until([&] { return server.received("/update_weights"); });
    broadcasts.push_back(t.clone());
    ++sent;
  };
  RemoteEngine remote(server.url(), options);
  const auto weights = two_tensors();
  remote.update_weights(weights, 7, temp_dir("nccl"));
  CHECK(concurrent);
  CHECK(joined == 2);  // this process and the server's one worker

  const std::vector<std::string> expected = {"/get_world_size", "/init_weight_transfer_engine", "/pause",
                                             "/start_weight_update", "/update_weights", "/finish_weight_update",
                                             "/reset_prefix_cache", "/resume"};
  REQUIRE(server.paths() == expected);
  const std::string uid_b64 = "CzBVep/E6Q4zWH2ix+wRNluApcrvFDleg6jN8hc8YYar0PUaP2SJrtP4HUJnjLHW+yBFao+02f4jSG2St9wBJktw"
                              "lbrfBClOc5i94gcsUXabwOUKL1R5nsPoDTJXfKHG6xA1Wn+kye4TOF2Cp8zxFjtgharP9Bk+Y4it0vccQWY=";
  CHECK(server.requests[1].second ==
        json{{"init_info", {{"nccl_unique_id_b64", uid_b64}, {"rank_offset", 1}, {"world_size", 2}, {"packed", false}}}});
  CHECK(server.queries[2] == json{{"mode", "wait"}});
  CHECK(server.requests[4].second ==
        json{{"update_info", {{"names", {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}},
                              {"dtype_names", {"float32", "bfloat16"}},
                              {"shapes", {{2, 3}, {2}}}}}});
  CHECK(server.requests[5].second == json{{"weight_version", "7"}});
  REQUIRE(broadcasts.size() == 2);  // in names order, the bytes as given
  CHECK(torch::equal(broadcasts[0], weights.at("model.layers.0.mlp.up_proj.weight")));
  CHECK(torch::equal(broadcasts[1], weights.at("model.norm.weight")));

  remote.update_weights(weights, 8, temp_dir("nccl"));  // joined once: no second rendezvous
  CHECK(server.calls() == 8 + 6);
}

TEST_CASE("a refused weight update names the route and keeps the old version; the server stays paused") {
  SUBCASE("reload: /collective_rpc answers 400") {
    FakeServer server([](const httplib::Request& req, httplib::Response& res, int) {
      if (req.path == "/collective_rpc") return reply_json(res, {{"error", {{"message", "no such tensor"}}}}, 400);
      vllm_weight_route(req, res);
    });
    RemoteEngine remote(server.url(), fast_retries());
    auto message = error_of([&] { remote.update_weights({{"x", torch::ones({1})}}, 2, temp_dir("refused")); });
    CHECK(message == server.url() + "/collective_rpc: HTTP 400: \"no such tensor\"");
    CHECK(remote.version() == 0);
    CHECK(server.paths() == std::vector<std::string>{"/pause", "/collective_rpc"});  // no version, no resume
  }
  SUBCASE("disk: a 5xx is not retried, since a second start could open a second session") {
    FakeServer server([](const httplib::Request& req, httplib::Response& res, int) {
      if (req.path == "/start_weight_update") return reply_json(res, {{"error", {{"message", "already active"}}}}, 500);
      vllm_weight_route(req, res);
    });
    RemoteOptions options = fast_retries();
    options.weight_transfer = "disk";
    RemoteEngine remote(server.url(), options);
    auto message = error_of([&] { remote.update_weights({{"x", torch::ones({1})}}, 2, temp_dir("refused")); });
    CHECK(message == server.url() + "/start_weight_update: HTTP 500 (\"already active\") after 1 try");
    CHECK(remote.version() == 0);
    CHECK(server.paths() == std::vector<std::string>{"/init_weight_transfer_engine", "/pause", "/start_weight_update"});
  }
  SUBCASE("a prefix cache that could not be reset: the error names the route and the field") {
    FakeServer server([](const httplib::Request& req, httplib::Response& res, int) {
      if (req.path == "/reset_prefix_cache") return reply_json(res, {{"success", false}});
      vllm_weight_route(req, res);
    });
    RemoteEngine remote(server.url(), fast_retries());
    auto message = error_of([&] { remote.update_weights({{"x", torch::ones({1})}}, 2, temp_dir("refused")); });
    CHECK(message.starts_with(server.url() + "/reset_prefix_cache: the answer's 'success' is false"));
    CHECK(remote.version() == 0);
    CHECK(server.paths().back() == "/reset_prefix_cache");
  }
}

// ---------------------------------------------------------------- llama-cpp-python's server

TEST_CASE("llama-cpp-python's server on the SmolLM2 GGUF answers our greedy requests") {
  const fs::path gguf = test::smollm2_gguf();
  REQUIRE_MESSAGE(std::system((python().string() + " -c 'import llama_cpp.server' 2>/dev/null").c_str()) == 0,
                  python() << " cannot import llama_cpp.server: run scripts/setup.sh (scripts/requirements.txt pins it)");
  const int port = unused_port();
  ChildProcess child({python().string(), "-m", "llama_cpp.server", "--model", gguf.string(), "--host", "127.0.0.1",
                      "--port", std::to_string(port), "--n_ctx", "1024", "--n_threads", "2", "--seed", "0",
                      // One token per compute batch: llama-cpp-python 0.3.36 built for a CPU with AMX dies
                      // (general protection fault in libggml-cpu) on a prompt of more than one token.
                      "--n_ubatch", "1"},
                     temp_dir("llama_cpp") / "server.log");
  auto tok = Tokenizer::load(gguf);

  // llama-cpp-python takes text prompts only, returns no token ids and ignores n; each option
  // checks what it relies on (prompts re-encode exactly, every token string names one id).
  RemoteOptions options;
  options.text_prompts = true;
  options.ids_from_logprob_tokens = true;
  options.one_sample_per_request = true;
  options.max_concurrent = 1;  // it serves one request at a time anyway
  // Its defaults differ from vLLM's: repeat_penalty 1.1 (vLLM: none) and top_k 40 (vLLM: all).
  options.extra = {{"repeat_penalty", 1.0}, {"top_k", 0}};
  RemoteEngine remote("http://127.0.0.1:" + std::to_string(port), options, tok);
  wait_for(remote, child, 180);

  const auto prompts = smollm2_prompts(tok);
  SamplingParams greedy{.temperature = 0, .max_tokens = 24};
  auto theirs = remote.generate(prompts, greedy);
  REQUIRE(theirs.size() == prompts.size());
  for (const auto& c : theirs) {
    CAPTURE(c.request_id);
    CHECK(c.prompt_ids == prompts[c.request_id]);
    REQUIRE_FALSE(c.ids.empty());
    REQUIRE(c.logprobs.size() == c.ids.size());
    for (float lp : c.logprobs) CHECK((std::isfinite(lp) && lp <= 1e-6f));
    CHECK((c.finish_reason == FinishReason::stop || c.finish_reason == FinishReason::length));
    if (c.finish_reason == FinishReason::length) CHECK(c.ids.size() == 24);
    CHECK(c.text == tok.decode(c.ids, /*skip_special_tokens=*/true));
  }

  // Our model on the same file. llama.cpp computes Q4_1 layers with quantized activations (Q8_1
  // dot products) while troupe dequantizes to float32, so near-ties can break differently and
  // greedy paths part (transformers on the dequantized weights sides with troupe). What is
  // asserted: each token llama.cpp generated, scored by our model with llama.cpp's own prefix,
  // has the log-prob llama.cpp reported, within quantization noise. A wrong id (a token string
  // mapped to the wrong vocabulary entry) would be off by whole nats. Greedy agreement is reported.
  auto ours_model = load_model(gguf);
  Engine engine(ours_model.model, ours_model.tokenizer, {.max_batch = 4, .max_seq_len = 512});
  auto ours = engine.generate(prompts, greedy);
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto scored = teacher_forced_logprobs(*ours_model.model, prompts[i], theirs[i].ids);
    double worst = 0, total = 0;
    for (size_t t = 0; t < scored.size(); ++t) {
      double d = std::abs(scored[t] - theirs[i].logprobs[t]);
      worst = std::max(worst, d);
      total += d;
    }
    size_t k = common_prefix(ours[i].ids, theirs[i].ids);
    MESSAGE("prompt " << i << ": greedy tokens agree for " << k << " of " << theirs[i].ids.size()
                      << "; |our log-prob - llama.cpp's| of llama.cpp's tokens: max " << worst << ", mean "
                      << total / scored.size() << "\n  llama.cpp: " << json(theirs[i].text).dump()
                      << "\n  troupe:    " << json(ours[i].text).dump());
    CHECK(worst < kQuantizationNoise);
    CHECK(total / scored.size() < kMeanQuantizationNoise);
  }
}

// ---------------------------------------------------------------- troupe serve

TEST_CASE("troupe serve through RemoteEngine: generation, then pushes by reload and by the disk backend") {
  const fs::path gguf = test::smollm2_gguf();
  auto log = temp_dir("serve") / "serve.log";
  ChildProcess child({test::env_dir("TROUPE_BIN").string(), "serve", "--model", gguf.string(), "--port", "0",
                      "--api-key", "k3y", "--max-batch", "8", "--max-seq-len", "512", "--seed", "1"},
                     log);
  // --port 0 picks a free port; the listening line names it.
  std::smatch m;
  static const std::regex listening(R"(listening on http://[^:\s]+:(\d+))");
  std::string out;
  for (int i = 0; i < 1500 && !std::regex_search(out = child.output(), m, listening); ++i) {
    REQUIRE_MESSAGE(child.running(), "troupe serve exited:\n" << child.output());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  REQUIRE_MESSAGE(std::regex_search(out, m, listening), "no listening line:\n" << out);

  auto model = load_model(gguf);
  RemoteOptions options;
  options.api_key = "k3y";
  RemoteEngine remote("http://127.0.0.1:" + m[1].str(), options, model.tokenizer);
  wait_for(remote, child, 60);
  Engine local(model.model, model.tokenizer, {.max_batch = 4, .max_seq_len = 512});

  const auto prompts = smollm2_prompts(*model.tokenizer);
  SamplingParams greedy{.temperature = 0, .max_tokens = 16};
  auto before = remote.generate(prompts, greedy);
  auto local_before = local.generate(prompts, greedy);
  REQUIRE(before.size() == prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    CHECK(before[i].ids == local_before[i].ids);  // the same engine in float32: the same tokens
    CHECK(before[i].text == local_before[i].text);
    CHECK(before[i].min_version == 0);
    CHECK(before[i].max_version == 0);
    CHECK(before[i].logprobs.size() == before[i].ids.size());
  }

  // Sampled requests with n > 1 go through the same path.
  auto sampled = remote.generate({prompts[2]}, {.n = 3, .temperature = 1.0, .max_tokens = 8, .seed = 5});
  REQUIRE(sampled.size() == 3);
  CHECK(sampled[0].index == 0);
  CHECK(sampled[2].index == 2);

  // New weights: the final norm scaled per channel changes every logit. Server and local engine
  // take the same tensors, so the server's greedy tokens and log-probs must be the local
  // engine's under the new weights, and differ from before.
  auto norm = state_dict(*model.model).at("model.norm.weight").clone();
  auto generator = at::detail::createCPUGenerator(42);
  auto check_pushed = [&](RemoteEngine& pusher, const torch::Tensor& new_norm, int64_t version) {
    return push_and_compare({.pusher = pusher, .reader = remote, .local = local, .prompts = prompts, .params = greedy},
                            {{"model.norm.weight", new_norm}}, version);
  };

  // reload (the default): /collective_rpc reload_weights, then /update_weight_version.
  auto scaled = norm * (1 + 0.5 * torch::randn(norm.sizes(), generator));
  auto after_reload = check_pushed(remote, scaled, 1);
  size_t changed = 0;
  for (size_t i = 0; i < prompts.size(); ++i) changed += after_reload[i].ids != before[i].ids;
  CHECK(changed >= 1);
  MESSAGE(changed << " of " << prompts.size() << " greedy completions changed after the reload");

  // The disk backend: init once, then start, update {path}, finish, twice; the second push
  // writes the original norm back, which restores the first greedy completions exactly.
  RemoteOptions disk = options;
  disk.weight_transfer = "disk";
  RemoteEngine native("http://127.0.0.1:" + m[1].str(), disk, model.tokenizer);
  check_pushed(native, norm * (1 + 0.5 * torch::randn(norm.sizes(), generator)), 2);
  auto restored = check_pushed(native, norm, 3);
  for (size_t i = 0; i < prompts.size(); ++i) CHECK(restored[i].ids == before[i].ids);

  // NCCL is refused before a request is sent: this machine has no CUDA device, or the caller no communicator.
  RemoteOptions nccl = options;
  nccl.weight_transfer = "nccl";
  CHECK(error_of([&] { RemoteEngine("http://127.0.0.1:" + m[1].str(), nccl, model.tokenizer); }).find("NCCL") != std::string::npos);
}
