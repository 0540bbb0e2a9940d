// RemoteEngine against servers it shares no code with: a fake vLLM in this file (error paths,
// retries, answer parsing, weight sync calls), llama-cpp-python's server, and `troupe serve`.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

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
  std::vector<std::string> authorizations;

  explicit FakeServer(Handler handler) {
    auto record = [this, handler](const httplib::Request& req, httplib::Response& res) {
      int call;
      {
        std::lock_guard lock(mutex);
        requests.emplace_back(req.path, json::parse(req.body, nullptr, false));
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

}  // namespace

// ---------------------------------------------------------------- error paths and parsing

TEST_CASE("a server that is down: the error names the URL and the tries") {
  const std::string url = "http://127.0.0.1:" + std::to_string(unused_port());
  RemoteEngine remote(url, fast_retries());
  CHECK_FALSE(remote.health());
  CHECK(error_of([&] { remote.generate({{1, 2, 3}}, {}); }) ==
        url + "/v1/completions: cannot connect (connection refused or host unreachable) after 3 tries");
  auto weights_error = error_of([&] { remote.update_weights({{"w", torch::ones({2})}}, 1, temp_dir("down")); });
  CHECK(weights_error.starts_with(url + "/start_weight_update: cannot connect"));
  CHECK(remote.version() == 0);  // nothing was pushed
  auto waited = error_of([&] { remote.wait_healthy(0.3); });
  CHECK(waited.starts_with(url + "/health: not healthy after"));
}

TEST_CASE("bad URLs and options are refused up front") {
  CHECK(error_of([] { RemoteEngine("localhost:8000"); }).find("expected http://host:port") != std::string::npos);
  CHECK(error_of([] { RemoteEngine("http://"); }).find("expected http://host:port") != std::string::npos);
  CHECK(error_of([] { RemoteEngine("http://h:1", {.tries = 0}); }).find("tries") != std::string::npos);
  CHECK(error_of([] { RemoteEngine("http://h:1", {.text_prompts = true}); }).find("tokenizer") != std::string::npos);
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

TEST_CASE("update_weights writes a safetensors folder and calls vLLM's three endpoints") {
  FakeServer server([](const httplib::Request& req, httplib::Response& res, int) {
    if (req.path == "/v1/completions") return reply_json(res, vllm_answer(json::parse(req.body)));
    res.status = 200;  // vLLM answers these with an empty body
  });
  RemoteEngine remote(server.url(), fast_retries());
  auto w = torch::arange(6, torch::kFloat32).reshape({2, 3});
  auto b = torch::tensor({1.5, -2.0}, torch::kBFloat16);
  auto dir = temp_dir("weights") / "v7";
  remote.update_weights({{"model.layers.0.mlp.up_proj.weight", w}, {"model.norm.weight", b}}, 7, dir);
  CHECK(remote.version() == 7);

  REQUIRE(server.requests.size() == 3);
  CHECK(server.requests[0].first == "/start_weight_update");
  CHECK(server.requests[1].first == "/update_weights");
  CHECK(server.requests[2].first == "/finish_weight_update");
  CHECK(server.requests[2].second == json{{"weight_version", 7}});
  fs::path sent = server.requests[1].second["update_info"]["path"].get<std::string>();
  CHECK(sent.is_absolute());
  CHECK(fs::equivalent(sent, dir));
  auto checkpoint = safetensors::Checkpoint::open_dir(sent);
  CHECK(checkpoint.names() == std::vector<std::string>{"model.layers.0.mlp.up_proj.weight", "model.norm.weight"});
  auto read = read_safetensors(checkpoint);
  CHECK(torch::equal(read.at("model.layers.0.mlp.up_proj.weight"), w));
  CHECK((read.at("model.norm.weight").scalar_type() == torch::kBFloat16));
  CHECK(torch::equal(read.at("model.norm.weight"), b));

  // A server that reports no versions: completions carry the version last pushed.
  auto out = remote.generate({{1}}, {});
  CHECK(out[0].min_version == 7);
  CHECK(out[0].max_version == 7);
}

TEST_CASE("a refused weight update names the endpoint and keeps the old version") {
  FakeServer server([](const httplib::Request& req, httplib::Response& res, int) {
    if (req.path == "/update_weights") return reply_json(res, {{"error", {{"message", "no such tensor"}}}}, 400);
    res.status = 200;
  });
  RemoteEngine remote(server.url(), fast_retries());
  auto message = error_of([&] { remote.update_weights({{"x", torch::ones({1})}}, 2, temp_dir("refused")); });
  CHECK(message == server.url() + "/update_weights: HTTP 400: \"no such tensor\"");
  CHECK(remote.version() == 0);
  CHECK(server.calls() == 2);  // finish is not called after a failed update
}

// ---------------------------------------------------------------- llama-cpp-python's server

TEST_CASE("llama-cpp-python's server on the SmolLM2 GGUF answers our greedy requests") {
  const fs::path gguf = test::smollm2_gguf();
  REQUIRE_MESSAGE(std::system((python().string() + " -c 'import llama_cpp.server' 2>/dev/null").c_str()) == 0,
                  python() << " cannot import llama_cpp.server: run scripts/setup.sh (scripts/requirements.txt pins it)");
  const int port = unused_port();
  ChildProcess child({python().string(), "-m", "llama_cpp.server", "--model", gguf.string(), "--host", "127.0.0.1",
                      "--port", std::to_string(port), "--n_ctx", "1024", "--n_threads", "2", "--seed", "0"},
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

TEST_CASE("troupe serve through RemoteEngine: generation, then a weight update changes outputs and versions") {
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
  // take the same tensors, so their outputs must still agree, and differ from before.
  auto norm = state_dict(*model.model).at("model.norm.weight").clone();
  auto generator = at::detail::createCPUGenerator(42);
  auto scaled = norm * (1 + 0.5 * torch::randn(norm.sizes(), generator));
  remote.update_weights({{"model.norm.weight", scaled}}, 1, temp_dir("serve") / "weights_v1");
  local.update_weights({{"model.norm.weight", scaled}}, 1);
  CHECK(remote.version() == 1);
  auto after = remote.generate(prompts, greedy);
  auto local_after = local.generate(prompts, greedy);
  size_t changed = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    CHECK(after[i].ids == local_after[i].ids);
    CHECK(after[i].min_version == 1);
    CHECK(after[i].max_version == 1);
    changed += after[i].ids != before[i].ids;
  }
  CHECK(changed >= 1);
  MESSAGE(changed << " of " << prompts.size() << " greedy completions changed after the weight update");
}
