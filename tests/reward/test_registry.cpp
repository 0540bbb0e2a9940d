// Rewards by kind: plugins loaded by path (the example and ones that misbehave), an HTTP
// reward service started inside the test (batches, retries, timeouts, malformed replies),
// weighted combinations, specs, and reading `troupe score` files.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "policy/error.hpp"
#include "reward/http_reward.hpp"
#include "reward/plugin_reward.hpp"
#include "reward/registry.hpp"
#include "reward/score_file.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace troupe;

namespace {

// The message of the troupe::Error that `f` throws ("" when it throws none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

RewardSample sample(std::string completion, json metadata = json::object()) {
  return {.prompt = "Q: what is 2+2?", .completion = std::move(completion), .metadata = std::move(metadata)};
}

// A reward that returns a fixed function of the completion, for combinations.
struct LambdaReward : RewardFn {
  std::function<double(const RewardSample&)> f;
  explicit LambdaReward(std::function<double(const RewardSample&)> fn) : f(std::move(fn)) {}
  double score(const RewardSample& s) const override { return f(s); }
};

// A cpp-httplib server on a free loopback port, running until the end of the scope.
struct TestServer {
  httplib::Server server;
  std::thread thread;
  int port = 0;

  explicit TestServer(const std::function<void(httplib::Server&)>& routes) {
    routes(server);
    port = server.bind_to_any_port("127.0.0.1");
    REQUIRE(port > 0);
    thread = std::thread([this] { server.listen_after_bind(); });
    while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~TestServer() {
    server.stop();
    thread.join();
  }
  std::string url(const std::string& path) const { return "http://127.0.0.1:" + std::to_string(port) + path; }
};

// A loopback port that was free a moment ago and that nothing listens on.
int closed_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  close(fd);
  return ntohs(addr.sin_port);
}

// Scores each sample with its completion's length, as the protocol says.
void reply_lengths(const httplib::Request& req, httplib::Response& res) {
  auto body = json::parse(req.body);
  json scores = json::array();
  for (const auto& s : body.at("samples")) scores.push_back(s.at("completion").get<std::string>().size());
  res.set_content(json{{"scores", scores}}.dump(), "application/json");
}

}  // namespace

TEST_CASE("the example plugin loads by path and scores") {
  PluginReward r(MY_REWARD_PLUGIN);
  CHECK(r.score(sample("2 + 2 = 4, so the answer is 4.")) == 1.0);
  CHECK(r.score(sample("4")) == 0.0);  // no reasoning word
  std::string long_answer = "so";
  for (int i = 0; i < 299; ++i) long_answer += " word";
  CHECK(r.score(sample(long_answer)) == doctest::Approx(0.5));  // 300 words: halfway from 200 to 400

  auto made = make_reward({.name = "mine", .plugin = MY_REWARD_PLUGIN});  // kind inferred from `plugin`
  CHECK(made->score(sample("Because 2 + 2 = 4.")) == 1.0);
}

TEST_CASE("plugin errors name the path and the symbol") {
  std::string missing = (fs::temp_directory_path() / "no_such_reward_plugin.so").string();
  auto e = error_of([&] { PluginReward r(missing); });
  CHECK(contains(e, missing));
  CHECK(contains(e, "no such reward plugin"));

  e = error_of([&] { PluginReward r(PLUGIN_NO_SYMBOL); });
  CHECK(contains(e, PLUGIN_NO_SYMBOL));
  CHECK(contains(e, "no symbol 'troupe_reward'"));

  e = error_of([&] { PluginReward r(PLUGIN_ABI2); });
  CHECK(contains(e, PLUGIN_ABI2));
  CHECK(contains(e, "troupe_reward_abi_version() is 2"));

  // Not a shared library at all.
  auto text = fs::temp_directory_path() / "troupe_not_a_plugin.so";
  std::ofstream(text) << "hello";
  e = error_of([&] { PluginReward r(text.string()); });
  CHECK(contains(e, text.string()));
  CHECK(contains(e, "cannot load reward plugin"));
  fs::remove(text);
}

TEST_CASE("a plugin that throws or returns NaN gives an Error naming it; the next call works") {
  PluginReward throws(PLUGIN_THROWS);
  CHECK(throws.score(sample("abcd")) == 4.0);
  auto e = error_of([&] { throws.score(sample("abcd", {{"fail", true}})); });
  CHECK(contains(e, PLUGIN_THROWS));
  CHECK(contains(e, "asked to fail"));
  CHECK(throws.score(sample("abcdef")) == 6.0);

  PluginReward raw(PLUGIN_RAW);  // the C ABI written by hand, without reward/plugin.hpp
  CHECK(raw.score(sample("abc")) == 3.0);
  e = error_of([&] { raw.score(sample("")); });
  CHECK(contains(e, PLUGIN_RAW));
  CHECK(contains(e, "returned nan"));

  // Several threads at once through one loaded plugin.
  std::vector<std::thread> threads;
  std::atomic<int> right{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) right += throws.score(sample(std::string(t + i % 7, 'x'))) == t + i % 7;
    });
  for (auto& th : threads) th.join();
  CHECK(right == 800);
}

