// GGUF import: a bounds-checked parser over a read-only mapping, scalar dequantizers with ggml's
// exact block semantics, llama.cpp -> HF names and config. No LibTorch, no writing, no big-endian.
#include "policy/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>

#include <nlohmann/json.hpp>

#include "policy/error.hpp"

namespace troupe::gguf {

static_assert(std::endian::native == std::endian::little, "GGUF blocks are read in place as little-endian");

namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const fs::path& path, const std::string& what) {
  throw Error(path.string() + ": " + what);
}

// ---- types --------------------------------------------------------------------------------

struct TypeTraits {
  TensorType type;
  const char* name;
  uint32_t block;  // elements per block
  uint32_t bytes;  // bytes per block
};

constexpr uint32_t QK_K = 256;

constexpr TypeTraits kTypes[] = {
    {TensorType::F32, "F32", 1, 4},
    {TensorType::F16, "F16", 1, 2},
    {TensorType::Q4_0, "Q4_0", 32, 2 + 16},
    {TensorType::Q4_1, "Q4_1", 32, 2 + 2 + 16},
    {TensorType::Q5_0, "Q5_0", 32, 2 + 4 + 16},
    {TensorType::Q5_1, "Q5_1", 32, 2 + 2 + 4 + 16},
    {TensorType::Q8_0, "Q8_0", 32, 2 + 32},
    {TensorType::Q8_1, "Q8_1", 32, 4 + 4 + 32},
    {TensorType::Q2_K, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4},
    {TensorType::Q3_K, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12},
    {TensorType::Q4_K, "Q4_K", QK_K, 2 + 2 + 12 + QK_K / 2},
    {TensorType::Q5_K, "Q5_K", QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2},
    {TensorType::Q6_K, "Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2},
    {TensorType::Q8_K, "Q8_K", QK_K, 4 + QK_K + QK_K / 8},
    {TensorType::IQ2_XXS, "IQ2_XXS", QK_K, 2 + QK_K / 4},
    {TensorType::IQ2_XS, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32},
    {TensorType::IQ3_XXS, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8},
    {TensorType::IQ1_S, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16},
    {TensorType::IQ4_NL, "IQ4_NL", 32, 2 + 16},
    {TensorType::IQ3_S, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4},
    {TensorType::IQ2_S, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16},
    {TensorType::IQ4_XS, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64},
    {TensorType::I8, "I8", 1, 1},
    {TensorType::I16, "I16", 1, 2},
    {TensorType::I32, "I32", 1, 4},
    {TensorType::I64, "I64", 1, 8},
    {TensorType::F64, "F64", 1, 8},
    {TensorType::IQ1_M, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32},
    {TensorType::BF16, "BF16", 1, 2},
    {TensorType::TQ1_0, "TQ1_0", QK_K, 2 + 4 * 13},
    {TensorType::TQ2_0, "TQ2_0", QK_K, 2 + 64},
    {TensorType::MXFP4, "MXFP4", 32, 1 + 16},
    {TensorType::NVFP4, "NVFP4", 64, 4 + 32},
    {TensorType::Q1_0, "Q1_0", 128, 2 + 16},
};

const TypeTraits* traits(TensorType type) {
  for (const auto& t : kTypes)
    if (t.type == type) return &t;
  return nullptr;
}

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::UINT8: return "uint8";
    case ValueType::INT8: return "int8";
    case ValueType::UINT16: return "uint16";
    case ValueType::INT16: return "int16";
    case ValueType::UINT32: return "uint32";
    case ValueType::INT32: return "int32";
    case ValueType::FLOAT32: return "float32";
    case ValueType::BOOL: return "bool";
    case ValueType::STRING: return "string";
    case ValueType::ARRAY: return "array";
    case ValueType::UINT64: return "uint64";
    case ValueType::INT64: return "int64";
    case ValueType::FLOAT64: return "float64";
  }
  return "unknown";
}

// The fewest bytes one value of this type occupies, to bound counts before allocating.
size_t min_value_bytes(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: return 8;
    case ValueType::STRING: return 8;       // length
    case ValueType::ARRAY: return 4 + 8;    // element type, count
  }
  return 1;
}

// ---- the bounds-checked reader --------------------------------------------------------------

