// The engine against independent computations: a plain token-by-token loop, one request at
// a time, and log-probs recomputed by a full forward pass over prompt + completion.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "generator/engine.hpp"
#include "generator/generate.hpp"
#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "tests/test_util.hpp"
#include "trainer/trainer.hpp"

using namespace troupe;

namespace {

LoadedModel tiny(const std::string& name = "llama3") {
  return load_model(test::fixtures() / "hf_models" / name, {.tokenizer = false});
}

std::vector<std::vector<int32_t>> prompts() {
  return {{5, 9, 14, 20, 33}, {7, 8}, {100, 3, 44, 12, 19, 21, 150, 6, 77}, {42}, {11, 12, 13, 14}, {60, 61, 62}};
}

// log_softmax(logits / T) of each completion token, from one forward over prompt + completion.
std::vector<float> recompute_logprobs(TransformerImpl& model, const Completion& c, double temperature) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> all(c.prompt_ids.begin(), c.prompt_ids.end());
  all.insert(all.end(), c.ids.begin(), c.ids.end());
  const int64_t P = c.prompt_ids.size(), L = c.ids.size();
  auto ids = torch::tensor(all).unsqueeze(0);
  auto hidden = model.forward(ids, torch::arange((int64_t)all.size()).unsqueeze(0));
  auto logits = model.logits(hidden[0].narrow(0, P - 1, L));  // (L, V): row i predicts ids[i]
  auto logp = (temperature > 0 ? logits / temperature : logits).log_softmax(-1);
  auto target = torch::tensor(std::vector<int64_t>(c.ids.begin(), c.ids.end()));
  auto picked = logp.gather(1, target.unsqueeze(1)).squeeze(1);
  return std::vector<float>(picked.data_ptr<float>(), picked.data_ptr<float>() + L);
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (double)std::abs(a[i] - b[i]));
  return m;
}

}  // namespace

TEST_CASE("greedy engine output equals the plain token-by-token loop") {
  auto m = tiny();
  Engine engine(m.model, std::nullopt, {.max_batch = 4, .max_seq_len = 64});
  SamplingParams greedy{.temperature = 0, .max_tokens = 20, .ignore_eos = true};
  auto out = engine.generate(prompts(), greedy);
  REQUIRE(out.size() == prompts().size());
  for (size_t i = 0; i < out.size(); ++i) {
    auto ref = generate(*m.model, prompts()[i], greedy, {});
    CHECK(out[i].ids == ref.ids);
    CHECK(out[i].finish_reason == FinishReason::length);
    CHECK(out[i].prompt_ids == prompts()[i]);
  }
}

TEST_CASE("batched and one-at-a-time generation give the same tokens") {
  auto m = tiny("qwen3");
  for (double temperature : {0.0, 0.8}) {
    CAPTURE(temperature);
    SamplingParams params{.n = 2, .temperature = temperature, .top_p = 0.9, .max_tokens = 16, .ignore_eos = true,
                          .seed = 1234};
    Engine batched(m.model, std::nullopt, {.max_batch = 5, .max_seq_len = 64});
    auto together = batched.generate(prompts(), params);
    for (size_t i = 0; i < prompts().size(); ++i) {
      Engine alone(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 64});
      auto single = alone.generate({prompts()[i]}, params);
      for (int64_t s = 0; s < 2; ++s) CHECK(together[2 * i + s].ids == single[s].ids);
    }
  }
}

TEST_CASE("a seed reproduces samples, and different seeds differ") {
  auto m = tiny();
  Engine engine(m.model, std::nullopt, {.max_batch = 8, .max_seq_len = 64});
  SamplingParams params{.n = 4, .temperature = 1.0, .max_tokens = 24, .ignore_eos = true, .seed = 7};
  auto a = engine.generate({prompts()[0]}, params);
  auto b = engine.generate({prompts()[0]}, params);
  params.seed = 8;
  auto c = engine.generate({prompts()[0]}, params);
  for (int i = 0; i < 4; ++i) CHECK(a[i].ids == b[i].ids);
  CHECK(a[0].ids != c[0].ids);
  CHECK(a[0].ids != a[1].ids);  // the n samples are not copies of each other
}