TEST_CASE("HTTP reward: one request per batch, or per max_batch samples") {
  std::atomic<int> requests{0};
  std::vector<size_t> batch_sizes;
  std::mutex mu;
  TestServer srv([&](httplib::Server& s) {
    s.Post("/score", [&](const httplib::Request& req, httplib::Response& res) {
      ++requests;
      auto body = json::parse(req.body);
      CHECK(body.at("samples").at(0).at("prompt") == "Q: what is 2+2?");
      CHECK(body.at("samples").at(0).at("metadata").at("answer") == "4");
      std::lock_guard lock(mu);
      batch_sizes.push_back(body.at("samples").size());
      reply_lengths(req, res);
    });
  });
  std::vector<RewardSample> samples;
  for (int i = 0; i < 5; ++i) samples.push_back(sample(std::string(i + 1, 'a'), {{"answer", "4"}}));

  auto r = make_reward({.name = "judge", .url = srv.url("/score")});  // kind inferred from `url`
  CHECK(r->score_batch(samples) == std::vector<double>{1, 2, 3, 4, 5});
  CHECK(requests == 1);
  CHECK(r->score(samples[2]) == 3.0);
  CHECK(r->score_batch({}).empty());
  CHECK(requests == 2);

  HttpReward chunked({.url = srv.url("/score"), .max_batch = 2});
  CHECK(chunked.score_batch(samples) == std::vector<double>{1, 2, 3, 4, 5});
  CHECK(requests == 5);
  CHECK(batch_sizes == std::vector<size_t>{5, 1, 2, 2, 1});
}

TEST_CASE("HTTP reward: 5xx replies are retried with backoff, 4xx are not") {
  std::atomic<int> flaky_calls{0}, bad_calls{0};
  TestServer srv([&](httplib::Server& s) {
    s.Post("/flaky", [&](const httplib::Request& req, httplib::Response& res) {
      if (++flaky_calls % 3 != 0) {  // fails twice, then answers
        res.status = 503;
        res.set_content("busy", "text/plain");
        return;
      }
      reply_lengths(req, res);
    });
    s.Post("/bad", [&](const httplib::Request&, httplib::Response& res) {
      ++bad_calls;
      res.status = 400;
      res.set_content("{\"error\": \"no\"}", "application/json");
    });
  });
  std::vector<RewardSample> samples = {sample("ab"), sample("abc")};

  HttpReward patient({.url = srv.url("/flaky"), .retries = 2, .backoff_s = 0.01});
  CHECK(patient.score_batch(samples) == std::vector<double>{2, 3});
  CHECK(flaky_calls == 3);

  HttpReward impatient({.url = srv.url("/flaky"), .retries = 1, .backoff_s = 0.01});
  auto e = error_of([&] { impatient.score_batch(samples); });
  CHECK(contains(e, srv.url("/flaky")));
  CHECK(contains(e, "HTTP 503: busy after 2 attempts"));
  CHECK(flaky_calls == 5);

  e = error_of([&] { patient.score_batch(samples); });  // calls 6: answers
  CHECK(e.empty());
  e = error_of([&] { HttpReward({.url = srv.url("/bad"), .retries = 3, .backoff_s = 0.01}).score_batch(samples); });
  CHECK(contains(e, srv.url("/bad")));
  CHECK(contains(e, "HTTP 400"));
  CHECK(bad_calls == 1);
}

TEST_CASE("HTTP reward: a service that is down or too slow gives an Error naming the URL") {
  std::string down = "http://127.0.0.1:" + std::to_string(closed_port()) + "/score";
  HttpReward r({.url = down, .timeout_s = 1.0, .retries = 2, .backoff_s = 0.01});
  auto e = error_of([&] { r.score(sample("x")); });
  CHECK(contains(e, down));
  CHECK(contains(e, "after 3 attempts"));
  CHECK(contains(e, "is the reward service running"));

  std::atomic<int> calls{0};
  TestServer srv([&](httplib::Server& s) {
    s.Post("/slow", [&](const httplib::Request& req, httplib::Response& res) {
      ++calls;
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      reply_lengths(req, res);
    });
  });
  HttpReward slow({.url = srv.url("/slow"), .timeout_s = 0.2, .retries = 1, .backoff_s = 0.01});
  e = error_of([&] { slow.score(sample("x")); });
  CHECK(contains(e, srv.url("/slow")));
  CHECK(contains(e, "after 2 attempts"));
  CHECK(calls == 2);
}

