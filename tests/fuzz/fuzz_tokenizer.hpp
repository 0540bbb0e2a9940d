// A small byte-level BPE tokenizer (every byte, a few merges, ChatML's special tokens) for the
// harnesses of readers that tokenize: built in memory, so they need no fixture at run time.
#pragma once

#include <nlohmann/json.hpp>

#include "policy/tokenizer.hpp"
#include "tests/fuzz/fuzz_util.hpp"

namespace troupe::fuzz {

inline const Tokenizer& small_tokenizer() {
  static const Tokenizer tokenizer = [] {
    // GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest for 256 + n.
    std::vector<std::string> byte_token(256);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const int cp = printable ? b : next++;
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      byte_token[b] = s;
    }
    nlohmann::json vocab = nlohmann::json::object();
    for (int b = 0; b < 256; ++b) vocab[byte_token[b]] = b;
    nlohmann::json merges = nlohmann::json::array();
    int id = 256;
    for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
             {"\xC4\xA0", "t"}, {"h", "e"}, {"\xC4\xA0t", "he"}, {"i", "n"}, {"\xC4\xA0", "a"}, {"1", "2"}, {"=", "1"}}) {
      merges.push_back(a + " " + b);
      if (!vocab.contains(a + b)) vocab[a + b] = id++;
    }
    nlohmann::json added = nlohmann::json::array();
    for (const char* t : {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eot_id|>", "<|begin_of_text|>"})
      added.push_back({{"id", id++}, {"content", t}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", false}, {"special", true}});
    const nlohmann::json doc = {
        {"version", "1.0"},
        {"added_tokens", added},
        {"normalizer", nullptr},
        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
        {"decoder", {{"type", "ByteLevel"}}},
        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}},
    };
    static MemFile file("small_tokenizer.json");
    return Tokenizer::from_json_file(file.write(doc.dump()));
  }();
  return tokenizer;
}

}  // namespace troupe::fuzz