TEST_CASE("prefix sharing: a request's samples decode the same tokens whether their prompt is prefilled per sample, copied, or held once") {
  for (const char* name : {"llama3", "qwen3"}) {
    CAPTURE(std::string(name));
    auto m = tiny(name);
    // max_batch 7 with n = 3: groups are admitted whole and split, beside rows of other groups
    // at other lengths, and a slot freed by one request is reused by the next.
    auto run = [&](PrefixSharing prefix, const SamplingParams& params) {
      Engine engine(m.model, std::nullopt, {.max_batch = 7, .max_seq_len = 64, .prefix = prefix});
      CHECK(engine.prefix_sharing() == prefix);  // float32 on the CPU: each runs as asked
      return engine.generate(prompts(), params);
    };
    for (double temperature : {0.0, 1.0}) {
      CAPTURE(temperature);
      SamplingParams params{.n = 3, .temperature = temperature, .max_tokens = 20, .ignore_eos = true, .seed = 11};
      auto separate = run(PrefixSharing::separate, params), copy = run(PrefixSharing::copy, params),
           shared = run(PrefixSharing::shared, params);
      REQUIRE(shared.size() == prompts().size() * 3);
      double worst = 0;
      for (size_t i = 0; i < shared.size(); ++i) {
        CHECK(separate[i].ids == copy[i].ids);  // the same prefill computed once or n times
        CHECK(separate[i].logprobs == copy[i].logprobs);
        CHECK(shared[i].ids == copy[i].ids);
        worst = std::max(worst, max_diff(shared[i].logprobs, copy[i].logprobs));
        // and the shared prefix's log-probs are the model's, from a full forward pass
        worst = std::max(worst, max_diff(shared[i].logprobs, recompute_logprobs(*m.model, shared[i], temperature > 0 ? temperature : 1.0)));
      }
      MESSAGE(std::string(name) << " T=" << temperature << ": shared prefix, max abs log-prob difference " << worst);
      CHECK(worst < 1e-5);
    }
  }
}

TEST_CASE("fixed-shape decode steps (what CUDA graphs replay) give the eager steps' tokens and log-probs") {
  for (const char* name : {"llama3", "qwen3"}) {
    CAPTURE(std::string(name));
    auto m = tiny(name);
    // max_batch 7: rows padded to 1, 2, 4 or 7; 30 new tokens after a 9-token prompt cross the
    // key spans 16, 32 and 64; groups of 3 split over slots beside other requests' rows.
    auto run = [&](DecodeMode mode, const SamplingParams& params) {
      Engine engine(m.model, std::nullopt, {.max_batch = 7, .max_seq_len = 64, .decode = mode});
      CHECK(engine.decode_mode() == mode);
      CHECK(engine.decode_graphs() == 0);  // nothing captured off a GPU
      return engine.generate(prompts(), params);
    };
    for (double temperature : {0.0, 1.0}) {
      CAPTURE(temperature);
      SamplingParams params{.n = 3, .temperature = temperature, .max_tokens = 30, .ignore_eos = true, .seed = 5};
      auto eager = run(DecodeMode::eager, params), fixed = run(DecodeMode::static_eager, params);
      REQUIRE(fixed.size() == eager.size());
      double worst = 0, worst_full = 0;
      for (size_t i = 0; i < fixed.size(); ++i) {
        CHECK(fixed[i].ids == eager[i].ids);
        worst = std::max(worst, max_diff(fixed[i].logprobs, eager[i].logprobs));
        worst_full = std::max(worst_full, max_diff(fixed[i].logprobs, recompute_logprobs(*m.model, fixed[i], temperature > 0 ? temperature : 1.0)));
      }
      MESSAGE(std::string(name) << " T=" << temperature << ": fixed shapes against eager, max abs log-prob difference "
                                << worst << "; against a full forward pass " << worst_full);
      CHECK(worst < 1e-5);
      CHECK(worst_full < 1e-4);
    }
  }
}

