// Token ids and decodes against Hugging Face `tokenizers` on a 2,000-line corpus (fixtures from
// make_tokenizer_fixtures.py), for Qwen3's tokenizer.json and SmolLM2's GGUF (also against llama.cpp's
// own ids for that file); plus bad inputs.
#include <doctest/doctest.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "policy/chat_template.hpp"
#include "policy/error.hpp"
#include "policy/gguf.hpp"
#include "policy/gguf_tokenizer.hpp"
#include "policy/tokenizer.hpp"
#include "tests/test_util.hpp"

using troupe::Tokenizer;
using nlohmann::json;
namespace fs = std::filesystem;
namespace test = troupe::test;

namespace {

fs::path fixture_dir() { return test::fixtures() / "tokenizer"; }

struct CorpusLine {
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
  bool nfc;
};

std::vector<CorpusLine> read_corpus(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in, "missing fixture " << path);
  std::vector<CorpusLine> lines;
  for (std::string row; std::getline(in, row);) {
    const json j = json::parse(row);
    lines.push_back({j["text"], j["ids"].get<std::vector<int32_t>>(), j["decoded"], j["nfc"]});
  }
  return lines;
}

// Control characters and non-ASCII shown as escapes, so mismatching lines can be read in a log.
std::string escaped(std::string_view s, size_t limit = 300) {
  std::string out = json(std::string(s.substr(0, limit))).dump(-1, ' ', true);
  if (s.size() > limit) out += "...";
  return out;
}

std::string show_ids(const std::vector<int32_t>& ids, const Tokenizer& tok, size_t limit = 40) {
  std::ostringstream out;
  for (size_t i = 0; i < ids.size() && i < limit; ++i)
    out << (i ? " " : "") << ids[i] << ":" << escaped(ids[i] < tok.vocab_size() ? tok.token(ids[i]) : "?");
  if (ids.size() > limit) out << " ... (" << ids.size() << " ids)";
  return out.str();
}

// Whether decode(ids) must give back the original text of every line that is already NFC. It
// cannot where the vocabulary lacks some bytes (SmolLM2 has no token for 0x1D or 0xF1, say: BPE
// drops them, as tokenizers does) or the pre-tokenizer removes text; there only the reference
// decode is required.
enum class RoundTrip { nfc_lines, reference_only };

// Every line must give the reference ids, and decoding them the reference text. The first
// mismatches are printed in full.
void check_parity(const Tokenizer& tok, const fs::path& jsonl, const std::string& name,
                  RoundTrip round_trip = RoundTrip::reference_only) {
  const auto lines = read_corpus(jsonl);
  REQUIRE(!lines.empty());
  size_t id_mismatches = 0, decode_mismatches = 0, round_trip_failures = 0, tokens = 0;
  double seconds = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const CorpusLine& line = lines[i];
    const auto start = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok.encode(line.text);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    tokens += ids.size();
    if (ids != line.ids && ++id_mismatches <= 5)
      MESSAGE(name << " line " << i + 1 << ": ids differ\n  text:     " << escaped(line.text)
                   << "\n  expected: " << show_ids(line.ids, tok) << "\n  got:      " << show_ids(ids, tok));
    const std::string decoded = tok.decode(line.ids);
    if (decoded != line.decoded && ++decode_mismatches <= 5)
      MESSAGE(name << " line " << i + 1 << ": decode differs\n  text:     " << escaped(line.text)
                   << "\n  expected: " << escaped(line.decoded) << "\n  got:      " << escaped(decoded));
    if (line.nfc && decoded != line.text) ++round_trip_failures;
  }
  MESSAGE(name << ": " << lines.size() << " lines, " << tokens << " tokens encoded in " << seconds * 1e3
               << " ms; " << id_mismatches << " id mismatches, " << decode_mismatches << " decode mismatches, "
               << round_trip_failures << " NFC lines that do not decode to themselves");
  CHECK(id_mismatches == 0);
  CHECK(decode_mismatches == 0);
  if (round_trip == RoundTrip::nfc_lines) CHECK(round_trip_failures == 0);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const troupe::Error& e) {
    return e.what();
  }
  return "(no troupe::Error thrown)";
}

fs::path write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

}  // namespace

