// LoRA adapters: attaching them under the projections, merging, and PEFT's adapter folder.
// The forward pass that uses them is Projection::add_lora in transformer.cpp.
#include "policy/lora.hpp"

#include <cmath>
#include <fstream>
#include <set>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "policy/error.hpp"
#include "policy/safetensors.hpp"

namespace troupe {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kPeftPrefix = "base_model.model.";
constexpr std::string_view kKnownTargets = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj";

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// PEFT's rule for a list of target names: the module's name, or a dotted suffix of it.
bool matches(const std::string& module, const std::string& target) {
  return module == target || ends_with(module, "." + target);
}

bool targets(const std::string& module, const std::vector<std::string>& target_modules) {
  for (const auto& t : target_modules)
    if (matches(module, t)) return true;
  return false;
}

// The projections `config` selects, in module order; every target must select something.
ProjectionList selected(TransformerImpl& model, const LoraConfig& config, const std::string& origin) {
  ProjectionList out;
  std::set<std::string> used;
  for (auto& [name, p] : model.projections()) {
    if (!targets(name, config.target_modules)) continue;
    out.emplace_back(name, p);
    for (const auto& t : config.target_modules)
      if (matches(name, t)) used.insert(t);
  }
  for (const auto& t : config.target_modules)
    if (!used.count(t))
      throw Error(origin + ": target module '" + t + "' matches none of the model's projections (LoRA goes on " +
                  std::string(kKnownTargets) + ")");
  return out;
}

// A bare module holding `weight` under the projection, so the name reads q_proj.lora_A.weight as
// in PEFT; not a torch::nn::Linear, whose constructor would draw from the global RNG.
torch::Tensor register_lora_weight(torch::nn::Linear& base, const char* name, torch::Tensor value) {
  auto holder = std::make_shared<torch::nn::Module>("troupe::LoraWeight");
  auto& param = holder->register_parameter("weight", std::move(value));
  base->register_module(name, holder);
  return param;
}

void set_adapter(Projection& p, torch::Tensor A, torch::Tensor B, const LoraConfig& config) {
  p.lora_A = register_lora_weight(p.base, "lora_A", std::move(A));
  p.lora_B = register_lora_weight(p.base, "lora_B", std::move(B));
  p.lora_scale = config.scale();
  p.lora_dropout = config.dropout;
}

void remove_adapter(Projection& p) {
  p.base->unregister_module("lora_A");
  p.base->unregister_module("lora_B");
  p.lora_A = p.lora_B = torch::Tensor();
  p.lora_scale = p.lora_dropout = 0.0;
}

// W + B A * scale, computed in float32 (or wider) and rounded once to W's dtype.
torch::Tensor merged_weight(const Projection& p) {
  torch::NoGradGuard no_grad;
  const auto& w = p.base->weight;
  auto wide = at::promote_types(w.scalar_type(), torch::kFloat32);
  auto delta = torch::mm(p.lora_B.to(wide), p.lora_A.to(wide)) * p.lora_scale;  // [out, in]
  return (w.detach().to(wide) + delta.to(w.device())).to(w.scalar_type());
}

std::string text(torch::IntArrayRef shape) {
  std::ostringstream s;
  s << shape;
  return s.str();
}

std::string text(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

// ---------------------------------------------------------------- PEFT's adapter folder

safetensors::Dtype file_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return safetensors::Dtype::F32;
    case torch::kBFloat16: return safetensors::Dtype::BF16;
    case torch::kFloat16: return safetensors::Dtype::F16;
    case torch::kFloat64: return safetensors::Dtype::F64;
    default: break;
  }
  throw Error(std::string("LoRA adapters of dtype ") + c10::toString(t) + " cannot be saved");
}

torch::Tensor to_tensor(const safetensors::TensorView& v, const fs::path& file) {
  torch::ScalarType t;
  switch (v.dtype) {
    case safetensors::Dtype::F32: t = torch::kFloat32; break;
    case safetensors::Dtype::BF16: t = torch::kBFloat16; break;
    case safetensors::Dtype::F16: t = torch::kFloat16; break;
    case safetensors::Dtype::F64: t = torch::kFloat64; break;
    default:
      throw Error(file.string() + ": tensor '" + v.name + "' has dtype " + std::string(safetensors::dtype_name(v.dtype)) +
                  "; LoRA weights are floating point");
  }
  // The view need not be aligned: from_blob only reads it inside clone's copy.
  return torch::from_blob(const_cast<std::byte*>(v.data), v.shape, t).clone();
}

}  // namespace

bool is_lora_parameter(std::string_view name) {
  return name.find(".lora_A.") != std::string_view::npos || name.find(".lora_B.") != std::string_view::npos;
}

