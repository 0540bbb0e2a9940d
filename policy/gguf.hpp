// GGUF v3 import: header, metadata, tensor infos and data (memory-mapped), dequantization to
// float32, and the translation of llama.cpp names and metadata into Hugging Face ones.
// Reading only: troupe never writes GGUF.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace troupe::gguf {

enum class ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

// One metadata value. Integers of every width are widened to int64/uint64, floats to double.
struct Value {
  ValueType type;       // the type as stored; for arrays, ARRAY
  ValueType elem_type;  // arrays: the element type; scalars: the same as type
  std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<Value>> v;
};

// ggml tensor types (ggml.h numbering); the ones troupe dequantizes are listed in dequantize().
// Every type ggml defines is listed so that any llama.cpp file opens; codes missing here
// (retired or newer than this list) are rejected when the file is opened.
enum class TensorType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41,
};

std::string type_name(TensorType type);  // "Q4_K", or "type 77" for unknown codes
size_t block_elements(TensorType type);  // elements per block (1 for F32/F16/BF16)
size_t block_bytes(TensorType type);     // bytes per block; throws Error for unknown types

struct TensorInfo {
  std::string name;             // llama.cpp name, e.g. "blk.0.attn_q.weight"
  TensorType type;
  std::vector<uint64_t> dims;   // GGUF order: dims[0] is the fastest-varying (ne[0])
  uint64_t offset;              // from the start of the data section
  const std::byte* data;        // into the mapping
  size_t nbytes;
  std::filesystem::path file;   // the file it lives in, so that errors can name it
  uint64_t elements() const;
  std::vector<int64_t> torch_shape() const;  // reversed dims: row-major [ne[n-1], ..., ne[0]]
};

// A memory-mapped GGUF file, validated on open (magic, version 2 or 3, counts, string and
// array lengths, tensor types, alignment, every tensor inside the file). Errors name the file.
class File {
 public:
  static std::shared_ptr<const File> open(const std::filesystem::path& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::filesystem::path& path() const { return path_; }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  const std::map<std::string, Value, std::less<>>& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

  const Value* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Typed getters: throw Error naming the file and key when missing or of another type.
  std::string get_string(std::string_view key) const;
  uint64_t get_uint(std::string_view key) const;  // any non-negative integer type
  int64_t get_int(std::string_view key) const;    // any integer type
  double get_float(std::string_view key) const;   // float or integer types
  bool get_bool(std::string_view key) const;
  std::vector<std::string> get_string_array(std::string_view key) const;
  std::vector<int64_t> get_int_array(std::string_view key) const;
  const TensorInfo& tensor(std::string_view name) const;  // throws naming the tensor
  const TensorInfo* find_tensor(std::string_view name) const;

 private:
  File() = default;
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  std::map<std::string, Value, std::less<>> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;  // name -> index into tensors_
};

// Dequantizes n elements (a multiple of the block size) of `type` at `src` into `dst`.
// Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K; others throw Error
// ("unsupported tensor type Q2_K"). File::open accepts them: only this call refuses.
bool dequantize_supported(TensorType type);
void dequantize(TensorType type, const std::byte* src, float* dst, size_t n);
// All elements, row-major torch order. Errors name the file and the tensor.
std::vector<float> dequantize(const TensorInfo& tensor);

// llama.cpp tensor name -> Hugging Face parameter name:
//   token_embd.weight -> model.embed_tokens.weight, blk.N.attn_q.weight ->
//   model.layers.N.self_attn.q_proj.weight, output.weight -> lm_head.weight, ...
// Throws Error for names it does not know, including rope_freqs.weight (llama 3's RoPE
// scaling factors, which hf_config() turns into rope_scaling): callers loading weights skip it.
std::string hf_tensor_name(std::string_view gguf_name);

// llama.cpp's converter permutes the rows of q_proj and k_proj weights (and biases) so
// that RoPE pairs are interleaved; this restores the Hugging Face (rotate-half) order.
// `data` holds `rows` x `cols` floats row-major; rows = n_head * head_dim (cols = 1 for a
// bias). Pass n_head = attention.head_count for attn_q and head_count_kv for attn_k.
// Only general.architecture "llama" is permuted by the converter: qwen2 and qwen3 files
// are already in HF order and must not be unpermuted. Throws Error when rows is not a
// multiple of 2 * n_head.
void unpermute_qk_rows(float* data, int64_t rows, int64_t cols, int64_t n_head);

// The Hugging Face config.json that describes this file's model (llama, qwen2, qwen3
// architectures): hidden sizes, heads, rope, norms, vocab, tied embeddings (no output.weight),
// attention_bias (blk.0.attn_q.bias present), special token ids (only those the file has),
// torch_dtype "float32" (what dequantize() yields), rope_scaling when the file has one
// (linear or yarn from {arch}.rope.scaling.*; llama 3's from rope_freqs.weight, verified
// against the standard llama3 parameters). Throws Error naming the file and the missing key,
// or the architecture when it is none of the three.
nlohmann::json hf_config(const File& file);

}  // namespace troupe::gguf
