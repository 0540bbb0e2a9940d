// Rollout accounting through the actor graph: every prompt handed out is trained on exactly
// once or reported as failed, when a reward plugin throws and when the HTTP reward service is
// down, slow (retried) or answers garbage. Failures are logged, the run goes on, nothing crashes.
// With dynamic sampling, a third outcome: filtered (the group's rewards tied), never trained.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include <httplib.h>
#include <torch/torch.h>

#include "actors/graph.hpp"
#include "actors/trainer_actor.hpp"
#include "policy/checkpoint.hpp"
#include "tests/test_util.hpp"

using namespace troupe;

namespace {

// What a prompt asks the rewards to do; the test plugin and the fake service read it.
enum class Mode { ok, fail, slow, garbage };

const char* name_of(Mode m) {
  switch (m) {
    case Mode::ok: return "ok";
    case Mode::fail: return "fail";
    case Mode::slow: return "slow";
    case Mode::garbage: return "garbage";
  }
  return "?";
}

struct Run {
  GraphResult result;
  std::map<Mode, int64_t> handed_out;  // prompts the data source gave out, by mode
  std::vector<nlohmann::json> failures;  // failures.jsonl
};

// A few GRPO steps of the tiny Llama on "a+b=" prompts whose metadata carries a mode chosen
// by `mode_of(k)` for the k-th prompt handed out.
Run run(std::shared_ptr<CombinedReward> reward, std::function<Mode(int64_t)> mode_of, const std::string& name,
        int64_t steps = 6, int64_t eta = 1, std::function<void(GraphSpec&)> adjust = {}) {
  Tokenizer tokenizer = Tokenizer::load(test::data() / "tokenizers" / "qwen3");
  auto counts = std::make_shared<std::map<Mode, int64_t>>();
  auto handed = std::make_shared<int64_t>(0);
  GraphSpec spec;
  spec.make_policy = [] { return load_model(test::fixtures() / "hf_models" / "llama3", {.tokenizer = false}).model; };
  spec.tokenizer = tokenizer;
  spec.tokenizer_path = test::data() / "tokenizers" / "qwen3";
  spec.next_prompts = [tokenizer, counts, handed, mode_of](int64_t n) {
    std::vector<PromptItem> out;
    for (int64_t i = 0; i < n; ++i) {
      int64_t k = (*handed)++;
      Mode m = mode_of(k);
      ++(*counts)[m];
      std::string text = std::to_string(k % 5) + "+" + std::to_string(k % 3) + "=";
      nlohmann::json meta{{"answer", std::to_string(k % 5 + k % 3)}, {"mode", name_of(m)}, {"uid", k},
                          {"fail", m == Mode::fail}};
      out.push_back({static_cast<uint64_t>(k), 0, tokenizer.encode(text), text, meta.dump()});
    }
    return out;
  };
  spec.reward = std::move(reward);
  spec.trainer = {.optimizer = {.lr = 1e-4}};
  spec.batch_groups = 4;
  spec.steps = steps;
  spec.engine = {.max_batch = 64, .max_seq_len = 12};
  spec.sampling = {.n = 4, .temperature = 1.0, .max_tokens = 2};
  spec.max_staleness = eta;
  spec.run_dir = test::fixtures() / ("accounting_" + name);
  spec.model_config = ModelConfig::from_file(test::fixtures() / "hf_models" / "llama3" / "config.json");
  spec.model_source = test::fixtures() / "hf_models" / "llama3";
  spec.quiet = true;
  if (adjust) adjust(spec);
  std::filesystem::remove_all(spec.run_dir);
  Run r{run_graph(spec), *counts, {}};
  std::ifstream in(spec.run_dir / "failures.jsonl");
  for (std::string line; std::getline(in, line);) r.failures.push_back(nlohmann::json::parse(line));
  return r;
}

// Every ticket handed out is in trained, filtered or failed, exactly once; the per-step counts
// in the metrics add up to the same totals. Without dynamic sampling nothing is filtered and
// exactly steps x batch_groups prompts are handed out.
void check_accounting(const Run& r, int64_t steps, int64_t batch_groups, int64_t expect_failed) {
  INFO(r.result.error);
  REQUIRE(r.result.ok);
  REQUIRE(r.result.metrics.size() == static_cast<size_t>(steps));
  auto issued = r.result.issued;
  std::sort(issued.begin(), issued.end());
  // Each filtered group is replaced by a new prompt, except in a batch out of refill rounds.
  CHECK(issued.size() >= static_cast<size_t>(steps * batch_groups));
  CHECK(issued.size() <= static_cast<size_t>(steps * batch_groups) + r.result.filtered.size());
  CHECK(std::adjacent_find(issued.begin(), issued.end()) == issued.end());
  std::vector<int64_t> done = r.result.trained;
  done.insert(done.end(), r.result.failed.begin(), r.result.failed.end());
  done.insert(done.end(), r.result.filtered.begin(), r.result.filtered.end());
  std::sort(done.begin(), done.end());
  CHECK(done == issued);  // each once: no loss, no double count
  int64_t filtered = 0;
  for (const auto& j : r.result.metrics) filtered += j.value("rollouts/filtered", int64_t{0});
  CHECK(filtered == static_cast<int64_t>(r.result.filtered.size()));
  CHECK(static_cast<int64_t>(r.result.failed.size()) == expect_failed);
  int64_t trained = 0, failed = 0;
  for (const auto& j : r.result.metrics) {
    trained += j["rollouts/trained"].get<int64_t>();
    failed += j["rollouts/failed"].get<int64_t>();
  }
  CHECK(trained == static_cast<int64_t>(r.result.trained.size()));
  CHECK(failed == expect_failed);
  CHECK(r.failures.size() == static_cast<size_t>(expect_failed));
  std::set<int64_t> failed_tickets(r.result.failed.begin(), r.result.failed.end());
  for (const auto& f : r.failures) CHECK(failed_tickets.count(f["ticket"].get<int64_t>()) == 1);
}

// A reward service on a free port: scores each completion 1 if it is non-empty; a "slow" prompt
// sleeps past the client's timeout the first time it is seen (so the retry succeeds); a
// "garbage" prompt gets HTML back.
struct FakeRewardService {
  httplib::Server server;
  std::thread thread;
  int port = 0;
  std::mutex mu;
  std::set<int64_t> seen_slow;
  std::atomic<int64_t> requests{0};

