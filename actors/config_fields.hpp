// How the run config is read, checked and written, shared by actors/config*.cpp (not by the rest
// of troupe): the YAML map reader with file:line errors (Source, Map), the scalar readers, and
// the visitors of the field tables (config_tables.hpp). A section's keys are listed once there,
// as v(key, member, rules...); the same list declares the keys a map may hold (KeyList), reads
// and checks them (Reader), and writes them back (Writer).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "actors/config.hpp"
#include "policy/error.hpp"

namespace troupe::cfg {

// ---- formatting ----------------------------------------------------------------------------

// Shortest text that reads back to the same double, with a '.' so that YAML 1.1 readers
// (PyYAML) also see a float: 1e-06 -> 1.0e-06, 1 -> 1.0.
std::string fmt(double v);
std::string fmt(int64_t v);
std::string fmt(uint64_t v);
// Messages show numbers as short as they read back (-1, 1e-06), not in fmt()'s YAML float form.
std::string short_num(double v);
// A YAML double-quoted scalar (also how error messages show a bad value).
std::string quote(const std::string& s);
std::string describe(const YAML::Node& n);
// " (did you mean X?)" for the closest candidate within a few edits, else "".
std::string did_you_mean(std::string_view word, const std::vector<std::string_view>& candidates);

inline std::string got(double v) { return ", got " + short_num(v); }
inline std::string got(int64_t v) { return ", got " + fmt(v); }
inline std::string got(uint64_t v) { return ", got " + fmt(v); }

template <ConfigEnum E>
std::vector<std::string_view> names(E v) {
  std::vector<std::string_view> out;
  for (const auto& n : names_of(v)) out.push_back(n.name);
  return out;
}
std::string join(const std::vector<std::string_view>& names);
template <size_t N>
std::string join(const std::array<std::string_view, N>& names) {
  return join(std::vector<std::string_view>(names.begin(), names.end()));
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

  std::string where(const std::string& path, const YAML::Mark& mark) const;
  [[noreturn]] void fail(const std::string& path, const YAML::Mark& mark, const std::string& msg) const {
    throw Error(where(path, mark) + ": " + path + ": " + msg);
  }
};

// ---- scalars -------------------------------------------------------------------------------

// Each read() reports at `at`: the key's mark for map values, the item's own for list items.
// Numbers and booleans must be plain scalars: `max_tokens: "256"` is a string, and quoting a
// number is more often a mistake than a wish.
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, std::string& out);
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, int64_t& out);
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, uint64_t& out);
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, double& out);
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, bool& out);
// A list of strings; one string alone is a list of one (as vLLM's `stop` allows).
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, std::vector<std::string>& out);

template <ConfigEnum E>
void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, E& out) {
  std::string v;
  read(s, path, n, at, v);
  if (auto value = from_name<E>(v)) {
    out = *value;
    return;
  }
  s.fail(path, at, "expected one of " + join(names(out)) + ", got " + quote(v) + did_you_mean(v, names(out)));
}

// ---- maps ----------------------------------------------------------------------------------

// One YAML map being read, with its key path and marks for error messages.
class Map {
 public:
  // `at` locates the map itself: its key's line (a block map's own mark is its first child's);
  // an absent or null `node` reads as an empty map.
  Map(const Source& s, std::string path, const YAML::Node& node, YAML::Mark at);

  std::string child(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  bool has(const std::string& key) const { return find(key) != nullptr; }
  // The key's mark when present (a null value has no useful one), else this map's.
  YAML::Mark mark(const std::string& key) const;
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const { s_.fail(child(key), mark(key), msg); }
  [[noreturn]] void missing(const std::string& key, const std::string& hint) const {
    s_.fail(child(key), mark_, "required: " + hint);
  }
  void check(bool ok, const std::string& key, const std::string& msg) const {
    if (!ok) fail(key, msg);
  }
  const Source& source() const { return s_; }

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
    if (!get(key, out)) missing(key, hint);
  }

  // A nested map (absent: empty, so its defaults apply).
  Map map(const std::string& key);
  // Whether a nested section is given (present and not null).
  bool given(const std::string& key) const { return has(key) && !find(key)->value.IsNull(); }
  // The raw node, for lists; undefined when absent.
  YAML::Node node(const std::string& key);

  // Declares the keys this map may hold and rejects any other, before anything is read, so
  // that a typo reports "unknown key (did you mean path?)" rather than "path: required".
  void allow(std::vector<std::string> keys);

 private:
  struct Entry {
    std::string key;
    YAML::Mark key_mark;
    YAML::Node value;
  };
  const Entry* find(const std::string& key) const;
  const Entry* use(const std::string& key);

  const Source& s_;
  std::string path_;
  YAML::Mark mark_;
  std::vector<Entry> entries_;
  std::vector<std::string> keys_;
};

// ---- the field tables' rules ---------------------------------------------------------------

