// Rollout groups to and from JSON, and lists of them as msgpack (doubles hold floats exactly).
// Reading is strict: a checkpoint's file may be truncated, edited or from elsewhere, and the
// trainer indexes per-completion fields by completion and token without checking again.
#include "actors/rollout_io.hpp"

#include <cmath>
#include <limits>
#include <type_traits>

#include "policy/error.hpp"

namespace troupe {

using nlohmann::json;

namespace {

// Real files nest three levels (groups, completions, tokens); nlohmann's msgpack reader recurses
// once per level, so a file of a million nested arrays would overflow the stack.
constexpr int kMaxDepth = 16;

std::string describe(const json& v) {
  if (v.is_primitive() && !v.is_string()) return v.dump();
  return std::string(v.is_array() ? "an " : "a ") + v.type_name();
}

const json& field(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end()) throw Error(std::string("no field '") + key + "'");
  return *it;
}

// nlohmann's get<int>() casts a float or an out-of-range integer silently (undefined behaviour
// for a float beyond the type's range); these name the field and refuse instead.
template <class T>
T integer(const json& v, const std::string& what) {
  static_assert(std::is_integral_v<T>);
  using L = std::numeric_limits<T>;
  if (v.is_number_unsigned()) {
    if (const uint64_t u = v.get<uint64_t>(); u <= static_cast<uint64_t>(L::max())) return static_cast<T>(u);
  } else if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i >= static_cast<int64_t>(L::min()) && (i < 0 || static_cast<uint64_t>(i) <= static_cast<uint64_t>(L::max())))
      return static_cast<T>(i);
  }
  throw Error(what + " is " + describe(v) + ", expected an integer in [" + std::to_string(L::min()) + ", " +
              std::to_string(L::max()) + "]");
}

template <class T>
T number(const json& v, const std::string& what) {
  if (!v.is_number()) throw Error(what + " is " + describe(v) + ", expected a number");
  const double x = v.get<double>();
  if constexpr (std::is_same_v<T, float>)
    if (std::isfinite(x) && std::abs(x) > std::numeric_limits<float>::max())
      throw Error(what + " is " + v.dump() + ", beyond the range of a float");
  return static_cast<T>(x);
}

std::string text(const json& v, const std::string& what) {
  if (!v.is_string()) throw Error(what + " is " + describe(v) + ", expected a string");
  return v.get<std::string>();
}

template <class T, class Read>
std::vector<T> list(const json& v, const std::string& what, Read read) {
  if (!v.is_array()) throw Error(what + " is " + describe(v) + ", expected a list");
  std::vector<T> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) out.push_back(read(v[i], what + "[" + std::to_string(i) + "]"));
  return out;
}

template <class T>
std::vector<T> integers(const json& v, const std::string& what) {
  return list<T>(v, what, integer<T>);
}
template <class T>
std::vector<T> numbers(const json& v, const std::string& what) {
  return list<T>(v, what, number<T>);
}
template <class T>
std::vector<std::vector<T>> nested(const json& v, const std::string& what, std::vector<T> (*read)(const json&, const std::string&)) {
  return list<std::vector<T>>(v, what, read);
}

void check_length(size_t got, size_t expected, const std::string& what, const std::string& per) {
  if (got != expected)
    throw Error(what + " holds " + std::to_string(got) + " entries for " + std::to_string(expected) + " " + per);
}

// nlohmann's DOM builder, refusing containers nested deeper than kMaxDepth before it recurses.
struct BoundedSax {
  json& result;
  nlohmann::detail::json_sax_dom_parser<json> dom{result, /*allow_exceptions=*/false};
  int depth = 0;
  bool too_deep = false;

  bool enter() {
    too_deep = ++depth > kMaxDepth;
    return !too_deep;
  }
  bool null() { return dom.null(); }
  bool boolean(bool v) { return dom.boolean(v); }
  bool number_integer(json::number_integer_t v) { return dom.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return dom.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& s) { return dom.number_float(v, s); }
  bool string(json::string_t& v) { return dom.string(v); }
  bool binary(json::binary_t& v) { return dom.binary(v); }
  bool start_object(std::size_t n) { return enter() && dom.start_object(n); }
  bool key(json::string_t& v) { return dom.key(v); }
  bool end_object() { return --depth, dom.end_object(); }
  bool start_array(std::size_t n) { return enter() && dom.start_array(n); }
  bool end_array() { return --depth, dom.end_array(); }
  bool parse_error(std::size_t pos, const std::string& token, const nlohmann::detail::exception& e) {
    return dom.parse_error(pos, token, e);
  }
};

}  // namespace

