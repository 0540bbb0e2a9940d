// Model loading and saving: safetensors views become tensors here, GGUF tensors are
// dequantized and un-permuted into HF layout. Optimizer and trainer state live in trainer/.
#include "policy/checkpoint.hpp"

#include <fstream>
#include <set>

#include <torch/torch.h>

#include "policy/error.hpp"
#include "policy/gguf.hpp"
#include "policy/gguf_tokenizer.hpp"
#include "policy/lora.hpp"
#include "policy/safetensors.hpp"

namespace troupe {
namespace fs = std::filesystem;

namespace {

torch::Dtype torch_dtype(safetensors::Dtype d, const std::string& name) {
  using safetensors::Dtype;
  switch (d) {
    case Dtype::F64: return torch::kFloat64;
    case Dtype::F32: return torch::kFloat32;
    case Dtype::F16: return torch::kFloat16;
    case Dtype::BF16: return torch::kBFloat16;
    case Dtype::I64: return torch::kInt64;
    case Dtype::I32: return torch::kInt32;
    case Dtype::I16: return torch::kInt16;
    case Dtype::I8: return torch::kInt8;
    case Dtype::U8: return torch::kUInt8;
    case Dtype::BOOL: return torch::kBool;
  }
  throw Error("tensor '" + name + "' has a dtype troupe cannot hold");
}

safetensors::Dtype file_dtype(torch::Dtype d) {
  switch (d) {
    case torch::kFloat32: return safetensors::Dtype::F32;
    case torch::kFloat16: return safetensors::Dtype::F16;
    case torch::kBFloat16: return safetensors::Dtype::BF16;
    case torch::kFloat64: return safetensors::Dtype::F64;
    case torch::kInt64: return safetensors::Dtype::I64;
    case torch::kInt32: return safetensors::Dtype::I32;
    default: break;
  }
  throw Error(std::string("cannot save tensors of dtype ") + c10::toString(d) + " to safetensors");
}

std::string dtype_config_name(torch::Dtype d) {
  switch (d) {
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: return "float32";
  }
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw Error(path.string() + ": cannot open");
  auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error(path.string() + ": not valid JSON");
  return j;
}

void write_json(const fs::path& path, const nlohmann::json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw Error(path.string() + ": cannot write");
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// llama.cpp permutes q/k rows only for the Llama architecture (convert_hf_to_gguf's
// LlamaModel.permute); Qwen2/Qwen3 weights are stored in HF order.
std::map<std::string, torch::Tensor> read_gguf(const gguf::File& file, const ModelConfig& config) {
  std::map<std::string, torch::Tensor> out;
  const bool permuted = config.model_type == "llama";
  for (const gguf::TensorInfo& info : file.tensors()) {
    if (info.name == "rope_freqs.weight") continue;  // recomputed from the config's rope settings
    std::string name = gguf::hf_tensor_name(info.name);
    std::vector<float> values = gguf::dequantize(info);
    auto shape = info.torch_shape();
    if (permuted && (ends_with(name, "self_attn.q_proj.weight") || ends_with(name, "self_attn.k_proj.weight") ||
                     ends_with(name, "self_attn.q_proj.bias") || ends_with(name, "self_attn.k_proj.bias"))) {
      int64_t heads = name.find("q_proj") != std::string::npos ? config.num_attention_heads : config.num_key_value_heads;
      int64_t cols = shape.size() == 2 ? shape[1] : 1;
      gguf::unpermute_qk_rows(values.data(), shape[0], cols, heads);
    }
    out[name] = torch::from_blob(values.data(), shape, torch::kFloat32).clone();
  }
  return out;
}

// The Hugging Face weights: every parameter but LoRA adapters.
std::map<std::string, torch::Tensor> base_parameters(const TransformerImpl& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    if (!is_lora_parameter(item.key())) out[item.key()] = item.value();
  return out;
}

void copy_tokenizer_files(const fs::path& from, const fs::path& to) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    if (fs::exists(from / name)) fs::copy_file(from / name, to / name, fs::copy_options::overwrite_existing);
  }
}

}  // namespace

namespace {

// Every tensor of a mapped file, copied out into `out`.
void copy_tensors(const safetensors::File& file, std::map<std::string, torch::Tensor>& out) {
  for (const auto& view : file.tensors()) {
    // from_blob wants a mutable pointer; the clone makes the copy we own before anything writes.
    auto t = torch::from_blob(const_cast<std::byte*>(view.data), view.shape, torch_dtype(view.dtype, view.name));
    out[view.name] = t.clone();
  }
}

}  // namespace

std::map<std::string, torch::Tensor> read_safetensors(const safetensors::Checkpoint& checkpoint) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& file : checkpoint.files()) copy_tensors(*file, out);
  return out;
}

std::map<std::string, torch::Tensor> state_dict(const TransformerImpl& model) {
  if (has_lora(model))
    throw Error("state_dict: the model has LoRA adapters, which Hugging Face weights cannot hold: take "
                "merged_state_dict() for the weights with the adapters folded in, lora_state_dict() or "
                "save_peft_adapter() for the adapters alone, or merge_lora() first (policy/lora.hpp)");
  return base_parameters(model);
}