TEST_CASE("fixed-shape decode: vLLM's batch sizes and power-of-two key spans") {
  CHECK(StaticDecode::batch_sizes(1) == std::vector<int64_t>{1});
  CHECK(StaticDecode::batch_sizes(7) == std::vector<int64_t>{1, 2, 4, 7});
  CHECK(StaticDecode::batch_sizes(20) == std::vector<int64_t>{1, 2, 4, 8, 16, 20});
  CHECK(StaticDecode::batch_sizes(32) == std::vector<int64_t>{1, 2, 4, 8, 16, 24, 32});
  CHECK(StaticDecode::span_for(1, 64) == 16);
  CHECK(StaticDecode::span_for(16, 64) == 16);
  CHECK(StaticDecode::span_for(17, 64) == 32);
  CHECK(StaticDecode::span_for(40, 48) == 48);  // never past the cache
}

TEST_CASE("decode modes: automatic is eager on the CPU; graphs off a GPU and fixed shapes with batch-invariant kernels are errors") {
  auto m = tiny();
  Engine automatic(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 16});
  CHECK(automatic.decode_mode() == DecodeMode::eager);
  CHECK(automatic.prefix_sharing() == PrefixSharing::shared);
  Engine fixed(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 16, .decode = DecodeMode::static_eager});
  CHECK(fixed.prefix_sharing() == PrefixSharing::copy);  // fixed shapes read each slot's own keys
  CHECK_THROWS_WITH_AS(Engine(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 16, .decode = DecodeMode::graphs}),
                       doctest::Contains("CUDA"), Error);
  CHECK_THROWS_WITH_AS(Engine(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 16, .batch_invariant = true,
                                                      .decode = DecodeMode::static_eager}),
                       doctest::Contains("batch-invariant"), Error);
}

TEST_CASE("CUDA graphs: replayed decode steps give the eager steps' tokens and log-probs (GPU)") {
  if (!torch::cuda::is_available()) {
    MESSAGE("GPU part skipped: no CUDA device here");
    return;
  }
  auto m = tiny("qwen3");
  m.model->to(torch::Device(torch::kCUDA, 0));
  auto run = [&](DecodeMode mode, const SamplingParams& params, int64_t* graphs) {
    Engine engine(m.model, std::nullopt, {.max_batch = 7, .max_seq_len = 64, .decode = mode});
    auto out = engine.generate(prompts(), params);
    if (graphs) *graphs = engine.decode_graphs();
    return out;
  };
  Engine automatic(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 16});
  CHECK(automatic.decode_mode() == DecodeMode::graphs);
  for (double temperature : {0.0, 1.0}) {
    CAPTURE(temperature);
    SamplingParams params{.n = 3, .temperature = temperature, .max_tokens = 30, .ignore_eos = true, .seed = 5};
    int64_t graphs = 0;
    auto eager = run(DecodeMode::eager, params, nullptr), replayed = run(DecodeMode::graphs, params, &graphs);
    CHECK(graphs > 1);
    double worst = 0;
    for (size_t i = 0; i < replayed.size(); ++i) {
      CHECK(replayed[i].ids == eager[i].ids);
      worst = std::max(worst, max_diff(replayed[i].logprobs, eager[i].logprobs));
    }
    MESSAGE("T=" << temperature << ": " << graphs << " graphs, max abs log-prob difference against eager " << worst);
    CHECK(worst < 1e-4);
  }
}

TEST_CASE("prefix sharing falls back to copies where it cannot run: batch-invariant kernels, float64") {
  auto m = tiny();
  Engine invariant(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 16, .batch_invariant = true});
  CHECK(invariant.prefix_sharing() == PrefixSharing::copy);
  auto wide = tiny();
  wide.model->to(torch::kFloat64);
  Engine float64(wide.model, std::nullopt, {.max_batch = 2, .max_seq_len = 16});
  CHECK(float64.prefix_sharing() == PrefixSharing::copy);
  auto out = float64.generate({prompts()[0]}, {.n = 2, .temperature = 0, .max_tokens = 4, .ignore_eos = true});
  CHECK(out[0].ids == out[1].ids);
}

