// SFT: assistant-only masks against transformers' on known chats, JSONL reading and its errors,
// packing (same loss as padding), accumulation, activation checkpointing, a restricted parameter
// list, optimizer state round trips, and a tiny model learning to reverse digits from JSONL text.
#include <doctest/doctest.h>

#include <fstream>
#include <random>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "generator/engine.hpp"
#include "policy/checkpoint.hpp"
#include "policy/error.hpp"
#include "policy/lora.hpp"
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
  auto path = fs::temp_directory_path() / ("troupe_test_sft_" + name);
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

// The decoded text of each run of trained tokens.
std::vector<std::string> trained_spans(const sft::Sequence& s, const Tokenizer& tok) {
  std::vector<std::string> spans;
  std::vector<int32_t> run;
  for (size_t i = 0; i <= s.ids.size(); ++i) {
    if (i < s.ids.size() && s.loss_mask[i]) {
      run.push_back(s.ids[i]);
    } else if (!run.empty()) {
      spans.push_back(tok.decode(run));
      run.clear();
    }
  }
  return spans;
}

// Random documents over the tiny models' vocabulary, each with a prompt part and a trained part.
std::vector<sft::Sequence> random_sequences(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<sft::Sequence> out;
  for (int i = 0; i < n; ++i) {
    sft::Sequence s;
    const int prompt = 2 + rng() % 6, response = 1 + rng() % 7;
    for (int t = 0; t < prompt + response; ++t) {
      s.ids.push_back(3 + rng() % 150);
      s.loss_mask.push_back(t >= prompt);
    }
    out.push_back(std::move(s));
  }
  return out;
}

double max_diff(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  double worst = 0;
  for (const auto& [name, t] : a) worst = std::max(worst, (t - b.at(name)).abs().max().item<double>());
  return worst;
}

// The gradients of one sft_step, caught by hooks on the parameters before the step zeroes
// them: summed over the micro-batches' backward passes, or (`last`) the last value seen. A
// checkpointed layer's parameters see their hook twice per backward pass, once inside the
// layer's recomputation and once as the node hands the gradient on; both times the same value.
std::map<std::string, torch::Tensor> step_gradients(Trainer& trainer, std::span<const sft::Batch> batches, bool last,
                                                    SftMetrics* metrics = nullptr, std::map<std::string, int>* calls = nullptr) {
  std::map<std::string, torch::Tensor> captured;
  for (auto& [name, p] : trainer.model()->named_parameters().pairs()) {
    if (!p.requires_grad()) continue;  // frozen
    p.register_hook([out = &captured, key = name, last, calls](torch::Tensor g) {
      if (calls) ++(*calls)[key];
      auto& slot = (*out)[key];
      slot = slot.defined() && !last ? slot + g : g.clone();
      return g;
    });
  }
  auto m = trainer.sft_step(batches);
  if (metrics) *metrics = m;
  return captured;
}

LoadedModel fixture_model(const std::string& name) {
  return load_model(test::fixtures() / "hf_models" / name, {.tokenizer = false});
}

}  // namespace

TEST_CASE("assistant masks equal transformers' {% generation %} masks on known chats") {
  const auto cases = json::parse(std::ifstream(test::fixtures() / "sft" / "chat_masks.json"));
  REQUIRE(cases.size() == 3);
  for (const auto& c : cases) {
    std::vector<ChatMessage> messages;
    for (const auto& m : c["messages"]) messages.push_back({m["role"], m["content"]});
    auto s = sft::encode_chat(messages, ChatTemplate::chatml(), qwen3());
    CHECK(s.ids == c["ids"].get<std::vector<int32_t>>());
    CHECK(s.loss_mask == c["assistant_mask"].get<std::vector<uint8_t>>());
  }
}

