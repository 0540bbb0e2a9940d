// `troupe serve` as a separate process on the real SmolLM2 GGUF, driven by raw HTTP: greedy
// output against `troupe generate`, bad requests, auth, concurrency, pauses, and weight updates
// through vLLM 0.33.0's routes (weight-transfer protocol with the disk backend, and the disk reload).
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "policy/safetensors.hpp"
#include "tests/serve_process.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using troupe::test::env_dir;
using troupe::test::smollm2_gguf;
using troupe::test::ServerProcess;
using troupe::test::shell_quote;

namespace {

constexpr const char* kApiKey = "test-key-123";
constexpr const char* kModelName = "smollm2";
constexpr int kMaxSeqLen = 512;
constexpr int kRequestTimeout = 3;  // seconds for a request to arrive (slow clients)

// Runs `troupe ARGS` and returns its stdout (stderr passes through).
std::string run_troupe(const std::string& args) {
  std::string cmd = shell_quote(env_dir("TROUPE_BIN").string()) + " " + args;
  auto r = troupe::test::run_command(cmd);
  REQUIRE_MESSAGE(r.status == 0, cmd << "\n" << r.out);
  return r.out;
}

// The server every test case shares (it stays up across cases; the last one stops it).
ServerProcess& server() {
  static ServerProcess s({"--model", smollm2_gguf().string(), "--port", "0", "--api-key", kApiKey,
                          "--served-model-name", kModelName, "--max-batch", "8", "--max-seq-len",
                          std::to_string(kMaxSeqLen), "--max-n", "8", "--max-tokens", "64", "--max-request-bytes",
                          "65536", "--seed", "1", "--request-timeout", std::to_string(kRequestTimeout)});
  return s;
}

std::unique_ptr<httplib::Client> client(bool auth = true) {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", server().port);
  if (auth) c->set_bearer_token_auth(kApiKey);
  c->set_read_timeout(300, 0);
  c->set_write_timeout(60, 0);
  return c;
}

struct Reply {
  int status = 0;
  json body;
};

Reply post_raw(const std::string& path, const std::string& body, bool auth = true) {
  auto res = client(auth)->Post(path.c_str(), body, "application/json");
  REQUIRE_MESSAGE(res, "POST " << path << ": no response (" << httplib::to_string(res.error()) << ")");
  return {res->status, json::parse(res->body, nullptr, /*allow_exceptions=*/false)};
}

Reply post(const std::string& path, const json& body, bool auth = true) { return post_raw(path, body.dump(), auth); }

json ok(const std::string& path, const json& body) {
  auto r = post(path, body);
  REQUIRE_MESSAGE(r.status == 200, path << " " << body.dump() << " -> " << r.status << " " << r.body.dump());
  return r.body;
}

Reply get(const std::string& path, bool auth = true) {
  auto res = client(auth)->Get(path.c_str());
  REQUIRE(res);
  return {res->status, json::parse(res->body, nullptr, false)};
}

// vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}.
void check_error_body(const Reply& r, int status) {
  REQUIRE(r.body.is_object());
  REQUIRE(r.body.contains("error"));
  const json& e = r.body["error"];
  CHECK(e["code"] == status);
  CHECK(e["message"].is_string());
  CHECK(!e["message"].get<std::string>().empty());
  CHECK(e["type"].is_string());
  CHECK(e.contains("param"));
}

json greedy(const json& prompt, int max_tokens = 12) {
  return ok("/v1/completions", {{"model", kModelName}, {"prompt", prompt}, {"max_tokens", max_tokens},
                                {"temperature", 0}, {"return_token_ids", true}});
}

std::string strip_newline(std::string s) {
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

const char* kPrompt = "The three primary colors are";

}  // namespace

TEST_CASE("health, models and the API key") {
  CHECK(get("/health", /*auth=*/false).status == 200);
  auto models = get("/v1/models");
  REQUIRE(models.status == 200);
  CHECK(models.body["object"] == "list");
  CHECK(models.body["data"][0]["id"] == kModelName);
  CHECK(models.body["data"][0]["max_model_len"] == kMaxSeqLen);

  auto no_key = get("/v1/models", /*auth=*/false);
  CHECK(no_key.status == 401);
  check_error_body(no_key, 401);
  auto no_key_post = post("/v1/completions", {{"prompt", "hi"}}, /*auth=*/false);
  CHECK(no_key_post.status == 401);
  httplib::Client wrong("127.0.0.1", server().port);
  wrong.set_bearer_token_auth("wrong-key");
  auto res = wrong.Post("/update_weights", R"({"update_info": {"path": "/tmp"}})", "application/json");
  REQUIRE(res);
  CHECK(res->status == 401);
}

TEST_CASE("greedy completions equal `troupe generate`, by text and by token ids") {
  json by_text = greedy(kPrompt);
  const json& choice = by_text["choices"][0];
  std::string expected = strip_newline(run_troupe("generate --model " + shell_quote(smollm2_gguf().string()) +
                                                  " --max-tokens 12 --prompt " + shell_quote(kPrompt)));
  MESSAGE("server: " << choice["text"] << "  troupe generate: " << json(expected));
  CHECK(choice["text"] == expected);
  CHECK(by_text["object"] == "text_completion");
  CHECK(by_text["model"] == kModelName);
  const auto& ids = choice["token_ids"];
  CHECK(by_text["usage"]["completion_tokens"] == ids.size());
  CHECK(by_text["usage"]["prompt_tokens"] == choice["prompt_token_ids"].size());
  CHECK(by_text["usage"]["total_tokens"] == ids.size() + choice["prompt_token_ids"].size());
  CHECK((choice["finish_reason"] == "length" || choice["finish_reason"] == "stop"));
  CHECK(choice["troupe"]["min_version"] == 0);
  CHECK(choice["troupe"]["max_version"] == 0);
  CHECK(choice["logprobs"].is_null());

  json tokens = ok("/tokenize", {{"prompt", kPrompt}});
  CHECK(tokens["tokens"] == choice["prompt_token_ids"]);
  json by_ids = greedy(tokens["tokens"]);
  CHECK(by_ids["choices"][0]["token_ids"] == ids);
  CHECK(by_ids["choices"][0]["text"] == choice["text"]);
}

TEST_CASE("chat completions render the template: same tokens as the rendered prompt through /v1/completions") {
  const std::string question = "What is the capital of France?";
  const json messages = {{{"role", "user"}, {"content", question}}};
  json r = ok("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 16}, {"temperature", 0}, {"return_token_ids", true}});
  CHECK(r["object"] == "chat.completion");
  const json& choice = r["choices"][0];
  CHECK(choice["message"]["role"] == "assistant");
  MESSAGE("chat: " << choice["message"]["content"]);
  CHECK(choice["message"]["content"].get<std::string>().find("Paris") != std::string::npos);
  CHECK(r["usage"]["prompt_tokens"] == r["prompt_token_ids"].size());
  // /tokenize renders the same messages to the prompt the server generated from, and those
  // ids through /v1/completions give the same tokens (the greedy path itself is checked
  // against `troupe generate` above).
  json t = ok("/tokenize", {{"messages", messages}});
  CHECK(t["tokens"] == r["prompt_token_ids"]);
  json same = greedy(t["tokens"], 16);
  CHECK(same["choices"][0]["token_ids"] == choice["token_ids"]);
  CHECK(same["choices"][0]["text"] == choice["message"]["content"]);

  json lp = ok("/v1/chat/completions", {{"messages", messages},
                                        {"max_tokens", 4}, {"logprobs", true}, {"top_logprobs", 1}, {"seed", 3}});
  const json& content = lp["choices"][0]["logprobs"]["content"];
  REQUIRE(content.size() == lp["usage"]["completion_tokens"].get<size_t>());
  for (const auto& e : content) {
    CHECK(std::isfinite(e["logprob"].get<double>()));
    CHECK(e["logprob"].get<double>() <= 0.0);
    CHECK(e["top_logprobs"].size() == 1);
  }
}

TEST_CASE("n samples with a seed: logprobs present and finite, and the seed reproduces them") {
  json body = {{"prompt", kPrompt}, {"n", 4}, {"max_tokens", 8}, {"temperature", 1.0}, {"top_p", 0.95},
               {"seed", 7}, {"logprobs", 1}, {"return_token_ids", true}};
  json a = ok("/v1/completions", body);
  json b = ok("/v1/completions", body);
  REQUIRE(a["choices"].size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    const json& c = a["choices"][i];
    CHECK(c["index"] == i);
    const json& lp = c["logprobs"];
    REQUIRE(lp.is_object());
    CHECK(lp["tokens"].size() == c["token_ids"].size());
    CHECK(lp["token_logprobs"].size() == c["token_ids"].size());
    CHECK(lp["top_logprobs"].size() == c["token_ids"].size());
    CHECK(lp["text_offset"].size() == c["token_ids"].size());
    for (const auto& x : lp["token_logprobs"]) {
      CHECK(std::isfinite(x.get<double>()));
      CHECK(x.get<double>() <= 0.0);
    }
    for (size_t k = 1; k < lp["text_offset"].size(); ++k) CHECK(lp["text_offset"][k] >= lp["text_offset"][k - 1]);
    CHECK(c["token_ids"] == b["choices"][i]["token_ids"]);
    CHECK(lp["token_logprobs"] == b["choices"][i]["logprobs"]["token_logprobs"]);
  }
  CHECK(a["usage"]["completion_tokens"] > 0);

  // A batch of prompts: choices are indexed prompt * n + sample.
  json batch = ok("/v1/completions", {{"prompt", json::array({json("Hello"), json(std::vector<int>{1, 2, 3})})}, {"n", 2}, {"max_tokens", 3}});
  REQUIRE(batch["choices"].size() == 4);
  for (size_t i = 0; i < 4; ++i) CHECK(batch["choices"][i]["index"] == i);
}

TEST_CASE("stop strings and stop token ids report stop_reason") {
  json first = greedy(kPrompt, 6);
  const auto ids = first["choices"][0]["token_ids"].get<std::vector<int>>();
  REQUIRE(ids.size() >= 3);
  json r = ok("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 12}, {"temperature", 0}, {"stop_token_ids", {ids[2]}},
                                  {"return_token_ids", true}});
  CHECK(r["choices"][0]["finish_reason"] == "stop");
  CHECK(r["choices"][0]["stop_reason"] == ids[2]);
  CHECK(r["choices"][0]["token_ids"].size() == 3);

  std::string text = first["choices"][0]["text"];
  std::string stop = text.substr(text.size() / 2, 2);
  json s = ok("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 12}, {"temperature", 0}, {"stop", stop}});
  CHECK(s["choices"][0]["finish_reason"] == "stop");
  CHECK(s["choices"][0]["stop_reason"] == stop);
  CHECK(s["choices"][0]["text"].get<std::string>().find(stop) == std::string::npos);
}

// The official OpenAI client (stream=True, include_usage, closing a stream mid-way) and
// prometheus_client's parser of /metrics, in tests/generator/check_openai_stream.py.
TEST_CASE("the OpenAI client streams chat and completions; /metrics counts them; a closed stream frees its slot") {
  const std::string script = (troupe::test::source() / "tests" / "generator" / "check_openai_stream.py").string();
  const std::string cmd = shell_quote(env_dir("TROUPE_PYTHON").string()) + " " + shell_quote(script) + " " +
                          shell_quote("http://127.0.0.1:" + std::to_string(server().port)) + " " + kApiKey + " " + kModelName +
                          " 2>&1";
  auto r = troupe::test::run_command("timeout 600 " + cmd);
  MESSAGE(r.out);
  CHECK_MESSAGE(r.status == 0, cmd);
  CHECK(r.out.find("all streaming checks passed") != std::string::npos);
}

TEST_CASE("a raw stream is server-sent events: data chunks, then data: [DONE]") {
  auto res = client()->Post("/v1/completions",
                            json{{"model", kModelName}, {"prompt", kPrompt}, {"max_tokens", 8}, {"temperature", 0}, {"stream", true}}.dump(),
                            "application/json");
  REQUIRE(res);
  CHECK(res->status == 200);
  CHECK(res->get_header_value("Content-Type").rfind("text/event-stream", 0) == 0);
  const std::string& body = res->body;
  REQUIRE(body.size() > 14);
  CHECK(body.substr(body.size() - 14) == "data: [DONE]\n\n");
  std::string text;
  size_t events = 0;
  for (size_t at = 0; at < body.size();) {
    size_t end = body.find("\n\n", at);
    REQUIRE(end != std::string::npos);
    std::string line = body.substr(at, end - at);
    at = end + 2;
    if (line.rfind(":", 0) == 0) continue;  // an SSE comment
    REQUIRE(line.rfind("data: ", 0) == 0);
    if (line == "data: [DONE]") {
      CHECK(at == body.size());
      break;
    }
    json chunk = json::parse(line.substr(6));
    CHECK(chunk["object"] == "text_completion");
    CHECK(!chunk.contains("usage"));  // only with stream_options.include_usage
    text += chunk["choices"][0]["text"].get<std::string>();
    ++events;
  }
  CHECK(events >= 1);
  CHECK(text == greedy(kPrompt, 8)["choices"][0]["text"].get<std::string>());
}

TEST_CASE("tokenize and detokenize round trip") {
  const std::string text = "Héllo, wörld! 123 + 456 = 579 ✓";
  json t = ok("/tokenize", {{"prompt", text}, {"return_token_strs", true}});
  CHECK(t["count"] == t["tokens"].size());
  CHECK(t["max_model_len"] == kMaxSeqLen);
  CHECK(t["token_strs"].size() == t["tokens"].size());
  json d = ok("/detokenize", {{"tokens", t["tokens"]}});
  CHECK(d["prompt"] == text);
}

TEST_CASE("malformed requests get a 400 with vLLM's error body, and the server keeps serving") {
  struct Case {
    const char* path;
    std::string body;
    const char* param;  // nullptr: no particular field
  };
  const std::string long_prompt = json(std::vector<int>(kMaxSeqLen, 1)).dump();
  const std::vector<Case> cases = {
      {"/v1/completions", "{not json", nullptr},
      {"/v1/completions", "[1, 2]", nullptr},
      {"/v1/completions", "", nullptr},
      {"/v1/completions", R"({"prompt": "hi", "temperature": 1e309})", nullptr},  // found by fuzz_serve_request: was a 500
      {"/v1/completions", R"({"prompt": "hi", "max_tokens": "ten"})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "hi", "max_tokens": -1})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "hi", "max_tokens": 0})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "hi", "max_tokens": 100000})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "hi", "max_tokens": 2.5})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "hi", "temperature": -0.5})", "temperature"},
      {"/v1/completions", R"({"prompt": "hi", "temperature": "hot"})", "temperature"},
      {"/v1/completions", R"({"prompt": "hi", "top_p": 0})", "top_p"},
      {"/v1/completions", R"({"prompt": "hi", "top_p": 1.5})", "top_p"},
      {"/v1/completions", R"({"prompt": "hi", "top_k": -5})", "top_k"},
      {"/v1/completions", R"({"prompt": "hi", "min_p": 2})", "min_p"},
      {"/v1/completions", R"({"prompt": "hi", "n": 0})", "n"},
      {"/v1/completions", R"({"prompt": "hi", "n": 100})", "n"},
      {"/v1/completions", R"({"prompt": "hi", "seed": "x"})", "seed"},
      {"/v1/completions", R"({"prompt": "hi", "ignore_eos": "yes"})", "ignore_eos"},
      {"/v1/completions", R"({"prompt": "hi", "stop": 3})", "stop"},
      {"/v1/completions", R"({"prompt": "hi", "stop": [""]})", "stop"},
      {"/v1/completions", R"({"prompt": "hi", "stop_token_ids": [99999999]})", "stop_token_ids"},
      {"/v1/completions", R"({"prompt": "hi", "logprobs": 100})", "logprobs"},
      {"/v1/completions", R"({"prompt": "hi", "logprobs": -2})", "logprobs"},
      {"/v1/completions", R"({"prompt": "hi", "stream": "yes"})", "stream"},
      {"/v1/completions", R"({"prompt": "hi", "stream_options": {"include_usage": true}})", "stream_options"},
      {"/v1/completions", R"({"prompt": "hi", "stream": true, "stream_options": 3})", "stream_options"},
      {"/v1/completions", R"({"prompt": "hi", "stream": true, "stream_options": {"include_usage": 1}})", "stream_options.include_usage"},
      {"/v1/completions", R"({"prompt": "hi", "stream": true, "stream_options": {"continuous_usage_stats": true}})",
       "stream_options.continuous_usage_stats"},
      {"/v1/completions", R"({"prompt": "hi", "stream": true, "stream_options": {"every_token": true}})", "stream_options.every_token"},
      {"/v1/completions", R"({"prompt": "hi", "stream": true, "max_tokens": 100000})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "hi", "presence_penalty": 0.5})", "presence_penalty"},
      {"/v1/completions", R"({})", "prompt"},
      {"/v1/completions", R"({"prompt": ""})", "prompt"},
      {"/v1/completions", R"({"prompt": []})", "prompt"},
      {"/v1/completions", R"({"prompt": 5})", "prompt"},
      {"/v1/completions", R"({"prompt": [1, 2, 99999999]})", "prompt"},
      {"/v1/completions", R"({"prompt": [-1]})", "prompt"},
      {"/v1/completions", R"({"prompt": ["ok", 7]})", "prompt"},
      {"/v1/completions", R"({"prompt": )" + long_prompt + R"(, "max_tokens": 16})", "max_tokens"},
      {"/v1/chat/completions", R"({"messages": "hi"})", "messages"},
      {"/v1/chat/completions", R"({"messages": []})", "messages"},
      {"/v1/chat/completions", R"({})", "messages"},
      {"/v1/chat/completions", R"({"messages": [{"content": "x"}]})", "messages"},
      {"/v1/chat/completions", R"({"messages": [{"role": "wizard", "content": "x"}]})", "messages"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": 5}]})", "messages"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"})", "max_tokens"},
      {"/tokenize", R"({})", "prompt"},
      {"/tokenize", R"({"prompt": 12})", "prompt"},
      {"/detokenize", R"({"tokens": [99999999]})", "tokens"},
      {"/detokenize", R"({"tokens": "abc"})", "tokens"},
      {"/update_weights", R"({})", "update_info"},
      {"/update_weights", R"({"update_info": {"path": 3}})", "update_info.path"},
      {"/update_weights", R"({"update_info": {"path": "relative/dir"}})", "update_info.path"},
      {"/update_weights", R"({"update_info": [{"path": "/tmp"}]})", "update_info"},
      {"/update_weights", R"({"update_info": {"names": ["model.norm.weight"]}})", "update_info.names"},
      {"/update_weights", R"({"update_info": {"path": "/tmp", "format": "pt"}})", "update_info.format"},
      {"/finish_weight_update", R"({"weight_version": "abc"})", "weight_version"},
      {"/finish_weight_update", R"({"weight_version": -3})", "weight_version"},
      {"/finish_weight_update", R"({"weight_version": true})", "weight_version"},
      {"/update_weight_version", R"({})", "new_version"},
      {"/update_weight_version", R"({"new_version": "v2"})", "new_version"},
      {"/init_weight_transfer_engine", R"({})", "init_info"},
      {"/init_weight_transfer_engine", R"({"init_info": []})", "init_info"},
      {"/init_weight_transfer_engine", R"({"init_info": {"path": "/tmp"}})", "init_info.path"},
      {"/init_weight_transfer_engine", R"({"init_info": {"rank_offset": 1}})", "init_info.world_size"},
      {"/init_weight_transfer_engine", R"({"init_info": {"rank_offset": "1", "world_size": 2}})", "init_info.rank_offset"},
      {"/init_weight_transfer_engine", R"({"init_info": {"rank_offset": 1, "world_size": 2}})", "init_info.nccl_unique_id_b64"},
      {"/init_weight_transfer_engine", R"({"init_info": {"rank_offset": 1, "world_size": 2, "nccl_unique_id_b64": "not base64!"}})",
       "init_info.nccl_unique_id_b64"},
      {"/init_weight_transfer_engine", R"({"init_info": {"rank_offset": 1, "world_size": 2, "nccl_unique_id_b64": "AAAA"}})",
       "init_info.nccl_unique_id_b64"},
      {"/init_weight_transfer_engine",
       R"({"init_info": {"rank_offset": 1, "world_size": 2, "master_address": "h", "master_port": "29500"}})", "init_info.master_port"},
      {"/collective_rpc", R"({})", "method"},
      {"/collective_rpc", R"({"method": "sleep"})", "method"},
      {"/collective_rpc", R"({"method": "reload_weights"})", "kwargs"},
      {"/collective_rpc", R"({"method": "reload_weights", "kwargs": {}})", "kwargs.weights_path"},
      {"/collective_rpc", R"({"method": "reload_weights", "kwargs": {"weights_path": "rel/dir"}})", "kwargs.weights_path"},
      {"/collective_rpc", R"({"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent/troupe"}})", "kwargs.weights_path"},
      {"/collective_rpc", R"({"method": "reload_weights", "kwargs": {"weights_path": "/tmp", "strict": true}})", "kwargs.strict"},
      {"/collective_rpc", R"({"method": "reload_weights", "args": ["/tmp"], "kwargs": {"weights_path": "/tmp"}})", "args"},
      // Query parameters are checked before the pause takes hold, so these leave the server serving.
      {"/pause", "", "mode"},  // vLLM's default, abort: troupe serve cannot cut running requests short
      {"/pause?mode=sideways", "", "mode"},
      {"/pause?mode=wait&clear_cache=maybe", "", "clear_cache"},
      {"/reset_prefix_cache?reset_external=maybe", "", "reset_external"},
  };
  for (const auto& c : cases) {
    const std::string path = c.path, body = c.body;  // doctest prints a const char* as a pointer
    CAPTURE(path);
    CAPTURE(body);
    auto r = post_raw(c.path, c.body);
    CHECK(r.status == 400);
    check_error_body(r, 400);
    if (r.body.is_object() && r.body.contains("error")) {
      CHECK(r.body["error"]["type"] == "BadRequestError");
      if (c.param) CHECK(r.body["error"]["param"] == c.param);
      MESSAGE(path << " " << body.substr(0, 80) << " -> " << r.body["error"]["message"]);
    }
  }

  // NCCL's init_info, well formed: refused, naming why (the bytes would need a CUDA device).
  auto nccl = post("/init_weight_transfer_engine",
                   {{"init_info", {{"nccl_unique_id_b64", std::string(171, 'A') + "="}, {"rank_offset", 1},
                                   {"world_size", 2}, {"packed", false}}}});
  CHECK(nccl.status == 400);
  check_error_body(nccl, 400);
  CHECK(nccl.body["error"]["param"] == "init_info");
  CHECK(nccl.body["error"]["message"].get<std::string>().find("NCCL weight transfer needs a CUDA device") != std::string::npos);
  CHECK(get("/is_paused").body["is_paused"] == false);

  auto unknown_model = post("/v1/completions", {{"model", "gpt-17"}, {"prompt", "hi"}});
  CHECK(unknown_model.status == 404);
  check_error_body(unknown_model, 404);
  auto huge = post("/v1/completions", {{"prompt", std::string(100000, 'a')}});
  CHECK(huge.status == 413);
  auto no_route = post("/v1/nothing", json::object());
  CHECK(no_route.status == 404);

  // Unknown fields are ignored (vLLM logs them); the server still answers.
  CHECK(get("/health", false).status == 200);
  json r = ok("/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}, {"frobnicate", true}});
  CHECK(r["choices"].size() == 1);
}

TEST_CASE("concurrent clients share the batch and get the tokens they would get alone") {
  const std::vector<std::string> prompts = {"One, two, three,", "The sky is", "def add(a, b):", "Paris is the capital of",
                                            "Water boils at", "My favourite food is"};
  std::vector<json> alone;
  for (const auto& p : prompts) alone.push_back(greedy(p, 8)["choices"][0]["token_ids"]);

  std::vector<json> together(prompts.size());
  std::vector<int> status(prompts.size(), 0);
  std::vector<std::unique_ptr<httplib::Client>> clients;
  for (size_t i = 0; i < prompts.size(); ++i) clients.push_back(client());  // here: REQUIREs must not run on the threads
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] {
      auto& c = clients[i];
      json body = {{"prompt", prompts[i]}, {"max_tokens", 8}, {"temperature", 0}, {"return_token_ids", true}};
      auto res = c->Post("/v1/completions", body.dump(), "application/json");
      if (!res) return;
      status[i] = res->status;
      together[i] = json::parse(res->body, nullptr, false);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(prompts[i]);
    REQUIRE(status[i] == 200);
    CHECK(together[i]["choices"][0]["token_ids"] == alone[i]);
  }
}

TEST_CASE("pause with mode=keep queues requests until resume") {
  CHECK(ok("/pause?mode=keep", json::object()) == json{{"status", "paused"}});
  CHECK(get("/is_paused").body["is_paused"] == true);
  int queued = 0;
  auto c = client();  // made here: assertions must not run on the other thread
  std::thread t([&] {
    auto res = c->Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 2})", "application/json");
    queued = res ? res->status : -1;
  });
  CHECK(get("/health", false).status == 200);  // the server answers while paused
  CHECK(ok("/resume", json::object()) == json{{"status", "resumed"}});
  t.join();
  CHECK(queued == 200);
  CHECK(get("/is_paused").body["is_paused"] == false);
}