  FakeRewardService() {
    server.Post("/score", [this](const httplib::Request& req, httplib::Response& res) {
      ++requests;
      auto body = nlohmann::json::parse(req.body);
      const auto& samples = body["samples"];
      const auto& meta = samples[0]["metadata"];
      std::string mode = meta["mode"];
      if (mode == "garbage") {
        res.set_content("<html>502 upstream hiccup</html>", "text/html");
        return;
      }
      if (mode == "slow") {
        bool first;
        {
          std::lock_guard lock(mu);
          first = seen_slow.insert(meta["uid"].get<int64_t>()).second;
        }
        if (first) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      }
      nlohmann::json scores = nlohmann::json::array();
      for (const auto& s : samples) scores.push_back(s["completion"].get<std::string>().empty() ? 0.0 : 1.0);
      res.set_content(nlohmann::json{{"scores", scores}}.dump(), "application/json");
    });
    port = server.bind_to_any_port("127.0.0.1");
    REQUIRE(port > 0);
    thread = std::thread([this] { server.listen_after_bind(); });
    while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeRewardService() {
    server.stop();
    thread.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port) + "/score"; }
};

// Dynamic sampling's test reward: 1 for every completion of a prompt whose uid is a multiple of
// 3 (its group always ties), else the parity of the completion's text (mixed in most groups).
// It keeps each prompt's scores by uid, so the test judges ties by what was actually scored.
struct RecordingReward : RewardFn {
  bool all_tie = false;  // every prompt scores 1
  mutable std::mutex mu;
  mutable std::map<int64_t, std::vector<double>> scores;
  double score(const RewardSample& s) const override {
    const int64_t uid = s.metadata["uid"].get<int64_t>();
    const double v = all_tie || uid % 3 == 0 ? 1.0 : static_cast<double>(std::hash<std::string>{}(s.completion) % 2);
    std::lock_guard lock(mu);
    scores[uid].push_back(v);
    return v;
  }
  bool ties(int64_t uid) const {
    const auto& v = scores.at(uid);
    return std::adjacent_find(v.begin(), v.end(), std::not_equal_to<>()) == v.end();
  }
};

RewardSpec http_spec(const std::string& url) {
  return {.name = "service", .kind = "http", .url = url, .timeout_s = 0.5, .retries = 2, .backoff_s = 0.05};
}

}  // namespace

TEST_CASE("a reward plugin that throws fails its groups only; the rest train, each prompt once") {
  torch::manual_seed(0);
  auto reward = std::make_shared<CombinedReward>(make_combined_reward(
      {{.name = "correct", .kind = "math_answer"}, {.name = "plugin", .weight = 0.0, .plugin = PLUGIN_THROWS}}));
  // Every third prompt makes the plugin throw; steps 2's batch (prompts 4..7) also has one.
  auto r = run(reward, [](int64_t k) { return k % 3 == 0 ? Mode::fail : Mode::ok; }, "plugin");
  check_accounting(r, 6, 4, r.handed_out[Mode::fail]);
  CHECK(r.handed_out[Mode::fail] == 8);  // prompts 0, 3, ..., 21 of 24
  for (const auto& f : r.failures) CHECK(f["error"].get<std::string>().find("asked to fail") != std::string::npos);
  // Versions advance once per step that trained something: here every step did.
  CHECK(r.result.metrics.back()["policy_version"].get<int64_t>() == 6);
}