TEST_CASE("the trained span is each assistant turn's content and its end-of-turn token") {
  const std::vector<ChatMessage> chat{{"system", "Be brief."}, {"user", "2+2?"}, {"assistant", "4"},
                                      {"user", "and 3+3?"}, {"assistant", "6"}};
  SUBCASE("ChatML: <|im_end|> trained, the newline after it not") {
    auto s = sft::encode_chat(chat, ChatTemplate::chatml(), qwen3());
    CHECK(trained_spans(s, qwen3()) == std::vector<std::string>{"4<|im_end|>", "6<|im_end|>"});
    CHECK(qwen3().decode(s.ids) == ChatTemplate::chatml().render(chat, false));
    // Which positions: the last three tokens are "6", <|im_end|>, "\n".
    const size_t L = s.ids.size();
    CHECK(s.loss_mask[L - 1] == 0);
    CHECK(s.loss_mask[L - 2] == 1);
    CHECK(s.loss_mask[L - 3] == 1);
    CHECK(s.loss_mask[L - 4] == 0);  // the "\n" of the assistant header
    CHECK(s.ids[L - 2] == *qwen3().token_id("<|im_end|>"));
  }
  SUBCASE("Qwen3's own template: the last turn's empty think block is part of what the model writes") {
    auto t = ChatTemplate::detect(*qwen3().chat_template(), "qwen3");
    auto s = sft::encode_chat(chat, t, qwen3());
    CHECK(trained_spans(s, qwen3()) == std::vector<std::string>{"4<|im_end|>", "<think>\n\n</think>\n\n6<|im_end|>"});
  }
  SUBCASE("Llama-3: <|eot_id|> trained, headers not") {
    auto s = sft::encode_chat(chat, ChatTemplate::llama3(), qwen3());
    CHECK(trained_spans(s, qwen3()) == std::vector<std::string>{"4<|eot_id|>", "6<|eot_id|>"});
  }
  SUBCASE("a conversation without an assistant turn is an error") {
    CHECK(error_of([&] { sft::encode_chat(std::span(chat).first(2), ChatTemplate::chatml(), qwen3()); })
              .find("no assistant message") != std::string::npos);
  }
}

