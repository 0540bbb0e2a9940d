// The preference-pair reader (dpo::read_jsonl) on arbitrary JSONL, through ChatML and Llama-3 and
// as plain text, with max_length handling. Errors must be troupe::Error.
#include "policy/error.hpp"
#include "tests/fuzz/fuzz_tokenizer.hpp"
#include "trainer/dpo_data.hpp"

using troupe::fuzz::fail;
namespace dpo = troupe::dpo;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("prefs.jsonl");
  const troupe::Tokenizer& tok = troupe::fuzz::small_tokenizer();
  const std::string& path = file.write(data, size);

  std::vector<dpo::DataOptions> option_sets(3);
  option_sets[0].chat_template = troupe::ChatTemplate::chatml();
  option_sets[1].prompt_field = "question";
  option_sets[1].chat = false;
  option_sets[1].eos_id = 256;
  option_sets[1].max_length = 24;
  option_sets[1].overlong = troupe::sft::Overlong::truncate;
  option_sets[2].chat_template = troupe::ChatTemplate::llama3();
  option_sets[2].system = "Prefer the right answer.";
  option_sets[2].max_length = 40;
  option_sets[2].overlong = troupe::sft::Overlong::drop;
  option_sets[2].limit = 3;
  for (const auto& options : option_sets) {
    std::vector<dpo::Pair> pairs;
    try {
      pairs = dpo::read_jsonl(path, tok, options);
    } catch (const troupe::Error&) {
      continue;
    }
    if (pairs.empty()) fail("read_jsonl returned no pairs without an error");
    for (const auto& p : pairs)
      for (const auto* s : {&p.chosen, &p.rejected}) {
        if (s->loss_mask.size() != s->ids.size()) fail("a response's loss mask and ids differ in length");
        if (s->trained_tokens() == 0) fail("a response with nothing to score");
        if (options.max_length > 0 && s->size() > options.max_length) fail("a response above max_length");
      }
  }
  return 0;
}
