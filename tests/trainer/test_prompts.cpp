// The prompt source: seeded epoch orders (reproducible, a permutation, different per seed and
// epoch), cursor save/restore, chat rendering against ChatTemplate + Tokenizer, and bad files.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <set>

#include "policy/error.hpp"
#include "trainer/prompts.hpp"
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
  auto path = fs::temp_directory_path() / ("troupe_test_prompts_" + name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// N records {"question": "Question i?", "answer": "#### i"}.
fs::path numbered_file(int n) {
  std::string text;
  for (int i = 0; i < n; ++i)
    text += json{{"question", "Question " + std::to_string(i) + "?"}, {"answer", "#### " + std::to_string(i)}}.dump() + "\n";
  return write_file("numbered_" + std::to_string(n) + ".jsonl", text);
}

std::vector<uint64_t> ids_of(const std::vector<Prompt>& prompts) {
  std::vector<uint64_t> ids;
  for (const auto& p : prompts) ids.push_back(p.id);
  return ids;
}

}  // namespace

TEST_CASE("each epoch hands out every prompt exactly once, in an order fixed by the seed") {
  const auto file = numbered_file(50);
  PromptSource a(file, qwen3(), {.seed = 7});
  PromptSource b(file, qwen3(), {.seed = 7});
  PromptSource c(file, qwen3(), {.seed = 8});
  REQUIRE(a.size() == 50);

  const auto a0 = ids_of(a.next(50)), a1 = ids_of(a.next(50));
  CHECK(ids_of(b.next(50)) == a0);
  CHECK(ids_of(b.next(50)) == a1);
  const auto c0 = ids_of(c.next(50));
  CHECK(c0 != a0);
  CHECK(a1 != a0);  // reshuffled per epoch
  for (const auto& order : {a0, a1, c0}) {
    CHECK(std::set<uint64_t>(order.begin(), order.end()).size() == 50);
    CHECK(*std::max_element(order.begin(), order.end()) == 49);
  }
  std::vector<uint64_t> file_order(50);
  for (uint64_t i = 0; i < 50; ++i) file_order[i] = i;
  CHECK(a0 != file_order);

  // Neighbouring seeds do not reuse each other's orders one epoch later.
  CHECK(c.order(0) != a.order(1));
  // The prompt handed out is the record with that id.
  PromptSource d(file, qwen3(), {.seed = 7});
  for (const auto& p : d.next(10)) {
    CHECK(p.text == "Question " + std::to_string(p.id) + "?");
    CHECK(p.metadata["answer"] == "#### " + std::to_string(p.id));
    CHECK(p.ids == qwen3().encode(p.text));
  }
}

TEST_CASE("the shuffle is pinned: same order on every platform and library") {
  // Orders computed by a separate Python implementation of mt19937_64, the splitmix seed mix
  // and the rejection Fisher-Yates (std::shuffle would differ between libstdc++ and libc++). If
  // these change, resumed runs see different data.
  PromptSource s(numbered_file(10), qwen3(), {.seed = 0});
  CHECK(s.order(0) == std::vector<uint64_t>{1, 7, 9, 2, 5, 3, 8, 4, 6, 0});
  PromptSource t(numbered_file(10), qwen3(), {.seed = 7});
  CHECK(t.order(1) == std::vector<uint64_t>{1, 0, 8, 7, 5, 2, 9, 6, 3, 4});
  // mt19937_64 itself is fixed by the standard: its 10000th output from the default seed.
  std::mt19937_64 rng;
  rng.discard(9999);
  CHECK(rng() == 9981545732273789042ULL);
}