TEST_CASE("reported log-probs equal log_softmax(logits / T) from a full forward pass") {
  for (const char* name : {"llama3", "qwen2"}) {
    CAPTURE(std::string(name));
    auto m = tiny(name);
    Engine engine(m.model, std::nullopt, {.max_batch = 3, .max_seq_len = 64});
    for (auto params : {SamplingParams{.n = 3, .temperature = 0.7, .top_p = 0.9, .top_k = 40, .max_tokens = 20,
                                       .ignore_eos = true, .seed = 3},
                        SamplingParams{.n = 1, .temperature = 0.0, .max_tokens = 12, .ignore_eos = true}}) {
      auto out = engine.generate(prompts(), params);
      double worst = 0;
      for (const auto& c : out) {
        REQUIRE(c.logprobs.size() == c.ids.size());
        worst = std::max(worst, max_diff(c.logprobs, recompute_logprobs(*m.model, c, params.temperature)));
      }
      MESSAGE(std::string(name) << " T=" << params.temperature << " max abs log-prob error " << worst);
      CHECK(worst < 1e-4);
    }
  }
}

TEST_CASE("generator.weights int8 and int4: log-probs are the quantized policy's, equal to a full forward pass through it") {
  // The reference quantizes on every call (nothing kept) and runs the whole sequence at once; the
  // engine keeps its quantized copy and decodes a token at a time beside other sequences.
  SamplingParams params{.n = 2, .temperature = 0.8, .max_tokens = 16, .ignore_eos = true, .seed = 9};
  for (auto format : {WeightFormat::int8, WeightFormat::int4}) {
    for (const char* name : {"llama3", "qwen3"}) {
      CAPTURE(std::string(to_string(format)));
      CAPTURE(std::string(name));
      auto m = tiny(name);
      Engine engine(m.model, std::nullopt, {.max_batch = 4, .max_seq_len = 64, .weights = format});
      auto out = engine.generate(prompts(), params);
      auto quantized = tiny(name), full = tiny(name);
      quantized.model->set_weight_format(format);
      double worst = 0, from_full = 0;
      for (const auto& c : out) {
        worst = std::max(worst, max_diff(c.logprobs, recompute_logprobs(*quantized.model, c, params.temperature)));
        from_full = std::max(from_full, max_diff(c.logprobs, recompute_logprobs(*full.model, c, params.temperature)));
      }
      MESSAGE(std::string(name) << " " << to_string(format) << ": max abs log-prob error " << worst
                   << " against the quantized forward pass, " << from_full << " against the float one");
      CHECK(worst < 1e-4);
      CHECK(from_full > 1e-4);  // the quantization is real: the float policy is another one

      // New weights are requantized: the engine then samples the updated quantized policy.
      std::map<std::string, torch::Tensor> update;
      {
        torch::NoGradGuard no_grad;
        torch::manual_seed(5);
        for (auto& p : quantized.model->named_parameters()) {
          p.value().add_(torch::randn_like(p.value()) * 0.05);
          update[p.key()] = p.value().clone();
        }
      }
      engine.update_weights(update, 1);
      // ... there, not in the next decode step: the engine's kept copies (4 GEMMs a layer and the
      // LM head) are current when it returns, and the time it took is reported on its own.
      CHECK(engine.requantize_seconds() > 0);
      CHECK(m.model->prepare_weights(torch::kFloat32) == 0);
      {
        torch::NoGradGuard no_grad;
        m.model->named_parameters()["model.layers.1.mlp.down_proj.weight"].mul_(0.5);
      }
      CHECK(m.model->prepare_weights(torch::kFloat32) == 1);  // only the GEMM whose weight changed
      engine.update_weights(update, 1);
      CHECK(m.model->prepare_weights(torch::kFloat32) == 0);
      auto after = engine.generate({prompts()[2]}, params);
      for (const auto& c : after)
        CHECK(max_diff(c.logprobs, recompute_logprobs(*quantized.model, c, params.temperature)) < 1e-4);
    }
  }
  // Float weights have nothing to requantize.
  auto m = tiny();
  Engine engine(m.model, std::nullopt, {.max_batch = 4, .max_seq_len = 64});
  engine.update_weights({{"model.norm.weight", torch::ones_like(m.model->named_parameters()["model.norm.weight"])}}, 1);
  CHECK(engine.requantize_seconds() == 0);
  CHECK(m.model->prepare_weights(torch::kFloat32) == 0);
  // A weight whose input size int4's groups do not divide is refused, naming it; int8 takes it.
  auto config = tiny().model->config();
  config.hidden_size = 48;
  config.head_dim = 12;
  Transformer odd(config);
  CHECK_THROWS_WITH_AS(odd->set_weight_format(WeightFormat::int4),
                       "model.layers.0.self_attn.q_proj.weight [48, 48] cannot be int4: int4 needs the input size to be "
                       "a multiple of 32, got 48",
                       Error);
  CHECK_NOTHROW(odd->set_weight_format(WeightFormat::int8));
}