TEST_CASE("Qwen3 tokenizer.json: ids and decodes match tokenizers on the corpus") {
  const Tokenizer tok = Tokenizer::from_json_file(test::data() / "tokenizers/qwen3/tokenizer.json");
  CHECK(tok.vocab_size() == 151669);
  CHECK(tok.token_id("<|im_start|>") == 151644);
  CHECK(tok.token(151667) == "<think>");
  CHECK(tok.is_special(151645));
  CHECK_FALSE(tok.is_special(151667));  // <think> is an added token, not a special one
  CHECK_FALSE(tok.bos_id());            // a bare tokenizer.json carries no special-token roles
  check_parity(tok, fixture_dir() / "qwen3.jsonl", "qwen3", RoundTrip::nfc_lines);
}

TEST_CASE("SmolLM2 GGUF tokenizer: ids and decodes match the smollm reference on the corpus") {
  const Tokenizer tok = Tokenizer::load(test::smollm2_gguf());
  CHECK(tok.vocab_size() == 49152);
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);
  CHECK(tok.pad_id() == 2);
  CHECK(tok.is_special(0));
  REQUIRE(tok.chat_template());
  const auto chat = troupe::ChatTemplate::detect(*tok.chat_template(), "SmolLM2 GGUF");
  const std::vector<troupe::ChatMessage> hi{{"user", "Hi"}};
  CHECK(chat.render(hi, true).starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
  check_parity(tok, fixture_dir() / "smollm2.jsonl", "smollm2 gguf");
}

// The smollm reference above is transformers' conversion with its pre-tokenizer patched by hand;
// this one is llama.cpp's own tokenization of the same GGUF (llama-cpp-python, vocab only, special
// tokens parsed) and its own detokenization, so the GGUF path is checked against the engine that
// defines the format. On this corpus the two references agree line for line.
TEST_CASE("SmolLM2 GGUF tokenizer: ids and decodes match llama.cpp on the corpus") {
  const Tokenizer tok = Tokenizer::load(test::smollm2_gguf());
  check_parity(tok, fixture_dir() / "smollm2_llama_cpp.jsonl", "smollm2 gguf vs llama.cpp");
}

TEST_CASE("SmolLM2 tokenizer.json with \"a b\" merges and Digits + ByteLevel matches too") {
  const Tokenizer tok = Tokenizer::from_json_file(fixture_dir() / "smollm2/tokenizer.json");
  check_parity(tok, fixture_dir() / "smollm2.jsonl", "smollm2 json");
}

TEST_CASE("pre-tokenizer, normalizer and added-token variants match tokenizers") {
  for (const char* name : {"split_removed_prefix_space", "split_string_merged_previous", "split_merged_next",
                           "split_contiguous_invert", "digits_contiguous_nfc", "byte_level_alone", "split_word_classes",
                           "qwen3_ignore_merges_added"}) {
    CAPTURE(name);
    const Tokenizer tok = Tokenizer::from_json_file(fixture_dir() / "variants" / name / "tokenizer.json");
    check_parity(tok, fixture_dir() / "variants" / (std::string(name) + ".jsonl"), name);
  }
}

TEST_CASE("GGUF pre-tokenizers qwen2 and llama-bpe, and user-defined tokens") {
  // The qwen2 file holds Qwen3's vocabulary, so it must tokenize exactly like Qwen3's tokenizer.json.
  const Tokenizer qwen2 = Tokenizer::load(fixture_dir() / "gguf/qwen2_pre.gguf");
  CHECK(qwen2.eos_id() == 151645);
  CHECK_FALSE(qwen2.is_special(151667));  // token type 4 (user defined): matched whole, not special
  CHECK(qwen2.encode("<think>") == std::vector<int32_t>{151667});
  check_parity(qwen2, fixture_dir() / "qwen3.jsonl", "qwen2 pre gguf", RoundTrip::nfc_lines);
  const Tokenizer llama = Tokenizer::load(fixture_dir() / "gguf/llama_bpe_pre.gguf");
  check_parity(llama, fixture_dir() / "llama_bpe_pre.jsonl", "llama-bpe pre gguf", RoundTrip::nfc_lines);
}

TEST_CASE("decode: invalid UTF-8 becomes U+FFFD exactly as tokenizers does; special tokens can be skipped") {
  const Tokenizer tok = Tokenizer::from_json_file(test::data() / "tokenizers/qwen3/tokenizer.json");
  std::ifstream in(fixture_dir() / "lossy.json");
  const json cases = json::parse(in);
  REQUIRE(cases.size() > 100);
  size_t mismatches = 0;
  for (const json& c : cases) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const std::string got = tok.decode(ids);
    if (got != c["decoded"].get<std::string>() && ++mismatches <= 5)
      MESSAGE("ids " << c["ids"].dump() << ": expected " << escaped(c["decoded"].get<std::string>()) << ", got "
                     << escaped(got));
  }
  CHECK(mismatches == 0);

  const auto ids = tok.encode("<|im_start|>user\nHi<think><|im_end|>");
  CHECK(tok.decode(ids, /*skip_special_tokens=*/true) == "user\nHi<think>");
  CHECK(tok.decode(std::vector<int32_t>{151644, 999999, -1, 151645}) == "<|im_start|><|im_end|>");
  CHECK_THROWS_AS(tok.token(999999), troupe::Error);
}