// A bound on a number: "must be >= 0 (0: no limit)", to which the reader adds ", got -1".
struct Bound {
  std::function<bool(double)> ok;
  std::string text;
};
inline Bound at_least(double lo, const std::string& note = "") {
  return {[lo](double v) { return v >= lo; }, "must be >= " + short_num(lo) + (note.empty() ? "" : " (" + note + ")")};
}
inline Bound above(double lo, const std::string& note = "") {
  return {[lo](double v) { return v > lo; }, "must be > " + short_num(lo) + (note.empty() ? "" : " (" + note + ")")};
}
// `interval` as the message writes it, "(0, 1]"; `ok` decides.
inline Bound within(const std::string& interval, std::function<bool(double)> ok) { return {std::move(ok), "must be in " + interval}; }

// A rule on a string value; with `show_value` the reader adds ", got \"x\"" to `text`.
struct TextRule {
  std::function<bool(const std::string&)> ok;
  std::string text;
  bool show_value = false;
};
inline TextRule not_empty(const std::string& text = "must not be empty") {
  return {[](const std::string& v) { return !v.empty(); }, text};
}

struct Required {
  std::string hint;  // what the key is for, after "required: "
};
// A key that applies only when `on`: given otherwise, it is an error saying `why`; not written.
struct OnlyWhen {
  bool on;
  std::string why;
};
struct OmitIfEmpty {};  // written only when set

// ---- the visitors --------------------------------------------------------------------------

// The keys a table lists (Map::allow takes them).
struct KeyList {
  std::vector<std::string> keys;
  template <class T, class... Rules>
  void operator()(const std::string& key, T&, const Rules&...) {
    keys.push_back(key);
  }
};

// Reads every key a table lists from `m`, and checks each rule (defaults included).
struct Reader {
  Map& m;

  template <class T, class... Rules>
  void operator()(const std::string& key, T& value, const Rules&... rules) {
    bool on = true;
    std::string why;
    (only(rules, on, why), ...);
    if (!on) {
      m.check(!m.has(key), key, why);
      return;
    }
    [[maybe_unused]] const bool present = m.get(key, value);
    (apply(key, value, present, rules), ...);
  }

 private:
  static void only(const OnlyWhen& r, bool& on, std::string& why) {
    if (!r.on) on = false, why = r.why;
  }
  static void only(const auto&, bool&, std::string&) {}

  void apply(const std::string& key, const auto&, bool present, const Required& r) {
    if (!present) m.missing(key, r.hint);
  }
  template <class T>
  void apply(const std::string& key, const T& v, bool, const Bound& b) {
    if constexpr (std::is_arithmetic_v<T>) m.check(b.ok(static_cast<double>(v)), key, b.text + got(v));
  }
  void apply(const std::string& key, const std::string& v, bool, const TextRule& r) {
    m.check(r.ok(v), key, r.show_value ? r.text + ", got " + quote(v) : r.text);
  }
  void apply(const std::string&, const auto&, bool, const auto&) {}
};

// Writes every key a table lists as YAML lines at `indent`.
struct Writer {
  std::ostringstream& out;
  int indent = 0;

  void line(const std::string& key, const std::string& value) const {
    out << std::string(indent, ' ') << key << ":" << (value.empty() ? "" : " " + value) << "\n";
  }
  template <class T, class... Rules>
  void operator()(const std::string& key, const T& value, const Rules&... rules) const {
    bool on = true;
    (keep(rules, value, on), ...);
    if (on) write(key, value);
  }

 private:
  static void keep(const OnlyWhen& r, const auto&, bool& on) { on = on && r.on; }
  static void keep(const OmitIfEmpty&, const std::string& v, bool& on) { on = on && !v.empty(); }
  static void keep(const auto&, const auto&, bool&) {}

  void write(const std::string& key, const std::string& v) const { line(key, quote(v)); }
  void write(const std::string& key, int64_t v) const { line(key, fmt(v)); }
  void write(const std::string& key, uint64_t v) const { line(key, fmt(v)); }
  void write(const std::string& key, double v) const { line(key, fmt(v)); }
  void write(const std::string& key, bool v) const { line(key, v ? "true" : "false"); }
  void write(const std::string& key, const std::vector<std::string>& v) const {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + quote(v[i]);
    line(key, s + "]");
  }
  template <ConfigEnum E>
  void write(const std::string& key, E v) const {
    line(key, std::string(to_string(v)));
  }
  template <class T>
  void write(const std::string& key, const std::optional<T>& v) const {
    if (v) write(key, *v);
  }
};

// Reads a section through its table: declares its keys (and `extra`, read by hand), then reads
// and checks them in the table's order.
template <class Section>
void read_table(Map& m, Section& c, std::vector<std::string> extra = {}) {
  KeyList keys;
  fields(keys, c);
  keys.keys.insert(keys.keys.end(), extra.begin(), extra.end());
  m.allow(std::move(keys.keys));
  Reader r{m};
  fields(r, c);
}
template <class Section>
void read_table(Map&& m, Section& c, std::vector<std::string> extra = {}) {
  read_table(m, c, std::move(extra));
}

// The section as YAML: "name:" and its keys indented below.
template <class Section>
void write_table(std::ostringstream& out, int indent, const std::string& name, const Section& c) {
  Writer w{out, indent};
  w.line(name, "");
  Writer inner{out, indent + 2};
  fields(inner, c);
}

}  // namespace troupe::cfg
