// Chat prompts against transformers' apply_chat_template, for Qwen3's, Qwen2.5's, SmolLM2's (GGUF),
// Llama-3's and Llama-3.1's templates (fixtures from make_tokenizer_fixtures.py); plus refusals.
#include <doctest/doctest.h>

#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>

#include "policy/chat_template.hpp"
#include "policy/error.hpp"
#include "tests/test_util.hpp"

using troupe::ChatMessage;
using troupe::ChatTemplate;
using nlohmann::json;

namespace {

struct Template {
  std::string name, origin, source;
  json cases;
};

std::vector<Template> read_templates() {
  std::ifstream in(troupe::test::fixtures() / "tokenizer" / "chat_templates.json");
  REQUIRE_MESSAGE(in, "missing fixture chat_templates.json");
  std::vector<Template> out;
  for (const json& t : json::parse(in)) out.push_back({t["name"], t["origin"], t["source"], t["cases"]});
  return out;
}

const Template& find_template(const std::vector<Template>& all, const std::string& name) {
  for (const Template& t : all)
    if (t.name == name) return t;
  FAIL("no template " << name << " in the fixture");
  throw;
}

std::vector<ChatMessage> messages_of(const json& c) {
  std::vector<ChatMessage> out;
  for (const json& m : c["messages"]) out.push_back({m["role"], m["content"]});
  return out;
}

std::string escaped(const std::string& s) { return json(s).dump(-1, ' ', true); }

// Every conversation, with and without the generation prompt, must render byte for byte.
void check_renders(const ChatTemplate& chat, const Template& t) {
  size_t mismatches = 0;
  for (const json& c : t.cases) {
    const auto messages = messages_of(c);
    const std::string got = chat.render(messages, c["add_generation_prompt"].get<bool>());
    const std::string expected = c["expected"];
    if (got != expected && ++mismatches <= 3)
      MESSAGE(t.name << ": messages " << c["messages"].dump() << " add_generation_prompt="
                     << c["add_generation_prompt"] << "\n  expected: " << escaped(expected)
                     << "\n  got:      " << escaped(got));
  }
  MESSAGE(t.name << ": " << t.cases.size() << " renders, " << mismatches << " mismatches");
  CHECK(mismatches == 0);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const troupe::Error& e) {
    return e.what();
  }
  return "(no troupe::Error thrown)";
}

}  // namespace

TEST_CASE("detected templates render exactly what apply_chat_template renders") {
  const auto templates = read_templates();
  REQUIRE(templates.size() == 6);
  for (const Template& t : templates) {
    CAPTURE(t.name);
    const ChatTemplate chat = ChatTemplate::detect(t.source, t.origin);
    const bool llama = t.name.starts_with("llama");
    CHECK(chat.family() == (llama ? ChatTemplate::Family::llama3 : ChatTemplate::Family::chatml));
    check_renders(chat, t);
  }
}

TEST_CASE("the built-in ChatML and Llama-3 templates match the plain Jinja ones") {
  const auto templates = read_templates();
  check_renders(ChatTemplate::chatml(), find_template(templates, "chatml"));
  check_renders(ChatTemplate::llama3(), find_template(templates, "llama3"));
}

TEST_CASE("SmolLM2's template adds its default system prompt only when there is no system turn") {
  const ChatTemplate smol = ChatTemplate::detect(find_template(read_templates(), "smollm2").source, "smollm2");
  const std::vector<ChatMessage> user_only{{"user", "Hi"}};
  CHECK(smol.render(user_only, true) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<ChatMessage> with_system{{"system", "S"}, {"user", "Hi"}};
  CHECK(smol.render(with_system, false) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

TEST_CASE("unknown templates and roles are errors that say what is supported") {
  const std::string mistral =
      "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
      "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token}}{% endif %}"
      "{% endfor %}";
  const std::string message = error_of([&] { ChatTemplate::detect(mistral, "models/mistral/tokenizer_config.json"); });
  CHECK(message.find("models/mistral/tokenizer_config.json: chat template not recognised") != std::string::npos);
  CHECK(message.find("ChatML") != std::string::npos);
  CHECK(message.find("Llama-3") != std::string::npos);
  CHECK(error_of([] { ChatTemplate::detect("", "empty.jinja"); }).find("empty.jinja") != std::string::npos);

  const std::vector<ChatMessage> tool{{"user", "x"}, {"tool", "42"}};
  for (const ChatTemplate& chat : {ChatTemplate::chatml(), ChatTemplate::llama3()})
    CHECK(error_of([&] { chat.render(tool, true); }).find("message 1 has role 'tool'") != std::string::npos);
}
