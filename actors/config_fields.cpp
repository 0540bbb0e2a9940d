#include "actors/config_fields.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <type_traits>

namespace troupe::cfg {

std::string fmt(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (!std::isfinite(v) || s.find('.') != std::string::npos) return s;
  auto e = s.find('e');
  return e == std::string::npos ? s + ".0" : s.insert(e, ".0");
}
std::string fmt(int64_t v) { return std::to_string(v); }
std::string short_num(double v) {
  char buf[64];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}
std::string fmt(uint64_t v) { return std::to_string(v); }

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

std::string join(const std::vector<std::string_view>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + std::string(names[i]);
  return s;
}

namespace {

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

}  // namespace

std::string did_you_mean(std::string_view word, const std::vector<std::string_view>& candidates) {
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

std::string Source::where(const std::string& path, const YAML::Mark& mark) const {
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

namespace {

const std::string& plain_scalar(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at,
                                const char* what) {
  if (!n.IsScalar()) s.fail(path, at, std::string("expected ") + what + ", got " + describe(n));
  if (n.Tag() == "!") s.fail(path, at, std::string("expected ") + what + ", got the quoted string " + quote(n.Scalar()));
  return n.Scalar();
}

}  // namespace

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, std::string& out) {
  if (!n.IsScalar()) s.fail(path, at, "expected a string, got " + describe(n));
  out = n.Scalar();
}

namespace {

// The plain scalar as a T by from_chars (a leading '+' allowed); `what` names T in errors.
template <class T>
void read_number(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, const char* what,
                 T& out) {
  std::string t = plain_scalar(s, path, n, at, what);
  const char* b = t.data() + (t.starts_with('+') ? 1 : 0);
  auto r = std::from_chars(b, t.data() + t.size(), out);
  if constexpr (std::is_same_v<T, int64_t>)
    if (r.ec == std::errc::result_out_of_range) s.fail(path, at, "integer out of range, got " + t);
  if (r.ec != std::errc() || r.ptr != t.data() + t.size() || b == t.data() + t.size())
    s.fail(path, at, std::string("expected ") + what + ", got " + quote(t));
}

}  // namespace

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, int64_t& out) {
  read_number(s, path, n, at, "an integer", out);
}

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, uint64_t& out) {
  read_number(s, path, n, at, "a non-negative integer", out);
}

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, double& out) {
  read_number(s, path, n, at, "a number", out);
  if (!std::isfinite(out)) s.fail(path, at, "expected a finite number, got " + n.Scalar());
}

void read(const Source& s, const std::string& path, const YAML::Node& n, const YAML::Mark& at, bool& out) {
  std::string t = plain_scalar(s, path, n, at, "true or false");
  if (!YAML::convert<bool>::decode(n, out)) s.fail(path, at, "expected true or false, got " + quote(t));
}

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

Map::Map(const Source& s, std::string path, const YAML::Node& node, YAML::Mark at)
    : s_(s), path_(std::move(path)), mark_(at.line >= 0 ? at : node.Mark()) {
  if (!node.IsDefined() || node.IsNull()) return;
  if (!node.IsMap()) s.fail(path_.empty() ? "(top level)" : path_, mark_, "expected a map of keys, got " + describe(node));
  for (auto it = node.begin(); it != node.end(); ++it) {
    // A copy (a handle): yaml-cpp's it->first lives in a proxy that dies with the statement.
    const YAML::Node k = it->first;
    if (!k.IsScalar()) s.fail(path_.empty() ? "(top level)" : path_, k.Mark(), "keys must be plain names, got " + describe(k));
    for (const auto& e : entries_)
      if (e.key == k.Scalar())
        s.fail(child(e.key), k.Mark(), "duplicate key (first given on line " + std::to_string(e.key_mark.line + 1) + ")");
    entries_.push_back({k.Scalar(), k.Mark(), it->second});
  }
  if (s_.locations && !path_.empty()) (*s_.locations)[path_] = s_.where(path_, mark_);
}

YAML::Mark Map::mark(const std::string& key) const {
  const Entry* e = find(key);
  return e ? e->key_mark : mark_;
}

Map Map::map(const std::string& key) {
  const Entry* e = use(key);
  return Map(s_, child(key), e ? e->value : YAML::Node(), e ? e->key_mark : mark_);
}

YAML::Node Map::node(const std::string& key) {
  const Entry* e = use(key);
  return e ? e->value : YAML::Node();
}

void Map::allow(std::vector<std::string> keys) {
  keys_ = std::move(keys);
  for (const auto& e : entries_) {
    if (std::find(keys_.begin(), keys_.end(), e.key) != keys_.end()) continue;
    std::string hint = did_you_mean(e.key, std::vector<std::string_view>(keys_.begin(), keys_.end()));
    if (hint.empty()) {
      hint = " (expected one of: ";
      for (size_t i = 0; i < keys_.size(); ++i) hint += (i ? ", " : "") + keys_[i];
      hint += ")";
    }
    s_.fail(child(e.key), e.key_mark, "unknown key" + hint);
  }
}

const Map::Entry* Map::find(const std::string& key) const {
  for (const auto& e : entries_)
    if (e.key == key) return &e;
  return nullptr;
}

const Map::Entry* Map::use(const std::string& key) {
  if (std::find(keys_.begin(), keys_.end(), key) == keys_.end())
    throw std::logic_error("config parser: " + child(key) + " read but not declared in allow()");
  const Entry* e = find(key);
  if (e && s_.locations) (*s_.locations)[child(key)] = s_.where(child(key), mark(key));
  return e;
}

}  // namespace troupe::cfg
