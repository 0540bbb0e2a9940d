// The SFT reader (sft::read_jsonl) on arbitrary JSONL: chat records and prompt/response records,
// through ChatML, Llama-3 and Qwen3 templates and as plain text, with max_length handling.
// Errors must be troupe::Error; every example keeps one mask entry per token.
#include "policy/error.hpp"
#include "tests/fuzz/fuzz_tokenizer.hpp"
#include "trainer/sft_data.hpp"

using troupe::fuzz::fail;
namespace sft = troupe::sft;

namespace {

// Qwen3's template, as far as ChatTemplate::detect reads it (ChatML markers, think blocks).
constexpr const char* kQwen3 =
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{%- if reasoning_content %}<think>"
    "</think>{%- endif %}{{ message.content }}<|im_end|>\n{%- endfor %}";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("sft.jsonl");
  const troupe::Tokenizer& tok = troupe::fuzz::small_tokenizer();
  const std::string& path = file.write(data, size);

  std::vector<sft::DataOptions> option_sets(4);
  option_sets[0].chat_template = troupe::ChatTemplate::chatml();
  option_sets[1].prompt_field = "prompt";
  option_sets[1].response_field = "completion";
  option_sets[1].chat_template = troupe::ChatTemplate::llama3();
  option_sets[1].system = "Be brief.";
  option_sets[1].max_length = 24;
  option_sets[1].overlong = sft::Overlong::truncate;
  option_sets[2].prompt_field = "question";
  option_sets[2].response_field = "answer";
  option_sets[2].chat = false;
  option_sets[2].eos_id = 256;
  option_sets[2].max_length = 32;
  option_sets[2].overlong = sft::Overlong::drop;
  option_sets[3].chat_template = troupe::ChatTemplate::detect(kQwen3, "qwen3");
  option_sets[3].max_length = 48;
  option_sets[3].limit = 4;
  for (const auto& options : option_sets) {
    std::vector<sft::Sequence> seqs;
    sft::ReadReport report;
    try {
      seqs = sft::read_jsonl(path, tok, options, &report);
    } catch (const troupe::Error&) {
      continue;
    }
    if (seqs.empty()) fail("read_jsonl returned no examples without an error");
    for (const auto& s : seqs) {
      if (s.loss_mask.size() != s.ids.size()) fail("an example's loss mask and ids differ in length");
      if (s.trained_tokens() == 0) fail("an example with nothing to train on");
      if (options.max_length > 0 && s.size() > options.max_length) fail("an example above max_length");
      for (int32_t id : s.ids)
        if (id < 0 || id >= tok.vocab_size()) fail("a token id outside the vocabulary");
    }
  }
  return 0;
}