// Real files hold at most a few hundred thousand values (vocabularies); the cap keeps a hostile
// file from turning each byte into a 48-byte Value. Arrays of arrays are legal but rare.
constexpr uint64_t kMaxValues = uint64_t{1} << 24;
constexpr int kMaxArrayDepth = 8;
constexpr uint64_t kMaxTensors = uint64_t{1} << 20;  // the largest MoE files hold tens of thousands

class Reader {
 public:
  Reader(const fs::path& path, const std::byte* base, size_t size)
      : path_(path), base_(base), size_(size) {}

  // What is being read, for the message when the file ends early.
  void at(std::string what) { what_ = std::move(what); }
  const std::string& where() const { return what_; }

  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }

  void need(uint64_t n) const {
    if (n > left()) fail(path_, "truncated while reading " + what_ + " (file is " + std::to_string(size_) + " bytes)");
  }
  template <class T>
  T read() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string() {
    const uint64_t n = read<uint64_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(base_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const fs::path& path_;
  const std::byte* base_;
  size_t size_;
  size_t pos_ = 0;
  std::string what_;
};

bool valid_value_type(uint32_t t) { return t <= uint32_t(ValueType::FLOAT64); }

struct MetadataParser {
  Reader& r;
  const fs::path& path;
  uint64_t values = 0;

  Value read_value(ValueType type, int depth) {
    if (++values > kMaxValues)
      fail(path, "metadata holds more than " + std::to_string(kMaxValues) + " values (" + r.where() + ")");
    Value v{type, type, uint64_t{0}};
    switch (type) {
      case ValueType::UINT8: v.v = uint64_t{r.read<uint8_t>()}; break;
      case ValueType::UINT16: v.v = uint64_t{r.read<uint16_t>()}; break;
      case ValueType::UINT32: v.v = uint64_t{r.read<uint32_t>()}; break;
      case ValueType::UINT64: v.v = r.read<uint64_t>(); break;
      case ValueType::INT8: v.v = int64_t{r.read<int8_t>()}; break;
      case ValueType::INT16: v.v = int64_t{r.read<int16_t>()}; break;
      case ValueType::INT32: v.v = int64_t{r.read<int32_t>()}; break;
      case ValueType::INT64: v.v = r.read<int64_t>(); break;
      case ValueType::FLOAT32: v.v = double{r.read<float>()}; break;
      case ValueType::FLOAT64: v.v = r.read<double>(); break;
      case ValueType::BOOL: v.v = r.read<uint8_t>() != 0; break;
      case ValueType::STRING: v.v = r.read_string(); break;
      case ValueType::ARRAY: {
        if (depth >= kMaxArrayDepth)
          fail(path, "arrays nested deeper than " + std::to_string(kMaxArrayDepth) + " in " + r.where());
        const uint32_t elem = r.read<uint32_t>();
        if (!valid_value_type(elem))
          fail(path, "unknown array element type " + std::to_string(elem) + " in " + r.where());
        v.elem_type = ValueType(elem);
        const uint64_t n = r.read<uint64_t>();
        if (n > r.left() / min_value_bytes(v.elem_type))
          fail(path, "truncated while reading " + r.where() + ": an array of " + std::to_string(n) + " " +
                         value_type_name(v.elem_type) + " values cannot fit in the " + std::to_string(r.left()) +
                         " bytes left (or its count is corrupt)");
        std::vector<Value> items;
        items.reserve(n);
        for (uint64_t i = 0; i < n; ++i) items.push_back(read_value(v.elem_type, depth + 1));
        v.v = std::move(items);
        break;
      }
    }
    return v;
  }
};

bool add_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_add_overflow(a, b, out); }
bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

// ---- fp16 and block dequantizers -------------------------------------------------------------

// Exact for every half: normals rebias the exponent, subnormals are mant * 2^-24 (exact in
// float32), inf and NaN keep their payload.
float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float m = float(mant) * 0x1p-24f;
    return sign ? -m : m;
  }
  return std::bit_cast<float>(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t(h) << 16); }

uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
float half(const uint8_t* p) { return f16_to_f32(u16(p)); }

// The 32-element formats store element j in the low nibble of qs[j] and element j + 16 in the
// high nibble; Q5's fifth bits are bit j of the little-endian word qh.
void dq_q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = float(int(qs[j] & 0x0f) - 8) * d;
    y[j + 16] = float(int(qs[j] >> 4) - 8) * d;
  }
}

void dq_q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = float(qs[j] & 0x0f) * d + m;
    y[j + 16] = float(qs[j] >> 4) * d + m;
  }
}