TEST_CASE("next(n) crosses epoch boundaries and reshuffles each epoch") {
  PromptSource s(numbered_file(10), qwen3(), {.seed = 3});
  const auto got = ids_of(s.next(25));
  std::vector<uint64_t> expected;
  for (uint64_t e = 0; e < 3; ++e) {
    auto o = s.order(e);
    expected.insert(expected.end(), o.begin(), o.end());
  }
  expected.resize(25);
  CHECK(got == expected);
  CHECK(s.cursor() == PromptCursor{.epoch = 2, .position = 5, .seed = 3});
  CHECK(s.next(0).empty());
  CHECK_THROWS_AS(s.next(-1), Error);

  // An exactly used-up epoch moves the cursor on at once.
  PromptSource t(numbered_file(10), qwen3(), {.seed = 3});
  t.next(10);
  CHECK(t.cursor() == PromptCursor{.epoch = 1, .position = 0, .seed = 3});

  // Without shuffling, every epoch is file order.
  PromptSource u(numbered_file(10), qwen3(), {.shuffle = false});
  const auto plain = ids_of(u.next(20));
  for (uint64_t i = 0; i < 20; ++i) CHECK(plain[i] == i % 10);
}

TEST_CASE("a saved cursor resumes with exactly the next prompts") {
  const auto file = numbered_file(13);
  for (int64_t taken : {0, 5, 13, 20, 39}) {
    CAPTURE(taken);
    PromptSource run(file, qwen3(), {.seed = 42});
    run.next(taken);
    const std::string saved = run.cursor().to_json().dump();
    const auto continued = ids_of(run.next(30));

    PromptSource resumed(file, qwen3(), {.seed = 42});
    resumed.restore(PromptCursor::from_json(json::parse(saved), "state.json"));
    CHECK(resumed.cursor() == PromptCursor::from_json(json::parse(saved)));
    CHECK(ids_of(resumed.next(30)) == continued);
  }
}

TEST_CASE("cursor errors name the problem") {
  PromptSource s(numbered_file(10), qwen3(), {.seed = 1});
  CHECK_THROWS_WITH_AS(s.restore({.epoch = 0, .position = 3, .seed = 2}),
                       doctest::Contains("the saved cursor has seed 2, this source 1"), Error);
  CHECK_THROWS_WITH_AS(s.restore({.epoch = 0, .position = 10, .seed = 1}),
                       doctest::Contains("position 10 but the dataset has 10 prompts"), Error);
  CHECK_THROWS_WITH_AS(PromptCursor::from_json(json{{"epoch", 1}, {"seed", 0}}, "state.json"),
                       doctest::Contains("state.json: no key 'position'"), Error);
  CHECK_THROWS_WITH_AS(PromptCursor::from_json(json{{"epoch", -1}, {"position", 0}, {"seed", 0}}, "state.json"),
                       doctest::Contains("state.json: key 'epoch' is -1, expected a non-negative integer"), Error);
  CHECK_THROWS_AS(PromptCursor::from_json(json::array(), "state.json"), Error);
}

TEST_CASE("chat rendering matches ChatTemplate::render + Tokenizer::encode on GSM8K") {
  const auto gsm8k = test::data() / "gsm8k" / "test.jsonl";
  const auto& tok = qwen3();
  REQUIRE(tok.chat_template());
  const auto chat = ChatTemplate::detect(*tok.chat_template(), "qwen3");

  std::vector<std::string> questions, answers;
  {
    std::ifstream in(gsm8k);
    std::string line;
    while (questions.size() < 20 && std::getline(in, line)) {
      auto j = json::parse(line);
      questions.push_back(j["question"]);
      answers.push_back(j["answer"]);
    }
  }
  REQUIRE(questions.size() == 20);

  for (const std::string system : {"", "Reason step by step; end with #### and the number."}) {
    CAPTURE(system);
    PromptSource s(gsm8k, tok, {.chat = true, .system = system, .limit = 20, .shuffle = false});
    REQUIRE(s.size() == 20);
    for (const auto& p : s.next(20)) {
      std::vector<ChatMessage> messages;
      if (!system.empty()) messages.push_back({"system", system});
      messages.push_back({"user", questions[p.id]});
      const std::string text = chat.render(messages, /*add_generation_prompt=*/true);
      CHECK(p.text == text);
      CHECK(p.ids == tok.encode(text));
      CHECK(p.metadata["answer"] == answers[p.id]);
      CHECK(p.metadata["question"] == questions[p.id]);
    }
  }
  // An explicit template wins over the tokenizer's.
  PromptSource llama(gsm8k, tok, {.chat = true, .chat_template = ChatTemplate::llama3(), .limit = 1});
  CHECK(llama.prompts()[0].text.find("<|start_header_id|>user<|end_header_id|>") != std::string::npos);
  // Without chat, the prompt is the question as it stands.
  PromptSource plain(gsm8k, tok, {.limit = 3});
  CHECK(plain.prompts()[2].text == questions[2]);
  CHECK(plain.prompts()[2].ids == tok.encode(questions[2]));
}