TEST_CASE("read_jsonl: chat records, prompt/response records, plain text with eos") {
  const auto chat_file = write_file("chat.jsonl",
      json{{"messages", {{{"role", "user"}, {"content", "hi"}}, {{"role", "assistant"}, {"content", "hello"}}}}}.dump() +
      "\n\n" + json{{"messages", {{{"role", "user"}, {"content", "a"}}, {{"role", "assistant"}, {"content", "b"}}}}}.dump() + "\n");
  auto chats = sft::read_jsonl(chat_file, qwen3(), {.chat_template = ChatTemplate::chatml()});
  REQUIRE(chats.size() == 2);
  CHECK(chats[0].line == 1);
  CHECK(chats[1].line == 3);
  CHECK(trained_spans(chats[0], qwen3()) == std::vector<std::string>{"hello<|im_end|>"});

  const auto qa = write_file("qa.jsonl", json{{"question", "1+1"}, {"answer", "2"}}.dump() + "\n");
  auto pairs = sft::read_jsonl(qa, qwen3(), {.prompt_field = "question", .response_field = "answer",
                                             .chat_template = ChatTemplate::chatml(), .system = "Add."});
  CHECK(qwen3().decode(pairs[0].ids) ==
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n");
  CHECK(trained_spans(pairs[0], qwen3()) == std::vector<std::string>{"2<|im_end|>"});

  auto plain = sft::read_jsonl(qa, qwen3(), {.prompt_field = "question", .response_field = "answer", .chat = false});
  CHECK(qwen3().decode(plain[0].ids) == "1+12<|im_end|>");  // Qwen3's eos is <|im_end|>
  CHECK(trained_spans(plain[0], qwen3()) == std::vector<std::string>{"2<|im_end|>"});
}

TEST_CASE("bad SFT files: errors name the file and the line") {
  const sft::DataOptions chat{.chat_template = ChatTemplate::chatml()};
  const sft::DataOptions qa{.prompt_field = "question", .response_field = "answer", .chat_template = ChatTemplate::chatml()};
  const std::string good = json{{"question", "q"}, {"answer", "a"}}.dump() + "\n";
  const std::string good_chat =
      json{{"messages", {{{"role", "user"}, {"content", "q"}}, {{"role", "assistant"}, {"content", "a"}}}}}.dump() + "\n";
  auto expect = [](const fs::path& file, const sft::DataOptions& o, const std::string& where, const std::string& what) {
    const auto message = error_of([&] { sft::read_jsonl(file, qwen3(), o); });
    INFO(message);
    CHECK(message.starts_with(file.string() + where));
    CHECK(message.find(what) != std::string::npos);
  };
  SUBCASE("missing field") {
    expect(write_file("missing.jsonl", good + good + json{{"question", "q"}}.dump() + "\n"), qa, ":3:", "no field 'answer'");
  }
  SUBCASE("field of the wrong type") {
    expect(write_file("type.jsonl", json{{"question", 3}, {"answer", "a"}}.dump() + "\n"), qa, ":1:",
           "field 'question' is number");
  }
  SUBCASE("unknown role") {
    expect(write_file("role.jsonl", good_chat +
               json{{"messages", {{{"role", "tool"}, {"content", "x"}}, {{"role", "assistant"}, {"content", "a"}}}}}.dump()),
           chat, ":2:", "message 0 has role 'tool'");
  }
  SUBCASE("no messages field") { expect(write_file("nomsg.jsonl", good), chat, ":1:", "no field 'messages'"); }
  SUBCASE("no assistant turn") {
    expect(write_file("noasst.jsonl", json{{"messages", {{{"role", "user"}, {"content", "q"}}}}}.dump()), chat, ":1:",
           "no assistant message");
  }
  SUBCASE("malformed JSON") { expect(write_file("bad.jsonl", good + "{\"question\": \"q\",\n"), qa, ":2:", "not valid JSON"); }
  SUBCASE("empty file") { expect(write_file("empty.jsonl", "\n  \n"), qa, "", "no examples"); }
  SUBCASE("missing file") { expect(fs::temp_directory_path() / "troupe_no_such.jsonl", qa, "", "cannot open"); }
  SUBCASE("longer than max_length: error, truncate or drop") {
    const auto file = write_file("long.jsonl", good + json{{"question", std::string(200, '7')}, {"answer", "a"}}.dump() + "\n");
    auto o = qa;
    o.max_length = 40;
    expect(file, o, ":2:", "above max_length 40");
    o.overlong = sft::Overlong::drop;
    sft::ReadReport report;
    CHECK(sft::read_jsonl(file, qwen3(), o, &report).size() == 1);
    CHECK(report.dropped == 1);
    o.overlong = sft::Overlong::truncate;  // the prompt alone fills 40 tokens: nothing left to train
    CHECK(sft::read_jsonl(file, qwen3(), o, &report).size() == 1);
    CHECK(report.dropped == 1);
    o.max_length = 12;
    auto cut = sft::read_jsonl(write_file("cut.jsonl", json{{"question", "q"}, {"answer", std::string(100, '8')}}.dump()),
                               qwen3(), o, &report);
    CHECK(cut[0].size() == 12);
    CHECK(report.truncated == 1);
  }
}

TEST_CASE("packing: rows within max_length, every sequence once, positions restart, no target across documents") {
  auto seqs = random_sequences(40, 1);
  auto rows = sft::pack(seqs, 24);
  std::multiset<int64_t> seen;
  for (const auto& row : rows) {
    int64_t len = 0;
    for (int64_t i : row) {
      len += seqs[i].size();
      seen.insert(i);
    }
    CHECK(len <= 24);
  }
  CHECK(seen.size() == seqs.size());
  CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == seqs.size());
  int64_t total = 0;
  for (const auto& s : seqs) total += s.size();
  CHECK(rows.size() < seqs.size() / 2);  // they do share rows
  CHECK(static_cast<int64_t>(rows.size()) <= total / 24 + 2);

  auto b = sft::collate(seqs, rows);
  const auto& first = rows[0];
  int64_t t = 0;
  for (int64_t i : first) {
    CHECK(b.positions[0][t].item<int64_t>() == 0);
    if (t > 0) CHECK(b.loss_mask[0][t - 1].item<float>() == 0);  // the last token of a document predicts nothing
    t += seqs[i].size();
  }
  int64_t trained = 0;
  for (const auto& s : seqs) trained += s.trained_tokens();
  CHECK(b.tokens == trained);  // first tokens are never trained here (prompts come first)
  CHECK(sft::collate(seqs).tokens == trained);
  CHECK_THROWS_AS(sft::pack(seqs, 5), Error);
}

