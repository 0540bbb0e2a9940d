// Writes GGUF tokenizer metadata out in tokenizers' JSON schema. The regexes are the ones
// the original Hugging Face tokenizer.json files carry for each llama.cpp pre type.
#include "policy/gguf_tokenizer.hpp"

#include "policy/error.hpp"
#include "policy/gguf.hpp"

namespace troupe::gguf {
namespace {

using nlohmann::json;

// llama.cpp token types (llama_token_type): 3 control, 4 user-defined.
constexpr int64_t kControl = 3;
constexpr int64_t kUserDefined = 4;

const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

json byte_level(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

json split(const char* pattern) {
  return {{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}};
}

json pre_tokenizer(const File& file, const std::string& pre) {
  if (pre == "smollm")
    return {{"type", "Sequence"},
            {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level(true)}}};
  if (pre == "qwen2") return {{"type", "Sequence"}, {"pretokenizers", {split(kQwen2Pattern), byte_level(false)}}};
  if (pre == "llama-bpe") return {{"type", "Sequence"}, {"pretokenizers", {split(kLlama3Pattern), byte_level(false)}}};
  throw Error(file.path().string() + ": tokenizer.ggml.pre '" + pre +
              "' is not supported (supported: smollm, qwen2, llama-bpe)");
}

// Well-formed UTF-8 (no overlongs, surrogates or code points above U+10FFFF), as JSON text requires.
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    unsigned lo = 0x80, hi = 0xBF;  // the allowed range of the first continuation byte
    if (c < 0x80) {
      n = 0;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (s.size() - i <= n) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if (d < (k == 1 ? lo : 0x80u) || d > (k == 1 ? hi : 0xBFu)) return false;
    }
    i += n + 1;
  }
  return true;
}

// GGUF strings are raw bytes; the JSON files written here can hold only valid UTF-8.
const std::string& utf8(const File& file, const std::string& s, const std::string& what) {
  if (!valid_utf8(s))
    throw Error(file.path().string() + ": " + what + " is not valid UTF-8, which tokenizer.json cannot hold");
  return s;
}

std::optional<std::string> token_of(const File& file, const std::vector<std::string>& tokens, const char* key) {
  if (!file.has(key)) return std::nullopt;
  uint64_t id = file.get_uint(key);
  if (id >= tokens.size())
    throw Error(file.path().string() + ": " + key + " = " + std::to_string(id) + " is outside the vocabulary");
  return utf8(file, tokens[id], std::string(key) + "'s token");
}

}  // namespace

json hf_tokenizer_json(const File& file) {
  std::string model = file.get_string("tokenizer.ggml.model");
  if (model != "gpt2")
    throw Error(file.path().string() + ": tokenizer.ggml.model '" + model + "' is not supported (only gpt2, byte-level BPE)");
  std::string pre = file.has("tokenizer.ggml.pre") ? file.get_string("tokenizer.ggml.pre") : "default";
  auto tokens = file.get_string_array("tokenizer.ggml.tokens");
  auto merges = file.get_string_array("tokenizer.ggml.merges");
  std::vector<int64_t> types = file.has("tokenizer.ggml.token_type") ? file.get_int_array("tokenizer.ggml.token_type")
                                                                      : std::vector<int64_t>{};

  json vocab = json::object();
  json added = json::array();
  for (size_t i = 0; i < merges.size(); ++i) utf8(file, merges[i], "tokenizer.ggml.merges[" + std::to_string(i) + "]");
  for (size_t id = 0; id < tokens.size(); ++id) {
    vocab[utf8(file, tokens[id], "tokenizer.ggml.tokens[" + std::to_string(id) + "]")] = id;
    int64_t type = id < types.size() ? types[id] : 1;
    if (type == kControl || type == kUserDefined) {
      added.push_back({{"id", id}, {"content", tokens[id]}, {"single_word", false}, {"lstrip", false},
                       {"rstrip", false}, {"normalized", type != kControl}, {"special", type == kControl}});
    }
  }
  json normalizer = pre == "qwen2" ? json{{"type", "NFC"}} : json(nullptr);
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", normalizer},
      {"pre_tokenizer", pre_tokenizer(file, pre)},
      {"post_processor", byte_level(true)},
      {"decoder", byte_level(true)},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", merges}}},
  };
}

json hf_tokenizer_config(const File& file) {
  auto tokens = file.get_string_array("tokenizer.ggml.tokens");
  json config = {{"tokenizer_class", "PreTrainedTokenizerFast"}, {"clean_up_tokenization_spaces", false}};
  if (auto t = token_of(file, tokens, "tokenizer.ggml.bos_token_id")) config["bos_token"] = *t;
  if (auto t = token_of(file, tokens, "tokenizer.ggml.eos_token_id")) config["eos_token"] = *t;
  if (auto t = token_of(file, tokens, "tokenizer.ggml.padding_token_id")) config["pad_token"] = *t;
  if (auto t = token_of(file, tokens, "tokenizer.ggml.unknown_token_id")) config["unk_token"] = *t;
  if (file.has("tokenizer.chat_template"))
    config["chat_template"] = utf8(file, file.get_string("tokenizer.chat_template"), "tokenizer.chat_template");
  return config;
}

}  // namespace troupe::gguf
