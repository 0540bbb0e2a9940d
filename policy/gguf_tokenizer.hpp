// The Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json) that describe a
// GGUF file's BPE tokenizer, so `troupe convert` output loads in transformers.
#pragma once

#include <nlohmann/json.hpp>

namespace troupe::gguf {

class File;

// Byte-level BPE ("gpt2" tokenizer model) with the pre-tokenizer of tokenizer.ggml.pre:
// smollm, qwen2 or llama-bpe. Other models or pre types throw Error naming them.
nlohmann::json hf_tokenizer_json(const File& file);
// bos/eos/pad tokens and the chat template.
nlohmann::json hf_tokenizer_config(const File& file);

}  // namespace troupe::gguf