void dq_q5_0(const uint8_t* b, float* y) {
  const float d = half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = int((qs[j] & 0x0f) | (((qh >> j) & 1u) << 4));
    const int hi = int((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
    y[j] = float(lo - 16) * d;
    y[j + 16] = float(hi - 16) * d;
  }
}

void dq_q5_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const uint32_t lo = (qs[j] & 0x0f) | (((qh >> j) & 1u) << 4);
    const uint32_t hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
    y[j] = float(lo) * d + m;
    y[j + 16] = float(hi) * d + m;
  }
}

void dq_q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int j = 0; j < 32; ++j) y[j] = float(int8_t(b[2 + j])) * d;
}

// Q4_K packs eight 6-bit (scale, min) pairs into 12 bytes: pairs 0-3 sit in the low six bits
// of bytes 0-3 (scales) and 4-7 (mins); pairs 4-7 take their low nibbles from bytes 8-11 and
// their top two bits from the spare high bits of bytes 0-7 (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = uint8_t((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
    *m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// 256 elements as four 64-element chunks; each chunk is 32 bytes of qs whose low nibbles are
// the first 32 elements (sub-block 2c) and high nibbles the next 32 (sub-block 2c + 1).
void dq_q4_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int c = 0; c < 4; ++c, q += 32) {
    uint8_t sc, m;
    scale_min_k4(2 * c, scales, &sc, &m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    scale_min_k4(2 * c + 1, scales, &sc, &m);
    const float d2 = d * float(sc), m2 = dmin * float(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * float(q[l] & 0x0f) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * float(q[l] >> 4) - m2;
  }
}

// Two 128-element halves; in each, ql holds 64 bytes (low nibbles: elements 0-63, high
// nibbles: 64-127) and qh 32 bytes whose four 2-bit fields top up elements l, l+32, l+64,
// l+96. Each 16 elements share one int8 scale.
void dq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + QK_K / 2;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + QK_K / 2 + QK_K / 4);
  const float d = half(b + QK_K / 2 + QK_K / 4 + QK_K / 16);
  for (int n = 0; n < 2; ++n, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = int((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = int((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * float(sc[is]) * float(q1);
      y[l + 32] = d * float(sc[is + 2]) * float(q2);
      y[l + 64] = d * float(sc[is + 4]) * float(q3);
      y[l + 96] = d * float(sc[is + 6]) * float(q4);
    }
  }
}

using BlockFn = void (*)(const uint8_t*, float*);

BlockFn block_fn(TensorType type) {
  switch (type) {
    case TensorType::Q4_0: return dq_q4_0;
    case TensorType::Q4_1: return dq_q4_1;
    case TensorType::Q5_0: return dq_q5_0;
    case TensorType::Q5_1: return dq_q5_1;
    case TensorType::Q8_0: return dq_q8_0;
    case TensorType::Q4_K: return dq_q4_k;
    case TensorType::Q6_K: return dq_q6_k;
    default: return nullptr;
  }
}

// The float32 a GGUF float32 was rounded from, as the shortest decimal: 1e-5f is stored as
// 9.99999974738e-06 and HF configs say 1e-05.
double shortest_decimal(double stored_as_float) {
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, float(stored_as_float));
  double out = stored_as_float;
  std::from_chars(buf, res.ptr, out);
  return out;
}

}  // namespace

// ---- types ---------------------------------------------------------------------------------

std::string type_name(TensorType type) {
  if (const auto* t = traits(type)) return t->name;
  return "type " + std::to_string(uint32_t(type));
}

size_t block_elements(TensorType type) {
  if (const auto* t = traits(type)) return t->block;
  throw Error("unknown tensor type code " + std::to_string(uint32_t(type)));
}

size_t block_bytes(TensorType type) {
  if (const auto* t = traits(type)) return t->bytes;
  throw Error("unknown tensor type code " + std::to_string(uint32_t(type)));
}

uint64_t TensorInfo::elements() const {
  uint64_t n = 1;
  for (uint64_t d : dims) n *= d;  // File::open checked that this does not overflow
  return n;
}

std::vector<int64_t> TensorInfo::torch_shape() const {
  return {dims.rbegin(), dims.rend()};
}

// ---- File ----------------------------------------------------------------------------------

File::~File() {
  if (map_) munmap(map_, map_size_);
}