TEST_CASE("bad input: errors name file:line and the field") {
  const auto& tok = qwen3();
  const auto check_error = [&](const std::string& name, const std::string& text, const std::string& expected,
                               PromptSourceOptions options = {}) {
    CAPTURE(name);
    const auto path = write_file(name, text);
    CHECK_THROWS_WITH_AS(PromptSource(path, tok, options), doctest::Contains((path.string() + expected).c_str()), Error);
  };
  const std::string good = R"({"question": "What is 2+2?", "answer": "#### 4"})" "\n";

  CHECK_THROWS_WITH_AS(PromptSource(fs::temp_directory_path() / "troupe_no_such_prompts.jsonl", tok),
                       doctest::Contains("troupe_no_such_prompts.jsonl: cannot open the prompt file"), Error);
  check_error("not_json.jsonl", good + "{\"question\": \"x\", \n", ":2: not valid JSON");
  check_error("not_object.jsonl", good + "\n[1, 2]\n", ":3: expected a JSON object, got array");
  check_error("no_prompt.jsonl", good + good + R"({"problem": "x", "answer": "#### 1"})" "\n", ":3: no field 'question'");
  check_error("prompt_number.jsonl", R"({"question": 12, "answer": "#### 1"})", ":1: field 'question' is number, expected a string");
  check_error("prompt_empty.jsonl", R"({"question": "  ", "answer": "#### 1"})", ":1: field 'question' is empty");
  check_error("no_answer.jsonl", good + R"({"question": "x"})", ":2: no field 'answer'");
  check_error("answer_list.jsonl", R"({"question": "x", "answer": [1]})", ":1: field 'answer' is array, expected a string or a number");
  check_error("empty.jsonl", "", ": no prompts (the file is empty or has only blank lines)");
  check_error("blank.jsonl", "\n  \n\r\n", ": no prompts");
  check_error("custom_field.jsonl", good, ":1: no field 'problem'", {.prompt_field = "problem"});
  // The first line fits in 8 tokens, the second does not; the chat template pushes the first over.
  check_error("too_long.jsonl", good + R"({"question": "one two three four five six seven eight nine ten", "answer": "1"})",
              ":2: field 'question' is 10 tokens, above the limit of 8 (raise max_prompt_tokens or drop the line)",
              {.max_prompt_tokens = 8});
  check_error("too_long_chat.jsonl", good, ":1: field 'question' is", {.chat = true, .max_prompt_tokens = 8});

  // Numbers are fine answers; no answer field at all when asked for none; blank lines skipped.
  PromptSource s(write_file("ok.jsonl", "\n" + good + R"({"question": "x?", "answer": 5})" "\n\n" R"({"question": "y?"})"),
                 tok, {.answer_field = "", .shuffle = false});
  CHECK(s.size() == 3);
  CHECK(s.prompts()[1].metadata["answer"] == 5);
  CHECK(s.prompts()[2].id == 2);
}

// Found by tests/fuzz/ (regressions/prompts/deep_metadata.jsonl): a record nested 16k deep loaded,
// and troupe run then overflowed the stack writing it out as the prompt's metadata (dump() recurses).
TEST_CASE("a record nested far deeper than any dataset is an error naming the line") {
  const fs::path path = test::source() / "tests/fuzz/regressions/prompts/deep_metadata.jsonl";
  CHECK_THROWS_WITH_AS(PromptSource(path, qwen3()), doctest::Contains((path.string() + ":1: JSON nested 16385 levels deep").c_str()),
                       Error);
  const std::string nested = std::string(63, '[') + std::string(63, ']');  // 64 levels with the record
  PromptSource ok(write_file("nested_64.jsonl", R"({"question": "q", "answer": "1", "x": )" + nested + "}\n"), qwen3());
  CHECK(ok.prompts()[0].metadata.dump().size() > 128);
}