TEST_CASE("packed and padded batches give the same loss and the same gradients") {
  for (std::string name : {"llama3", "qwen3"}) {
    CAPTURE(name);
    auto seqs = random_sequences(24, 2);
    auto run = [&](bool packing, int64_t micro_rows, std::map<std::string, torch::Tensor>& grads) {
      auto m = fixture_model(name);
      Trainer trainer(m.model, {.optimizer = {.lr = 1e-2, .max_grad_norm = 0}});
      auto batches = sft::micro_batches(seqs, {.packing = packing, .max_length = 32, .micro_rows = micro_rows});
      const double eval = trainer.sft_eval(batches);
      SftMetrics metrics;
      grads = step_gradients(trainer, batches, /*last=*/false, &metrics);
      CHECK(metrics.loss == doctest::Approx(eval).epsilon(1e-6));
      CHECK(metrics.sequences == 24);
      return eval;
    };
    std::map<std::string, torch::Tensor> padded_g, packed_g, micro_g;
    const double padded = run(false, 0, padded_g);
    const double packed = run(true, 0, packed_g);
    const double packed_micro = run(true, 2, micro_g);
    MESSAGE(name << ": padded loss " << padded << ", packed " << packed << ", |diff| " << std::abs(padded - packed)
                 << "; max |grad diff| packed vs padded " << max_diff(packed_g, padded_g)
                 << ", 2-row micro-batches vs one batch " << max_diff(micro_g, packed_g));
    CHECK(std::abs(padded - packed) <= 1e-5);
    CHECK(std::abs(packed_micro - packed) <= 1e-5);
    CHECK(max_diff(packed_g, padded_g) <= 1e-6);
    CHECK(max_diff(micro_g, packed_g) <= 1e-6);
  }
}

TEST_CASE("the old prompt/completion sft_step is the same loss as the batch path") {
  auto m = fixture_model("qwen2");
  Trainer trainer(m.model, {.optimizer = {.lr = 0.0}});
  std::vector<SftExample> examples{{{5, 6, 7}, {8, 9}}, {{10, 11}, {12, 13, 14}}};
  std::vector<sft::Sequence> seqs{{{5, 6, 7, 8, 9}, {0, 0, 0, 1, 1}}, {{10, 11, 12, 13, 14}, {0, 0, 1, 1, 1}}};
  const double eval = trainer.sft_eval(sft::micro_batches(seqs, {.packing = true, .max_length = 16}));
  CHECK(trainer.sft_step(examples) == doctest::Approx(eval).epsilon(1e-6));
}