std::shared_ptr<const File> File::open(const std::filesystem::path& path) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  f->map_size_ = size_t(st.st_size);
  if (f->map_size_ > 0) {
    void* m = mmap(nullptr, f->map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    if (m == MAP_FAILED) fail(path, std::string("cannot map: ") + std::strerror(err));
    f->map_ = m;
  } else {
    ::close(fd);
  }
  const auto* base = static_cast<const std::byte*>(f->map_);
  const size_t size = f->map_size_;
  Reader r(f->path_, base, size);

  // Header: magic, version, counts. Counts are bounded by what the rest of the file could
  // hold before anything is reserved.
  r.at("the magic number");
  const auto magic = r.read<std::array<char, 4>>();
  if (std::string_view(magic.data(), 4) != "GGUF")
    fail(path, "not a GGUF file (bad magic number; expected \"GGUF\")");
  r.at("the version");
  const uint32_t version = r.read<uint32_t>();
  if (version == 0x03000000u || version == 0x02000000u)
    fail(path, "big-endian GGUF is not supported; convert the model on a little-endian machine");
  if (version != 2 && version != 3)
    fail(path, "unsupported GGUF version " + std::to_string(version) + " (troupe reads versions 2 and 3)");
  f->version_ = version;
  r.at("the tensor count");
  const uint64_t n_tensors = r.read<uint64_t>();
  r.at("the metadata count");
  const uint64_t n_kv = r.read<uint64_t>();
  // Entries are parsed one by one, so a count larger than the file can hold ends in "truncated
  // while reading ..."; these caps only bound the memory a hostile header can make us use.
  if (n_kv > kMaxValues)
    fail(path, "header claims " + std::to_string(n_kv) + " metadata entries (more than " +
                   std::to_string(kMaxValues) + "; corrupt?)");
  if (n_tensors > kMaxTensors)
    fail(path, "header claims " + std::to_string(n_tensors) + " tensors (more than " + std::to_string(kMaxTensors) +
                   "; corrupt?)");

  MetadataParser meta{r, f->path_};
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string index = "metadata key " + std::to_string(i);
    r.at(index);
    std::string key = r.read_string();
    r.at(index + " ('" + key + "')");
    const uint32_t type = r.read<uint32_t>();
    if (!valid_value_type(type))
      fail(path, "metadata key '" + key + "' has unknown value type " + std::to_string(type));
    Value value = meta.read_value(ValueType(type), 0);
    if (!f->metadata_.emplace(key, std::move(value)).second)
      fail(path, "duplicate metadata key '" + key + "'");
  }

  if (const Value* a = f->find("general.alignment")) {
    const uint64_t* n = std::get_if<uint64_t>(&a->v);
    if (!n || *n == 0 || !std::has_single_bit(*n) || *n > (uint64_t{1} << 30))
      fail(path, "general.alignment must be a power of two (got " +
                     (n ? std::to_string(*n) : std::string("a ") + value_type_name(a->type)) + ")");
    f->alignment_ = size_t(*n);
  }

  f->tensors_.reserve(std::min<uint64_t>(n_tensors, r.left() / 24));  // 24: the smallest tensor info
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const std::string index = "tensor info " + std::to_string(i);
    r.at(index);
    TensorInfo t{};
    t.name = r.read_string();
    r.at(index + " ('" + t.name + "')");
    const uint32_t n_dims = r.read<uint32_t>();
    if (n_dims > 4)
      fail(path, "tensor '" + t.name + "' has " + std::to_string(n_dims) + " dimensions (GGUF allows at most 4)");
    t.dims.resize(n_dims);
    for (auto& d : t.dims) d = r.read<uint64_t>();
    const uint32_t type = r.read<uint32_t>();
    t.type = TensorType(type);
    if (!traits(t.type))
      fail(path, "tensor '" + t.name + "' has unknown tensor type code " + std::to_string(type) +
                     " (newer llama.cpp quantization? re-export it as Q8_0 or F16)");
    t.offset = r.read<uint64_t>();
    t.file = f->path_;
    if (!f->tensor_index_.emplace(t.name, f->tensors_.size()).second)
      fail(path, "duplicate tensor name '" + t.name + "'");
    f->tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment; pos <= size, so no overflow.
  const uint64_t align = f->alignment_;
  const uint64_t data_start = (uint64_t(r.pos()) + align - 1) / align * align;
  for (auto& t : f->tensors_) {
    const std::string name = "tensor '" + t.name + "'";
    const auto* tt = traits(t.type);
    uint64_t n = 1;
    for (uint64_t d : t.dims)
      if (d > uint64_t(std::numeric_limits<int64_t>::max()) || mul_overflows(n, d, &n) ||
          n > uint64_t(std::numeric_limits<int64_t>::max()))
        fail(path, name + " has absurd dimensions (element count overflows)");
    const uint64_t row = t.dims.empty() ? 1 : t.dims[0];
    if (row % tt->block != 0)
      fail(path, name + " has rows of " + std::to_string(row) + " elements, not a multiple of the " + tt->name +
                     " block size " + std::to_string(tt->block));
    uint64_t nbytes = 0, begin = 0, end = 0;
    if (mul_overflows(n / tt->block, tt->bytes, &nbytes) || nbytes > std::numeric_limits<size_t>::max())
      fail(path, name + " has absurd dimensions (byte size overflows)");
    if (t.offset % align != 0)
      fail(path, name + " has offset " + std::to_string(t.offset) + ", not a multiple of the alignment " +
                     std::to_string(align));
    if (add_overflows(data_start, t.offset, &begin) || add_overflows(begin, nbytes, &end) || end > size)
      fail(path, name + " runs past the end of the file (truncated?)");
    t.nbytes = size_t(nbytes);
    t.data = base + begin;
  }
  return f;
}