TEST_CASE("HTTP reward: malformed replies are errors naming the URL") {
  TestServer srv([&](httplib::Server& s) {
    auto reply = [&](const std::string& path, const std::string& body) {
      s.Post(path, [body](const httplib::Request&, httplib::Response& res) { res.set_content(body, "application/json"); });
    };
    reply("/short", "{\"scores\": [1.0]}");
    reply("/text", "hello, not json");
    reply("/noscores", "{\"score\": [1.0, 2.0]}");
    reply("/null", "{\"scores\": [1.0, null]}");
    reply("/string", "{\"scores\": [1.0, \"2\"]}");
    reply("/array", "[1.0, 2.0]");
  });
  std::vector<RewardSample> two = {sample("a"), sample("b")};
  auto check = [&](const std::string& path, const std::string& what) {
    auto e = error_of([&] { HttpReward({.url = srv.url(path), .retries = 2, .backoff_s = 0.01}).score_batch(two); });
    INFO(path << ": " << e);
    CHECK(contains(e, srv.url(path)));
    CHECK(contains(e, what));
  };
  check("/short", "the reply has 1 scores for 2 samples");
  check("/text", "the reply is not JSON: hello, not json");
  check("/noscores", "no \"scores\" array");
  check("/null", "scores[1] is null, not a finite number");
  check("/string", "scores[1] is \"2\", not a finite number");
  check("/array", "no \"scores\" array");
}

TEST_CASE("HTTP reward: bad URLs and options fail at construction") {
  CHECK(contains(error_of([] { HttpReward({.url = "ftp://host/score"}); }), "ftp://host/score"));
  CHECK(contains(error_of([] { HttpReward({.url = "localhost:8000"}); }), "expected http://"));
  CHECK(contains(error_of([] { HttpReward({.url = "http:///score"}); }), "no host"));
  CHECK(contains(error_of([] { HttpReward({.url = "http://h", .timeout_s = 0}); }), "timeout"));
  CHECK(contains(error_of([] { HttpReward({.url = "http://h", .retries = -1}); }), "retries"));
  CHECK(error_of([] { HttpReward({.url = "https://example.com"}); }).empty());  // nothing is contacted
}

TEST_CASE("combined rewards: total = sum of weight * score, with each component") {
  std::vector<WeightedReward> parts;
  parts.push_back({"gsm8k", 1.0, make_reward({.name = "gsm8k", .kind = "math_answer"})});
  parts.push_back({"format", 0.5, make_reward({.name = "format", .kind = "format"})});
  parts.push_back({"short", -0.25, std::make_shared<LambdaReward>([](const RewardSample& s) {
                     return s.completion.size() > 10 ? 1.0 : 0.0;
                   })});
  CombinedReward combined(std::move(parts));

  std::vector<RewardSample> samples = {
      sample("#### 4", {{"answer", "#### 4"}}),                   // right, formatted, short
      sample("2 + 2 = 4, I think", {{"answer", "#### 4"}}),       // right, unformatted, long
      sample("so it is\n#### 5", {{"answer", "#### 4"}}),         // wrong, formatted, long
      sample("the answer is \\boxed{4}", {{"answer", 4}}),        // a number as the answer
  };
  auto all = combined.score_all(samples);
  REQUIRE(all.components.size() == 3);
  CHECK(all.components[0].name == "gsm8k");
  CHECK(all.components[0].scores == std::vector<double>{1, 1, 0, 1});
  CHECK(all.components[1].name == "format");
  CHECK(all.components[1].scores == std::vector<double>{1, 0, 1, 1});
  CHECK(all.components[2].name == "short");
  CHECK(all.components[2].weight == -0.25);
  CHECK(all.components[2].scores == std::vector<double>{0, 1, 1, 1});
  CHECK(all.total == std::vector<double>{1.5, 0.75, 0.25, 1.25});
  CHECK(combined.score_batch(samples) == all.total);
  CHECK(combined.score(samples[0]) == 1.5);

  // From specs, with a plugin among them.
  auto from_specs = make_combined_reward({
      {.name = "gsm8k", .kind = "math_answer", .weight = 2.0},
      {.name = "concise", .weight = 0.5, .plugin = MY_REWARD_PLUGIN},
  });
  CHECK(from_specs.score(sample("2 + 2 = 4 so\n#### 4", {{"answer", "#### 4"}})) == 2.5);
}

TEST_CASE("combined rewards: bad parts and a failing component") {
  auto none = error_of([] { CombinedReward c({}); });
  CHECK(contains(none, "at least one"));
  auto twice = error_of([] {
    make_combined_reward({{.name = "a", .kind = "format"}, {.name = "a", .kind = "math_answer"}});
  });
  CHECK(contains(twice, "'a' is used twice"));

  std::vector<WeightedReward> parts;
  parts.push_back({"gsm8k", 1.0, make_reward({.name = "gsm8k", .kind = "math_answer"})});
  CombinedReward c(std::move(parts));
  auto e = error_of([&] { c.score(sample("#### 4", {{"question", "no answer here"}})); });
  CHECK(contains(e, "no 'answer' field"));
}

