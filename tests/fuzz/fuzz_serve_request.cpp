// troupe serve's request reading (generator/server_request.hpp) on arbitrary bodies: the first byte
// picks the route (completions, chat, tokenize, detokenize), the rest is the body as the HTTP layer
// hands it over. Every bad body must be an HttpError with a 4xx status (vLLM's error answer); an
// accepted one must be within the server's limits, as the engine relies on.
#include <string>

#include "generator/server_request.hpp"
#include "tests/fuzz/fuzz_tokenizer.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace troupe::serve_request;
using troupe::fuzz::fail;

namespace {

constexpr RequestLimits kLimits{.max_n = 4, .max_batch = 8, .max_tokens = 64, .max_seq_len = 128, .max_prompts = 8};

const RequestReader& reader() {
  static const troupe::ChatTemplate chat = troupe::ChatTemplate::chatml();
  static const RequestReader r(kLimits, "fuzz-model", "fuzz", troupe::fuzz::small_tokenizer().vocab_size(),
                               &troupe::fuzz::small_tokenizer(), &chat, "", {troupe::fuzz::small_tokenizer().vocab_size() - 5});
  return r;
}

void check_accepted(const GenerationRequest& r) {
  const auto& p = r.sampling.params;
  if (r.prompts.empty() || static_cast<int64_t>(r.prompts.size()) > kLimits.max_prompts) fail("prompt count outside the limit");
  if (p.n < 1 || p.n > kLimits.max_n) fail("n outside [1, max_n]");
  if (p.max_tokens < 1 || p.max_tokens > kLimits.max_tokens) fail("max_tokens outside [1, max_tokens]");
  if (!(p.temperature >= 0) || !(p.top_p > 0 && p.top_p <= 1) || !(p.min_p >= 0 && p.min_p <= 1) || p.top_k < -1)
    fail("a sampling parameter outside its range");
  const int64_t vocab = troupe::fuzz::small_tokenizer().vocab_size();
  for (const auto& prompt : r.prompts) {
    if (prompt.empty()) fail("an empty prompt was accepted");
    if (static_cast<int64_t>(prompt.size()) + p.max_tokens > kLimits.max_seq_len) fail("prompt + max_tokens past max_seq_len");
    for (int32_t id : prompt)
      if (id < 0 || id >= vocab) fail("a prompt token outside the vocabulary");
  }
  for (int32_t id : p.stop_token_ids)
    if (id < 0 || id >= vocab) fail("a stop token outside the vocabulary");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const char route = static_cast<char>(data[0] % 4);
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    const json body = parse_body(text, /*allow_empty=*/route >= 2);
    switch (route) {
      case 0: check_accepted(reader().completion(body)); break;
      case 1: check_accepted(reader().chat(body)); break;
      case 2: reader().tokenize(body).dump(); break;
      default: reader().detokenize(body).dump(-1, ' ', false, json::error_handler_t::replace); break;
    }
  } catch (const HttpError& e) {
    if (e.status < 400 || e.status >= 500) fail("a bad request answered with a status outside 4xx");
    // The error body is sent as JSON: it must serialize whatever the input echoed into it.
    error_body(e.status, e.type, e.what(), e.param).dump(-1, ' ', false, json::error_handler_t::replace);
  }
  return 0;
}