TEST_CASE("activation checkpointing: the same loss and gradients, also through a padded GRPO step") {
  for (std::string name : {"llama3", "qwen2", "qwen3", "llama_tied"}) {
    CAPTURE(name);
    auto seqs = random_sequences(12, 3);
    auto grads = [&](bool checkpointing) {
      auto m = fixture_model(name);
      Trainer trainer(m.model, {.optimizer = {.lr = 0.0, .max_grad_norm = 0}, .activation_checkpointing = checkpointing});
      auto batches = sft::micro_batches(seqs, {.packing = true, .max_length = 40});
      REQUIRE(batches.size() == 1);
      const double nll = trainer.sft_eval(batches);
      SftMetrics metrics;
      std::map<std::string, int> calls;
      auto g = step_gradients(trainer, batches, /*last=*/true, &metrics, &calls);
      CHECK(metrics.loss == doctest::Approx(nll).epsilon(1e-6));
      // The sign that the layers really were recomputed: their parameters' hooks fired twice.
      CHECK(calls.at("model.layers.1.mlp.down_proj.weight") == (checkpointing ? 2 : 1));
      CHECK(calls.at("model.norm.weight") == 1);
      return g;
    };
    auto plain = grads(false), checkpointed = grads(true);
    REQUIRE(plain.size() == checkpointed.size());
    MESSAGE(name << ": max |grad diff| with checkpointing " << max_diff(plain, checkpointed));
    CHECK(max_diff(plain, checkpointed) <= 1e-6);
    // Rows of one document each and no padding take the causal kernel, checkpointed or not.
    auto rows = seqs;
    size_t shortest = rows[0].ids.size();
    for (const auto& r : rows) shortest = std::min(shortest, r.ids.size());
    for (auto& r : rows) {
      r.ids.resize(shortest);
      r.loss_mask.assign(shortest, 1);
    }
    auto causal = [&](bool checkpointing) {
      auto m = fixture_model(name);
      Trainer trainer(m.model, {.optimizer = {.lr = 0.0, .max_grad_norm = 0}, .activation_checkpointing = checkpointing});
      auto batches = sft::micro_batches(rows, {.packing = false});
      REQUIRE(batches.size() == 1);
      REQUIRE(batches[0].token_mask.all().item<bool>());
      return step_gradients(trainer, batches, /*last=*/true, nullptr, nullptr);
    };
    CHECK(max_diff(causal(false), causal(true)) <= 1e-6);
  }
  auto grpo_weights = [](bool checkpointing) {
    auto m = fixture_model("qwen2");
    Trainer trainer(m.model, {.optimizer = {.lr = 1e-2, .max_grad_norm = 0}, .activation_checkpointing = checkpointing});
    RolloutGroup g;
    g.prompt_ids = {5, 6, 7};
    g.completion_ids = {{8, 9}, {10, 11, 12}, {13}, {14, 15}};
    g.behaviour_logprobs = {{-1.f, -2.f}, {-1.5f, -0.5f, -3.f}, {-2.f}, {-1.f, -1.f}};
    g.reward = {1, 0, 0.5, 0};
    trainer.grpo_step({g});
    return state_dict(*trainer.model());
  };
  CHECK(max_diff(grpo_weights(false), grpo_weights(true)) <= 1e-6);
}

TEST_CASE("activation checkpointing with LoRA adapters under dropout: the same gradients, first layer included") {
  auto seqs = random_sequences(12, 7);
  auto batches = sft::micro_batches(seqs, {.packing = true, .max_length = 40});
  auto grads = [&](bool checkpointing) {
    auto m = fixture_model("llama3");
    attach_lora(*m.model, {.rank = 4, .dropout = 0.3, .target_modules = {"q_proj", "v_proj", "down_proj"}}, 11);
    Trainer trainer(m.model, {.optimizer = {.lr = 0.0, .max_grad_norm = 0}, .activation_checkpointing = checkpointing},
                    lora_parameters(*m.model));
    torch::manual_seed(5);  // the dropout masks' stream
    return step_gradients(trainer, batches, /*last=*/true);
  };
  auto plain = grads(false), checkpointed = grads(true);
  REQUIRE(plain.count("model.layers.0.self_attn.q_proj.lora_B.weight"));
  {
    // Evaluation runs without dropout: the same loss whatever the random state.
    auto m = fixture_model("llama3");
    attach_lora(*m.model, {.rank = 4, .dropout = 0.3}, 11);
    Trainer trainer(m.model, {}, lora_parameters(*m.model));
    torch::manual_seed(1);
    const double a = trainer.sft_eval(batches);
    torch::manual_seed(2);
    CHECK(trainer.sft_eval(batches) == a);
    CHECK(m.model->is_training());
  }
  CHECK(plain.size() == checkpointed.size());
  // B starts at zero, so its gradient sees the dropout masks; the embedding is frozen, so the
  // first layer's input carries no gradient and only the node's parameter inputs reach B.
  CHECK(plain.at("model.layers.0.self_attn.q_proj.lora_B.weight").abs().max().item<double>() > 0);
  MESSAGE("LoRA (dropout 0.3): max |grad diff| with checkpointing " << max_diff(plain, checkpointed));
  CHECK(max_diff(plain, checkpointed) <= 1e-6);
}