TEST_CASE("an HTTP reward service that is slow (retried), answers garbage (failed) or is down (all failed)") {
  torch::manual_seed(0);
  SUBCASE("slow and garbage") {
    FakeRewardService service;
    auto reward = std::make_shared<CombinedReward>(make_combined_reward({http_spec(service.url())}));
    auto mode_of = [](int64_t k) { return k == 1 || k == 9 ? Mode::slow : k % 5 == 2 ? Mode::garbage : Mode::ok; };
    auto r = run(reward, mode_of, "http");
    check_accounting(r, 6, 4, r.handed_out[Mode::garbage]);
    CHECK(r.handed_out[Mode::garbage] == 5);  // prompts 2, 7, 12, 17, 22
    CHECK(r.handed_out[Mode::slow] == 2);     // timed out once each, then retried and trained
    for (const auto& f : r.failures) CHECK(f["error"].get<std::string>().find("is not JSON") != std::string::npos);
    std::set<int64_t> trained(r.result.trained.begin(), r.result.trained.end());
    CHECK(trained.count(1) == 1);
    CHECK(trained.count(9) == 1);
    // 24 groups, one request each, plus one retry per slow prompt.
    CHECK(service.requests.load() == 24 + 2);
  }
  SUBCASE("down") {
    std::string url;
    {
      FakeRewardService gone;  // a port that was free a moment ago and is closed now
      url = gone.url();
    }
    auto reward = std::make_shared<CombinedReward>(make_combined_reward({http_spec(url)}));
    auto r = run(reward, [](int64_t) { return Mode::ok; }, "down", 3);
    check_accounting(r, 3, 4, 12);
    for (const auto& j : r.result.metrics) {
      CHECK(j["loss"].is_null());  // nothing to learn from: no optimizer step
      CHECK(j["policy_version"].get<int64_t>() == 0);
    }
    REQUIRE(!r.failures.empty());
    CHECK(r.failures[0]["error"].get<std::string>().find(url) != std::string::npos);
    CHECK(r.failures[0]["error"].get<std::string>().find("after 3 attempts") != std::string::npos);
  }
}

TEST_CASE("dynamic sampling: no group whose rewards tie is trained; new prompts fill each batch; nothing is lost") {
  torch::manual_seed(0);
  auto recorder = std::make_shared<RecordingReward>();
  auto reward = std::make_shared<CombinedReward>(std::vector<WeightedReward>{{"parity", 1.0, recorder}});
  const int64_t steps = 6, batch_groups = 4;
  auto r = run(reward, [](int64_t) { return Mode::ok; }, "dynamic", steps, 1,
               [](GraphSpec& spec) { spec.dynamic_sampling = true; });
  check_accounting(r, steps, batch_groups, 0);
  // A ticket is the prompt's place in the data stream, which is the uid the test's data gave it.
  for (int64_t t : r.result.trained) CHECK_MESSAGE(!recorder->ties(t), "trained ticket " << t << " tied");
  for (int64_t t : r.result.filtered) CHECK_MESSAGE(recorder->ties(t), "filtered ticket " << t << " did not tie");
  int64_t multiples_of_3 = 0;
  for (int64_t t : r.result.issued) multiples_of_3 += t % 3 == 0;
  CHECK(static_cast<int64_t>(r.result.filtered.size()) >= multiples_of_3);  // every one of them, and chance ties
  // Each batch was filled back to batch_groups trained groups, with one new prompt per filtered group.
  for (const auto& j : r.result.metrics) CHECK(j["rollouts/trained"].get<int64_t>() == batch_groups);
  CHECK(r.result.issued.size() == static_cast<size_t>(steps * batch_groups) + r.result.filtered.size());
  CHECK(r.result.metrics.back()["policy_version"].get<int64_t>() == steps);
  MESSAGE("dynamic sampling: " << r.result.issued.size() << " prompts issued for " << steps * batch_groups << " trained groups, "
                               << r.result.filtered.size() << " filtered");
}

