// Parses run configs: YAML (yaml-cpp) plus overrides into RunConfig, every key checked where it is
// read; writes the resolved config back. Builds nothing from it: the controller does that.
#include "actors/config.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include <yaml-cpp/yaml.h>

#include "policy/error.hpp"

namespace troupe {
namespace {

namespace fs = std::filesystem;

// ---- formatting ----------------------------------------------------------------------------

// Shortest text that reads back to the same double, with a '.' so that YAML 1.1 readers
// (PyYAML) also see a float: 1e-06 -> 1.0e-06, 1 -> 1.0.
std::string fmt(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (!std::isfinite(v) || s.find('.') != std::string::npos) return s;
  auto e = s.find('e');
  return e == std::string::npos ? s + ".0" : s.insert(e, ".0");
}
std::string fmt(int64_t v) { return std::to_string(v); }
// Messages show numbers as short as they read back (-1, 1e-06), not in fmt()'s YAML float form.
std::string short_num(double v) {
  char buf[64];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}
std::string fmt(uint64_t v) { return std::to_string(v); }

// A YAML double-quoted scalar (also how error messages show a bad value).
std::string quote(const std::string& s) {
  std::string q = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      q += '\\';
      q += static_cast<char>(c);
    } else if (c == '\n') {
      q += "\\n";
    } else if (c == '\t') {
      q += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      q += buf;
    } else {
      q += static_cast<char>(c);
    }
  }
  return q + "\"";
}

template <size_t N>
std::string join(const std::array<std::string_view, N>& names) {
  std::string s;
  for (size_t i = 0; i < N; ++i) s += (i ? ", " : "") + std::string(names[i]);
  return s;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean X?)" for the closest candidate within a few edits, else "".
template <class Names>
std::string did_you_mean(std::string_view word, const Names& candidates) {
  size_t best = std::string::npos;
  std::string_view pick;
  for (std::string_view c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best) best = d, pick = c;
  }
  size_t allowed = std::clamp<size_t>(word.size() / 3, 1, 3);
  return best <= allowed ? " (did you mean " + std::string(pick) + "?)" : "";
}

std::string describe(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "nothing (an empty value)";
  if (n.IsMap()) return "a map";
  if (n.IsSequence()) return "a list";
  return quote(n.Scalar());
}

// ---- where a key came from -----------------------------------------------------------------

struct Override {
  std::string key;   // dotted path
  std::string text;  // as given: key=value
};

struct Source {
  std::string file;
  std::vector<Override> overrides;
  std::map<std::string, std::string>* locations = nullptr;

  std::string where(const std::string& path, const YAML::Mark& mark) const {
    // The last override at or above the key replaced what the file said there.
    for (auto it = overrides.rbegin(); it != overrides.rend(); ++it)
      if (path == it->key || path.starts_with(it->key + "."))
        return file + ", override '" + it->text + "'";
    if (mark.line >= 0) return file + ":" + std::to_string(mark.line + 1);
    // Not in the file: a section an override created on its way down (trainr.lr=1).
    for (auto it = overrides.rbegin(); it != overrides.rend(); ++it)
      if (it->key.starts_with(path + ".")) return file + ", override '" + it->text + "'";
    return file;
  }
  [[noreturn]] void fail(const std::string& path, const YAML::Mark& mark, const std::string& msg) const {
    throw Error(where(path, mark) + ": " + path + ": " + msg);
  }
};

// ---- scalars -------------------------------------------------------------------------------

// Numbers and booleans must be plain scalars: `max_tokens: "256"` is a string, and quoting a
// number is more often a mistake than a wish.
const std::string& plain_scalar(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at,
                                const char* what) {
  if (!n.IsScalar()) s.fail(path, at, std::string("expected ") + what + ", got " + describe(n));
  if (n.Tag() == "!") s.fail(path, at, std::string("expected ") + what + ", got the quoted string " + quote(n.Scalar()));
  return n.Scalar();
}

// Each read() reports at `at`: the key's mark for map values, the item's own for list items.
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, std::string& out) {
  if (!n.IsScalar()) s.fail(path, at, "expected a string, got " + describe(n));
  out = n.Scalar();
}

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, int64_t& out) {
  std::string t = plain_scalar(s, path, n, at, "an integer");
  const char* b = t.data() + (t.starts_with('+') ? 1 : 0);
  auto r = std::from_chars(b, t.data() + t.size(), out);
  if (r.ec == std::errc::result_out_of_range) s.fail(path, at, "integer out of range, got " + t);
  if (r.ec != std::errc() || r.ptr != t.data() + t.size() || b == t.data() + t.size())
    s.fail(path, at, "expected an integer, got " + quote(t));
}

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, uint64_t& out) {
  std::string t = plain_scalar(s, path, n, at, "a non-negative integer");
  const char* b = t.data() + (t.starts_with('+') ? 1 : 0);
  auto r = std::from_chars(b, t.data() + t.size(), out);
  if (r.ec != std::errc() || r.ptr != t.data() + t.size() || b == t.data() + t.size())
    s.fail(path, at, "expected a non-negative integer, got " + quote(t));
}

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, double& out) {
  std::string t = plain_scalar(s, path, n, at, "a number");
  const char* b = t.data() + (t.starts_with('+') ? 1 : 0);
  auto r = std::from_chars(b, t.data() + t.size(), out);
  if (r.ec != std::errc() || r.ptr != t.data() + t.size() || b == t.data() + t.size())
    s.fail(path, at, "expected a number, got " + quote(t));
  if (!std::isfinite(out)) s.fail(path, at, "expected a finite number, got " + t);
}

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, bool& out) {
  std::string t = plain_scalar(s, path, n, at, "true or false");
  if (!YAML::convert<bool>::decode(n, out)) s.fail(path, at, "expected true or false, got " + quote(t));
}

// A list of strings; one string alone is a list of one (as vLLM's `stop` allows).
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, std::vector<std::string>& out) {
  out.clear();
  if (n.IsNull()) return;
  if (n.IsScalar()) {
    out.push_back(n.Scalar());
    return;
  }
  if (!n.IsSequence()) s.fail(path, at, "expected a list of strings, got " + describe(n));
  for (size_t i = 0; i < n.size(); ++i) {
    std::string v;
    read(s, path + "." + std::to_string(i), n[i], n[i].Mark(), v);
    out.push_back(std::move(v));
  }
}

// recipe is required, so it is read with Map::require rather than Map::get_enum.
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, Recipe& out) {
  std::string v;
  read(s, path, n, at, v);
  for (size_t i = 0; i < kRecipeNames.size(); ++i)
    if (kRecipeNames[i] == v) {
      out = static_cast<Recipe>(i);
      return;
    }
  s.fail(path, at, "expected one of " + join(kRecipeNames) + ", got " + quote(v) + did_you_mean(v, kRecipeNames));
}