TEST_CASE("bfloat16 models train through the same path, with checkpointing too") {
  auto seqs = random_sequences(16, 6);
  auto batches = sft::micro_batches(seqs, {.packing = true, .max_length = 32});
  auto f32 = fixture_model("llama3");
  auto bf16 = load_model(test::fixtures() / "hf_models" / "llama3", {.dtype = torch::kBFloat16, .tokenizer = false});
  Trainer a(f32.model, {});
  Trainer b(bf16.model, {.optimizer = {.lr = 1e-2}, .activation_checkpointing = true});
  const double loss32 = a.sft_eval(batches), loss16 = b.sft_eval(batches);
  CHECK(loss16 == doctest::Approx(loss32).epsilon(2e-2));
  double last = 0;
  for (int step = 0; step < 15; ++step) last = b.sft_step(batches).loss;
  const double after = b.sft_eval(batches);
  MESSAGE("bfloat16: loss " << loss16 << " (float32 " << loss32 << "), after 15 steps on the same batch " << after);
  CHECK(std::isfinite(last));
  CHECK(after < 0.7 * loss16);
  CHECK((b.model()->lm_head_weight().scalar_type() == torch::kBFloat16));
}

TEST_CASE("a restricted parameter list: only those move, the rest are frozen") {
  auto m = fixture_model("qwen2");
  auto named = m.model->named_parameters();
  std::vector<torch::Tensor> params{named["model.layers.1.mlp.down_proj.weight"], named["model.norm.weight"]};
  auto before = state_dict(*m.model);
  for (auto& [k, v] : before) v = v.clone();
  Trainer trainer(m.model, {.optimizer = {.lr = 1e-2}}, params);
  CHECK(trainer.parameters().size() == 2);
  trainer.sft_step(sft::micro_batches(random_sequences(8, 4), {.packing = false}));
  for (const auto& [name, t] : state_dict(*m.model)) {
    CAPTURE(name);
    const bool moved = (t - before.at(name)).abs().max().item<double>() > 0;
    CHECK(moved == (name == "model.layers.1.mlp.down_proj.weight" || name == "model.norm.weight"));
  }
  CHECK_FALSE(named["model.embed_tokens.weight"].requires_grad());
}

TEST_CASE("optimizer state save/load: a resumed trainer continues exactly") {
  const auto file = fs::temp_directory_path() / "troupe_test_sft_state.pt";
  auto seqs = random_sequences(32, 5);
  const TrainerConfig config{.optimizer = {.lr = 3e-3, .weight_decay = 0.01, .warmup_steps = 2, .total_steps = 12}};
  auto batch = [&](int step) {
    return sft::micro_batches(std::span(seqs).subspan((step % 4) * 8, 8), {.packing = true, .max_length = 32});
  };
  auto a_model = fixture_model("llama3");
  Trainer a(a_model.model, config);
  for (int step = 0; step < 4; ++step) a.sft_step(batch(step));
  a.save_state(file);
  auto weights = state_dict(*a.model());
  for (auto& [k, v] : weights) v = v.clone();
  for (int step = 4; step < 10; ++step) a.sft_step(batch(step));

  auto b_model = fixture_model("llama3");
  load_weights(*b_model.model, weights, "the midway weights");
  Trainer b(b_model.model, config);
  b.load_state(file);
  CHECK(b.version() == 4);
  for (int step = 4; step < 10; ++step) b.sft_step(batch(step));
  const double diff = max_diff(state_dict(*a.model()), state_dict(*b.model()));
  MESSAGE("max |w_a - w_b| after 6 more steps: " << diff);
  CHECK(diff <= 1e-6);

  // Without the state (fresh moments and schedule) the weights go elsewhere: the test has teeth.
  auto c_model = fixture_model("llama3");
  load_weights(*c_model.model, weights, "the midway weights");
  Trainer c(c_model.model, config);
  for (int step = 4; step < 10; ++step) c.sft_step(batch(step));
  CHECK(max_diff(state_dict(*a.model()), state_dict(*c.model())) > 1e-4);

  SUBCASE("a state from another parameter list or model is refused, naming the file") {
    auto d_model = fixture_model("llama3");
    Trainer d(d_model.model, config, {d_model.model->named_parameters()["model.norm.weight"]});
    auto message = error_of([&] { d.load_state(file); });
    CHECK(message.starts_with(file.string()));
    CHECK(message.find("parameter tensors") != std::string::npos);
    auto e_model = fixture_model("qwen3");  // the same count of tensors? the shapes differ anyway
    Trainer e(e_model.model, config);
    CHECK(error_of([&] { e.load_state(file); }).starts_with(file.string()));
    CHECK(error_of([&] { e.load_state(write_file("not_state.pt", "hello")); }).find("not a troupe optimizer state") !=
          std::string::npos);
  }
}

