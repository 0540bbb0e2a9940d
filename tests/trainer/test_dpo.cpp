// DPO: the sigmoid loss and TRL's metrics against a hand computation and TRL's formula run in
// Python, pair reading and its errors, reference log-probs (against the rollout path) and their
// cache, accumulation, and a tiny model learning a preference from JSONL text.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "trainer/trainer.hpp"
#include "tests/test_util.hpp"

using namespace troupe;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const Tokenizer& qwen3() {
  static const Tokenizer tok = Tokenizer::load(test::data() / "tokenizers" / "qwen3");
  return tok;
}

fs::path write_file(const std::string& name, const std::string& text) {
  auto path = fs::temp_directory_path() / ("troupe_test_dpo_" + name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

std::string trained_text(const sft::Sequence& s, const Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < s.ids.size(); ++i)
    if (s.loss_mask[i]) ids.push_back(s.ids[i]);
  return tok.decode(ids);
}

double max_diff(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  double worst = 0;
  for (const auto& [name, t] : a) worst = std::max(worst, (t - b.at(name)).abs().max().item<double>());
  return worst;
}

// A pair over the tiny fixture models' vocabulary: prompt, then a response under the mask.
dpo::Pair id_pair(const std::vector<int32_t>& prompt, const std::vector<int32_t>& chosen,
                  const std::vector<int32_t>& rejected) {
  auto seq = [&](const std::vector<int32_t>& response) {
    sft::Sequence s;
    s.ids = prompt;
    s.ids.insert(s.ids.end(), response.begin(), response.end());
    s.loss_mask.assign(prompt.size(), 0);
    s.loss_mask.resize(s.ids.size(), 1);
    return s;
  };
  return {seq(chosen), seq(rejected)};
}

std::vector<dpo::Pair> id_pairs() {
  return {id_pair({5, 6, 7}, {8, 9}, {10}), id_pair({11, 12}, {13, 14, 15}, {16, 17}),
          id_pair({18, 19, 20, 21}, {22}, {23, 24, 25, 26}), id_pair({27}, {28, 29}, {30, 31})};
}

double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

}  // namespace

TEST_CASE("the sigmoid DPO loss and metrics equal a hand computation and TRL's formula in Python") {
  const auto ref = json::parse(std::ifstream(test::fixtures() / "sft" / "dpo_reference.json"));
  const double beta = ref["beta"], ls = ref["label_smoothing"];
  const auto pc = ref["policy_chosen"].get<std::vector<double>>(), pr = ref["policy_rejected"].get<std::vector<double>>();
  const auto rc = ref["ref_chosen"].get<std::vector<double>>(), rr = ref["ref_rejected"].get<std::vector<double>>();
  const size_t B = pc.size();

  // By hand, in doubles.
  double loss = 0, reward_c = 0, reward_r = 0, accuracy = 0, margin = 0;
  std::vector<double> grad_chosen(B);
  for (size_t i = 0; i < B; ++i) {
    const double h = (pc[i] - rc[i]) - (pr[i] - rr[i]);
    loss += (-(1 - ls) * log_sigmoid(beta * h) - ls * log_sigmoid(-beta * h)) / B;
    const double c = beta * (pc[i] - rc[i]), r = beta * (pr[i] - rr[i]);
    reward_c += c / B;
    reward_r += r / B;
    accuracy += (c > r ? 1.0 : 0.0) / B;
    margin += (c - r) / B;
    // d loss / d chosen_i = -(beta / B) ((1 - ls) sigmoid(-beta h) - ls sigmoid(beta h))
    grad_chosen[i] = -(beta / B) * ((1 - ls) * sigmoid(-beta * h) - ls * sigmoid(beta * h));
  }

  auto t = [](const std::vector<double>& v) { return torch::tensor(v, torch::kFloat64); };
  auto chosen = t(pc).requires_grad_(true);
  auto out = dpo::loss({chosen, t(pr), t(rc), t(rr)}, {.beta = beta, .label_smoothing = ls});
  out.loss.backward();
  MESSAGE("DPO loss " << out.loss.item<double>() << "; by hand " << loss << " (|diff| "
                      << std::abs(out.loss.item<double>() - loss) << "), TRL's formula in Python "
                      << ref["loss"].get<double>() << " (|diff| " << std::abs(out.loss.item<double>() - ref["loss"].get<double>())
                      << ")");
  CHECK(std::abs(out.loss.item<double>() - loss) <= 1e-12);
  CHECK(std::abs(out.loss.item<double>() - ref["loss"].get<double>()) <= 1e-12);
  CHECK(out.reward_chosen == doctest::Approx(reward_c).epsilon(1e-12));
  CHECK(out.reward_rejected == doctest::Approx(reward_r).epsilon(1e-12));
  CHECK(out.accuracy == accuracy);
  CHECK(out.margin == doctest::Approx(margin).epsilon(1e-12));
  CHECK(out.reward_chosen == doctest::Approx(ref["rewards/chosen"].get<double>()).epsilon(1e-12));
  CHECK(out.reward_rejected == doctest::Approx(ref["rewards/rejected"].get<double>()).epsilon(1e-12));
  CHECK(out.accuracy == ref["rewards/accuracies"].get<double>());
  CHECK(out.margin == doctest::Approx(ref["rewards/margins"].get<double>()).epsilon(1e-12));
  for (size_t i = 0; i < B; ++i) CHECK(chosen.grad()[i].item<double>() == doctest::Approx(grad_chosen[i]).epsilon(1e-12));

  // Without smoothing, at policy == reference, the loss is log 2 and no pair counts as won.
  auto equal = dpo::loss({t(rc), t(rr), t(rc), t(rr)}, {.beta = beta});
  CHECK(equal.loss.item<double>() == doctest::Approx(std::log(2.0)).epsilon(1e-12));
  CHECK(equal.accuracy == 0.0);
  CHECK_THROWS(dpo::loss({t(pc), t(pr), t(rc), t(rr)}, {.beta = beta, .label_smoothing = 0.5}));
}

