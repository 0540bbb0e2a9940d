// Reads a JSONL prompt dataset up front and deals it out in shuffled epochs. The shuffle is
// written here (mt19937_64 + Fisher-Yates) rather than std::shuffle, whose algorithm varies by library.
#include "trainer/prompts.hpp"

#include <algorithm>
#include <fstream>
#include <random>

#include "policy/error.hpp"
#include "policy/json_depth.hpp"
#include "policy/seed.hpp"
#include "trainer/sft_data.hpp"

namespace troupe {
namespace {

constexpr int kMaxDepth = 64;  // nesting of a record's JSON

// Uniform in [0, bound) by rejection: std::uniform_int_distribution's algorithm is left to the
// library, so it would break the same-order-everywhere promise. mt19937_64's output is fixed by
// the standard; values below 2^64 mod bound are rejected so that every residue is equally likely.
uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

std::string read_text_field(const nlohmann::json& j, const std::string& field, const std::string& where) {
  auto it = j.find(field);
  if (it == j.end()) throw Error(where + ": no field '" + field + "' (set the prompt field to the dataset's name for it)");
  if (!it->is_string()) throw Error(where + ": field '" + field + "' is " + it->type_name() + ", expected a string");
  return it->get<std::string>();
}

uint64_t read_count(const nlohmann::json& j, const char* key, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end()) throw Error(origin + ": no key '" + key + "'");
  if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0))
    throw Error(origin + ": key '" + key + "' is " + (it->is_primitive() ? it->dump() : std::string("a ") + it->type_name()) +
                ", expected a non-negative integer");
  return it->get<uint64_t>();
}

}  // namespace

nlohmann::json PromptCursor::to_json() const { return {{"epoch", epoch}, {"position", position}, {"seed", seed}}; }

PromptCursor PromptCursor::from_json(const nlohmann::json& j, const std::string& origin) {
  if (!j.is_object()) throw Error(origin + ": expected an object with epoch, position and seed");
  return {read_count(j, "epoch", origin), read_count(j, "position", origin), read_count(j, "seed", origin)};
}

PromptSource::PromptSource(const std::filesystem::path& path, const Tokenizer& tokenizer, PromptSourceOptions options)
    : path_(path), options_(std::move(options)) {
  const std::string file = path.string();
  if (options_.prompt_field.empty()) throw Error(file + ": the prompt field name is empty");
  std::optional<ChatTemplate> chat;
  if (options_.chat) {
    chat = sft::chat_template_for(tokenizer, options_.chat_template, file);
  }

  std::ifstream in(path);
  if (!in) throw Error(file + ": cannot open the prompt file");
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (options_.limit > 0 && size() >= options_.limit) break;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = file + ":" + std::to_string(line_no);
    int depth = 0;
    auto j = parse_json_measuring_depth(line, depth);
    if (j.is_discarded()) throw Error(where + ": not valid JSON");
    // The record travels with its prompt as metadata and is written out again (dump() recurses
    // once per level), so nesting far beyond any real dataset's is refused here.
    if (depth > kMaxDepth)
      throw Error(where + ": JSON nested " + std::to_string(depth) + " levels deep (at most " + std::to_string(kMaxDepth) +
                  "; the record is kept as the prompt's metadata)");
    if (!j.is_object()) throw Error(where + ": expected a JSON object, got " + std::string(j.type_name()));

    std::string question = read_text_field(j, options_.prompt_field, where);
    if (question.find_first_not_of(" \t\r\n") == std::string::npos)
      throw Error(where + ": field '" + options_.prompt_field + "' is empty");
    if (!options_.answer_field.empty()) {
      auto it = j.find(options_.answer_field);
      if (it == j.end())
        throw Error(where + ": no field '" + options_.answer_field + "' (set the answer field, or leave it empty for none)");
      if (!it->is_string() && !it->is_number())
        throw Error(where + ": field '" + options_.answer_field + "' is " + it->type_name() +
                    ", expected a string or a number");
    }

    Prompt p;
    p.id = prompts_.size();
    if (chat) {
      std::vector<ChatMessage> messages;
      if (!options_.system.empty()) messages.push_back({"system", options_.system});
      messages.push_back({"user", std::move(question)});
      p.text = chat->render(messages, /*add_generation_prompt=*/true);
    } else {
      p.text = std::move(question);
    }
    p.ids = tokenizer.encode(p.text);
    if (options_.max_prompt_tokens > 0 && static_cast<int64_t>(p.ids.size()) > options_.max_prompt_tokens)
      throw Error(where + ": field '" + options_.prompt_field + "' is " + std::to_string(p.ids.size()) +
                  " tokens" + (chat ? " with the chat template" : "") + ", above the limit of " +
                  std::to_string(options_.max_prompt_tokens) + " (raise max_prompt_tokens or drop the line)");
    p.metadata = std::move(j);
    prompts_.push_back(std::move(p));
  }
  if (in.bad()) throw Error(file + ": read error");
  if (prompts_.empty()) throw Error(file + ": no prompts (the file is empty or has only blank lines)");
  cursor_.seed = options_.seed;
  order_ = order(0);
}

std::vector<uint64_t> PromptSource::order(uint64_t epoch) const {
  std::vector<uint64_t> idx(prompts_.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  if (!options_.shuffle) return idx;
  std::mt19937_64 rng(mix_seed(options_.seed, epoch));
  // Fisher-Yates, from the back: each position takes a uniform pick of those not yet placed.
  for (size_t i = idx.size(); i > 1; --i) std::swap(idx[i - 1], idx[uniform_below(rng, i)]);
  return idx;
}

std::vector<Prompt> PromptSource::next(int64_t n) {
  if (n < 0) throw Error(path_.string() + ": asked for " + std::to_string(n) + " prompts");
  std::vector<Prompt> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(prompts_[order_[cursor_.position]]);
    // Step into the next epoch as soon as this one is used up, so a saved cursor never sits at
    // the end of an epoch and `epoch` counts the passes actually begun.
    if (++cursor_.position == prompts_.size()) {
      ++cursor_.epoch;
      cursor_.position = 0;
      order_ = order(cursor_.epoch);
    }
  }
  return out;
}

void PromptSource::restore(const PromptCursor& cursor) {
  if (cursor.seed != options_.seed)
    throw Error(path_.string() + ": the saved cursor has seed " + std::to_string(cursor.seed) + ", this source " +
                std::to_string(options_.seed) + " (resume with the run's original seed)");
  if (cursor.position >= prompts_.size())
    throw Error(path_.string() + ": the saved cursor is at position " + std::to_string(cursor.position) +
                " but the dataset has " + std::to_string(prompts_.size()) + " prompts (was the file changed?)");
  cursor_ = cursor;
  order_ = order(cursor_.epoch);
}

}  // namespace troupe