const Value* File::find(std::string_view key) const {
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

const Value& require(const File& f, std::string_view key) {
  const Value* v = f.find(key);
  if (!v) fail(f.path(), "missing metadata key '" + std::string(key) + "'");
  return *v;
}

[[noreturn]] void wrong_type(const File& f, std::string_view key, const Value& v, const char* expected) {
  std::string got = value_type_name(v.type);
  if (v.type == ValueType::ARRAY) got += std::string(" of ") + value_type_name(v.elem_type);
  fail(f.path(), "metadata key '" + std::string(key) + "' is " + got + ", expected " + expected);
}

bool as_int(const Value& v, int64_t* out) {
  if (const auto* u = std::get_if<uint64_t>(&v.v)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max())) return false;
    *out = int64_t(*u);
    return true;
  }
  if (const auto* i = std::get_if<int64_t>(&v.v)) {
    *out = *i;
    return true;
  }
  return false;
}

}  // namespace

std::string File::get_string(std::string_view key) const {
  const Value& v = require(*this, key);
  if (const auto* s = std::get_if<std::string>(&v.v)) return *s;
  wrong_type(*this, key, v, "a string");
}

uint64_t File::get_uint(std::string_view key) const {
  const Value& v = require(*this, key);
  if (const auto* u = std::get_if<uint64_t>(&v.v)) return *u;
  if (const auto* i = std::get_if<int64_t>(&v.v); i && *i >= 0) return uint64_t(*i);
  wrong_type(*this, key, v, "a non-negative integer");
}

int64_t File::get_int(std::string_view key) const {
  const Value& v = require(*this, key);
  int64_t out;
  if (as_int(v, &out)) return out;
  wrong_type(*this, key, v, "an integer (within int64)");
}

double File::get_float(std::string_view key) const {
  const Value& v = require(*this, key);
  if (const auto* d = std::get_if<double>(&v.v)) return *d;
  if (const auto* u = std::get_if<uint64_t>(&v.v)) return double(*u);
  if (const auto* i = std::get_if<int64_t>(&v.v)) return double(*i);
  wrong_type(*this, key, v, "a number");
}

bool File::get_bool(std::string_view key) const {
  const Value& v = require(*this, key);
  if (const auto* b = std::get_if<bool>(&v.v)) return *b;
  wrong_type(*this, key, v, "a bool");
}

std::vector<std::string> File::get_string_array(std::string_view key) const {
  const Value& v = require(*this, key);
  const auto* items = std::get_if<std::vector<Value>>(&v.v);
  if (!items || v.elem_type != ValueType::STRING) wrong_type(*this, key, v, "an array of strings");
  std::vector<std::string> out;
  out.reserve(items->size());
  for (const auto& item : *items) out.push_back(std::get<std::string>(item.v));
  return out;
}