TEST_CASE("encoding from several threads at once gives the same ids (shared cache, per-thread regex state)") {
  const Tokenizer tok = Tokenizer::from_json_file(test::data() / "tokenizers/qwen3/tokenizer.json");
  const auto lines = read_corpus(fixture_dir() / "qwen3.jsonl");
  std::vector<size_t> wrong(4, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < wrong.size(); ++t)
    threads.emplace_back([&, t] {
      for (size_t i = t; i < lines.size(); i += 2) wrong[t] += tok.encode(lines[i].text) != lines[i].ids;
    });
  for (auto& thread : threads) thread.join();
  for (size_t w : wrong) CHECK(w == 0);
}

TEST_CASE("encode rejects invalid UTF-8 with an error, not a crash") {
  const Tokenizer tok = Tokenizer::from_json_file(fixture_dir() / "smollm2/tokenizer.json");
  CHECK(error_of([&] { tok.encode("ok \xC3\x28 bad"); }).find("not valid UTF-8 (byte 3)") != std::string::npos);
  CHECK(tok.encode("").empty());
}

TEST_CASE("a model folder: tokenizer.json plus tokenizer_config.json") {
  const Tokenizer qwen = Tokenizer::load(test::data() / "tokenizers/qwen3");
  CHECK_FALSE(qwen.bos_id());
  CHECK(qwen.eos_id() == 151645);
  CHECK(qwen.pad_id() == 151643);
  REQUIRE(qwen.chat_template());
  CHECK(qwen.chat_template()->find("<think>") != std::string::npos);

  // Special tokens as {"content": ...} objects, and the template in chat_template.jinja.
  const fs::path dir = fixture_dir() / "folder_with_objects";
  fs::create_directories(dir);
  fs::copy_file(fixture_dir() / "smollm2/tokenizer.json", dir / "tokenizer.json",
                fs::copy_options::overwrite_existing);
  write_file(dir / "tokenizer_config.json",
             R"({"bos_token": {"content": "<|im_start|>", "lstrip": false}, "eos_token": "<|im_end|>",
                 "pad_token": null})");
  write_file(dir / "chat_template.jinja", "{{ messages }}");
  const Tokenizer smol = Tokenizer::load(dir);
  CHECK(smol.bos_id() == 1);
  CHECK(smol.eos_id() == 2);
  CHECK_FALSE(smol.pad_id());
  CHECK(smol.chat_template() == "{{ messages }}");
}