TEST_CASE("top_k = 1 and min_p = 1 sample the greedy token") {
  auto m = tiny();
  Engine engine(m.model, std::nullopt, {.max_batch = 4, .max_seq_len = 64});
  auto greedy = engine.generate(prompts(), {.temperature = 0, .max_tokens = 10, .ignore_eos = true});
  auto top1 = engine.generate(prompts(), {.temperature = 1.5, .top_k = 1, .max_tokens = 10, .ignore_eos = true});
  auto minp = engine.generate(prompts(), {.temperature = 1.5, .min_p = 1.0, .max_tokens = 10, .ignore_eos = true});
  for (size_t i = 0; i < greedy.size(); ++i) {
    CHECK(top1[i].ids == greedy[i].ids);
    CHECK(minp[i].ids == greedy[i].ids);
  }
}

TEST_CASE("stop tokens and stop strings end a completion with reason stop") {
  auto m = tiny();
  Engine engine(m.model, Tokenizer::load(test::data() / "tokenizers" / "qwen3"), {.max_batch = 4, .max_seq_len = 64});
  SamplingParams greedy{.temperature = 0, .max_tokens = 20, .ignore_eos = true};
  auto free_run = engine.generate({prompts()[2]}, greedy)[0];
  REQUIRE(free_run.ids.size() == 20);

  auto by_token = greedy;
  by_token.stop_token_ids = {free_run.ids[5]};
  auto c = engine.generate({prompts()[2]}, by_token)[0];
  CHECK(c.finish_reason == FinishReason::stop);
  CHECK(c.stop_token == free_run.ids[5]);
  CHECK(c.ids.back() == free_run.ids[5]);
  CHECK(c.ids.size() <= 6);

  // A stop string made of two tokens' text stops there and is cut from the text.
  std::string pair = engine.tokenizer()->decode(std::vector<int32_t>{free_run.ids[7], free_run.ids[8]});
  auto by_string = greedy;
  by_string.stop = {pair};
  c = engine.generate({prompts()[2]}, by_string)[0];
  CHECK(c.finish_reason == FinishReason::stop);
  CHECK(c.stop_string == pair);
  CHECK(c.text.find(pair) == std::string::npos);
  by_string.include_stop_str_in_output = true;
  c = engine.generate({prompts()[2]}, by_string)[0];
  CHECK(c.text.size() >= pair.size());
  CHECK(c.text.compare(c.text.size() - pair.size(), pair.size(), pair) == 0);
}