std::vector<int64_t> File::get_int_array(std::string_view key) const {
  const Value& v = require(*this, key);
  const auto* items = std::get_if<std::vector<Value>>(&v.v);
  if (!items) wrong_type(*this, key, v, "an array of integers");
  std::vector<int64_t> out;
  out.reserve(items->size());
  for (const auto& item : *items) {
    int64_t i;
    if (!as_int(item, &i)) wrong_type(*this, key, v, "an array of integers (within int64)");
    out.push_back(i);
  }
  return out;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& File::tensor(std::string_view name) const {
  if (const auto* t = find_tensor(name)) return *t;
  fail(path_, "no tensor named '" + std::string(name) + "'");
}

// ---- dequantization ------------------------------------------------------------------------

bool dequantize_supported(TensorType type) {
  switch (type) {
    case TensorType::F32: case TensorType::F16: case TensorType::BF16: return true;
    default: return block_fn(type) != nullptr;
  }
}

void dequantize(TensorType type, const std::byte* src, float* dst, size_t n) {
  if (!dequantize_supported(type))
    throw Error("unsupported tensor type " + type_name(type) +
                " (troupe dequantizes F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K)");
  if (n == 0) return;
  const auto* s = reinterpret_cast<const uint8_t*>(src);
  switch (type) {
    case TensorType::F32: std::memcpy(dst, s, n * sizeof(float)); return;
    case TensorType::F16:
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(u16(s + 2 * i));
      return;
    case TensorType::BF16:
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(u16(s + 2 * i));
      return;
    default: break;
  }
  const size_t block = block_elements(type), bytes = block_bytes(type);
  if (n % block != 0)
    throw Error(std::to_string(n) + " elements are not a whole number of " + type_name(type) + " blocks of " +
                std::to_string(block));
  const BlockFn fn = block_fn(type);
  for (size_t b = 0; b < n / block; ++b) fn(s + b * bytes, dst + b * block);
}

std::vector<float> dequantize(const TensorInfo& tensor) {
  if (!dequantize_supported(tensor.type))
    fail(tensor.file, "unsupported tensor type " + type_name(tensor.type) + " for tensor '" + tensor.name +
                          "'; requantize the model with llama-quantize to Q8_0, Q4_K_M or F16");
  // GGUF rows are ne[0]-contiguous and blocks never straddle rows, so the flat block stream is
  // already in row-major order for the reversed (torch) shape.
  std::vector<float> out(tensor.elements());
  dequantize(tensor.type, tensor.data, out.data(), out.size());
  return out;
}

// ---- names ---------------------------------------------------------------------------------

std::string hf_tensor_name(std::string_view gguf_name) {
  struct Pair { std::string_view gguf, hf; };
  static constexpr Pair kTop[] = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  static constexpr Pair kBlock[] = {
      {"attn_norm", "input_layernorm"},      {"ffn_norm", "post_attention_layernorm"},
      {"attn_q", "self_attn.q_proj"},        {"attn_k", "self_attn.k_proj"},
      {"attn_v", "self_attn.v_proj"},        {"attn_output", "self_attn.o_proj"},
      {"attn_q_norm", "self_attn.q_norm"},   {"attn_k_norm", "self_attn.k_norm"},
      {"ffn_gate", "mlp.gate_proj"},         {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"},
  };
  for (const auto& p : kTop)
    if (gguf_name == p.gguf) return std::string(p.hf);
  if (gguf_name == "rope_freqs.weight")
    throw Error("tensor 'rope_freqs.weight' has no Hugging Face parameter: it holds llama 3 RoPE scaling, "
                "which hf_config() turns into rope_scaling; skip it when loading weights");

  constexpr std::string_view blk = "blk.";
  if (gguf_name.starts_with(blk)) {
    std::string_view rest = gguf_name.substr(blk.size());
    const size_t dot = rest.find('.');
    const std::string_view layer = rest.substr(0, dot);
    const bool digits = !layer.empty() && layer.size() <= 9 &&
                        std::all_of(layer.begin(), layer.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits && dot != std::string_view::npos) {
      rest = rest.substr(dot + 1);
      const size_t last = rest.rfind('.');
      const std::string_view part = rest.substr(0, last);
      const std::string_view suffix = last == std::string_view::npos ? "" : rest.substr(last + 1);
      if (suffix == "weight" || suffix == "bias")
        for (const auto& p : kBlock)
          if (part == p.gguf)
            return "model.layers." + std::string(layer) + "." + std::string(p.hf) + "." + std::string(suffix);
    }
  }
  throw Error("unknown GGUF tensor name '" + std::string(gguf_name) +
              "' (troupe maps the tensors of llama, qwen2 and qwen3 models)");
}

void unpermute_qk_rows(float* data, int64_t rows, int64_t cols, int64_t n_head) {
  int64_t total;
  if (n_head <= 0 || rows <= 0 || cols < 0 || rows % (2 * n_head) != 0 || __builtin_mul_overflow(rows, cols, &total))
    throw Error("unpermute_qk_rows: " + std::to_string(rows) + " rows cannot be split into " +
                std::to_string(n_head) + " heads of an even size");
  // The converter stores HF row (h, s, i) of head h, half s, pair index i at (h, i, s); this is
  // the inverse: HF row h*hd + s*half + i <- GGUF row h*hd + 2*i + s.
  const int64_t hd = rows / n_head, half = hd / 2;
  std::vector<float> head(size_t(hd * cols));
  for (int64_t h = 0; h < n_head; ++h) {
    float* base = data + h * hd * cols;
    std::copy(base, base + hd * cols, head.begin());
    for (int64_t i = 0; i < half; ++i)
      for (int64_t s = 0; s < 2; ++s)
        std::copy_n(head.begin() + (2 * i + s) * cols, cols, base + (s * half + i) * cols);
  }
}

// ---- config.json ---------------------------------------------------------------------------

namespace {

// llama 3.x files carry their RoPE scaling only as rope_freqs.weight (per-frequency divisors).
// Every released llama 3 model uses low_freq_factor 1, high_freq_factor 4 and an original
// context of 8192; the factor is the largest divisor. The recomputed table must match the
// tensor, so a file made with other parameters is refused rather than silently misread.
nlohmann::json llama3_rope_scaling(const File& file, const TensorInfo& t, double theta, uint64_t head_dim) {
  const std::vector<float> freqs = dequantize(t);
  if (freqs.empty() || freqs.size() != head_dim / 2)  // head_dim 0 or 1: no frequencies to scale
    fail(file.path(), "rope_freqs.weight has " + std::to_string(freqs.size()) + " entries, expected head_dim / 2 = " +
                          std::to_string(head_dim / 2));
  const double factor = *std::max_element(freqs.begin(), freqs.end());
  const double low = 1.0, high = 4.0, original = 8192.0;
  bool all_one = true;
  for (float x : freqs) all_one = all_one && x == 1.0f;
  if (all_one) return nullptr;
  for (size_t i = 0; i < freqs.size(); ++i) {
    const double freq = 1.0 / std::pow(theta, double(2 * i) / double(head_dim));
    const double wavelen = 2 * std::numbers::pi / freq;
    double expect;
    if (wavelen < original / high) expect = 1.0;
    else if (wavelen > original / low) expect = factor;
    else {
      const double smooth = (original / wavelen - low) / (high - low);
      expect = 1.0 / ((1 - smooth) / factor + smooth);
    }
    if (!(std::abs(freqs[i] - expect) <= 1e-3 * expect))
      fail(file.path(), "rope_freqs.weight is not llama 3 RoPE scaling with low_freq_factor 1, high_freq_factor 4, "
                        "original context 8192 (entry " + std::to_string(i) + " is " + std::to_string(freqs[i]) +
                        ", expected " + std::to_string(expect) + "); troupe cannot describe it in config.json");
  }
  return {{"rope_type", "llama3"}, {"factor", factor}, {"low_freq_factor", low}, {"high_freq_factor", high},
          {"original_max_position_embeddings", uint64_t(original)}};
}

}  // namespace

nlohmann::json hf_config(const File& file) {
  struct Arch { std::string_view gguf, hf_class; };
  static constexpr Arch kArchs[] = {
      {"llama", "LlamaForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}, {"qwen3", "Qwen3ForCausalLM"}};
  const std::string arch = file.get_string("general.architecture");
  const Arch* a = nullptr;
  for (const auto& x : kArchs)
    if (x.gguf == arch) a = &x;
  if (!a) fail(file.path(), "unsupported architecture '" + arch + "' (troupe imports llama, qwen2 and qwen3)");
  const auto key = [&](std::string_view k) { return arch + "." + std::string(k); };
  // Floats stored as float32 come back as their shortest decimal (1e-05, not 9.99999974738e-06).
  const auto get_float = [&](const std::string& k) {
    const double x = file.get_float(k);
    return file.find(k)->type == ValueType::FLOAT32 ? shortest_decimal(x) : x;
  };

  nlohmann::json c;
  c["architectures"] = {std::string(a->hf_class)};
  c["model_type"] = arch;
  const uint64_t hidden = file.get_uint(key("embedding_length"));
  const uint64_t heads = file.get_uint(key("attention.head_count"));
  if (heads == 0) fail(file.path(), "metadata key '" + key("attention.head_count") + "' is 0");
  // llama.cpp itself defaults head_count_kv to head_count (no grouped-query attention).
  const uint64_t kv_heads = file.has(key("attention.head_count_kv")) ? file.get_uint(key("attention.head_count_kv")) : heads;
  if (kv_heads == 0 || heads % kv_heads != 0)
    fail(file.path(), "metadata key '" + key("attention.head_count_kv") + "' is " + std::to_string(kv_heads) +
                          ", which does not divide the " + std::to_string(heads) + " attention heads");
  const uint64_t head_dim =
      file.has(key("attention.key_length")) ? file.get_uint(key("attention.key_length")) : hidden / heads;
  if (file.has(key("rope.dimension_count")) && file.get_uint(key("rope.dimension_count")) != head_dim)
    fail(file.path(), "metadata key '" + key("rope.dimension_count") + "' differs from the head size " +
                          std::to_string(head_dim) + ": partial RoPE is not supported");

  uint64_t vocab;
  if (file.has(key("vocab_size"))) {
    vocab = file.get_uint(key("vocab_size"));
  } else if (const Value* tokens = file.find("tokenizer.ggml.tokens");
             tokens && std::holds_alternative<std::vector<Value>>(tokens->v)) {
    vocab = std::get<std::vector<Value>>(tokens->v).size();
  } else {
    fail(file.path(), "missing metadata key '" + key("vocab_size") + "' (and no tokenizer.ggml.tokens to count)");
  }

  c["vocab_size"] = vocab;
  c["hidden_size"] = hidden;
  c["intermediate_size"] = file.get_uint(key("feed_forward_length"));
  c["num_hidden_layers"] = file.get_uint(key("block_count"));
  c["num_attention_heads"] = heads;
  c["num_key_value_heads"] = kv_heads;
  c["head_dim"] = head_dim;
  c["hidden_act"] = "silu";
  c["rms_norm_eps"] = get_float(key("attention.layer_norm_rms_epsilon"));
  const double theta = file.has(key("rope.freq_base")) ? get_float(key("rope.freq_base")) : 10000.0;
  c["rope_theta"] = theta;
  c["max_position_embeddings"] = file.get_uint(key("context_length"));
  c["tie_word_embeddings"] = file.find_tensor("output.weight") == nullptr;
  c["attention_bias"] = file.find_tensor("blk.0.attn_q.bias") != nullptr;
  c["torch_dtype"] = "float32";

  nlohmann::json scaling = nullptr;
  if (file.has(key("rope.scaling.type"))) {
    const std::string type = file.get_string(key("rope.scaling.type"));
    if (type == "linear" || type == "yarn") {
      scaling = {{"rope_type", type}, {"factor", get_float(key("rope.scaling.factor"))}};
      if (type == "yarn")
        scaling["original_max_position_embeddings"] = file.get_uint(key("rope.scaling.original_context_length"));
    } else if (type != "none") {
      fail(file.path(), "metadata key '" + key("rope.scaling.type") + "' is '" + type +
                            "'; troupe supports none, linear and yarn");
    }
  }
  if (const TensorInfo* freqs = file.find_tensor("rope_freqs.weight")) {
    if (!scaling.is_null())
      fail(file.path(), "both rope.scaling.type and rope_freqs.weight are present; which one applies is ambiguous");
    scaling = llama3_rope_scaling(file, *freqs, theta, head_dim);
  }
  if (!scaling.is_null()) c["rope_scaling"] = scaling;

  for (const auto& [gguf_key, hf_key] : {std::pair{"tokenizer.ggml.bos_token_id", "bos_token_id"},
                                         std::pair{"tokenizer.ggml.eos_token_id", "eos_token_id"},
                                         std::pair{"tokenizer.ggml.padding_token_id", "pad_token_id"}})
    if (file.has(gguf_key)) c[hf_key] = file.get_uint(gguf_key);
  return c;
}

}  // namespace troupe::gguf