// ---- maps ----------------------------------------------------------------------------------

// One YAML map being read, with its key path and marks for error messages.
class Map {
 public:
  // `at` locates the map itself: its key's line (a block map's own mark is its first child's);
  // an absent or null `node` reads as an empty map.
  Map(const Source& s, std::string path, const YAML::Node& node, YAML::Mark at)
      : s_(s), path_(std::move(path)), mark_(at.line >= 0 ? at : node.Mark()) {
    if (!node.IsDefined() || node.IsNull()) return;
    if (!node.IsMap()) s.fail(path_.empty() ? "(top level)" : path_, mark_, "expected a map of keys, got " + describe(node));
    for (auto it = node.begin(); it != node.end(); ++it) {
      const YAML::Node& k = it->first;
      if (!k.IsScalar()) s.fail(path_.empty() ? "(top level)" : path_, k.Mark(), "keys must be plain names, got " + describe(k));
      for (const auto& e : entries_)
        if (e.key == k.Scalar())
          s.fail(child(e.key), k.Mark(),
                 "duplicate key (first given on line " + std::to_string(e.key_mark.line + 1) + ")");
      entries_.push_back({k.Scalar(), k.Mark(), it->second});
    }
    if (s_.locations && !path_.empty()) (*s_.locations)[path_] = s_.where(path_, mark_);
  }