namespace {

// A Llama small enough to train in seconds, over the byte-level fixture tokenizer's vocabulary.
Transformer tiny_llama(int64_t vocab, std::vector<int64_t> eos, uint64_t seed) {
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
  c.eos_token_ids = std::move(eos);
  torch::manual_seed(seed);
  Transformer model(c);
  return model;
}

std::string digits(std::mt19937& rng, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>('0' + rng() % 10);
  return s;
}

}  // namespace

TEST_CASE("SFT from JSONL text: held-out loss falls and the tiny model reverses unseen digit strings") {
  const auto tok = Tokenizer::load(test::fixtures() / "sft" / "bytes");
  const int32_t im_end = *tok.token_id("<|im_end|>");
  auto model = tiny_llama(tok.vocab_size(), {im_end}, 0);

  // Reverse four digits; the held-out strings never occur in training.
  std::mt19937 rng(1);
  std::set<std::string> held;
  std::string train_text, eval_text;
  while (held.size() < 40) held.insert(digits(rng, 4));
  for (const auto& d : held) eval_text += json{{"question", d}, {"answer", std::string(d.rbegin(), d.rend())}}.dump() + "\n";
  for (int i = 0; i < 3000; ++i) {
    auto d = digits(rng, 4);
    if (held.count(d)) continue;
    train_text += json{{"question", d}, {"answer", std::string(d.rbegin(), d.rend())}}.dump() + "\n";
  }
  const sft::DataOptions options{.prompt_field = "question", .response_field = "answer", .max_length = 64};
  auto train = sft::read_jsonl(write_file("reverse_train.jsonl", train_text), tok, options);
  auto eval = sft::read_jsonl(write_file("reverse_eval.jsonl", eval_text), tok, options);
  REQUIRE(trained_spans(eval[0], tok).size() == 1);
  CHECK(trained_spans(eval[0], tok)[0].size() == 4 + std::string("<|im_end|>").size());

  const int steps = 300, batch = 32;
  Trainer trainer(model, {.optimizer = {.lr = 3e-3, .warmup_steps = 10, .total_steps = steps, .min_lr_ratio = 0.1}});
  const auto eval_batches = sft::micro_batches(eval, {.packing = true, .max_length = 256});
  const double before = trainer.sft_eval(eval_batches);
  for (int step = 0; step < steps; ++step) {
    std::vector<sft::Sequence> picked;
    for (int i = 0; i < batch; ++i) picked.push_back(train[rng() % train.size()]);
    trainer.sft_step(sft::micro_batches(picked, {.packing = true, .max_length = 256}));
  }
  const double after = trainer.sft_eval(eval_batches);
  MESSAGE("held-out loss per assistant token: " << before << " before, " << after << " after " << steps << " steps");
  CHECK(after < 0.25 * before);

  // Greedy generation from the chat prompt, as serving would do it.
  auto chat = ChatTemplate::detect(*tok.chat_template(), "bytes");
  Engine engine(trainer.model(), tok, {.max_batch = 64, .max_seq_len = 64});
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> targets;
  for (const auto& d : held) {
    std::vector<ChatMessage> m{{"user", d}};
    prompts.push_back(tok.encode(chat.render(m, true)));
    targets.emplace_back(d.rbegin(), d.rend());
  }
  torch::NoGradGuard no_grad;
  trainer.model()->eval();
  auto completions = engine.generate(prompts, {.temperature = 0.0, .max_tokens = 8});
  int right = 0;
  for (size_t i = 0; i < completions.size(); ++i) right += tok.decode(completions[i].ids, true) == targets[i];
  MESSAGE("greedy answers equal to the reversed digits: " << right << " / " << completions.size());
  CHECK(right >= 0.8 * completions.size());
}
