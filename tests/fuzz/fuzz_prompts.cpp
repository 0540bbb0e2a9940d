// The prompt dataset reader (PromptSource) on arbitrary JSONL, under plain and chat options, then
// dealing out prompts across epochs and restoring a cursor. Errors must be troupe::Error.
#include "policy/error.hpp"
#include "tests/fuzz/fuzz_tokenizer.hpp"
#include "trainer/prompts.hpp"

using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("prompts.jsonl");
  const troupe::Tokenizer& tok = troupe::fuzz::small_tokenizer();
  const std::string& path = file.write(data, size);

  std::vector<troupe::PromptSourceOptions> option_sets(3);
  option_sets[1].prompt_field = "prompt";
  option_sets[1].chat = true;
  option_sets[1].chat_template = troupe::ChatTemplate::chatml();
  option_sets[1].system = "Be brief.";
  option_sets[1].max_prompt_tokens = 64;
  option_sets[2].prompt_field = "prompt";
  option_sets[2].answer_field = "";
  option_sets[2].chat = true;
  option_sets[2].chat_template = troupe::ChatTemplate::llama3();
  option_sets[2].limit = 3;
  option_sets[2].shuffle = false;
  for (const auto& options : option_sets) {
    std::optional<troupe::PromptSource> source;
    try {
      source.emplace(path, tok, options);
    } catch (const troupe::Error&) {
      continue;
    }
    if (source->size() <= 0) fail("a PromptSource with no prompts");
    for (const auto& p : source->prompts()) {
      for (int32_t id : p.ids)
        if (id < 0 || id >= tok.vocab_size()) fail("a prompt token id outside the vocabulary");
      (void)p.metadata.dump();  // as troupe run sends it on to the generators and rewards
    }
    (void)source->next(2 * source->size() + 1);
    const troupe::PromptCursor cursor = source->cursor();
    const auto after = source->next(3);
    source->restore(troupe::PromptCursor::from_json(cursor.to_json()));
    const auto again = source->next(3);
    for (size_t i = 0; i < after.size(); ++i)
      if (after[i].id != again[i].id) fail("a restored cursor hands out other prompts");
  }
  return 0;
}
