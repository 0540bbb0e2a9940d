// adapter_config.json -> LoraConfig, and LoraConfig's checks: moved out of lora.cpp unchanged,
// so that nothing here needs LibTorch.
#include "policy/lora_config.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "policy/error.hpp"
#include "policy/json_depth.hpp"

namespace troupe {
namespace fs = std::filesystem;

namespace {

constexpr int kMaxDepth = 64;  // nesting of adapter_config.json (PEFT's nest two or three levels)

std::string text(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw Error(path.string() + ": cannot open (is this a PEFT adapter folder?)");
  int depth = 0;
  auto j = parse_json_measuring_depth(in, depth);
  if (j.is_discarded() || !j.is_object()) throw Error(path.string() + ": not a JSON object");
  // An option troupe refuses is quoted with dump(), which recurses once per level of nesting.
  if (depth > kMaxDepth)
    throw Error(path.string() + ": JSON nested " + std::to_string(depth) + " levels deep (at most " +
                std::to_string(kMaxDepth) + ")");
  return j;
}

// adapter_config.json -> LoraConfig, refusing what this implementation would get wrong.
LoraConfig parse_adapter_config(const nlohmann::json& j, const fs::path& path) {
  const std::string where = path.string() + ": ";
  auto field = [&](const char* key) -> const nlohmann::json* {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  auto peft_type = field("peft_type");
  if (!peft_type || !peft_type->is_string()) throw Error(where + "key 'peft_type' is missing");
  if (*peft_type != "LORA")
    throw Error(where + "peft_type is '" + peft_type->get<std::string>() + "', troupe reads LORA adapters only");

  LoraConfig c;
  auto r = field("r");
  if (!r || !r->is_number_integer()) throw Error(where + "key 'r' must be an integer");
  c.rank = r->get<int64_t>();
  auto alpha = field("lora_alpha");
  if (!alpha || !alpha->is_number()) throw Error(where + "key 'lora_alpha' must be a number");
  c.alpha = alpha->get<double>();
  if (auto d = field("lora_dropout")) {
    if (!d->is_number()) throw Error(where + "key 'lora_dropout' must be a number");
    c.dropout = d->get<double>();
  } else {
    c.dropout = 0.0;
  }
  if (auto rs = field("use_rslora")) c.use_rslora = rs->is_boolean() && rs->get<bool>();

  auto t = field("target_modules");
  if (!t) throw Error(where + "key 'target_modules' is missing");
  if (t->is_string())
    throw Error(where + "target_modules is a regular expression ('" + t->get<std::string>() +
                "'); troupe reads a list of module names");
  if (!t->is_array()) throw Error(where + "key 'target_modules' must be a list of module names");
  c.target_modules.clear();
  for (const auto& name : *t) {
    if (!name.is_string()) throw Error(where + "target_modules must hold strings");
    c.target_modules.push_back(name.get<std::string>());
  }

  // Options that change what the adapter computes, which this implementation does not do.
  auto refuse = [&](const char* key, const std::string& what) { throw Error(where + key + " " + what + " is not supported"); };
  if (auto b = field("bias"); b && *b != "none") refuse("bias", b->dump());
  for (const char* key : {"use_dora", "fan_in_fan_out", "lora_bias"})
    if (auto f = field(key); f && f->is_boolean() && f->get<bool>()) refuse(key, "true");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (auto f = field(key); f && !f->empty()) refuse(key, f->dump());
  for (const char* key : {"layers_to_transform", "modules_to_save", "exclude_modules", "layer_replication",
                          "trainable_token_indices", "target_parameters"})
    if (auto f = field(key); f && !(f->is_array() && f->empty())) refuse(key, f->dump());
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(where + e.what());
  }
  return c;
}

}  // namespace

double LoraConfig::scale() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

void LoraConfig::validate() const {
  if (rank <= 0) throw Error("LoRA rank must be positive, got " + std::to_string(rank));
  if (!(dropout >= 0.0 && dropout < 1.0)) throw Error("LoRA dropout must be in [0, 1), got " + text(dropout));
  if (!std::isfinite(alpha)) throw Error("LoRA alpha must be finite");
  if (target_modules.empty()) throw Error("LoRA target_modules is empty (e.g. q_proj, v_proj)");
}

LoraConfig read_adapter_config(const fs::path& path) { return parse_adapter_config(read_json(path), path); }

}  // namespace troupe