TEST_CASE("read_jsonl: chat pairs share the prompt; responses are the trained span") {
  const auto file = write_file("pairs.jsonl", json{{"prompt", "2+2?"}, {"chosen", "4"}, {"rejected", "5"}}.dump() + "\n");
  auto pairs = dpo::read_jsonl(file, qwen3(), {.chat_template = ChatTemplate::chatml()});
  REQUIRE(pairs.size() == 1);
  const auto& p = pairs[0];
  CHECK(p.line == 1);
  CHECK(std::isnan(p.ref_chosen));
  CHECK(trained_text(p.chosen, qwen3()) == "4<|im_end|>");
  CHECK(trained_text(p.rejected, qwen3()) == "5<|im_end|>");
  CHECK(qwen3().decode(p.chosen.ids) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n");
  const auto prompt_len = std::find(p.chosen.loss_mask.begin(), p.chosen.loss_mask.end(), 1) - p.chosen.loss_mask.begin();
  CHECK(std::equal(p.chosen.ids.begin(), p.chosen.ids.begin() + prompt_len, p.rejected.ids.begin()));

  auto plain = dpo::read_jsonl(file, qwen3(), {.chat = false});
  CHECK(qwen3().decode(plain[0].chosen.ids) == "2+2?4<|im_end|>");
  CHECK(trained_text(plain[0].rejected, qwen3()) == "5<|im_end|>");
}

TEST_CASE("bad preference files: errors name the file and the line") {
  const std::string good = json{{"prompt", "p"}, {"chosen", "a"}, {"rejected", "b"}}.dump() + "\n";
  const dpo::DataOptions o{.chat_template = ChatTemplate::chatml()};
  auto expect = [&](const fs::path& file, const std::string& where, const std::string& what, dpo::DataOptions opt) {
    const auto message = error_of([&] { dpo::read_jsonl(file, qwen3(), opt); });
    INFO(message);
    CHECK(message.starts_with(file.string() + where));
    CHECK(message.find(what) != std::string::npos);
  };
  expect(write_file("missing.jsonl", good + json{{"prompt", "p"}, {"chosen", "a"}}.dump() + "\n"), ":2:",
         "no field 'rejected'", o);
  expect(write_file("type.jsonl", json{{"prompt", "p"}, {"chosen", 1}, {"rejected", "b"}}.dump()), ":1:",
         "field 'chosen' is number", o);
  expect(write_file("emptyresp.jsonl", good + good + json{{"prompt", "p"}, {"chosen", "a"}, {"rejected", ""}}.dump()), ":3:",
         "field 'rejected' is empty", dpo::DataOptions{.chat = false, .append_eos = false});
  expect(write_file("json.jsonl", "[1, 2]\n"), ":1:", "expected a JSON object", o);
  expect(write_file("empty.jsonl", ""), "", "no preference pairs", o);
  auto long_opt = o;
  long_opt.max_length = 10;
  expect(write_file("long.jsonl", good), ":1:", "above max_length 10", long_opt);
}

TEST_CASE("reference log-probs: summed response log-probs equal the rollout path's; the cache round-trips") {
  auto m = load_model(test::fixtures() / "hf_models" / "llama3", {.tokenizer = false});
  auto pairs = id_pairs();
  dpo::compute_reference(*m.model, pairs, {.batch_pairs = 3});
  for (const auto& p : pairs) {
    // The same numbers through completion_logprobs (prompt + completion rows, positions from the mask).
    const auto prompt_len = std::find(p.chosen.loss_mask.begin(), p.chosen.loss_mask.end(), 1) - p.chosen.loss_mask.begin();
    RolloutGroup g;
    g.prompt_ids.assign(p.chosen.ids.begin(), p.chosen.ids.begin() + prompt_len);
    g.completion_ids = {{p.chosen.ids.begin() + prompt_len, p.chosen.ids.end()},
                        {p.rejected.ids.begin() + prompt_len, p.rejected.ids.end()}};
    auto lp = completion_logprobs(*m.model, g);
    double c = 0, r = 0;
    for (float v : lp[0]) c += v;
    for (float v : lp[1]) r += v;
    CHECK(p.ref_chosen == doctest::Approx(c).epsilon(1e-5));
    CHECK(p.ref_rejected == doctest::Approx(r).epsilon(1e-5));
    CHECK(p.ref_chosen < 0);
  }

  const auto cache = fs::temp_directory_path() / "troupe_test_dpo_cache" / "ref.json";
  fs::remove_all(cache.parent_path());
  auto first = id_pairs();
  dpo::compute_reference(*m.model, first, {.cache = cache, .model_id = "llama3"});
  REQUIRE(fs::exists(cache));
  auto again = id_pairs();
  // A different model with the same cache: the cached values come back, so the model is not read.
  auto other = load_model(test::fixtures() / "hf_models" / "qwen2", {.tokenizer = false});
  dpo::compute_reference(*other.model, again, {.cache = cache, .model_id = "llama3"});
  for (size_t i = 0; i < again.size(); ++i) {
    CHECK(again[i].ref_chosen == first[i].ref_chosen);
    CHECK(again[i].ref_rejected == first[i].ref_rejected);
  }
  auto changed = id_pairs();
  changed[2].rejected.ids.back() = 99;
  auto message = error_of([&] { dpo::compute_reference(*m.model, changed, {.cache = cache, .model_id = "llama3"}); });
  CHECK(message.starts_with(cache.string()));
  CHECK(message.find("delete the file") != std::string::npos);
  CHECK(error_of([&] { dpo::compute_reference(*m.model, again, {.cache = cache, .model_id = "qwen2"}); })
            .starts_with(cache.string()));
}

// Caches of the right format whose fields have other types: each an Error naming the file, never
// an exception from the JSON library or a float cast to a count.
TEST_CASE("broken reference caches are errors naming the file") {
  auto m = load_model(test::fixtures() / "hf_models" / "llama3", {.tokenizer = false});
  const auto cache = fs::temp_directory_path() / "troupe_test_dpo_bad_cache" / "ref.json";
  fs::create_directories(cache.parent_path());
  for (const std::string fields : {R"("pairs": -1)", R"("pairs": 4.5)", R"("pairs": 1e300)", R"("pairs": "4")",
                                   R"("pairs": 4, "fingerprint": 7)", R"("pairs": 4, "model_id": ["llama3"])"}) {
    std::ofstream(cache) << R"({"format": "troupe-dpo-reference", "version": 1, )" << fields << "}\n";
    auto pairs = id_pairs();
    const std::string message = error_of([&] { dpo::compute_reference(*m.model, pairs, {.cache = cache, .model_id = "llama3"}); });
    CAPTURE(fields);
    CAPTURE(message);
    CHECK(message.starts_with(cache.string() + ": "));
    CHECK(message.find("delete") != std::string::npos);
  }
  for (const std::string text : {R"({"format": 5})", R"({"format": "troupe-dpo-reference", "version": "1"})"}) {
    std::ofstream(cache) << text;
    auto pairs = id_pairs();
    CHECK(error_of([&] { dpo::compute_reference(*m.model, pairs, {.cache = cache}); }).starts_with(cache.string() + ": "));
  }
  fs::remove_all(cache.parent_path());
}

TEST_CASE("dpo_step: log 2 at the start, and micro-batches accumulate to the whole batch's gradient") {
  // The gradients of one dpo_step, caught by hooks on the parameters (summed over micro-batches).
  auto run = [](int64_t micro, DpoMetrics* first) {
    auto m = load_model(test::fixtures() / "hf_models" / "qwen2", {.tokenizer = false});
    auto ref = load_model(test::fixtures() / "hf_models" / "qwen2", {.tokenizer = false});
    auto pairs = id_pairs();
    dpo::compute_reference(*ref.model, pairs);
    Trainer trainer(m.model, {.optimizer = {.lr = 1e-2, .max_grad_norm = 0},
                              .dpo = {.beta = 0.1, .label_smoothing = 0.2}, .dpo_micro_pairs = micro});
    *first = trainer.dpo_step(pairs);  // policy == reference here
    std::map<std::string, torch::Tensor> grads;
    for (auto& [name, p] : m.model->named_parameters().pairs())
      p.register_hook([out = &grads, key = name](torch::Tensor g) {
        auto& slot = (*out)[key];
        slot = slot.defined() ? slot + g : g.clone();
        return g;
      });
    trainer.dpo_step(pairs);
    return grads;
  };
  DpoMetrics a, b;
  auto whole = run(0, &a), parts = run(3, &b);
  CHECK(a.loss == doctest::Approx(std::log(2.0)).epsilon(1e-6));
  CHECK(std::abs(a.reward_chosen) < 1e-6);
  CHECK(a.accuracy == 0.0);
  CHECK(a.pairs == 4);
  CHECK(b.loss == doctest::Approx(a.loss).epsilon(1e-6));  // float32 sums in another order (bitwise with 2 threads, not with 1)
  MESSAGE("max |grad diff| of 3-pair micro-batches vs one batch of 4: " << max_diff(whole, parts));
  CHECK(max_diff(whole, parts) <= 1e-6);

  auto m = load_model(test::fixtures() / "hf_models" / "qwen2", {.tokenizer = false});
  auto pairs = id_pairs();
  dpo::compute_reference(*m.model, pairs);
  pairs[1].ref_rejected = std::nan("");
  pairs[1].line = 7;
  Trainer trainer(m.model, {});
  CHECK(error_of([&] { trainer.dpo_step(pairs); }).find("line 7 has no reference log-probs") != std::string::npos);
}

namespace {

Transformer tiny_llama(int64_t vocab, uint64_t seed) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.model_type = "llama";
  c.vocab_size = vocab;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 512;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  torch::manual_seed(seed);
  return Transformer(c);
}

std::string digits(std::mt19937& rng, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>('0' + rng() % 10);
  return s;
}

// The prompt's digits (chosen) against a copy with one digit changed (rejected).
std::string preference_line(std::mt19937& rng, const std::string& d) {
  std::string wrong = d;
  const size_t at = rng() % d.size();
  wrong[at] = static_cast<char>('0' + (wrong[at] - '0' + 1 + rng() % 9) % 10);
  return json{{"prompt", d}, {"chosen", d}, {"rejected", wrong}}.dump() + "\n";
}

}  // namespace

