// Parses and validates config.json into ModelConfig. Keys troupe does not use are kept
// (in `source`) and ignored; keys it uses are type- and range-checked with the key named.
#include "policy/model_config.hpp"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <utility>

#include "policy/error.hpp"
#include "policy/json_depth.hpp"

namespace troupe {
namespace {

using nlohmann::json;

constexpr int kMaxDepth = 64;  // nesting of config.json (real ones nest three or four levels)
constexpr int64_t kMaxSize = INT32_MAX;

struct Reader {
  const json& j;
  std::string_view origin;

  [[noreturn]] void fail(std::string_view key, std::string_view what) const {
    throw Error(std::string(origin) + ": key '" + std::string(key) + "' " + std::string(what));
  }
  const json* find(std::string_view key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  int64_t integer(std::string_view key, int64_t min) const {
    const json* v = find(key);
    if (!v) fail(key, "is missing");
    return checked_integer(key, *v, min);
  }
  int64_t integer_or(std::string_view key, int64_t fallback, int64_t min) const {
    const json* v = find(key);
    return v ? checked_integer(key, *v, min) : fallback;
  }
  int64_t checked_integer(std::string_view key, const json& v, int64_t min) const {
    if (!v.is_number_integer()) fail(key, "must be an integer, got " + v.dump());
    int64_t x = v.get<int64_t>();
    if (x < min) fail(key, "must be at least " + std::to_string(min) + ", got " + std::to_string(x));
    return x;
  }
  double number_or(std::string_view key, double fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) fail(key, "must be a number, got " + v->dump());
    return v->get<double>();
  }
  bool boolean_or(std::string_view key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(key, "must be true or false, got " + v->dump());
    return v->get<bool>();
  }
  std::string string_or(std::string_view key, std::string fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) fail(key, "must be a string, got " + v->dump());
    return v->get<std::string>();
  }
};

struct Family {
  const char* architecture;
  const char* model_type;
};
constexpr Family kFamilies[] = {
    {"LlamaForCausalLM", "llama"},
    {"Qwen2ForCausalLM", "qwen2"},
    {"Qwen3ForCausalLM", "qwen3"},
};

// transformers 5 folds rope_theta and rope_scaling into rope_parameters; 4.x kept them apart.
void read_rope(const Reader& r, ModelConfig& c) {
  const json* params = r.find("rope_parameters");
  if (!params) params = r.find("rope_scaling");
  c.rope_theta = r.number_or("rope_theta", 10000.0);
  if (!params) return;
  if (!params->is_object()) r.fail("rope_parameters", "must be an object, got " + params->dump());
  Reader p{*params, r.origin};
  c.rope_theta = p.number_or("rope_theta", c.rope_theta);
  std::string type = p.string_or("rope_type", p.string_or("type", "default"));
  if (type == "default") return;
  if (type != "llama3")
    r.fail("rope_parameters.rope_type", "'" + type + "' is not supported (supported: default, llama3)");
  Llama3RopeScaling s;
  s.factor = p.number_or("factor", s.factor);
  s.low_freq_factor = p.number_or("low_freq_factor", s.low_freq_factor);
  s.high_freq_factor = p.number_or("high_freq_factor", s.high_freq_factor);
  s.original_max_position_embeddings =
      p.integer_or("original_max_position_embeddings", s.original_max_position_embeddings, 1);
  if (s.high_freq_factor <= s.low_freq_factor)
    r.fail("rope_parameters.high_freq_factor", "must be greater than low_freq_factor");
  c.rope_llama3 = s;
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, std::string_view origin) {
  if (!j.is_object()) throw Error(std::string(origin) + ": config must be a JSON object");
  Reader r{j, origin};
  ModelConfig c;
  c.source = j;

  std::string model_type = r.string_or("model_type", "");
  std::string architecture;
  if (const json* archs = r.find("architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string())
      r.fail("architectures", "must be a list of class names, got " + archs->dump());
    architecture = (*archs)[0].get<std::string>();
  }
  const Family* family = nullptr;
  for (const Family& f : kFamilies)
    if (architecture == f.architecture || (architecture.empty() && model_type == f.model_type)) family = &f;
  if (!family) {
    std::string what = architecture.empty() ? "model_type '" + model_type + "'" : "architecture '" + architecture + "'";
    throw Error(std::string(origin) + ": unknown " + what +
                "; supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM");
  }
  c.architecture = family->architecture;
  c.model_type = family->model_type;

  c.vocab_size = r.integer("vocab_size", 1);
  c.hidden_size = r.integer("hidden_size", 1);
  c.intermediate_size = r.integer("intermediate_size", 1);
  c.num_hidden_layers = r.integer("num_hidden_layers", 1);
  c.num_attention_heads = r.integer("num_attention_heads", 1);
  c.num_key_value_heads = r.integer_or("num_key_value_heads", c.num_attention_heads, 1);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_key_value_heads", "must divide num_attention_heads (" + std::to_string(c.num_attention_heads) + ")");
  if (c.hidden_size % c.num_attention_heads != 0 && !r.find("head_dim"))
    r.fail("head_dim", "is missing and hidden_size is not a multiple of num_attention_heads");
  c.head_dim = r.integer_or("head_dim", c.hidden_size / c.num_attention_heads, 2);
  if (c.head_dim % 2 != 0) r.fail("head_dim", "must be even for rotary embeddings");
  c.max_position_embeddings = r.integer_or("max_position_embeddings", 4096, 1);
  // The model multiplies these in int64 (heads * head_dim, a weight's rows * columns); within
  // int32, as every real model is, no product of two can overflow.
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                                   {"hidden_size", c.hidden_size},
                                   {"intermediate_size", c.intermediate_size},
                                   {"num_hidden_layers", c.num_hidden_layers},
                                   {"num_attention_heads", c.num_attention_heads},
                                   {"num_key_value_heads", c.num_key_value_heads},
                                   {"head_dim", c.head_dim},
                                   {"max_position_embeddings", c.max_position_embeddings}})
    if (value > kMaxSize) r.fail(key, "must be at most " + std::to_string(kMaxSize) + ", got " + std::to_string(value));
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  read_rope(r, c);