TEST_CASE("a weight update mid-run changes the tokens that follow and records both versions") {
  auto m = tiny();
  auto fresh = tiny();  // the same weights, perturbed into the "new policy"
  std::map<std::string, torch::Tensor> update;
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    for (auto& p : fresh.model->named_parameters()) {
      p.value().add_(torch::randn_like(p.value()) * 0.05);
      update[p.key()] = p.value().clone();
    }
  }
  SamplingParams params{.temperature = 0.9, .max_tokens = 16, .ignore_eos = true, .seed = 11};

  SUBCASE("partial_rollouts continue: running sequences go on, each token tagged with the version that sampled it") {
    Engine engine(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 64});
    engine.add_request(prompts()[0], params);
    for (int i = 0; i < 6; ++i) CHECK(engine.step().empty());  // step 1 prefills and decodes: 7 tokens
    engine.update_weights(update, 1);
    CHECK(engine.version() == 1);
    std::vector<Completion> out;
    while (out.empty()) out = engine.step();
    const auto& c = out[0];
    CHECK(c.min_version == 0);
    CHECK(c.max_version == 1);
    REQUIRE(c.versions.size() == c.ids.size());
    for (size_t i = 0; i < c.ids.size(); ++i) CHECK(c.versions[i] == (i < 7 ? 0 : 1));
    // Each token's log-prob is a fresh decode of the same prefix by the version it is tagged
    // with: version 0's weights (now gone from `m`, so a fresh copy) or version 1's, the cache
    // having been recomputed under them.
    auto old_model = tiny();
    auto old_lp = recompute_logprobs(*old_model.model, c, params.temperature);
    auto new_lp = recompute_logprobs(*fresh.model, c, params.temperature);
    for (size_t i = 0; i < c.ids.size(); ++i) CHECK(std::abs(c.logprobs[i] - (c.versions[i] == 0 ? old_lp[i] : new_lp[i])) < 1e-4);
    CHECK(max_diff(old_lp, new_lp) > 1e-3);  // the update really changed the distribution
  }
  SUBCASE("partial_rollouts finish: new weights are refused while a sequence is in progress, taken once none is") {
    Engine engine(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 64, .partial_rollouts = PartialRollouts::finish});
    engine.add_request(prompts()[0], params);
    engine.step();
    CHECK_THROWS_WITH_AS(engine.update_weights(update, 1), doctest::Contains("1 running, 0 waiting"), Error);
    CHECK(engine.version() == 0);
    std::vector<Completion> out;
    while (out.empty()) out = engine.step();
    CHECK(out[0].versions == std::vector<int64_t>(out[0].ids.size(), 0));
    auto old_model = tiny();
    CHECK(max_diff(out[0].logprobs, recompute_logprobs(*old_model.model, out[0], params.temperature)) < 1e-4);
    engine.update_weights(update, 1);
    CHECK(engine.version() == 1);
  }
  SUBCASE("partial_rollouts abort: running sequences start again on the new weights") {
    Engine engine(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 64, .partial_rollouts = PartialRollouts::abort});
    engine.add_request(prompts()[0], params);
    for (int i = 0; i < 6; ++i) engine.step();
    engine.update_weights(update, 3);
    std::vector<Completion> out;
    while (out.empty()) out = engine.step();
    CHECK(out[0].min_version == 3);
    CHECK(out[0].max_version == 3);
    CHECK(out[0].versions == std::vector<int64_t>(out[0].ids.size(), 3));
    Engine on_new(fresh.model, std::nullopt, {.max_batch = 2, .max_seq_len = 64});
    CHECK(out[0].ids == on_new.generate({prompts()[0]}, params)[0].ids);
  }
}

TEST_CASE("abort returns the request's samples with reason abort") {
  auto m = tiny();
  Engine engine(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 64});
  auto running = engine.add_request(prompts()[0], {.n = 2, .max_tokens = 30, .ignore_eos = true});
  auto queued = engine.add_request(prompts()[1], {.n = 2, .max_tokens = 30, .ignore_eos = true});
  engine.step();
  CHECK(engine.running() == 2);
  CHECK(engine.waiting() == 2);
  engine.abort(queued);
  engine.abort(running);
  auto out = engine.step();
  CHECK(out.size() == 4);
  for (const auto& c : out) CHECK(c.finish_reason == FinishReason::abort);
  CHECK(!engine.has_work());
}