TEST_CASE("DPO teaches a tiny model a preference it generalises: held-out rewards/accuracies above 0.9") {
  const auto tok = Tokenizer::load(test::fixtures() / "sft" / "bytes");
  std::mt19937 rng(3);
  std::set<std::string> held;
  while (held.size() < 40) held.insert(digits(rng, 4));
  std::string train_text, eval_text;
  for (const auto& d : held) eval_text += preference_line(rng, d);
  for (int i = 0; i < 1000; ++i) {
    auto d = digits(rng, 4);
    if (!held.count(d)) train_text += preference_line(rng, d);
  }
  auto train = dpo::read_jsonl(write_file("copy_train.jsonl", train_text), tok);
  auto eval = dpo::read_jsonl(write_file("copy_eval.jsonl", eval_text), tok);

  auto policy = tiny_llama(tok.vocab_size(), 0);
  auto reference = tiny_llama(tok.vocab_size(), 0);  // the same seed: the same initial weights
  dpo::compute_reference(*reference, train);
  dpo::compute_reference(*reference, eval);

  const int steps = 300, batch = 16;
  Trainer trainer(policy, {.optimizer = {.lr = 3e-3, .warmup_steps = 5, .total_steps = steps, .min_lr_ratio = 0.1},
                           .dpo = {.beta = 0.1}});
  const auto before = trainer.dpo_eval(eval);
  DpoMetrics last;
  for (int step = 0; step < steps; ++step) {
    std::vector<dpo::Pair> picked;
    for (int i = 0; i < batch; ++i) picked.push_back(train[rng() % train.size()]);
    last = trainer.dpo_step(picked);
  }
  const auto after = trainer.dpo_eval(eval);
  MESSAGE("held-out: loss " << before.loss << " -> " << after.loss << ", rewards/accuracies " << before.accuracy << " -> "
                            << after.accuracy << ", rewards/margins " << before.margin << " -> " << after.margin
                            << "; last train step: loss " << last.loss << ", accuracy " << last.accuracy);
  CHECK(before.accuracy == 0.0);  // policy == reference: no pair is won yet
  CHECK(after.accuracy > 0.9);
  CHECK(after.loss < 0.5 * before.loss);
  CHECK(after.margin > 0);
}