  std::string act = r.string_or("hidden_act", "silu");
  if (act != "silu") r.fail("hidden_act", "'" + act + "' is not supported (only silu)");
  if (r.boolean_or("use_sliding_window", false)) r.fail("use_sliding_window", "true is not supported");

  bool attention_bias = r.boolean_or("attention_bias", false);
  c.qkv_bias = c.model_type == "qwen2" ? true : attention_bias;
  c.o_bias = c.model_type == "qwen2" ? false : attention_bias;
  c.mlp_bias = c.model_type == "llama" && r.boolean_or("mlp_bias", false);
  c.qk_norm = c.model_type == "qwen3";

  if (r.find("bos_token_id")) c.bos_token_id = r.integer("bos_token_id", 0);
  if (r.find("pad_token_id")) c.pad_token_id = r.integer("pad_token_id", 0);
  if (const json* eos = r.find("eos_token_id")) {
    if (eos->is_array()) {
      for (const json& e : *eos) c.eos_token_ids.push_back(r.checked_integer("eos_token_id", e, 0));
    } else {
      c.eos_token_ids.push_back(r.checked_integer("eos_token_id", *eos, 0));
    }
  }
  return c;
}

ModelConfig ModelConfig::from_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw Error(path.string() + ": cannot open config file");
  int depth = 0;
  json j = parse_json_measuring_depth(in, depth);
  if (j.is_discarded()) throw Error(path.string() + ": not valid JSON");
  // The whole file is kept (source) and written back on save, and copies and dump() recurse once
  // per level: nesting far beyond any real config's would overflow the stack.
  if (depth > kMaxDepth)
    throw Error(path.string() + ": JSON nested " + std::to_string(depth) + " levels deep (at most " +
                std::to_string(kMaxDepth) + ")");
  return from_json(j, path.string());
}

json ModelConfig::to_json() const {
  json j = source.is_object() ? source : json::object();
  j["architectures"] = {architecture};
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["hidden_act"] = "silu";
  if (!j.contains("rope_parameters") && !j.contains("rope_scaling")) j["rope_theta"] = rope_theta;
  return j;
}

}  // namespace troupe