TEST_CASE("invalid requests are refused with the reason") {
  auto m = tiny();
  Engine engine(m.model, std::nullopt, {.max_batch = 2, .max_seq_len = 32});
  CHECK_THROWS_WITH_AS(engine.add_request({}, {}), doctest::Contains("the prompt is empty"), Error);
  CHECK_THROWS_WITH_AS(engine.add_request({1, 999}, {}), doctest::Contains("prompt token id 999 is outside the vocabulary"), Error);
  CHECK_THROWS_WITH_AS(engine.add_request({1, 2}, {.max_tokens = 40}), doctest::Contains("exceeds max_seq_len 32"), Error);
  CHECK_THROWS_WITH_AS(engine.add_request({1, 2}, {.n = 3}), doctest::Contains("n = 3 must be between 1 and max_batch (2)"), Error);
  CHECK_THROWS_WITH_AS(engine.add_request({1, 2}, {.top_p = 0}), doctest::Contains("top_p"), Error);
  CHECK_THROWS_WITH_AS(engine.add_request({1, 2}, {.stop = {"x"}}), doctest::Contains("stop strings need a tokenizer"), Error);
  std::map<std::string, torch::Tensor> bad = {{"model.norm.weight", torch::zeros({3})}};
  CHECK_THROWS_WITH_AS(engine.update_weights(bad, 1), doctest::Contains("'model.norm.weight' is [3]"), Error);
  CHECK_THROWS_WITH_AS(engine.update_weights({{"nope", torch::zeros({1})}}, 1), doctest::Contains("unknown parameter 'nope'"), Error);
  CHECK(engine.version() == 0);
}

TEST_CASE("model.batch_invariant: the engine's log-probs are the trainer's recomputation bit for bit, whatever shares the batch") {
  // Mixed lengths and contents: six prompts of 1 to 9 tokens, 3 samples each, up to 4 to 14 new
  // tokens, through 5 slots, so sequences join and leave the decode batch at different positions.
  for (const char* name : {"llama3", "qwen3"}) {  // qwen3: q/k norms, grouped-query attention
    CAPTURE(name);
    auto m = tiny(name);
    Engine engine(m.model, std::nullopt, {.max_batch = 5, .max_seq_len = 64, .batch_invariant = true});
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < prompts().size(); ++i)
      ids.push_back(engine.add_request(prompts()[i], {.n = 3, .temperature = 1.0, .max_tokens = 4 + 2 * static_cast<int64_t>(i),
                                                      .ignore_eos = true, .seed = 100 + i}));
    std::map<uint64_t, std::vector<Completion>> by_request;
    while (engine.has_work())
      for (auto& c : engine.step()) by_request[c.request_id].push_back(std::move(c));
    // The trainer's side: a model of its own with the same weights, its groups packed as the
    // trainer packs them (right-padded to the longest), and each completion alone.
    auto trainer_model = tiny(name);
    trainer_model.model->set_batch_invariant(true);
    int64_t tokens = 0;
    double plain_worst = 0;
    auto plain_model = tiny(name);
    for (uint64_t id : ids) {
      auto& cs = by_request.at(id);
      REQUIRE(cs.size() == 3u);
      RolloutGroup group;
      group.prompt_ids = cs[0].prompt_ids;
      for (const auto& c : cs) group.completion_ids.push_back(c.ids);
      auto packed = completion_logprobs(*trainer_model.model, group, /*chunk=*/4);
      for (size_t i = 0; i < cs.size(); ++i) {
        CHECK(packed[i] == cs[i].logprobs);  // bit for bit
        RolloutGroup alone;
        alone.prompt_ids = group.prompt_ids;
        alone.completion_ids = {cs[i].ids};
        CHECK(completion_logprobs(*trainer_model.model, alone, 128)[0] == cs[i].logprobs);
        plain_worst = std::max(plain_worst, max_diff(completion_logprobs(*plain_model.model, alone, 128)[0], cs[i].logprobs));
        tokens += cs[i].ids.size();
      }
    }
    // The ATen kernels agree only to float rounding (and, the batch-invariant ones, with them).
    MESSAGE(std::string(name) << ": " << tokens << " tokens equal bit for bit; the plain forward pass differs by up to " << plain_worst);
    CHECK(plain_worst < 1e-4);
  }
}
