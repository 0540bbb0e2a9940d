// Byte-level BPE tokenizers as Hugging Face `tokenizers` runs them (tokenizer.json), or as
// built from GGUF metadata. Encoding and decoding only: no training, no offsets.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace troupe {

namespace gguf { class File; }

class Tokenizer {
 public:
  // A tokenizer.json; a Hugging Face model folder (its tokenizer.json, plus special tokens
  // from tokenizer_config.json when present); or a .gguf file. Errors name the file and field.
  static Tokenizer load(const std::filesystem::path& path);
  static Tokenizer from_json_file(const std::filesystem::path& tokenizer_json);
  static Tokenizer from_gguf(const gguf::File& file);

  // Like tokenizers' encode(text, add_special_tokens=False): added and special tokens that
  // appear in `text` are split out first and map to their ids; nothing is prepended.
  std::vector<int32_t> encode(std::string_view text) const;
  // Bytes back to UTF-8 (invalid sequences become U+FFFD, as tokenizers does).
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  int32_t vocab_size() const;  // largest id + 1, added tokens included
  std::optional<int32_t> token_id(std::string_view token) const;
  const std::string& token(int32_t id) const;  // the vocabulary string; throws if out of range
  bool is_special(int32_t id) const;

  // From tokenizer_config.json or GGUF metadata when known.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  // The Jinja chat template carried by tokenizer_config.json or GGUF metadata, if any.
  const std::optional<std::string>& chat_template() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace troupe
