// The tokenizer of a GGUF file (Tokenizer::from_gguf, and hf_tokenizer_json/config that troupe
// convert writes) on arbitrary bytes, then encoding a fixed text and the vocabulary's own tokens.
#include <nlohmann/json.hpp>

#include "policy/error.hpp"
#include "policy/gguf.hpp"
#include "policy/gguf_tokenizer.hpp"
#include "policy/tokenizer.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("tokenizer.gguf");
  std::shared_ptr<const troupe::gguf::File> f;
  try {
    f = troupe::gguf::File::open(file.write(data, size));
  } catch (const troupe::Error&) {
    return 0;
  }
  try {
    (void)troupe::gguf::hf_tokenizer_json(*f).dump();
  } catch (const troupe::Error&) {
  }
  try {
    (void)troupe::gguf::hf_tokenizer_config(*f).dump();
  } catch (const troupe::Error&) {
  }
  std::optional<troupe::Tokenizer> tok;
  try {
    tok = troupe::Tokenizer::from_gguf(*f);
  } catch (const troupe::Error&) {
    return 0;
  }
  std::vector<std::string> texts = {"Hello world! 12345 <|im_start|>user\nhéllo 世界\n\n  x"};
  for (int32_t id = 0; id < std::min<int32_t>(tok->vocab_size(), 64); ++id) {
    try {
      texts.push_back(tok->decode(std::vector<int32_t>{id}));
    } catch (const troupe::Error&) {
    }
  }
  for (const std::string& text : texts) {
    std::vector<int32_t> ids;
    try {
      ids = tok->encode(text);
    } catch (const troupe::Error&) {
      continue;
    }
    for (int32_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) fail("encode gave id " + std::to_string(id) + " outside the vocabulary");
    (void)tok->decode(ids, /*skip_special_tokens=*/true);
  }
  for (auto id : {tok->bos_id(), tok->eos_id(), tok->pad_id()})
    if (id && (*id < 0 || *id >= tok->vocab_size())) fail("a special token id lies outside the vocabulary");
  return 0;
}