void load_weights(TransformerImpl& model, const std::map<std::string, torch::Tensor>& weights,
                  const std::string& origin) {
  // Tied checkpoints sometimes carry lm_head.weight anyway; old ones carry rotary buffers.
  auto ignorable = [&](const std::string& name) {
    return ends_with(name, "rotary_emb.inv_freq") || (name == "lm_head.weight" && model.config().tie_word_embeddings);
  };
  auto params = base_parameters(model);  // a model with LoRA adapters gets new base weights under them
  std::vector<std::string> missing, unexpected, mismatched;
  for (const auto& [name, param] : params) {
    auto it = weights.find(name);
    if (it == weights.end()) {
      missing.push_back(name);
    } else if (it->second.sizes() != param.sizes()) {
      std::ostringstream s;
      s << name << " is " << it->second.sizes() << " in the file, " << param.sizes() << " in the model";
      mismatched.push_back(s.str());
    }
  }
  for (const auto& [name, _] : weights)
    if (!params.count(name) && !ignorable(name)) unexpected.push_back(name);
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 5; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > 5) s += ", ... (" + std::to_string(v.size()) + " in all)";
    return s;
  };
  std::string problems;
  if (!missing.empty()) problems += "; missing tensors: " + list(missing);
  if (!unexpected.empty()) problems += "; unexpected tensors: " + list(unexpected);
  if (!mismatched.empty()) problems += "; shape mismatch: " + list(mismatched);
  if (!problems.empty()) throw Error(origin + ": weights do not fit the " + model.config().architecture + " config" + problems);

  torch::NoGradGuard no_grad;
  for (auto& [name, param] : params) param.copy_(weights.at(name));
}

namespace {
void check_model_source(const fs::path& path) {
  if (!fs::exists(path)) throw Error(path.string() + ": no such file or folder");
  if (!fs::is_directory(path) && path.extension() != ".gguf")
    throw Error(path.string() + ": not a model (expected a Hugging Face folder with config.json, or a .gguf file)");
}
}  // namespace

ModelConfig load_config(const fs::path& path) {
  check_model_source(path);
  if (fs::is_directory(path)) return ModelConfig::from_file(path / "config.json");
  return ModelConfig::from_json(gguf::hf_config(*gguf::File::open(path)), path.string());
}

LoadedModel load_model(const fs::path& path, const LoadOptions& options) {
  check_model_source(path);
  LoadedModel m;
  m.source = path;
  std::map<std::string, torch::Tensor> weights;
  if (fs::is_directory(path)) {
    m.config = ModelConfig::from_file(path / "config.json");
    weights = read_safetensors(safetensors::Checkpoint::open_dir(path));
    if (fs::exists(path / "generation_config.json")) m.generation_config = read_json(path / "generation_config.json");
    if (options.tokenizer && fs::exists(path / "tokenizer.json")) m.tokenizer = Tokenizer::load(path);
  } else {
    auto file = gguf::File::open(path);
    m.config = ModelConfig::from_json(gguf::hf_config(*file), path.string());
    weights = read_gguf(*file, m.config);
    if (options.tokenizer) m.tokenizer = Tokenizer::from_gguf(*file);
  }
  m.model = Transformer(m.config);
  load_weights(*m.model, weights, path.string());
  m.model->to(options.device, options.dtype);
  m.model->eval();
  return m;
}

int64_t write_safetensors(const fs::path& file, const std::map<std::string, torch::Tensor>& tensors) {
  std::vector<torch::Tensor> keep;  // owns contiguous CPU copies while the writer reads them
  std::vector<safetensors::TensorRef> refs;
  int64_t bytes = 0;
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().cpu().contiguous();
    keep.push_back(t);
    refs.push_back({name, file_dtype(t.scalar_type()), t.sizes().vec(), t.data_ptr(), t.nbytes()});
    bytes += t.nbytes();
  }
  safetensors::write_file(file, refs);
  return bytes;
}

std::map<std::string, torch::Tensor> read_safetensors_file(const fs::path& file) {
  std::map<std::string, torch::Tensor> out;
  copy_tensors(*safetensors::File::open(file), out);
  return out;
}

void save_hf_dir(const LoadedModel& m, const fs::path& dir, const SaveOptions& options) {
  fs::create_directories(dir);
  auto config = m.config.to_json();
  config["dtype"] = dtype_config_name(options.dtype);
  config.erase("torch_dtype");
  write_json(dir / "config.json", config);
  if (!m.generation_config.is_null()) write_json(dir / "generation_config.json", m.generation_config);

  std::vector<torch::Tensor> keep;  // owns the converted copies while the writer reads them
  std::vector<safetensors::TensorRef> refs;
  for (const auto& [name, param] : state_dict(*m.model)) {
    auto t = param.detach().to(torch::kCPU, options.dtype).contiguous();
    keep.push_back(t);
    refs.push_back({name, file_dtype(options.dtype), t.sizes().vec(), t.data_ptr(), t.nbytes()});
  }
  safetensors::write_dir(dir, refs, options.max_shard_bytes);

  if (fs::is_directory(m.source)) {
    if (fs::weakly_canonical(m.source) != fs::weakly_canonical(dir)) copy_tokenizer_files(m.source, dir);
  } else if (m.source.extension() == ".gguf") {
    auto file = gguf::File::open(m.source);
    write_json(dir / "tokenizer.json", gguf::hf_tokenizer_json(*file));
    write_json(dir / "tokenizer_config.json", gguf::hf_tokenizer_config(*file));
  }
}

}  // namespace troupe
