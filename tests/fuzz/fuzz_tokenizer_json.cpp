// Tokenizer::from_json_file on arbitrary tokenizer.json text, then encoding and decoding with it.
// Input: the tokenizer.json, NUL, the text to encode. Errors must be troupe::Error.
#include <string>
#include <vector>

#include "policy/error.hpp"
#include "policy/tokenizer.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("tokenizer.json");
  const auto parts = troupe::fuzz::split_nul(data, size, 2);
  const std::string_view text = parts.size() > 1 ? parts[1] : std::string_view("Hello world 123, héllo!");
  std::optional<troupe::Tokenizer> tok;
  try {
    tok = troupe::Tokenizer::from_json_file(file.write(parts[0]));
  } catch (const troupe::Error&) {
    return 0;
  }
  std::vector<int32_t> ids;
  try {
    ids = tok->encode(text);
  } catch (const troupe::Error&) {
  }
  for (int32_t id : ids)
    if (id < 0 || id >= tok->vocab_size()) fail("encode gave id " + std::to_string(id) + " outside the vocabulary");
  (void)tok->decode(ids);
  (void)tok->decode(ids, /*skip_special_tokens=*/true);
  // Arbitrary ids, including out-of-range ones, decode without throwing (unknown ids are dropped).
  std::vector<int32_t> any;
  for (unsigned char c : text.substr(0, 64)) any.push_back(static_cast<int32_t>(c) * 37 - 100);
  (void)tok->decode(any);
  for (int32_t id = 0; id < std::min<int32_t>(tok->vocab_size(), 16); ++id) {
    try {
      const std::string& s = tok->token(id);
      if (tok->token_id(s) != id && !tok->token_id(s)) fail("token " + std::to_string(id) + " has no id back");
    } catch (const troupe::Error&) {
    }
  }
  return 0;
}