TEST_CASE("bad tokenizer files give an error naming the file and the problem") {
  const fs::path dir = fixture_dir() / "bad";
  const auto expect = [](const fs::path& path, const std::string& problem) {
    const std::string message = error_of([&] { Tokenizer::load(path); });
    CAPTURE(message);
    CHECK(message.find(path.string()) != std::string::npos);
    CHECK(message.find(problem) != std::string::npos);
  };
  const std::string vocab = R"("vocab": {"a": 0, "b": 1, "ab": 2})";
  expect(write_file(dir / "no_model.json", R"({"added_tokens": []})"), "model is missing");
  expect(write_file(dir / "no_vocab.json", R"({"model": {"type": "BPE", "merges": []}})"), "model.vocab is missing");
  expect(write_file(dir / "no_merges.json", R"({"model": {"type": "BPE", )" + vocab + "}}"),
         "model.merges is missing");
  expect(write_file(dir / "unigram.json", R"({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}})"),
         "model type 'Unigram' is not supported");
  expect(write_file(dir / "invalid.json", R"({"model": {"type": "BPE", "vocab": {"a": 0,}})"), "invalid JSON");
  expect(write_file(dir / "truncated.json", R"({"model": {"type": "BPE", "vo)"), "invalid JSON");
  expect(write_file(dir / "metaspace.json", R"({"model": {"type": "BPE", )" + vocab +
                                                R"(, "merges": []}, "pre_tokenizer": {"type": "Metaspace"}})"),
         "pre_tokenizer type 'Metaspace' is not supported");
  expect(write_file(dir / "nested.json",
                    R"({"model": {"type": "BPE", )" + vocab +
                        R"(, "merges": []}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [)"
                        R"({"type": "ByteLevel", "add_prefix_space": false}, {"type": "Whitespace"}]}})"),
         "pre_tokenizer.pretokenizers[1] type 'Whitespace' is not supported");
  expect(write_file(dir / "lowercase.json", R"({"model": {"type": "BPE", )" + vocab +
                                                R"(, "merges": []}, "normalizer": {"type": "Lowercase"}})"),
         "normalizer type 'Lowercase' is not supported");
  expect(write_file(dir / "bad_merge.json", R"({"model": {"type": "BPE", )" + vocab + R"(, "merges": ["a c"]}})"),
         "model.merges[0] 'a c': token 'c' is not in the vocabulary");
  expect(write_file(dir / "bad_merge_shape.json", R"({"model": {"type": "BPE", )" + vocab + R"(, "merges": [1]}})"),
         "model.merges[0] must be");
  expect(write_file(dir / "bad_regex.json", R"({"model": {"type": "BPE", )" + vocab +
                                                R"(, "merges": []}, "pre_tokenizer": {"type": "Split", )"
                                                R"("pattern": {"Regex": "(a"}, "behavior": "Isolated", "invert": false}})"),
         "pre_tokenizer.pattern");
  expect(write_file(dir / "bad_flag.json", R"({"model": {"type": "BPE", )" + vocab +
                                               R"(, "merges": []}, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": 1}})"),
         "pre_tokenizer.add_prefix_space must be true or false");
  expect(write_file(dir / "array.json", "[1, 2]"), "the top level must be an object");
  expect(write_file(dir / "huge_id.json", R"({"model": {"type": "BPE", "vocab": {"a": 2000000000}, "merges": []}})"),
         "token id 2000000000 is implausibly large");
  expect(dir / "does_not_exist.json", "no such file or directory");

  // A folder whose config names a special token the vocabulary lacks.
  write_file(dir / "folder/tokenizer.json", R"({"model": {"type": "BPE", )" + vocab + R"(, "merges": ["a b"]}})");
  write_file(dir / "folder/tokenizer_config.json", R"({"eos_token": "</s>"})");
  const std::string message = error_of([&] { Tokenizer::load(dir / "folder"); });
  CHECK(message.find("tokenizer_config.json: eos_token '</s>' is not in the vocabulary") != std::string::npos);
}

TEST_CASE("bad GGUF tokenizers give an error naming the file and the field") {
  const fs::path dir = fixture_dir() / "gguf";
  const auto expect = [](const fs::path& path, const std::string& problem) {
    const std::string message = error_of([&] { Tokenizer::load(path); });
    CAPTURE(message);
    CHECK(message.find(path.string()) != std::string::npos);
    CHECK(message.find(problem) != std::string::npos);
  };
  expect(dir / "bad_pre.gguf", "tokenizer.ggml.pre 'deepseek-llm' is not supported");
  expect(dir / "bad_model.gguf", "tokenizer.ggml.model 'llama' is not supported");
  expect(dir / "bad_merge.gguf", "tokenizer.ggml.merges[0] 'a c': token 'c' is not in the vocabulary");
}

// Found by tests/fuzz/: GGUF strings are raw bytes, so the tokenizer keeps such a token, but the
// tokenizer.json that troupe convert writes cannot hold it (nlohmann threw type_error 316 unnamed).
TEST_CASE("a GGUF token that is not UTF-8 loads, and converting it to tokenizer.json names the token") {
  const fs::path path = troupe::test::source() / "tests/fuzz/regressions/gguf_tokenizer/token_not_utf8.gguf";
  const auto file = troupe::gguf::File::open(path);
  CHECK(Tokenizer::from_gguf(*file).vocab_size() == 2);
  const std::string message = error_of([&] { troupe::gguf::hf_tokenizer_json(*file); });
  CAPTURE(message);
  CHECK(message.find(path.string() + ": tokenizer.ggml.tokens[1] is not valid UTF-8") != std::string::npos);
}

// Found by tests/fuzz/: the message for a model.type that is not a string quoted it with dump(), which
// recurses once per level of nesting, so a type nested 16k deep overflowed the stack.
TEST_CASE("a model type that is not a string is an error, however deeply it nests") {
  const fs::path path = troupe::test::source() / "tests/fuzz/regressions/tokenizer_json/deep_model_type.json";
  const std::string message = error_of([&] { Tokenizer::load(path); });
  CAPTURE(message);
  CHECK(message.find(path.string() + ": model.type must be a string, got array") != std::string::npos);
}