void attach_lora(TransformerImpl& model, const LoraConfig& config, uint64_t seed) {
  config.validate();
  if (has_lora(model)) throw Error("attach_lora: the model already has LoRA adapters (merge_lora folds them in)");
  auto chosen = selected(model, config, "attach_lora");
  for (auto& p : model.parameters()) p.set_requires_grad(false);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& [name, p] : chosen) {
    const auto& w = p->base->weight;  // [out, in]
    const int64_t out = w.size(0), in = w.size(1);
    // kaiming_uniform_(a = sqrt(5)): gain sqrt(1/3), bound gain * sqrt(3 / fan_in) = 1 / sqrt(in).
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    auto A = torch::empty({config.rank, in}, torch::kFloat32).uniform_(-bound, bound, gen);
    set_adapter(*p, A.to(w.options()), torch::zeros({out, config.rank}, w.options()), config);
  }
}

bool has_lora(const TransformerImpl& model) {
  for (const auto& [name, p] : model.projections())
    if (p->has_lora()) return true;
  return false;
}

std::vector<torch::Tensor> lora_parameters(TransformerImpl& model) {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : model.projections()) {
    if (!p->has_lora()) continue;
    out.push_back(p->lora_A);
    out.push_back(p->lora_B);
  }
  return out;
}

std::map<std::string, torch::Tensor> lora_state_dict(const TransformerImpl& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, p] : model.projections()) {
    if (!p->has_lora()) continue;
    out[name + ".lora_A.weight"] = p->lora_A;
    out[name + ".lora_B.weight"] = p->lora_B;
  }
  return out;
}

void merge_lora(TransformerImpl& model) {
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model.projections()) {
    if (!p->has_lora()) continue;
    p->base->weight.copy_(merged_weight(*p));
    remove_adapter(*p);
  }
}

std::map<std::string, torch::Tensor> merged_state_dict(const TransformerImpl& model) {
  std::map<std::string, const Projection*> adapted;  // "...q_proj.weight" -> its projection
  for (const auto& [name, p] : model.projections())
    if (p->has_lora()) adapted[name + ".weight"] = p;
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (is_lora_parameter(item.key())) continue;
    auto it = adapted.find(item.key());
    out[item.key()] = it == adapted.end() ? item.value().detach() : merged_weight(*it->second);
  }
  return out;
}