TEST_CASE("reward specs: kinds and validation") {
  CHECK(RewardSpec{.name = "a", .plugin = "x.so"}.resolved_kind() == "plugin");
  CHECK(RewardSpec{.name = "a", .url = "http://h"}.resolved_kind() == "http");
  CHECK(RewardSpec{.name = "a", .kind = "format"}.resolved_kind() == "format");
  CHECK(contains(error_of([] { make_reward({.name = "a", .kind = "bleu"}); }), "unknown kind 'bleu'"));
  CHECK(contains(error_of([] { make_reward({.name = "a"}); }), "reward 'a': no kind"));
  CHECK(contains(error_of([] { make_reward({.kind = "format"}); }), "name is empty"));
  CHECK(contains(error_of([] { make_reward({.name = "a", .kind = "plugin"}); }), "needs plugin"));
  CHECK(contains(error_of([] { make_reward({.name = "a", .kind = "http"}); }), "needs url"));
  CHECK(contains(error_of([] { make_reward({.name = "a", .plugin = "p.so", .url = "http://h"}); }), "both plugin and url"));
  CHECK(contains(error_of([] { make_reward({.name = "a", .kind = "format", .weight = NAN}); }), "weight"));
  CHECK(contains(error_of([] { make_reward({.name = "a", .kind = "http", .url = "http://h", .timeout_s = -1}); }),
                 "timeout"));
  auto custom = make_reward({.name = "a", .kind = "math_answer", .answer_key = "solution"});
  CHECK(custom->score(sample("#### 3", {{"solution", "#### 3"}})) == 1.0);
}

TEST_CASE("score files: samples from JSONL, errors naming file:line") {
  auto dir = fs::temp_directory_path() / "troupe_test_score_file";
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    auto p = dir / name;
    std::ofstream(p) << text;
    return p.string();
  };

  auto good = write("good.jsonl",
                    "{\"prompt\": \"2+2?\", \"completion\": \"#### 4\", \"answer\": \"#### 4\", \"id\": 7}\n"
                    "\n"
                    "{\"completion\": \"so 5\", \"answer\": 4}\n");
  auto samples = read_reward_samples(good);
  REQUIRE(samples.size() == 2);
  CHECK(samples[0].prompt == "2+2?");
  CHECK(samples[0].metadata == json{{"answer", "#### 4"}, {"id", 7}});
  CHECK(samples[1].prompt.empty());
  CHECK(score_file("math_answer", good) == std::vector<double>{1, 0});
  CHECK(score_file("format", good) == std::vector<double>{1, 0});
  CHECK(score_file(MY_REWARD_PLUGIN, good) == std::vector<double>{0, 1});

  auto expect = [&](const std::string& text, const std::string& what) {
    auto p = write("bad.jsonl", text);
    auto e = error_of([&] { read_reward_samples(p); });
    INFO(e);
    CHECK(contains(e, what));
  };
  std::string ok = "{\"completion\": \"x\", \"answer\": \"1\"}\n";
  expect(ok + "{\"completion\": \"x\", \"answer\": \n", dir.string() + "/bad.jsonl:2: not valid JSON");
  expect(ok + ok + "[1, 2]\n", "bad.jsonl:3: expected a JSON object");
  expect("{\"answer\": \"1\"}\n", "bad.jsonl:1: no field 'completion'");
  expect(ok + "{\"completion\": \"x\"}\n", "bad.jsonl:2: no field 'answer'");
  expect("{\"completion\": 5, \"answer\": \"1\"}\n", "bad.jsonl:1: field 'completion' is not a string");
  expect("{\"completion\": \"x\", \"answer\": null}\n", "bad.jsonl:1: field 'answer' is not a string or number");
  expect("{\"completion\": \"x\", \"answer\": \"1\", \"prompt\": []}\n", "bad.jsonl:1: field 'prompt' is not a string");
  CHECK(contains(error_of([&] { read_reward_samples((dir / "missing.jsonl").string()); }), "missing.jsonl: cannot open"));

  CHECK(reward_spec_from_name("math_answer").kind == "math_answer");
  CHECK(reward_spec_from_name("http://127.0.0.1:1/score").url == "http://127.0.0.1:1/score");
  CHECK(reward_spec_from_name(MY_REWARD_PLUGIN).plugin == MY_REWARD_PLUGIN);
  CHECK(contains(error_of([] { reward_spec_from_name("math_anwser"); }), "not a built-in reward"));
  fs::remove_all(dir);
}