TEST_CASE("dynamic sampling: a batch out of refill rounds trains what it has (here nothing); every prompt is accounted for") {
  torch::manual_seed(0);
  auto recorder = std::make_shared<RecordingReward>();
  recorder->all_tie = true;
  auto reward = std::make_shared<CombinedReward>(std::vector<WeightedReward>{{"ones", 1.0, recorder}});
  auto r = run(reward, [](int64_t) { return Mode::ok; }, "dynamic_rounds", 3, 1, [](GraphSpec& spec) {
    spec.dynamic_sampling = true;
    spec.dynamic_sampling_rounds = 2;
  });
  check_accounting(r, 3, 4, 0);
  CHECK(r.result.trained.empty());
  CHECK(r.result.issued.size() == 3 * 4 * 3);  // each batch: its 4 prompts, then two rounds of 4 more
  for (const auto& j : r.result.metrics) {
    CHECK(j["rollouts/filtered"].get<int64_t>() == 12);
    CHECK(j["dynamic_sampling/rounds"].get<int64_t>() == 2);
    CHECK(j["loss"].is_null());
    CHECK(j["policy_version"].get<int64_t>() == 0);
  }
}

namespace {

// A controller that keeps the trainer's step reports and takes every other message.
struct ReportsSeen {
  std::mutex mu;
  std::vector<StepReport> reports;
};

controller_actor::behavior_type recording_controller(std::shared_ptr<ReportsSeen> seen) {
  return {[](const WeightsReady&) {},
          [](const WeightsLoaded&) {},
          [seen](const StepReport& r) {
            std::lock_guard lock(seen->mu);
            seen->reports.push_back(r);
          },
          [](tick_atom) {},
          [](const ActorBusy&) {},
          [](join_atom) -> caf::result<int64_t, std::string, rollout_sink> { return caf::sec::unexpected_message; },
          [](join_atom, int64_t, const generator_actor&, int64_t) {},
          [](join_atom, const std::string&) -> caf::result<std::string, stage_router> { return caf::sec::unexpected_message; },
          [](stop_atom, int64_t) {},
          [](refill_atom, int64_t, int64_t) {}};
}

// A scored group of two completions of "1+1=" for `batch`, made by policy version 0.
RolloutGroup scored_group(int64_t ticket, int64_t batch) {
  RolloutGroup g;
  g.prompt_id = static_cast<uint64_t>(ticket);
  g.batch = batch;
  g.ticket = ticket;
  g.prompt_ids = {16, 10, 16, 28};
  g.completion_ids = {{17, 3}, {18, 3}};
  g.behaviour_logprobs = {{-1.0f, -0.5f}, {-2.0f, -0.5f}};
  g.min_version = g.max_version = {0, 0};
  g.truncated = {0, 0};
  g.rewards["correct"] = g.reward = {1.0, 0.0};
  return g;
}

}  // namespace

TEST_CASE("the trainer drops a second copy of a group, whether its batch is still filling or already trained") {
  // A prompt re-issued after its generator went away can come back twice. The trainer keeps only
  // the tickets of the batches it still buffers, so a copy that comes after its batch trained is
  // recognised by its batch, not by a record of every ticket the run has seen.
  torch::manual_seed(0);
  GraphSpec spec;
  spec.make_policy = [] { return load_model(test::fixtures() / "hf_models" / "llama3", {.tokenizer = false}).model; };
  spec.trainer = {.optimizer = {.lr = 1e-4}};
  spec.batch_groups = 2;
  spec.steps = 3;
  spec.sampling = {.n = 2, .temperature = 1.0, .max_tokens = 2};
  spec.max_staleness = 1;
  spec.quiet = true;
  auto seen = std::make_shared<ReportsSeen>();
  auto reports = [&] {
    std::lock_guard lock(seen->mu);
    return seen->reports;
  };
  caf::actor_system_config config;
  caf::actor_system system{config};
  auto controller = system.spawn(recording_controller, seen);
  auto trainer = spawn_trainer(system, &spec, controller);
  caf::anon_send(trainer, go_atom::value);
  auto wait_for = [&](size_t n) {
    for (int i = 0; i < 600 && reports().size() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    REQUIRE(reports().size() == n);  // within 60 s, or the trainer never trained the batch
  };
  caf::anon_send(trainer, scored_group(0, 0));
  caf::anon_send(trainer, scored_group(0, 0));  // while batch 0 fills
  caf::anon_send(trainer, scored_group(1, 0));
  wait_for(1);
  caf::anon_send(trainer, scored_group(1, 0));  // batch 0 has trained
  caf::anon_send(trainer, scored_group(2, 1));
  caf::anon_send(trainer, scored_group(3, 1));
  wait_for(2);
  auto r = reports();
  CHECK(r[0].trained == std::vector<int64_t>{0, 1});
  CHECK(r[1].trained == std::vector<int64_t>{2, 3});
  CHECK(nlohmann::json::parse(r[0].json)["rollouts/duplicates_dropped"] == 1);
  CHECK(nlohmann::json::parse(r[1].json)["rollouts/duplicates_dropped"] == 1);
  CHECK(nlohmann::json::parse(r[1].json)["policy_version"] == 2);
  caf::anon_send_exit(trainer, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(controller, caf::exit_reason::user_shutdown);
}