void save_peft_adapter(const TransformerImpl& model, const LoraConfig& config, const fs::path& dir,
                       const std::string& base_model_name_or_path) {
  config.validate();
  // The config is written beside the tensors, so it must describe them: PEFT scales by what
  // the config says, not by what we trained with.
  std::vector<std::pair<std::string, const Projection*>> adapted;
  for (const auto& [name, p] : model.projections()) {
    bool wanted = targets(name, config.target_modules);
    if (wanted != p->has_lora())
      throw Error("save_peft_adapter: " + name + (wanted ? " is targeted by the config but has no adapter"
                                                         : " has an adapter the config does not target"));
    if (!wanted) continue;
    if (p->lora_A.size(0) != config.rank || std::abs(p->lora_scale - config.scale()) > 1e-12 * std::abs(config.scale()))
      throw Error("save_peft_adapter: " + name + " has rank " + std::to_string(p->lora_A.size(0)) + " and scale " +
                  text(p->lora_scale) + ", the config says r = " + std::to_string(config.rank) + " and scale " +
                  text(config.scale()));
    adapted.emplace_back(name, p);
  }
  if (adapted.empty()) throw Error("save_peft_adapter: the model has no LoRA adapters");

  fs::create_directories(dir);
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model_name_or_path.empty() ? nlohmann::json() : nlohmann::json(base_model_name_or_path);
  j["r"] = config.rank;
  // PEFT writes lora_alpha as an integer when it is one; keep that spelling.
  if (config.alpha == std::floor(config.alpha) && std::abs(config.alpha) < 1e15)
    j["lora_alpha"] = static_cast<int64_t>(config.alpha);
  else
    j["lora_alpha"] = config.alpha;
  j["lora_dropout"] = config.dropout;
  j["target_modules"] = config.target_modules;
  j["use_rslora"] = config.use_rslora;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_dora"] = false;
  j["lora_bias"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["rank_pattern"] = nlohmann::json::object();
  j["alpha_pattern"] = nlohmann::json::object();
  for (const char* key : {"modules_to_save", "layers_to_transform", "layers_pattern", "exclude_modules", "revision",
                          "auto_mapping", "layer_replication"})
    j[key] = nullptr;
  {
    std::ofstream out(dir / "adapter_config.json");
    out << j.dump(2) << "\n";
    if (!out) throw Error((dir / "adapter_config.json").string() + ": cannot write");
  }

  std::vector<torch::Tensor> keep;  // owns the CPU copies while the writer reads them
  std::vector<safetensors::TensorRef> refs;
  for (const auto& [name, p] : adapted) {
    for (const auto& [suffix, t] : {std::pair{".lora_A.weight", p->lora_A}, std::pair{".lora_B.weight", p->lora_B}}) {
      auto c = t.detach().to(torch::kCPU).contiguous();
      keep.push_back(c);
      refs.push_back({std::string(kPeftPrefix) + name + suffix, file_dtype(c.scalar_type()), c.sizes().vec(),
                      c.data_ptr(), c.nbytes()});
    }
  }
  safetensors::write_file(dir / "adapter_model.safetensors", refs);
}

LoraConfig load_peft_adapter(TransformerImpl& model, const fs::path& dir) {
  if (!fs::is_directory(dir)) throw Error(dir.string() + ": no such folder (expected a PEFT adapter folder)");
  const auto config_path = dir / "adapter_config.json";
  const auto weights_path = dir / "adapter_model.safetensors";
  LoraConfig config = read_adapter_config(config_path);
  auto chosen = selected(model, config, config_path.string());

  if (!fs::exists(weights_path)) {
    if (fs::exists(dir / "adapter_model.bin"))
      throw Error(weights_path.string() + ": missing; troupe does not read adapter_model.bin (pickle): save with "
                                          "safe_serialization=True");
    throw Error(weights_path.string() + ": missing");
  }
  auto file = safetensors::File::open(weights_path);
  const std::string where = weights_path.string() + ": ";

  std::map<std::string, Projection*> by_name(chosen.begin(), chosen.end());
  std::set<std::string> all_projections;
  for (const auto& [name, p] : model.projections()) all_projections.insert(name);
  const bool attached = has_lora(model);
  if (attached) {
    for (const auto& [name, p] : model.projections()) {
      if (p->has_lora() != (by_name.count(name) > 0))
        throw Error(config_path.string() + ": the model's adapters are on other modules than target_modules (" + name +
                    (p->has_lora() ? " has an adapter, not targeted)" : " is targeted, has no adapter)"));
      if (p->has_lora() && p->lora_A.size(0) != config.rank)
        throw Error(config_path.string() + ": rank mismatch: r = " + std::to_string(config.rank) +
                    " but the model's adapter on " + name + " has rank " + std::to_string(p->lora_A.size(0)));
    }
  }

  // Every tensor is checked before anything is attached or copied.
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> values;  // module -> (A, B)
  for (const auto& v : file->tensors()) {
    std::string_view key = v.name;
    std::string_view which = ends_with(key, ".lora_A.weight") ? "A" : ends_with(key, ".lora_B.weight") ? "B" : "";
    if (!starts_with(key, kPeftPrefix) || which.empty())
      throw Error(where + "tensor '" + v.name + "' is not a LoRA weight (expected base_model.model.<module>.lora_A.weight"
                          " or .lora_B.weight)");
    std::string module(key.substr(kPeftPrefix.size(), key.size() - kPeftPrefix.size() - 14));
    auto it = by_name.find(module);
    if (it == by_name.end())
      throw Error(where + "tensor '" + v.name + "' is for module '" + module + "', which " +
                  (all_projections.count(module) ? "adapter_config.json's target_modules do not target"
                                                 : "the " + model.config().architecture + " model does not have"));
    const auto& w = it->second->base->weight;  // [out, in]
    std::vector<int64_t> want = which == "A" ? std::vector<int64_t>{config.rank, w.size(1)}
                                             : std::vector<int64_t>{w.size(0), config.rank};
    if (v.shape != want) {
      const size_t rank_dim = which == "A" ? 0 : 1;
      if (v.shape.size() == 2 && v.shape[rank_dim] != config.rank && v.shape[1 - rank_dim] == want[1 - rank_dim])
        throw Error(where + "rank mismatch: tensor '" + v.name + "' has rank " + std::to_string(v.shape[rank_dim]) +
                    " but adapter_config.json says r = " + std::to_string(config.rank));
      throw Error(where + "tensor '" + v.name + "' is " + text(v.shape) + ", the model needs " + text(want));
    }
    auto& slot = which == "A" ? values[module].first : values[module].second;
    slot = to_tensor(v, weights_path);
  }
  std::vector<std::string> missing;
  for (const auto& [name, p] : chosen) {
    if (!values[name].first.defined()) missing.push_back(std::string(kPeftPrefix) + name + ".lora_A.weight");
    if (!values[name].second.defined()) missing.push_back(std::string(kPeftPrefix) + name + ".lora_B.weight");
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 5; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 5) list += ", ... (" + std::to_string(missing.size()) + " in all)";
    throw Error(where + "missing tensors: " + list);
  }

  if (!attached) {
    for (auto& p : model.parameters()) p.set_requires_grad(false);
    for (auto& [name, p] : chosen) {
      const auto& w = p->base->weight;
      auto& [A, B] = values[name];
      set_adapter(*p, A.to(w.options()), B.to(w.options()), config);
    }
  } else {
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : chosen) {
      p->lora_A.copy_(values[name].first);
      p->lora_B.copy_(values[name].second);
      p->lora_scale = config.scale();
      p->lora_dropout = config.dropout;
    }
  }
  return config;
}

}  // namespace troupe