  std::string child(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  bool has(const std::string& key) const { return find(key) != nullptr; }

  // The key's mark when present (a null value has no useful one), else this map's.
  YAML::Mark mark(const std::string& key) const {
    const Entry* e = find(key);
    return e ? e->key_mark : mark_;
  }
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const { s_.fail(child(key), mark(key), msg); }
  void check(bool ok, const std::string& key, const std::string& msg) const {
    if (!ok) fail(key, msg);
  }

  // Reads `key` into `out` when present; returns whether it was.
  template <class T>
  bool get(const std::string& key, T& out) {
    const Entry* e = use(key);
    if (!e) return false;
    read(s_, child(key), e->value, e->key_mark, out);
    return true;
  }
  // An optional field: absent or null leaves it unset.
  template <class T>
  bool get(const std::string& key, std::optional<T>& out) {
    const Entry* e = use(key);
    if (!e) return false;
    if (e->value.IsNull()) {
      out.reset();
      return true;
    }
    T v{};
    read(s_, child(key), e->value, e->key_mark, v);
    out = std::move(v);
    return true;
  }
  template <class T>
  void require(const std::string& key, T& out, const std::string& hint) {
    if (!get(key, out)) s_.fail(child(key), mark_, "required: " + hint);
  }
  template <class E, size_t N>
  bool get_enum(const std::string& key, E& out, const std::array<std::string_view, N>& names) {
    std::string v;
    if (!get(key, v)) return false;
    for (size_t i = 0; i < N; ++i)
      if (names[i] == v) {
        out = static_cast<E>(i);
        return true;
      }
    fail(key, "expected one of " + join(names) + ", got " + quote(v) + did_you_mean(v, names));
  }

  // A nested map (absent: empty, so its defaults apply).
  Map map(const std::string& key) {
    const Entry* e = use(key);
    return Map(s_, child(key), e ? e->value : YAML::Node(), e ? e->key_mark : mark_);
  }
  // The raw node, for lists; undefined when absent.
  YAML::Node node(const std::string& key) {
    const Entry* e = use(key);
    return e ? e->value : YAML::Node();
  }

  // Declares the keys this map may hold and rejects any other, before anything is read, so
  // that a typo reports "unknown key (did you mean path?)" rather than "path: required".
  void allow(std::vector<std::string> keys) {
    keys_ = std::move(keys);
    for (const auto& e : entries_) {
      if (std::find(keys_.begin(), keys_.end(), e.key) != keys_.end()) continue;
      std::string hint = did_you_mean(e.key, keys_);
      if (hint.empty()) {
        hint = " (expected one of: ";
        for (size_t i = 0; i < keys_.size(); ++i) hint += (i ? ", " : "") + keys_[i];
        hint += ")";
      }
      s_.fail(child(e.key), e.key_mark, "unknown key" + hint);
    }
  }

 private:
  struct Entry {
    std::string key;
    YAML::Mark key_mark;
    YAML::Node value;
  };
  const Entry* find(const std::string& key) const {
    for (const auto& e : entries_)
      if (e.key == key) return &e;
    return nullptr;
  }
  const Entry* use(const std::string& key) {
    if (std::find(keys_.begin(), keys_.end(), key) == keys_.end())
      throw std::logic_error("config parser: " + child(key) + " read but not declared in allow()");
    const Entry* e = find(key);
    if (e && s_.locations) (*s_.locations)[child(key)] = s_.where(child(key), mark(key));
    return e;
  }

  const Source& s_;
  std::string path_;
  YAML::Mark mark_;
  std::vector<Entry> entries_;
  std::vector<std::string> keys_;
};

// ---- sections ------------------------------------------------------------------------------

std::string got(double v) { return ", got " + short_num(v); }
std::string got(int64_t v) { return ", got " + fmt(v); }

void parse_model(Map m, ModelSection& c) {
  m.allow({"path", "dtype", "device"});
  m.require("path", c.path, "the model to train: a Hugging Face folder or a .gguf file");
  m.check(!c.path.empty(), "path", "must not be empty");
  m.get_enum("dtype", c.dtype, kModelDtypeNames);
  m.get("device", c.device);
  bool cuda_n = c.device.starts_with("cuda:") && c.device.size() > 5 &&
                c.device.find_first_not_of("0123456789", 5) == std::string::npos;
  m.check(c.device == "cpu" || c.device == "cuda" || cuda_n, "device",
          "expected cpu, cuda or cuda:N, got " + quote(c.device));
}

void parse_dataset(Map m, DatasetSection& c) {
  m.allow({"path", "prompt", "answer", "system", "chat_template", "limit", "response", "messages", "chosen", "rejected"});
  m.get("response", c.response);
  m.get("messages", c.messages);
  m.check(!c.messages.empty(), "messages", "must name the JSONL field holding the chat messages");
  m.get("chosen", c.chosen);
  m.check(!c.chosen.empty(), "chosen", "must name the JSONL field holding the preferred response");
  m.get("rejected", c.rejected);
  m.check(!c.rejected.empty(), "rejected", "must name the JSONL field holding the rejected response");
  m.require("path", c.path, "a JSONL file of prompts");
  m.check(!c.path.empty(), "path", "must not be empty");
  m.get("prompt", c.prompt);
  m.check(!c.prompt.empty(), "prompt", "must name the JSONL field holding the prompt");
  m.get("answer", c.answer);
  m.get("system", c.system);
  m.get("chat_template", c.chat_template);
  m.check(!c.system || c.chat_template, "system", "a system message needs chat_template: true");
  m.get("limit", c.limit);
  m.check(c.limit >= 0, "limit", "must be >= 0 (0: every record)" + got(c.limit));
}

// Returns whether the file gave data.seed (else run.seed applies).
bool parse_data(Map m, DataSection& c) {
  m.allow({"train", "eval", "shuffle", "seed"});
  parse_dataset(m.map("train"), c.train);
  if (m.has("eval") && !m.node("eval").IsNull()) {
    c.eval.emplace();
    parse_dataset(m.map("eval"), *c.eval);
  }
  m.get("shuffle", c.shuffle);
  bool seeded = m.get("seed", c.seed);
  return seeded;
}

void parse_generator(Map m, GeneratorSection& c) {
  m.allow({"count", "engine", "url", "weight_transfer", "group_size", "max_tokens", "temperature", "top_p", "top_k", "min_p",
           "max_batch", "max_seq_len", "stop", "threads"});
  m.get("threads", c.threads);
  m.check(c.threads >= 0, "threads", "must be >= 0 (0: LibTorch's default)" + got(c.threads));
  m.get("count", c.count);
  m.check(c.count >= 1, "count", "must be >= 1" + got(c.count));
  m.get_enum("engine", c.engine, kEngineNames);
  m.get("url", c.url);
  if (c.engine == EngineKind::remote) {
    if (!m.has("url") || c.url.empty())
      m.fail(m.has("url") ? "url" : "engine", m.has("url") ? "must not be empty with engine: remote"
                                                          : "engine: remote needs url: http://host:port of a vLLM-compatible server");
    m.check(c.url.starts_with("http://") || c.url.starts_with("https://"), "url",
            "expected http://host:port or https://..., got " + quote(c.url));
    m.check(c.count == 1, "count", "must be 1 with engine: remote (one client drives the server, which batches "
                                   "the requests itself)" + got(c.count));
    m.get("weight_transfer", c.weight_transfer);
    m.check(c.weight_transfer == "reload" || c.weight_transfer == "disk", "weight_transfer",
            "expected reload or disk (vLLM's NCCL transfer needs a CUDA trainer), got " + quote(c.weight_transfer));
  } else {
    m.check(c.url.empty(), "url", "only used with engine: remote (the built-in engine runs in-process)");
    m.check(!m.has("weight_transfer"), "weight_transfer", "only used with engine: remote");
  }
  m.get("group_size", c.group_size);
  m.check(c.group_size >= 1, "group_size", "must be >= 1" + got(c.group_size));
  m.get("max_tokens", c.max_tokens);
  m.check(c.max_tokens >= 1, "max_tokens", "must be >= 1" + got(c.max_tokens));
  m.get("temperature", c.temperature);
  m.check(c.temperature >= 0, "temperature", "must be >= 0" + got(c.temperature));
  m.get("top_p", c.top_p);
  m.check(c.top_p > 0 && c.top_p <= 1, "top_p", "must be in (0, 1]" + got(c.top_p));
  m.get("top_k", c.top_k);
  m.check(c.top_k >= -1, "top_k", "must be >= 1, or -1 or 0 for no limit" + got(c.top_k));
  m.get("min_p", c.min_p);
  m.check(c.min_p >= 0 && c.min_p < 1, "min_p", "must be in [0, 1)" + got(c.min_p));
  m.get("max_batch", c.max_batch);
  m.check(c.max_batch >= 1, "max_batch", "must be >= 1" + got(c.max_batch));
  m.get("max_seq_len", c.max_seq_len);
  m.check(c.max_seq_len > c.max_tokens, m.has("max_seq_len") ? "max_seq_len" : "max_tokens",
          "generator.max_seq_len (" + fmt(c.max_seq_len) + ") must exceed generator.max_tokens (" + fmt(c.max_tokens) +
              "): it holds the prompt too");
  m.get("stop", c.stop);
  for (size_t i = 0; i < c.stop.size(); ++i) m.check(!c.stop[i].empty(), "stop", "stop strings must not be empty");
}

void parse_reward(Map m, RewardSection& c) {
  m.allow({"name", "kind", "weight", "answer_key", "plugin", "url", "timeout_s", "retries", "backoff_s", "max_batch"});
  m.require("name", c.name, "a unique name (metrics report reward/<name>/mean)");
  m.check(!c.name.empty(), "name", "must not be empty");
  m.get("kind", c.kind);
  m.get("weight", c.weight);
  m.get("answer_key", c.answer_key);
  m.get("plugin", c.plugin);
  m.get("url", c.url);
  m.get("timeout_s", c.timeout_s);
  m.get("retries", c.retries);
  m.get("backoff_s", c.backoff_s);
  m.get("max_batch", c.max_batch);
  if (c.kind.empty()) {
    // The same inference as RewardSpec::resolved_kind, stored resolved.
    if (!c.plugin.empty() && !c.url.empty()) m.fail("kind", "both plugin and url are set: give kind, or keep one");
    if (!c.plugin.empty()) c.kind = "plugin";
    else if (!c.url.empty()) c.kind = "http";
    else m.fail("kind", "required (one of " + join(kRewardKindNames) + "), or give plugin: PATH or url: URL");
  }
  if (std::find(kRewardKindNames.begin(), kRewardKindNames.end(), c.kind) == kRewardKindNames.end())
    m.fail("kind", "expected one of " + join(kRewardKindNames) + ", got " + quote(c.kind) + did_you_mean(c.kind, kRewardKindNames));
  if (c.kind == "plugin") m.check(!c.plugin.empty(), "plugin", "kind plugin needs plugin: PATH of a shared library");
  else m.check(c.plugin.empty(), "plugin", "only used with kind: plugin");
  if (c.kind == "http") {
    m.check(!c.url.empty(), "url", "kind http needs url: http://host:port/path");
    m.check(c.url.starts_with("http://") || c.url.starts_with("https://"), "url",
            "expected http://... or https://..., got " + quote(c.url));
  } else {
    m.check(c.url.empty(), "url", "only used with kind: http");
  }
  if (c.kind == "math_answer") m.check(!c.answer_key.empty(), "answer_key", "must name the metadata field holding the answer");
  m.check(c.timeout_s > 0, "timeout_s", "must be > 0" + got(c.timeout_s));
  m.check(c.retries >= 0 && c.retries <= 100, "retries", "must be in [0, 100]" + got(c.retries));
  m.check(c.backoff_s >= 0, "backoff_s", "must be >= 0" + got(c.backoff_s));
  m.check(c.max_batch >= 0, "max_batch", "must be >= 0 (0: one request per batch)" + got(c.max_batch));
}

void parse_rewards(const Source& s, Map& top, std::vector<RewardSection>& out) {
  YAML::Node n = top.node("rewards");
  if (!n.IsDefined() || n.IsNull()) return;
  if (!n.IsSequence()) top.fail("rewards", "expected a list of rewards ({name, kind, weight, ...}), got " + describe(n));
  for (size_t i = 0; i < n.size(); ++i) {
    std::string path = "rewards." + std::to_string(i);
    RewardSection r;
    parse_reward(Map(s, path, n[i], n[i].Mark()), r);
    const YAML::Node item = n[i];
    for (const auto& prev : out)
      if (prev.name == r.name) s.fail(path + ".name", std::as_const(item)["name"].Mark(), "duplicate reward name " + quote(r.name));
    out.push_back(std::move(r));
  }
}

void parse_loss(const Source& s, Map m, LossSection& c, Recipe recipe) {
  m.allow({"kind", "aggregation", "clip", "epsilon", "epsilon_high", "beta", "behaviour_cap", "label_smoothing", "gamma", "lambda", "value_clip", "vf_coef", "whiten_advantages"});
  m.get("gamma", c.gamma);
  m.check(c.gamma > 0 && c.gamma <= 1, "gamma", "must be in (0, 1]" + got(c.gamma));
  m.get("lambda", c.lambda);
  m.check(c.lambda >= 0 && c.lambda <= 1, "lambda", "must be in [0, 1]" + got(c.lambda));
  m.get("value_clip", c.value_clip);
  m.check(c.value_clip >= 0, "value_clip", "must be >= 0 (0: no clipping)" + got(c.value_clip));
  m.get("vf_coef", c.vf_coef);
  m.check(c.vf_coef > 0, "vf_coef", "must be > 0" + got(c.vf_coef));
  m.get("whiten_advantages", c.whiten_advantages);
  m.get("label_smoothing", c.label_smoothing);
  m.check(c.label_smoothing >= 0 && c.label_smoothing < 0.5, "label_smoothing", "must be in [0, 0.5)" + got(c.label_smoothing));
  m.get_enum("kind", c.kind, kLossKindNames);
  m.get_enum("aggregation", c.aggregation, kLossAggregationNames);
  YAML::Node clip = m.node("clip");
  if (clip.IsDefined() && !clip.IsNull()) {
    if (m.has("epsilon") || m.has("epsilon_high"))
      m.fail("clip", "give clip: [low, high] or epsilon/epsilon_high, not both");
    if (!clip.IsSequence() || clip.size() != 2)
      m.fail("clip", "expected [epsilon, epsilon_high], two numbers, got " + describe(clip));
    read(s, m.child("clip") + ".0", clip[0], m.mark("clip"), c.epsilon);
    read(s, m.child("clip") + ".1", clip[1], m.mark("clip"), c.epsilon_high);
    m.check(c.epsilon > 0 && c.epsilon < 1, "clip", "epsilon (the first value) must be in (0, 1)" + got(c.epsilon));
    m.check(c.epsilon_high > 0 && c.epsilon_high < 1, "clip", "epsilon_high (the second value) must be in (0, 1)" + got(c.epsilon_high));
  }
  if (m.get("epsilon", c.epsilon) && !m.has("epsilon_high")) c.epsilon_high = c.epsilon;  // TRL: defaults to epsilon
  m.get("epsilon_high", c.epsilon_high);
  m.check(c.epsilon > 0 && c.epsilon < 1, "epsilon", "must be in (0, 1)" + got(c.epsilon));
  m.check(c.epsilon_high > 0 && c.epsilon_high < 1, "epsilon_high", "must be in (0, 1)" + got(c.epsilon_high));
  m.get("beta", c.beta);
  m.check(c.beta >= 0, "beta", "must be >= 0 (0: no KL, no reference)" + got(c.beta));
  m.get("behaviour_cap", c.behaviour_cap);
  m.check(c.behaviour_cap >= 1, "behaviour_cap", "must be >= 1 (a cap below 1 would down-weight on-policy tokens)" + got(c.behaviour_cap));
  // dpo: the loss is DPO's and beta its strength (TRL's default 0.1); the reference is the
  // frozen starting model unless reference.path names another.
  if (recipe == Recipe::dpo || recipe == Recipe::online_dpo) {
    m.check(!m.has("kind") || c.kind == LossKind::dpo, "kind", "recipe " + std::string(to_string(recipe)) + " takes kind: dpo");
    c.kind = LossKind::dpo;
    if (!m.has("beta")) c.beta = 0.1;
    m.check(c.beta > 0, "beta", "must be > 0 for dpo" + got(c.beta));
  } else if (recipe == Recipe::ppo) {
    m.check(!m.has("kind") || c.kind == LossKind::ppo, "kind", "recipe ppo takes kind: ppo");
    c.kind = LossKind::ppo;
  } else {
    m.check(c.kind != LossKind::dpo, "kind", "kind: dpo needs recipe: dpo or online_dpo");
    m.check(c.kind != LossKind::ppo, "kind", "kind: ppo needs recipe: ppo");
  }
}

// Returns whether sft_warmup gave its own lr.
bool parse_sft_warmup(Map m, SftWarmupSection& c) {
  m.allow({"path", "prompt", "completion", "steps", "lr"});
  m.require("path", c.path, "a JSONL file of prompt/completion pairs");
  m.check(!c.path.empty(), "path", "must not be empty");
  m.get("prompt", c.prompt);
  m.check(!c.prompt.empty(), "prompt", "must name the JSONL field holding the prompt");
  m.get("completion", c.completion);
  m.check(!c.completion.empty(), "completion", "must name the JSONL field holding the completion");
  m.require("steps", c.steps, "optimizer steps of the supervised stage");
  m.check(c.steps >= 1, "steps", "must be >= 1" + got(c.steps));
  bool has_lr = m.get("lr", c.lr);
  if (has_lr) m.check(c.lr > 0, "lr", "must be > 0" + got(c.lr));
  return has_lr;
}

void parse_trainer(const Source& s, Map m, TrainerSection& c, Recipe recipe) {
  m.allow({"batch_groups", "steps", "lr", "weight_decay", "warmup_steps", "min_lr_ratio", "max_grad_norm", "micro_batch", "num_iterations", "logprob_chunk", "scale_rewards", "mask_truncated_completions", "loss", "sft_warmup", "threads", "batch_size", "max_length", "packing", "activation_checkpointing", "eval_every"});
  m.get("batch_size", c.batch_size);
  m.check(c.batch_size >= 1, "batch_size", "must be >= 1" + got(c.batch_size));
  m.get("max_length", c.max_length);
  m.check(c.max_length >= 2, "max_length", "must be >= 2" + got(c.max_length));
  m.get("packing", c.packing);
  m.get("activation_checkpointing", c.activation_checkpointing);
  m.get("eval_every", c.eval_every);
  m.check(c.eval_every >= 0, "eval_every", "must be >= 0 (0: only at the end)" + got(c.eval_every));
  m.get("threads", c.threads);
  m.check(c.threads >= 0, "threads", "must be >= 0 (0: LibTorch's default)" + got(c.threads));
  m.get("batch_groups", c.batch_groups);
  m.check(c.batch_groups >= 1, "batch_groups", "must be >= 1" + got(c.batch_groups));
  m.get("steps", c.steps);
  m.check(c.steps >= 1, "steps", "must be >= 1" + got(c.steps));
  m.get("lr", c.lr);
  m.check(c.lr > 0, "lr", "must be > 0" + got(c.lr));
  m.get("weight_decay", c.weight_decay);
  m.check(c.weight_decay >= 0, "weight_decay", "must be >= 0" + got(c.weight_decay));
  m.get("warmup_steps", c.warmup_steps);
  m.check(c.warmup_steps >= 0 && c.warmup_steps <= c.steps, "warmup_steps",
          "must be in [0, trainer.steps = " + fmt(c.steps) + "]" + got(c.warmup_steps));
  m.get("min_lr_ratio", c.min_lr_ratio);
  m.check(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]" + got(c.min_lr_ratio));
  m.get("max_grad_norm", c.max_grad_norm);
  m.check(c.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0: no clipping)" + got(c.max_grad_norm));
  m.get("micro_batch", c.micro_batch);
  m.check(c.micro_batch >= 0, "micro_batch", "must be >= 0 (0: the whole batch at once)" + got(c.micro_batch));
  m.get("num_iterations", c.num_iterations);
  m.check(c.num_iterations >= 1, "num_iterations", "must be >= 1" + got(c.num_iterations));
  m.get("logprob_chunk", c.logprob_chunk);
  m.check(c.logprob_chunk >= 1, "logprob_chunk", "must be >= 1" + got(c.logprob_chunk));
  m.get_enum("scale_rewards", c.scale_rewards, kRewardScalingNames);
  m.get("mask_truncated_completions", c.mask_truncated_completions);
  parse_loss(s, m.map("loss"), c.loss, recipe);
  if (m.has("sft_warmup") && !m.node("sft_warmup").IsNull()) {
    c.sft_warmup.emplace();
    if (!parse_sft_warmup(m.map("sft_warmup"), *c.sft_warmup)) c.sft_warmup->lr = c.lr;
  }
}

void parse_async(Map m, AsyncSection& c) {
  m.allow({"max_staleness", "sync_every"});
  m.get("max_staleness", c.max_staleness);
  m.check(c.max_staleness >= 0, "max_staleness", "must be >= 0 (0: synchronous, on-policy)" + got(c.max_staleness));
  m.get("sync_every", c.sync_every);
  m.check(c.sync_every >= 1, "sync_every", "must be >= 1" + got(c.sync_every));
  // Generators then hold weights up to k - 1 versions old: with k > eta + 1 no rollout would
  // ever be fresh enough, and the run would stall.
  m.check(c.sync_every <= c.max_staleness + 1, "sync_every",
          "must be <= async.max_staleness + 1 = " + fmt(c.max_staleness + 1) +
              " (generators would fall further behind than max_staleness allows)" + got(c.sync_every));
}

void parse_parallel(Map m, ParallelSection& c) {
  m.allow({"trainer_ranks", "sharding", "timeout_s"});
  m.get("trainer_ranks", c.trainer_ranks);
  m.check(c.trainer_ranks >= 1, "trainer_ranks", "must be >= 1 (1: one process)" + got(c.trainer_ranks));
  m.get_enum("sharding", c.sharding, kShardingNames);
  m.get("timeout_s", c.timeout_s);
  m.check(c.timeout_s > 0, "timeout_s", "must be > 0" + got(c.timeout_s));
}

void parse_cluster(Map m, ClusterSection& c) {
  m.allow({"generator_processes", "join_timeout_s", "restarts", "reward_processes", "reference_processes", "lost_groups",
           "answer_timeout_s"});
  m.get("generator_processes", c.generator_processes);
  m.check(c.generator_processes >= 0, "generator_processes",
          "must be >= 0 (0: generators in the run's own process)" + got(c.generator_processes));
  m.get("join_timeout_s", c.join_timeout_s);
  m.check(c.join_timeout_s > 0, "join_timeout_s", "must be > 0" + got(c.join_timeout_s));
  m.get("restarts", c.restarts);
  m.check(c.restarts >= 0, "restarts", "must be >= 0 (0: a worker that dies is not replaced)" + got(c.restarts));
  m.get("reward_processes", c.reward_processes);
  m.check(c.reward_processes >= 0, "reward_processes", "must be >= 0 (0: the reward in the run's own process)" +
                                                           got(c.reward_processes));
  m.get("reference_processes", c.reference_processes);
  m.check(c.reference_processes >= 0, "reference_processes",
          "must be >= 0 (0: the reference in the run's own process)" + got(c.reference_processes));
  m.get("lost_groups", c.lost_groups);
  m.check(c.lost_groups == "retry" || c.lost_groups == "fail", "lost_groups",
          "expected retry (score them on another worker) or fail, got " + quote(c.lost_groups));
  m.get("answer_timeout_s", c.answer_timeout_s);
  m.check(c.answer_timeout_s > 0, "answer_timeout_s", "must be > 0" + got(c.answer_timeout_s));
}

void parse_run(Map m, RunSection& c, const std::string& stem) {
  m.allow({"dir", "checkpoint_every", "log_every", "seed", "deterministic"});
  c.dir = "runs/" + stem;
  m.get("dir", c.dir);
  m.check(!c.dir.empty(), "dir", "must not be empty");
  m.get("checkpoint_every", c.checkpoint_every);
  m.check(c.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0: only at the end)" + got(c.checkpoint_every));
  m.get("log_every", c.log_every);
  m.check(c.log_every >= 1, "log_every", "must be >= 1" + got(c.log_every));
  m.get("seed", c.seed);
  m.get("deterministic", c.deterministic);
}

void parse_lora(Map m, LoraSection& c) {
  m.allow({"rank", "alpha", "dropout", "target_modules"});
  m.get("rank", c.rank);
  m.check(c.rank >= 1, "rank", "must be >= 1" + got(c.rank));
  m.get("alpha", c.alpha);
  m.check(c.alpha > 0, "alpha", "must be > 0" + got(c.alpha));
  m.get("dropout", c.dropout);
  m.check(c.dropout >= 0 && c.dropout < 1, "dropout", "must be in [0, 1)" + got(c.dropout));
  m.get("target_modules", c.target_modules);
  m.check(!c.target_modules.empty(), "target_modules", "must name at least one projection (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
  for (const auto& t : c.target_modules)
    m.check(t == "q_proj" || t == "k_proj" || t == "v_proj" || t == "o_proj" || t == "gate_proj" || t == "up_proj" || t == "down_proj",
            "target_modules", "unknown projection " + quote(t) + " (one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
}

RunConfig parse_root(const Source& s, const YAML::Node& root, const std::string& stem) {
  if (!root.IsDefined() || root.IsNull())
    throw Error(s.file + ": empty config (expected recipe, model, data, generator, rewards, trainer, async, run)");
  Map top(s, "", root, root.Mark());
  top.allow({"recipe", "resume", "model", "lora", "data", "generator", "rewards", "reference", "trainer", "async",
             "parallel", "cluster", "run"});
  RunConfig c;
  top.require("recipe", c.recipe, "one of " + join(kRecipeNames));
  top.get("resume", c.resume);
  parse_model(top.map("model"), c.model);
  if ((top.has("lora") && !top.node("lora").IsNull()) || c.recipe == Recipe::lora) {
    c.lora.emplace();
    parse_lora(top.map("lora"), *c.lora);
  }
  bool data_seeded = parse_data(top.map("data"), c.data);
  parse_generator(top.map("generator"), c.generator);
  parse_rewards(s, top, c.rewards);
  parse_trainer(s, top.map("trainer"), c.trainer, c.recipe);
  parse_async(top.map("async"), c.async);
  parse_parallel(top.map("parallel"), c.parallel);
  parse_cluster(top.map("cluster"), c.cluster);
  parse_run(top.map("run"), c.run, stem);

  Map ref = top.map("reference");
  ref.allow({"enabled", "path"});
  std::optional<bool> enabled;
  ref.get("enabled", enabled);
  c.reference.enabled = enabled.value_or(c.trainer.loss.beta > 0);
  ref.check(c.reference.enabled || c.trainer.loss.beta == 0, "enabled",
            "must be true when trainer.loss.beta > 0 (the KL term needs reference log-probs); set beta: 0 or enabled: true");
  c.reference.path = c.model.path;
  ref.get("path", c.reference.path);
  ref.check(!c.reference.path.empty(), "path", "must not be empty (absent: model.path)");

  // An RL checkpoint is resumable only where the generators hold its weights: after a sync.
  const bool graph = c.recipe == Recipe::grpo || c.recipe == Recipe::ppo || c.recipe == Recipe::online_dpo ||
                     c.recipe == Recipe::reinforce;
  if (graph)
    top.map("run").check(c.run.checkpoint_every % c.async.sync_every == 0, "checkpoint_every",
                         "must be a multiple of async.sync_every = " + fmt(c.async.sync_every) + got(c.run.checkpoint_every));
  if (!data_seeded) c.data.seed = c.run.seed;
  // online_dpo pairs each prompt's best and worst completion: it needs two of them.
  if (c.recipe == Recipe::online_dpo)
    top.map("generator").check(c.generator.group_size >= 2, "group_size",
                               "must be >= 2 for recipe online_dpo (a pair per prompt)" + got(c.generator.group_size));
  if (graph)
    top.map("parallel").check(c.parallel.trainer_ranks == 1 && c.parallel.sharding == ShardingMode::none, "trainer_ranks",
                              "recipe " + std::string(to_string(c.recipe)) +
                                  " trains in one process for now (the actor graph across processes comes first); "
                                  "sft, lora and dpo take parallel.trainer_ranks and parallel.sharding");
  else
    top.map("parallel").check(c.trainer.batch_size >= c.parallel.trainer_ranks, "trainer_ranks",
                              "must be <= trainer.batch_size = " + fmt(c.trainer.batch_size) +
                                  " (every rank trains a part of each batch)" + got(c.parallel.trainer_ranks));
  if (c.cluster.generator_processes > 0) {
    top.map("cluster").check(graph, "generator_processes",
                             "only the RL recipes (grpo, ppo, online_dpo, reinforce) have generators" +
                                 got(c.cluster.generator_processes));
    top.map("cluster").check(c.generator.engine == EngineKind::builtin, "generator_processes",
                             "runs built-in engines; generator.engine remote drives its server from the run's process");
    top.map("generator").check(c.generator.count == 1 || c.generator.count == c.cluster.generator_processes, "count",
                               "must be 1 or cluster.generator_processes = " + fmt(c.cluster.generator_processes) +
                                   " (each worker process runs one generator)" + got(c.generator.count));
    c.generator.count = c.cluster.generator_processes;
  }
  top.map("cluster").check(graph || c.cluster.reward_processes == 0, "reward_processes",
                           "only the RL recipes (grpo, ppo, online_dpo, reinforce) have a reward actor");
  top.map("cluster").check(c.cluster.reference_processes == 0 || (graph && c.reference.enabled), "reference_processes",
                           "needs the RL graph's reference actor (reference.enabled, or trainer.loss.beta > 0)");
  if (graph && c.rewards.empty())
    top.fail("rewards", "required: at least one reward for recipe " + std::string(to_string(c.recipe)) +
                            " (e.g. - {name: correct, kind: math_answer})");
  return c;
}

// ---- overrides -----------------------------------------------------------------------------

std::vector<std::string> split_key(const std::string& key) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return parts;
}

std::optional<size_t> as_index(const std::string& part) {
  size_t i = 0;
  auto r = std::from_chars(part.data(), part.data() + part.size(), i);
  if (r.ec != std::errc() || r.ptr != part.data() + part.size()) return std::nullopt;
  return i;
}

// Sets key.path in the tree to the YAML value, creating maps on the way. Whether the key is
// known is left to the parser, which then names the override.
void apply_override(const std::string& file, YAML::Node& root, const std::string& text, Override& out) {
  size_t eq = text.find('=');
  std::string where = file + ", override '" + text + "'";
  if (eq == std::string::npos || eq == 0)
    throw Error(where + ": expected key.path=value (e.g. trainer.lr=1e-6)");
  out = {text.substr(0, eq), text};
  auto parts = split_key(out.key);
  for (const auto& p : parts)
    if (p.empty()) throw Error(where + ": " + out.key + ": empty key name");
  YAML::Node value;
  try {
    value = YAML::Load(text.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    throw Error(where + ": " + out.key + ": the value is not valid YAML: " + e.msg);
  }
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  YAML::Node cur(root);  // copies share the node; reset() moves this handle down the tree
  std::string path;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    bool last = i + 1 == parts.size();
    path += (path.empty() ? "" : ".") + p;
    if (cur.IsSequence()) {
      auto idx = as_index(p);
      if (!idx || *idx > cur.size())
        throw Error(where + ": " + path + ": expected a list index in [0, " + std::to_string(cur.size()) + "]");
      if (*idx == cur.size()) cur.push_back(last ? value : YAML::Node(YAML::NodeType::Map));
      else if (last) cur[*idx] = value;
      if (last) break;
      YAML::Node next = cur[*idx];
      cur.reset(next);
      continue;
    }
    if (cur.IsScalar())
      throw Error(where + ": " + path + ": " + path.substr(0, path.rfind('.')) + " is a single value, not a section");
    if (last) {
      cur[p] = value;
      break;
    }
    YAML::Node next = cur[p];
    if (!next.IsDefined() || next.IsNull()) next = YAML::Node(YAML::NodeType::Map);  // binds into the tree
    cur.reset(next);
  }
}

// ---- writing -------------------------------------------------------------------------------

struct Writer {
  std::ostringstream out;
  void line(int indent, const std::string& key, const std::string& value) {
    out << std::string(indent, ' ') << key << ":" << (value.empty() ? "" : " " + value) << "\n";
  }
};

std::string flow(const std::vector<std::string>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + quote(v[i]);
  return s + "]";
}
std::string b(bool v) { return v ? "true" : "false"; }
std::string name_of(auto v) { return std::string(to_string(v)); }

void write_dataset(Writer& w, int ind, const DatasetSection& d) {
  w.line(ind, "path", quote(d.path));
  w.line(ind, "prompt", quote(d.prompt));
  w.line(ind, "answer", quote(d.answer));
  if (d.system) w.line(ind, "system", quote(*d.system));
  w.line(ind, "chat_template", b(d.chat_template));
  w.line(ind, "limit", fmt(d.limit));
  w.line(ind, "response", quote(d.response));
  w.line(ind, "messages", quote(d.messages));
  w.line(ind, "chosen", quote(d.chosen));
  w.line(ind, "rejected", quote(d.rejected));
}

}  // namespace

std::string ConfigOrigin::at(const std::string& key) const {
  for (std::string k = key;;) {
    if (auto it = locations.find(k); it != locations.end()) return it->second;
    auto dot = k.rfind('.');
    if (dot == std::string::npos) return file;
    k.resize(dot);
  }
}

RunConfig parse_run_config(const std::string& yaml, const std::string& source, const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    std::string at = e.mark.line >= 0 ? ":" + std::to_string(e.mark.line + 1) : "";
    std::string col = e.mark.column >= 0 ? " (column " + std::to_string(e.mark.column + 1) + ")" : "";
    throw Error(source + at + ": invalid YAML: " + e.msg + col);
  }
  ConfigOrigin origin{source, {}};
  Source s{source, {}, &origin.locations};
  for (const auto& text : overrides) {
    Override o;
    apply_override(source, root, text, o);
    s.overrides.push_back(std::move(o));
  }
  std::string stem = fs::path(source).stem().string();
  RunConfig c;
  try {
    c = parse_root(s, root, stem.empty() ? "run" : stem);
  } catch (const YAML::Exception& e) {
    // yaml-cpp's own throws (e.g. an alias to nothing) still name the file.
    throw Error(source + ": " + e.what());
  }
  c.origin = std::move(origin);
  return c;
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(path + ": no such config file");
  if (fs::is_directory(path, ec)) throw Error(path + ": is a folder, expected a YAML config file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_run_config(text.str(), path, overrides);
}

void validate_paths(const RunConfig& c) {
  std::error_code ec;
  auto cwd = fs::current_path(ec).string();
  auto need = [&](const std::string& key, const std::string& path, bool folder_ok) {
    if (!fs::exists(path, ec))
      throw Error(c.origin.at(key) + ": " + key + ": " + path + " does not exist (paths are relative to the current folder, " +
                  cwd + ")");
    if (!folder_ok && fs::is_directory(path, ec)) throw Error(c.origin.at(key) + ": " + key + ": " + path + " is a folder, expected a file");
  };
  need("model.path", c.model.path, true);
  if (c.reference.enabled) need("reference.path", c.reference.path, true);
  need("data.train.path", c.data.train.path, false);
  if (c.data.eval) need("data.eval.path", c.data.eval->path, false);
  if (c.trainer.sft_warmup) need("trainer.sft_warmup.path", c.trainer.sft_warmup->path, false);
  for (size_t i = 0; i < c.rewards.size(); ++i)
    if (c.rewards[i].kind == "plugin") need("rewards." + std::to_string(i) + ".plugin", c.rewards[i].plugin, false);
}

std::string to_yaml(const RunConfig& c) {
  Writer w;
  w.out << "# The resolved configuration: every key, defaults filled in (paths relative to the\n"
           "# folder troupe was started from). Run it again with: troupe run " << c.run.dir << "/config.yaml\n";
  w.line(0, "recipe", name_of(c.recipe));
  if (!c.resume.empty()) w.line(0, "resume", quote(c.resume));
  w.line(0, "model", "");
  w.line(2, "path", quote(c.model.path));
  w.line(2, "dtype", name_of(c.model.dtype));
  w.line(2, "device", quote(c.model.device));
  if (c.lora) {
    w.line(0, "lora", "");
    w.line(2, "rank", fmt(c.lora->rank));
    w.line(2, "alpha", fmt(c.lora->alpha));
    w.line(2, "dropout", fmt(c.lora->dropout));
    w.line(2, "target_modules", flow(c.lora->target_modules));
  }
  w.line(0, "data", "");
  w.line(2, "train", "");
  write_dataset(w, 4, c.data.train);
  if (c.data.eval) {
    w.line(2, "eval", "");
    write_dataset(w, 4, *c.data.eval);
  }
  w.line(2, "shuffle", b(c.data.shuffle));
  w.line(2, "seed", fmt(c.data.seed));

  const auto& g = c.generator;
  w.line(0, "generator", "");
  w.line(2, "count", fmt(g.count));
  w.line(2, "engine", name_of(g.engine));
  if (!g.url.empty()) w.line(2, "url", quote(g.url));
  if (g.engine == EngineKind::remote) w.line(2, "weight_transfer", g.weight_transfer);
  w.line(2, "group_size", fmt(g.group_size));
  w.line(2, "max_tokens", fmt(g.max_tokens));
  w.line(2, "temperature", fmt(g.temperature));
  w.line(2, "top_p", fmt(g.top_p));
  w.line(2, "top_k", fmt(g.top_k));
  w.line(2, "min_p", fmt(g.min_p));
  w.line(2, "max_batch", fmt(g.max_batch));
  w.line(2, "max_seq_len", fmt(g.max_seq_len));
  w.line(2, "threads", fmt(g.threads));
  w.line(2, "stop", flow(g.stop));

  w.line(0, "rewards", c.rewards.empty() ? "[]" : "");
  for (const auto& r : c.rewards) {
    w.out << "  - name: " << quote(r.name) << "\n";
    w.line(4, "kind", r.kind);
    w.line(4, "weight", fmt(r.weight));
    w.line(4, "answer_key", quote(r.answer_key));
    if (!r.plugin.empty()) w.line(4, "plugin", quote(r.plugin));
    if (!r.url.empty()) w.line(4, "url", quote(r.url));
    w.line(4, "timeout_s", fmt(r.timeout_s));
    w.line(4, "retries", fmt(r.retries));
    w.line(4, "backoff_s", fmt(r.backoff_s));
    w.line(4, "max_batch", fmt(r.max_batch));
  }

  w.line(0, "reference", "");
  w.line(2, "enabled", b(c.reference.enabled));
  w.line(2, "path", quote(c.reference.path));

  const auto& t = c.trainer;
  w.line(0, "trainer", "");
  w.line(2, "batch_groups", fmt(t.batch_groups));
  w.line(2, "steps", fmt(t.steps));
  w.line(2, "lr", fmt(t.lr));
  w.line(2, "weight_decay", fmt(t.weight_decay));
  w.line(2, "warmup_steps", fmt(t.warmup_steps));
  w.line(2, "min_lr_ratio", fmt(t.min_lr_ratio));
  w.line(2, "max_grad_norm", fmt(t.max_grad_norm));
  w.line(2, "micro_batch", fmt(t.micro_batch));
  w.line(2, "num_iterations", fmt(t.num_iterations));
  w.line(2, "logprob_chunk", fmt(t.logprob_chunk));
  w.line(2, "scale_rewards", name_of(t.scale_rewards));
  w.line(2, "mask_truncated_completions", b(t.mask_truncated_completions));
  w.line(2, "threads", fmt(t.threads));
  w.line(2, "batch_size", fmt(t.batch_size));
  w.line(2, "max_length", fmt(t.max_length));
  w.line(2, "packing", b(t.packing));
  w.line(2, "activation_checkpointing", b(t.activation_checkpointing));
  w.line(2, "eval_every", fmt(t.eval_every));
  w.line(2, "loss", "");
  w.line(4, "kind", name_of(t.loss.kind));
  w.line(4, "aggregation", name_of(t.loss.aggregation));
  w.line(4, "clip", "[" + fmt(t.loss.epsilon) + ", " + fmt(t.loss.epsilon_high) + "]");
  w.line(4, "beta", fmt(t.loss.beta));
  w.line(4, "behaviour_cap", fmt(t.loss.behaviour_cap));
  w.line(4, "label_smoothing", fmt(t.loss.label_smoothing));
  w.line(4, "gamma", fmt(t.loss.gamma));
  w.line(4, "lambda", fmt(t.loss.lambda));
  w.line(4, "value_clip", fmt(t.loss.value_clip));
  w.line(4, "vf_coef", fmt(t.loss.vf_coef));
  w.line(4, "whiten_advantages", b(t.loss.whiten_advantages));
  if (t.sft_warmup) {
    w.line(2, "sft_warmup", "");
    w.line(4, "path", quote(t.sft_warmup->path));
    w.line(4, "prompt", quote(t.sft_warmup->prompt));
    w.line(4, "completion", quote(t.sft_warmup->completion));
    w.line(4, "steps", fmt(t.sft_warmup->steps));
    w.line(4, "lr", fmt(t.sft_warmup->lr));
  }

  w.line(0, "async", "");
  w.line(2, "max_staleness", fmt(c.async.max_staleness));
  w.line(2, "sync_every", fmt(c.async.sync_every));

  w.line(0, "cluster", "");
  w.line(2, "generator_processes", fmt(c.cluster.generator_processes));
  w.line(2, "join_timeout_s", fmt(c.cluster.join_timeout_s));
  w.line(2, "restarts", fmt(c.cluster.restarts));
  w.line(2, "reward_processes", fmt(c.cluster.reward_processes));
  w.line(2, "reference_processes", fmt(c.cluster.reference_processes));
  w.line(2, "lost_groups", c.cluster.lost_groups);
  w.line(2, "answer_timeout_s", fmt(c.cluster.answer_timeout_s));
  w.line(0, "parallel", "");
  w.line(2, "trainer_ranks", fmt(c.parallel.trainer_ranks));
  w.line(2, "sharding", name_of(c.parallel.sharding));
  w.line(2, "timeout_s", fmt(c.parallel.timeout_s));

  w.line(0, "run", "");
  w.line(2, "dir", quote(c.run.dir));
  w.line(2, "checkpoint_every", fmt(c.run.checkpoint_every));
  w.line(2, "log_every", fmt(c.run.log_every));
  w.line(2, "seed", fmt(c.run.seed));
  w.line(2, "deterministic", b(c.run.deterministic));
  return w.out.str();
}

std::string summary(const RunConfig& c) {
  std::ostringstream s;
  const auto& g = c.generator;
  s << "recipe " << to_string(c.recipe) << ", model " << c.model.path << " (" << to_string(c.model.dtype) << ", "
    << c.model.device << ")";
  if (c.lora) s << " + LoRA rank " << c.lora->rank;
  s << ", data " << c.data.train.path;
  if (c.recipe == Recipe::sft || c.recipe == Recipe::lora || c.recipe == Recipe::dpo) {
    s << ", " << c.trainer.steps << " steps x " << c.trainer.batch_size << (c.recipe == Recipe::dpo ? " pairs" : " examples")
      << ", max_length " << c.trainer.max_length << ", lr " << short_num(c.trainer.lr);
    if (c.recipe == Recipe::dpo) s << ", beta " << short_num(c.trainer.loss.beta);
    s << ", run dir " << c.run.dir;
    return s.str();
  }
  s << ", " << g.count << " " << to_string(g.engine)
    << (g.count == 1 ? " generator" : " generators") << " x G=" << g.group_size << ", max_tokens " << g.max_tokens
    << ", rewards ";
  for (size_t i = 0; i < c.rewards.size(); ++i)
    s << (i ? " + " : "") << short_num(c.rewards[i].weight) << " " << c.rewards[i].name << " (" << c.rewards[i].kind << ")";
  if (c.rewards.empty()) s << "none";
  s << ", " << c.trainer.steps << " steps x " << c.trainer.batch_groups << " groups, lr " << short_num(c.trainer.lr)
    << ", beta " << short_num(c.trainer.loss.beta) << (c.reference.enabled ? " (reference on)" : " (no reference)")
    << ", max_staleness " << c.async.max_staleness << ", run dir " << c.run.dir;
  return s.str();
}

}  // namespace troupe
