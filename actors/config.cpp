// Run configs from YAML text or files, with key.path=value overrides applied to the tree before
// it is read (config_parse.cpp), and the check that the paths they name exist.
#include "actors/config.hpp"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "actors/config_parse.hpp"

namespace troupe {

using namespace cfg;

namespace {

namespace fs = std::filesystem;

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

}  // namespace

std::optional<std::pair<std::string, uint16_t>> split_host_port(const std::string& a) {
  const auto colon = a.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == a.size() || a.size() - colon > 6) return std::nullopt;
  if (a.find_first_not_of("0123456789", colon + 1) != std::string::npos) return std::nullopt;
  const int port = std::stoi(a.substr(colon + 1));
  if (port > 65535) return std::nullopt;
  return std::pair{a.substr(0, colon), static_cast<uint16_t>(port)};
}

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
  if (c.teacher) need("teacher.path", c.teacher->path, true);
  need("data.train.path", c.data.train.path, false);
  if (c.data.eval) need("data.eval.path", c.data.eval->path, false);
  if (c.trainer.sft_warmup) need("trainer.sft_warmup.path", c.trainer.sft_warmup->path, false);
  for (size_t i = 0; i < c.rewards.size(); ++i)
    if (c.rewards[i].kind == "plugin") need("rewards." + std::to_string(i) + ".plugin", c.rewards[i].plugin, false);
}

}  // namespace troupe