json to_json(const RolloutGroup& g) {
  return {{"prompt_id", g.prompt_id}, {"batch", g.batch}, {"prompt_ids", g.prompt_ids},
          {"completion_ids", g.completion_ids}, {"behaviour_logprobs", g.behaviour_logprobs},
          {"reference_logprobs", g.reference_logprobs}, {"min_version", g.min_version},
          {"max_version", g.max_version}, {"truncated", g.truncated}, {"rewards", g.rewards},
          {"reward", g.reward}, {"metadata", g.metadata}, {"ticket", g.ticket}, {"error", g.error},
          {"generate_s", g.generate_s}};
}

RolloutGroup group_from_json(const json& j) {
  if (!j.is_object()) throw Error("is " + describe(j) + ", expected an object of rollout fields");
  RolloutGroup g;
  g.prompt_id = integer<uint64_t>(field(j, "prompt_id"), "prompt_id");
  g.batch = integer<int64_t>(field(j, "batch"), "batch");
  g.prompt_ids = integers<int32_t>(field(j, "prompt_ids"), "prompt_ids");
  g.completion_ids = nested<int32_t>(field(j, "completion_ids"), "completion_ids", integers<int32_t>);
  g.behaviour_logprobs = nested<float>(field(j, "behaviour_logprobs"), "behaviour_logprobs", numbers<float>);
  g.reference_logprobs = nested<float>(field(j, "reference_logprobs"), "reference_logprobs", numbers<float>);
  g.min_version = integers<int64_t>(field(j, "min_version"), "min_version");
  g.max_version = integers<int64_t>(field(j, "max_version"), "max_version");
  g.truncated = integers<uint8_t>(field(j, "truncated"), "truncated");
  const json& rewards = field(j, "rewards");
  if (!rewards.is_object()) throw Error("rewards is " + describe(rewards) + ", expected an object of named score lists");
  for (const auto& [name, scores] : rewards.items()) g.rewards[name] = numbers<double>(scores, "rewards." + name);
  g.reward = numbers<double>(field(j, "reward"), "reward");
  g.metadata = text(field(j, "metadata"), "metadata");
  g.ticket = integer<int64_t>(field(j, "ticket"), "ticket");
  g.error = text(field(j, "error"), "error");
  if (const auto it = j.find("generate_s"); it != j.end()) g.generate_s = number<double>(*it, "generate_s");
  // (checkpoints of older builds have no generate_s)

  // One entry per completion and one log-prob per token: the trainer indexes by both. A group
  // that failed (error set) may have no scores: it is reported, not trained.
  const size_t n = g.completion_ids.size();
  const std::string per = "completions";
  check_length(g.behaviour_logprobs.size(), n, "behaviour_logprobs", per);
  check_length(g.min_version.size(), n, "min_version", per);
  check_length(g.max_version.size(), n, "max_version", per);
  if (!g.truncated.empty()) check_length(g.truncated.size(), n, "truncated", per);
  if (!g.reference_logprobs.empty()) check_length(g.reference_logprobs.size(), n, "reference_logprobs", per);
  if (g.error.empty() || !g.reward.empty()) check_length(g.reward.size(), n, "reward", per);
  for (const auto& [name, scores] : g.rewards) check_length(scores.size(), n, "rewards." + name, per);
  for (size_t i = 0; i < n; ++i) {
    const std::string tokens = "tokens of completion " + std::to_string(i);
    check_length(g.behaviour_logprobs[i].size(), g.completion_ids[i].size(), "behaviour_logprobs[" + std::to_string(i) + "]", tokens);
    if (!g.reference_logprobs.empty())
      check_length(g.reference_logprobs[i].size(), g.completion_ids[i].size(), "reference_logprobs[" + std::to_string(i) + "]", tokens);
  }
  return g;
}

std::vector<uint8_t> rollouts_to_msgpack(std::span<const RolloutGroup> groups) {
  json list = json::array();
  for (const auto& g : groups) list.push_back(to_json(g));
  return json::to_msgpack(list);
}

std::vector<RolloutGroup> rollouts_from_msgpack(std::span<const uint8_t> bytes, const std::string& origin) {
  json groups;
  BoundedSax sax{groups};
  const bool ok = json::sax_parse(bytes.begin(), bytes.end(), &sax, nlohmann::detail::input_format_t::msgpack, /*strict=*/true);
  if (sax.too_deep)
    throw Error(origin + ": msgpack nested deeper than " + std::to_string(kMaxDepth) + " levels, not rollout groups");
  if (!ok || groups.is_discarded() || !groups.is_array()) throw Error(origin + ": not a msgpack array of rollout groups");
  std::vector<RolloutGroup> out;
  out.reserve(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    try {
      out.push_back(group_from_json(groups[i]));
    } catch (const std::exception& e) {
      throw Error(origin + ": group " + std::to_string(i) + ": " + e.what());
    }
  }
  return out;
}

}  // namespace troupe