TEST_CASE("pause with mode=wait lets a running request finish, then answers new ones 503 until resume") {
  std::atomic<int> status{0};
  json answer;
  auto c = client();  // made here: assertions must not run on the other thread
  std::thread t([&] {
    json body = {{"prompt", kPrompt}, {"max_tokens", 48}, {"temperature", 0}, {"ignore_eos", true}};
    auto res = c->Post("/v1/completions", body.dump(), "application/json");
    if (res) answer = json::parse(res->body, nullptr, false);
    status = res ? res->status : -1;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // admitted by now; 48 tokens take longer
  CHECK(ok("/pause?mode=wait", json::object()) == json{{"status", "paused"}});
  // The running request is answered in full while the pause holds (mode=keep would freeze it).
  for (int i = 0; i < 600 && status == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(status == 200);
  CHECK(get("/is_paused").body["is_paused"] == true);

  auto turned_away = post("/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}});
  CHECK(turned_away.status == 503);
  check_error_body(turned_away, 503);
  CHECK(turned_away.body["error"]["type"] == "ServiceUnavailableError");
  CHECK(get("/health", false).status == 200);  // the server answers while paused

  CHECK(ok("/resume", json::object()) == json{{"status", "resumed"}});
  t.join();
  CHECK(answer["usage"]["completion_tokens"] == 48);  // not cut short
  CHECK(get("/is_paused").body["is_paused"] == false);
  CHECK(ok("/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}})["choices"].size() == 1);
}

namespace {

// Writes dir/model.safetensors with the tensors `names` of a float32 safetensors file, negating
// those in `flip` (flipping the sign bit is exact); the others are written from the mapping.
void write_tensors(const fs::path& from, const fs::path& dir, const std::vector<std::string>& names,
                   const std::vector<std::string>& flip) {
  auto file = troupe::safetensors::File::open(from);
  std::vector<std::vector<uint32_t>> flipped;
  flipped.reserve(flip.size());  // no reallocation: refs point into it
  std::vector<troupe::safetensors::TensorRef> refs;
  for (const auto& name : names) {
    const auto& v = file->at(name);
    const void* data = v.data;
    if (std::find(flip.begin(), flip.end(), name) != flip.end()) {
      REQUIRE(v.dtype == troupe::safetensors::Dtype::F32);
      auto& words = flipped.emplace_back(v.nbytes / 4);
      std::memcpy(words.data(), v.data, v.nbytes);
      for (auto& w : words) w ^= 0x80000000u;
      data = words.data();
    }
    refs.push_back({name, v.dtype, v.shape, data, v.nbytes});
  }
  fs::create_directories(dir);
  troupe::safetensors::write_file(dir / "model.safetensors", refs);
}

// The Hugging Face folder `hf` with the tensors `flip` negated: a model to compute references with.
void write_flipped_model(const fs::path& hf, const fs::path& dir, const std::vector<std::string>& flip) {
  fs::create_directories(dir);
  for (const auto& entry : fs::directory_iterator(hf))
    if (entry.path().filename() != "model.safetensors") fs::copy_file(entry.path(), dir / entry.path().filename());
  std::vector<std::string> all;
  auto file = troupe::safetensors::File::open(hf / "model.safetensors");  // alive while its views are read
  for (const auto& v : file->tensors()) all.push_back(v.name);
  write_tensors(hf / "model.safetensors", dir, all, flip);
}

std::string troupe_generate(const fs::path& model) {
  return strip_newline(run_troupe("generate --model " + shell_quote(model.string()) + " --max-tokens 12 --prompt " +
                                  shell_quote(kPrompt)));
}

// Folders of new weights for the weight tests, made once: four down_proj tensors negated
// ("flipped") or as they are ("original"), and `troupe generate`'s greedy text for the whole
// model either way, the references the server's output must match after each update.
struct Updates {
  fs::path work, flipped, original;
  std::vector<std::string> names;
  std::string greedy_original, greedy_flipped;
};

const Updates& updates() {
  static const Updates made = [] {
    Updates u;
    u.work = fs::temp_directory_path() / ("troupe_test_server_" + std::to_string(getpid()));
    fs::remove_all(u.work);
    run_troupe("convert " + shell_quote(smollm2_gguf().string()) + " " + shell_quote((u.work / "hf").string()) + " --dtype float32");
    const fs::path weights = u.work / "hf" / "model.safetensors";
    REQUIRE(fs::exists(weights));
    for (int l = 0; l < 4; ++l) u.names.push_back("model.layers." + std::to_string(l) + ".mlp.down_proj.weight");
    u.flipped = u.work / "flipped";
    u.original = u.work / "original";
    write_tensors(weights, u.flipped, u.names, u.names);
    write_tensors(weights, u.original, u.names, {});
    write_flipped_model(u.work / "hf", u.work / "hf_flipped", u.names);
    u.greedy_original = troupe_generate(u.work / "hf");
    u.greedy_flipped = troupe_generate(u.work / "hf_flipped");
    return u;
  }();
  return made;
}

const json kPaused = {{"status", "paused"}}, kResumed = {{"status", "resumed"}}, kReset = {{"success", true}};

}  // namespace

TEST_CASE("vLLM's weight-transfer protocol with the disk backend: the new weights' own greedy output") {
  const Updates& u = updates();
  json before = greedy(kPrompt);

  // vLLM's sequence: init, pause, start, update, finish, reset the prefix cache, resume.
  CHECK(ok("/init_weight_transfer_engine", {{"init_info", json::object()}}) == json{{"message", "Weight transfer initialized"}});
  CHECK(ok("/pause?mode=wait", json::object()) == kPaused);
  CHECK(ok("/start_weight_update", json::object()) == json{{"message", "Weight update started"}});
  json staged = ok("/update_weights", {{"update_info", {{"path", u.flipped.string()}}}});
  CHECK(staged["message"] == "Weights updated");
  CHECK(staged["tensors"] == u.names.size());
  json finished = ok("/finish_weight_update", {{"weight_version", "7"}});
  CHECK(finished["message"] == "Weight update finished");
  CHECK(finished["weight_version"] == 7);
  CHECK(ok("/reset_prefix_cache", json::object()) == kReset);
  CHECK(post("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 2}}).status == 503);  // paused until resume
  CHECK(ok("/resume", json::object()) == kResumed);
  CHECK(get("/weight_info").body["weight_version"] == 7);
  CHECK(get("/is_paused").body["is_paused"] == false);

  json after = greedy(kPrompt);
  MESSAGE("before: " << before["choices"][0]["text"] << "  after: " << after["choices"][0]["text"]);
  CHECK(after["choices"][0]["text"] == u.greedy_flipped);  // `troupe generate` on the model with the new weights
  CHECK(after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]);
  CHECK(after["choices"][0]["troupe"]["min_version"] == 7);
  CHECK(after["choices"][0]["troupe"]["max_version"] == 7);
}

TEST_CASE("weight updates out of turn answer 409; bad folders answer 400 naming the tensor and end the session") {
  const Updates& u = updates();
  const int64_t version = get("/weight_info").body["weight_version"];
  const json original = {{"update_info", {{"path", u.original.string()}}}};
  for (const Reply& r : {post("/update_weights", original), post("/finish_weight_update", {{"weight_version", 9}})}) {
    CHECK(r.status == 409);
    check_error_body(r, 409);
  }
  std::vector<float> bogus(576, 1.0f), short_norm(3, 1.0f);
  troupe::safetensors::TensorRef unknown{"model.bogus.weight", troupe::safetensors::Dtype::F32, {576}, bogus.data(), bogus.size() * 4};
  troupe::safetensors::TensorRef wrong{"model.norm.weight", troupe::safetensors::Dtype::F32, {3}, short_norm.data(), short_norm.size() * 4};
  fs::create_directories(u.work / "unknown");
  fs::create_directories(u.work / "wrong");
  troupe::safetensors::write_file(u.work / "unknown" / "model.safetensors", std::span(&unknown, 1));
  troupe::safetensors::write_file(u.work / "wrong" / "model.safetensors", std::span(&wrong, 1));
  const std::vector<std::pair<std::string, std::string>> folders = {
      {"unknown", "model.bogus.weight"}, {"wrong", "model.norm.weight"}, {"missing", "is not a directory"}};
  for (const auto& folder : folders) {
    CAPTURE(folder.first);
    ok("/start_weight_update", json::object());
    auto r = post("/update_weights", {{"update_info", {{"path", (u.work / folder.first).string()}}}});
    CHECK(r.status == 400);
    check_error_body(r, 400);
    CHECK(r.body["error"]["param"] == "update_info.path");
    std::string message = r.body["error"]["message"];
    MESSAGE(message);
    CHECK(message.find(folder.second) != std::string::npos);
    CHECK(post("/finish_weight_update", json::object()).status == 409);  // the failure ended the session
  }
  // One session at a time, one checkpoint per session (as vLLM's disk backend).
  ok("/start_weight_update", json::object());
  CHECK(post("/start_weight_update", json::object()).status == 409);
  ok("/update_weights", original);
  CHECK(post("/update_weights", original).status == 409);  // and the session is closed
  CHECK(post("/finish_weight_update", json::object()).status == 409);
  CHECK(get("/weight_info").body["weight_version"] == version);  // nothing was applied
}

TEST_CASE("vLLM's disk reload, /collective_rpc reload_weights: the original tensors restore the original output") {
  const Updates& u = updates();
  CHECK(ok("/pause?mode=wait", json::object()) == kPaused);
  CHECK(ok("/collective_rpc", {{"method", "reload_weights"}, {"kwargs", {{"weights_path", u.original.string()}}}}) ==
        json{{"results", json::array({nullptr})}});
  CHECK(ok("/update_weight_version", {{"new_version", "8"}}) == json{{"success", true}, {"new_version", "8"}});
  CHECK(ok("/reset_prefix_cache", json::object()) == kReset);
  CHECK(ok("/resume", json::object()) == kResumed);
  CHECK(get("/weight_info").body["weight_version"] == 8);
  json restored = greedy(kPrompt);
  CHECK(restored["choices"][0]["text"] == u.greedy_original);
  CHECK(restored["choices"][0]["troupe"]["min_version"] == 8);
  CHECK(restored["choices"][0]["troupe"]["max_version"] == 8);
  fs::remove_all(u.work);
}

// ---------------------------------------------------------------------------------------
// Hostile clients over raw sockets (tests/generator/serve_abuse.py sends many more).

namespace {

int connect_raw() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server().port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  timeval tv{.tv_sec = 20, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

void send_all(int fd, const std::string& data) {
  for (size_t at = 0; at < data.size();) {
    const ssize_t n = send(fd, data.data() + at, data.size() - at, MSG_NOSIGNAL);
    if (n <= 0) return;  // the server may answer and close before reading it all
    at += static_cast<size_t>(n);
  }
}

// What the server sends until it closes the connection (or 20 s pass).
std::string read_to_end(int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  return out;
}

// The status and JSON body of one raw answer (0 when there is none).
Reply parse_raw(const std::string& answer) {
  if (answer.rfind("HTTP/1.1 ", 0) != 0) return {};
  const size_t body = answer.find("\r\n\r\n");
  return {std::stoi(answer.substr(9, 3)), json::parse(answer.substr(body == std::string::npos ? answer.size() : body + 4), nullptr, false)};
}

Reply raw_exchange(const std::string& request) {
  const int fd = connect_raw();
  send_all(fd, request);
  std::string answer = read_to_end(fd);
  close(fd);
  return parse_raw(answer);
}

// One sample of /metrics, by the text that ends its labels (`finished_reason="abort"}`).
double metric(const std::string& name, const std::string& labels_end = "}") {
  auto res = client()->Get("/metrics");
  REQUIRE(res);
  std::istringstream lines(res->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + "{", 0) != 0) continue;
    const size_t space = line.rfind(' ');
    if (line.compare(space - labels_end.size(), labels_end.size(), labels_end) == 0) return std::stod(line.substr(space + 1));
  }
  FAIL("no sample " << name << " ..." << labels_end);
  return 0;
}

}  // namespace

TEST_CASE("slow clients are cut off with 408 after --request-timeout, and others are served meanwhile") {
  // More than httplib's old pool of 64 threads, which clients sending a byte a second held for ever.
  constexpr int kSlow = 70;
  std::vector<int> fds;
  for (int i = 0; i < kSlow; ++i) {
    fds.push_back(connect_raw());
    send_all(fds.back(), "POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
  }
  std::atomic<bool> dripping{true};
  std::thread drip([&] {
    for (int i = 0; i < 40 && dripping; ++i) {
      for (int fd : fds) send(fd, "X", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
  });
  const auto start = std::chrono::steady_clock::now();
  auto c = client();
  c->set_read_timeout(5, 0);
  auto health = c->Get("/health");
  auto answer = c->Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 2})", "application/json");
  CHECK_MESSAGE(health, "no answer to /health within 5 s while slow clients hold connections");
  CHECK_MESSAGE(answer, "no answer to a completion within 5 s while slow clients hold connections");
  if (health) CHECK(health->status == 200);
  if (answer) CHECK(answer->status == 200);
  int timed_out = 0;
  for (int fd : fds) {
    Reply r = parse_raw(read_to_end(fd));
    if (r.status == 408) {
      ++timed_out;
      CHECK(r.body["error"]["message"].get<std::string>().find("--request-timeout") != std::string::npos);
    }
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  dripping = false;
  drip.join();
  for (int fd : fds) close(fd);
  CHECK(timed_out == kSlow);
  CHECK(took < kRequestTimeout + 5);
}

TEST_CASE("a burst of 300 connections is accepted at once, past httplib's listen backlog of 5") {
  const auto start = std::chrono::steady_clock::now();
  std::vector<int> fds;
  for (int i = 0; i < 300; ++i) fds.push_back(connect_raw());  // a dropped SYN waits a second before it retries
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(get("/health", false).status == 200);
  for (int fd : fds) close(fd);
  MESSAGE("300 connections in " << took << " s");
  CHECK(took < 3);
}

TEST_CASE("bodies past the limits: chunked over --max-request-bytes 413, compressed 415, nested too deep 400") {
  std::string chunked = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + std::string(kApiKey) +
                        "\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 5; ++i) chunked += "4000\r\n" + std::string(0x4000, ' ') + "\r\n";  // 80 KiB of 64 allowed
  Reply r = raw_exchange(chunked + "0\r\n\r\n");
  CHECK(r.status == 413);
  check_error_body(r, 413);

  r = raw_exchange("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nabcd");
  CHECK(r.status == 415);
  check_error_body(r, 415);

  const std::string deep = R"({"prompt": "hi", "user": )" + std::string(65, '[') + std::string(65, ']') + "}";
  auto nested = post_raw("/v1/completions", deep);
  CHECK(nested.status == 400);
  check_error_body(nested, 400);
  CHECK(nested.body["error"]["message"].get<std::string>().find("64 levels") != std::string::npos);

  // Without Content-Length or chunked encoding a request has no body: answered at once, not when the client gives up.
  const auto start = std::chrono::steady_clock::now();
  r = raw_exchange("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + std::string(kApiKey) +
                   "\r\nConnection: close\r\n\r\n");
  CHECK(r.status == 400);
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 2);
  CHECK(ok("/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}})["choices"].size() == 1);
}

TEST_CASE("a client that closes its connection before a non-streamed answer has its request aborted") {
  const double aborted = metric("vllm:request_success_total", "finished_reason=\"abort\"}");
  CHECK(ok("/pause?mode=keep", json::object()) == json{{"status", "paused"}});
  const int fd = connect_raw();
  const std::string body = R"({"prompt": "hi", "max_tokens": 8, "n": 2})";
  send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + std::string(kApiKey) +
                   "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  for (int i = 0; i < 100 && metric("vllm:num_requests_waiting") < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  close(fd);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the server looks every 100 ms
  CHECK(ok("/resume", json::object()) == json{{"status", "resumed"}});
  double now = aborted;
  for (int i = 0; i < 100 && now < aborted + 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    now = metric("vllm:request_success_total", "finished_reason=\"abort\"}");
  }
  CHECK(now == aborted + 2);  // both samples, none decoded for nobody
  CHECK(metric("vllm:num_requests_running") == 0);
}

TEST_CASE("a second troupe serve on the same port fails, naming the port (no SO_REUSEPORT)") {
  const std::string port = std::to_string(server().port);
  auto r = troupe::test::run_command("timeout 120 " + shell_quote(env_dir("TROUPE_BIN").string()) + " serve --model " +
                                     shell_quote(smollm2_gguf().string()) + " --port " + port + " 2>&1");
  MESSAGE(r.out);
  CHECK(r.status != 0);
  CHECK(r.out.find("127.0.0.1:" + port) != std::string::npos);
  CHECK(r.out.find("Address already in use") != std::string::npos);
  CHECK(get("/health", false).status == 200);  // the first one still holds it
}

TEST_CASE("SIGTERM stops the server cleanly with exit code 0") {
  CHECK(server().terminate() == 0);
}
