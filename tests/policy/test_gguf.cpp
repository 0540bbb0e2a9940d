// GGUF import against independent references: hand-computed blocks, gguf-py's numpy dequantizer,
// transformers' GGUF loader on SmolLM2. Corrupt files are mutated copies made here, not fixtures.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "policy/error.hpp"
#include "policy/gguf.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using namespace troupe::gguf;
using Bytes = std::vector<uint8_t>;

namespace {

fs::path dir() { return troupe::test::fixtures() / "gguf"; }

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE_MESSAGE(in, "cannot read " << p);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const fs::path& p, const Bytes& b, size_t n = SIZE_MAX) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(std::min(n, b.size())));
}

std::vector<float> read_f32(const fs::path& p) {
  const Bytes b = read_bytes(p);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(std::ifstream(p)); }

// Largest |a - b|; NaN must sit where the reference has NaN, infinities must match exactly.
double max_abs_err(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double err = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(b[i]) || std::isinf(b[i])) {
      const bool same = std::isnan(b[i]) ? std::isnan(a[i]) : a[i] == b[i];
      if (!same) return INFINITY;
      continue;
    }
    err = std::max(err, std::abs(double(a[i]) - double(b[i])));
  }
  return err;
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("troupe_test_gguf_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The message of the troupe::Error that fn throws, or "" when it returns.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const troupe::Error& e) {
    return e.what();
  }
  return "";
}

// The message of the troupe::Error that opening `p` throws, or "" when it opens.
std::string open_error(const fs::path& p) {
  return error_of([&] { File::open(p); });
}

void check_error(const std::string& msg, const fs::path& p, const std::string& phrase) {
  INFO("expected \"" << phrase << "\" in: " << msg);
  CHECK(msg.starts_with(p.string() + ": "));
  CHECK(msg.find(phrase) != std::string::npos);
}

template <class T>
void put(Bytes& b, size_t at, T v) {
  REQUIRE(at + sizeof(T) <= b.size());
  std::memcpy(b.data() + at, &v, sizeof(T));
}

// Where a length-prefixed string (a key or tensor name) starts in the file: at its length.
size_t find_string(const Bytes& b, const std::string& s) {
  Bytes needle(8);
  const uint64_t n = s.size();
  std::memcpy(needle.data(), &n, 8);
  needle.insert(needle.end(), s.begin(), s.end());
  const auto it = std::search(b.begin(), b.end(), needle.begin(), needle.end());
  REQUIRE_MESSAGE(it != b.end(), "'" << s << "' not found");
  return size_t(it - b.begin());
}

// Offsets of the fields of one tensor info record.
struct InfoAt {
  size_t n_dims, type, offset, end;
};
InfoAt tensor_info_at(const Bytes& b, const std::string& name, uint32_t n_dims) {
  const size_t at = find_string(b, name) + 8 + name.size();
  return {at, at + 4 + 8 * n_dims, at + 4 + 8 * n_dims + 4, at + 4 + 8 * n_dims + 12};
}

std::vector<float> dq(TensorType type, const Bytes& block, size_t n) {
  std::vector<float> out(n);
  dequantize(type, reinterpret_cast<const std::byte*>(block.data()), out.data(), n);
  return out;
}

}  // namespace

// ---- hand-computed values: these depend on nothing but the ggml block layouts ------------------

TEST_CASE("fp16 and bf16 conversion is exact, including subnormals, infinities and NaN") {
  const std::vector<std::pair<uint16_t, float>> halves = {
      {0x0000, 0.0f},          {0x3c00, 1.0f},           {0xc000, -2.0f},
      {0x3555, 0.333251953125f}, {0x7bff, 65504.0f},     {0xfbff, -65504.0f},
      {0x0400, 0x1p-14f},      {0x0001, 0x1p-24f},       {0x03ff, 1023 * 0x1p-24f},
      {0x8001, -0x1p-24f},     {0x7c00, INFINITY},       {0xfc00, -INFINITY},
  };
  Bytes raw;
  for (auto [h, f] : halves) raw.insert(raw.end(), {uint8_t(h & 0xff), uint8_t(h >> 8)});
  raw.insert(raw.end(), {0x00, 0x80, 0x00, 0x7e, 0x01, 0xfc});  // -0, NaN, NaN with payload
  const auto y = dq(TensorType::F16, raw, halves.size() + 3);
  for (size_t i = 0; i < halves.size(); ++i) {
    INFO("half 0x" << std::hex << halves[i].first);
    CHECK(y[i] == halves[i].second);
  }
  CHECK(y[halves.size()] == 0.0f);
  CHECK(std::signbit(y[halves.size()]));
  CHECK(std::isnan(y[halves.size() + 1]));
  CHECK(std::isnan(y[halves.size() + 2]));

  const Bytes bf = {0x80, 0x3f, 0x49, 0xc0, 0x80, 0x7f, 0x01, 0x00};  // 1, -3.140625, inf, 2^-133
  const auto z = dq(TensorType::BF16, bf, 4);
  CHECK(z[0] == 1.0f);
  CHECK(z[1] == -3.140625f);
  CHECK(z[2] == INFINITY);
  CHECK(z[3] == 0x1p-133f);
}

TEST_CASE("hand-built Q8_0, Q4_0, Q4_1, Q5_0 and Q4_K blocks") {
  SUBCASE("Q8_0: d = 0.5, qs = -16..15") {
    Bytes b = {0x00, 0x38};
    for (int i = 0; i < 32; ++i) b.push_back(uint8_t(int8_t(i - 16)));
    const auto y = dq(TensorType::Q8_0, b, 32);
    for (int i = 0; i < 32; ++i) CHECK(y[i] == 0.5f * float(i - 16));
  }
  SUBCASE("Q4_0: d = 2, element j in the low nibble, element j + 16 in the high nibble") {
    Bytes b = {0x00, 0x40};
    for (int j = 0; j < 16; ++j) b.push_back(uint8_t(j | ((15 - j) << 4)));
    const auto y = dq(TensorType::Q4_0, b, 32);
    for (int j = 0; j < 16; ++j) {
      CHECK(y[j] == 2.0f * float(j - 8));
      CHECK(y[j + 16] == 2.0f * float(7 - j));
    }
  }
  SUBCASE("Q4_1: d = 0.25, m = -1") {
    Bytes b = {0x00, 0x34, 0x00, 0xbc};
    for (int j = 0; j < 16; ++j) b.push_back(uint8_t(j | ((15 - j) << 4)));
    const auto y = dq(TensorType::Q4_1, b, 32);
    for (int j = 0; j < 16; ++j) {
      CHECK(y[j] == 0.25f * float(j) - 1.0f);
      CHECK(y[j + 16] == 0.25f * float(15 - j) - 1.0f);
    }
  }
  SUBCASE("Q5_0: the fifth bit of element i is bit i of qh") {
    const uint32_t qh = 0xa5a5f00fu;
    Bytes b = {0x00, 0x3c, uint8_t(qh), uint8_t(qh >> 8), uint8_t(qh >> 16), uint8_t(qh >> 24)};
    for (int j = 0; j < 16; ++j) b.push_back(uint8_t(j | ((15 - j) << 4)));
    const auto y = dq(TensorType::Q5_0, b, 32);
    for (int i = 0; i < 32; ++i) {
      const int low = i < 16 ? i : 15 - (i - 16);
      CHECK(y[i] == float(low + 16 * int((qh >> i) & 1) - 16));
    }
  }
  SUBCASE("Q4_K: 6-bit scales and mins, the high ones split across bytes") {
    const int sc[8] = {1, 2, 3, 4, 33, 34, 63, 17};
    const int mn[8] = {0, 5, 10, 15, 20, 47, 60, 1};
    uint8_t scales[12] = {};
    for (int j = 0; j < 4; ++j) {
      scales[j] = uint8_t(sc[j] | ((sc[j + 4] >> 4) << 6));
      scales[j + 4] = uint8_t(mn[j] | ((mn[j + 4] >> 4) << 6));
      scales[j + 8] = uint8_t((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
    Bytes b = {0x00, 0x3c, 0x00, 0x38};  // d = 1, dmin = 0.5
    b.insert(b.end(), scales, scales + 12);
    b.insert(b.end(), 128, 0x21);  // low nibble 1, high nibble 2
    REQUIRE(b.size() == block_bytes(TensorType::Q4_K));
    const auto y = dq(TensorType::Q4_K, b, 256);
    for (int i = 0; i < 256; ++i) {
      const int sub = i / 32;  // sub-blocks alternate low (even) and high (odd) nibbles
      const float q = sub % 2 == 0 ? 1.0f : 2.0f;
      INFO("element " << i);
      CHECK(y[i] == float(sc[sub]) * q - 0.5f * float(mn[sub]));
    }
  }
  SUBCASE("a count that is not a whole number of blocks is refused") {
    Bytes b(34 * 2);
    std::vector<float> out(64);
    CHECK_THROWS_AS(dequantize(TensorType::Q8_0, reinterpret_cast<const std::byte*>(b.data()), out.data(), 40),
                    troupe::Error);
  }
}

// ---- gguf-py writes, numpy dequantizes -------------------------------------------------------

TEST_CASE("every supported type matches gguf-py's dequantize") {
  const auto f = File::open(dir() / "types.gguf");
  const auto expected = read_json(dir() / "types.json")["tensors"];
  REQUIRE(expected.size() == 10);
  for (const auto& [name, e] : expected.items()) {
    INFO("tensor " << name);
    const TensorInfo& t = f->tensor(name);
    CHECK(type_name(t.type) == e["type"].get<std::string>());
    CHECK(t.torch_shape() == e["shape"].get<std::vector<int64_t>>());
    CHECK(t.nbytes == t.elements() / block_elements(t.type) * block_bytes(t.type));
    const auto ours = dequantize(t);
    const auto ref = read_f32(dir() / e["file"].get<std::string>());
    const double err = max_abs_err(ours, ref);
    MESSAGE(name << " (" << type_name(t.type) << ", " << ours.size() << " values): max abs err " << err);
    CHECK(err <= 1e-6);
  }
}

TEST_CASE("tensors in a 64-byte aligned file") {
  const auto f = File::open(dir() / "align64.gguf");
  CHECK(f->alignment() == 64);
  const auto expected = read_json(dir() / "align64.json")["tensors"];
  for (const auto& [name, e] : expected.items()) {
    const TensorInfo& t = f->tensor(name);
    CHECK(t.offset % 64 == 0);
    CHECK(max_abs_err(dequantize(t), read_f32(dir() / e["file"].get<std::string>())) == 0.0);
  }
  CHECK(f->tensor("b").offset == 64);  // 7 floats, then padding to 64
}

TEST_CASE("metadata of every value type round-trips") {
  const auto f = File::open(dir() / "types.gguf");
  CHECK(f->version() == 3);
  CHECK(f->alignment() == 32);
  CHECK(f->get_string("general.architecture") == "llama");
  CHECK(f->get_uint("test.u8") == 200);
  CHECK(f->get_int("test.i8") == -100);
  CHECK(f->get_uint("test.u16") == 60000);
  CHECK(f->get_int("test.i16") == -30000);
  CHECK(f->get_uint("test.u32") == 4000000000u);
  CHECK(f->get_int("test.i32") == -2000000000);
  CHECK(f->get_uint("test.u64") == 18000000000000000000ull);
  CHECK(f->get_int("test.i64") == -9000000000000000000ll);
  CHECK(f->get_float("test.f32") == 1.5);
  CHECK(f->get_float("test.f64") == -2.25e100);
  CHECK(f->get_float("test.u8") == 200.0);
  CHECK(f->get_bool("test.true"));
  CHECK_FALSE(f->get_bool("test.false"));
  CHECK(f->get_string("test.string") == "h\xc3\xa9llo w\xc3\xb6rld");
  CHECK(f->get_string("test.empty_string").empty());
  CHECK(f->get_string_array("test.strings") == std::vector<std::string>{"a", "bc", "", "d\xc3\xa9" "f"});
  CHECK(f->get_int_array("test.u8s") == std::vector<int64_t>{1, 2, 255});
  CHECK(f->get_int_array("test.i32s") == std::vector<int64_t>{-1, 0, 7});
  CHECK(f->get_int_array("test.i64s") == std::vector<int64_t>{-(int64_t{1} << 40), int64_t{1} << 40});

  // The stored types survive, not just the values.
  CHECK(f->find("test.u16")->type == ValueType::UINT16);
  CHECK(f->find("test.i8")->type == ValueType::INT8);
  CHECK(f->find("test.f64")->type == ValueType::FLOAT64);
  CHECK(f->find("test.u8s")->elem_type == ValueType::UINT8);
  const Value* floats = f->find("test.f32s");
  REQUIRE(floats);
  CHECK(floats->elem_type == ValueType::FLOAT32);
  const auto& fl = std::get<std::vector<Value>>(floats->v);
  REQUIRE(fl.size() == 2);
  CHECK(std::get<double>(fl[0].v) == 0.5);
  CHECK(std::get<double>(fl[1].v) == -1.25);
  const auto& bools = std::get<std::vector<Value>>(f->find("test.bools")->v);
  REQUIRE(bools.size() == 3);
  CHECK(std::get<bool>(bools[0].v));
  CHECK_FALSE(std::get<bool>(bools[1].v));

  const Value* nested = f->find("test.nested");
  REQUIRE(nested);
  CHECK(nested->elem_type == ValueType::ARRAY);
  const auto& outer = std::get<std::vector<Value>>(nested->v);
  REQUIRE(outer.size() == 3);
  CHECK(outer[0].elem_type == ValueType::INT32);
  CHECK(std::get<int64_t>(std::get<std::vector<Value>>(outer[0].v)[1].v) == 2);
  CHECK(std::get<std::vector<Value>>(outer[1].v).size() == 1);
  CHECK(outer[2].elem_type == ValueType::STRING);
  CHECK(std::get<std::string>(std::get<std::vector<Value>>(outer[2].v)[1].v) == "y");

  // Getters name the file and key when the key is missing or of another type.
  const auto msg = [](auto&& fn) { return error_of(fn); };
  const fs::path p = dir() / "types.gguf";
  check_error(msg([&] { f->get_uint("no.such.key"); }), p, "missing metadata key 'no.such.key'");
  check_error(msg([&] { f->get_uint("test.string"); }), p, "'test.string' is string, expected a non-negative integer");
  check_error(msg([&] { f->get_uint("test.i8"); }), p, "'test.i8'");
  check_error(msg([&] { f->get_int("test.u64"); }), p, "'test.u64'");
  check_error(msg([&] { f->get_string_array("test.i32s"); }), p, "is array of int32, expected an array of strings");
  check_error(msg([&] { f->tensor("nope"); }), p, "no tensor named 'nope'");
}

TEST_CASE("a type known to ggml but not dequantized opens, and fails in dequantize()") {
  const fs::path p = dir() / "types.gguf";
  const auto f = File::open(p);
  const TensorInfo& t = f->tensor("t_q2_k");
  CHECK(t.type == TensorType::Q2_K);
  CHECK_FALSE(dequantize_supported(TensorType::Q2_K));
  check_error(error_of([&] { dequantize(t); }), p, "unsupported tensor type Q2_K for tensor 't_q2_k'");
  std::vector<float> out(256);
  CHECK_THROWS_WITH_AS(dequantize(TensorType::Q2_K, t.data, out.data(), 256),
                       doctest::Contains("unsupported tensor type Q2_K"), troupe::Error);
}

// ---- corrupt files -----------------------------------------------------------------------

TEST_CASE("corrupt and truncated files give an Error naming the file and the problem") {
  TempDir tmp;
  const Bytes good = read_bytes(dir() / "types.gguf");
  const auto layout = read_json(dir() / "types.json");
  const size_t data_offset = layout["data_offset"];
  const fs::path p = tmp.path / "bad.gguf";
  const auto with = [&](auto&& mutate) {
    Bytes b = good;
    mutate(b);
    write_bytes(p, b);
    return open_error(p);
  };

  check_error(with([](Bytes& b) { b[0] = 'X'; }), p, "not a GGUF file (bad magic number");
  check_error(with([](Bytes& b) { put<uint32_t>(b, 4, 1); }), p, "unsupported GGUF version 1");
  check_error(with([](Bytes& b) { put<uint32_t>(b, 4, 4); }), p, "unsupported GGUF version 4");
  check_error(with([](Bytes& b) { put<uint32_t>(b, 4, 0x03000000u); }), p, "big-endian GGUF is not supported");
  CHECK(with([](Bytes& b) { put<uint32_t>(b, 4, 2); }).empty());  // v2 has v3's layout
  CHECK(File::open(p)->version() == 2);

  // Counts and lengths are checked against the bytes left before anything is allocated.
  check_error(with([](Bytes& b) { put<uint64_t>(b, 8, uint64_t{1} << 60); }), p,
              "header claims 1152921504606846976 tensors");
  check_error(with([](Bytes& b) { put<uint64_t>(b, 16, uint64_t{1} << 60); }), p,
              "header claims 1152921504606846976 metadata entries");
  check_error(with([](Bytes& b) { put<uint64_t>(b, 16, 1000); }), p, "truncated while reading metadata key 23");
  check_error(with([](Bytes& b) { put<uint64_t>(b, 24, uint64_t{1} << 62); }), p,
              "truncated while reading metadata key 0");
  check_error(with([&](Bytes& b) {
                const size_t at = find_string(b, "test.strings") + 8 + 12 + 4 + 4;  // past type, elem type
                put<uint64_t>(b, at, uint64_t{1} << 40);
              }),
              p, "truncated while reading metadata key 15 ('test.strings'): an array of 1099511627776 string values "
                 "cannot fit");
  check_error(with([&](Bytes& b) { put<uint32_t>(b, find_string(b, "test.u8") + 8 + 7, 13); }), p,
              "metadata key 'test.u8' has unknown value type 13");

  // Tensor infos.
  const InfoAt q40 = tensor_info_at(good, "t_q4_0", 2);
  const InfoAt q2k = tensor_info_at(good, "t_q2_k", 2);
  check_error(with([&](Bytes& b) { put<uint32_t>(b, q40.type, 77); }), p,
              "tensor 't_q4_0' has unknown tensor type code 77");
  check_error(with([&](Bytes& b) { put<uint32_t>(b, q40.n_dims, 5); }), p, "tensor 't_q4_0' has 5 dimensions");
  check_error(with([&](Bytes& b) { put<uint64_t>(b, q2k.offset, good.size() - data_offset + 32 - good.size() % 32); }),
              p, "tensor 't_q2_k' runs past the end of the file");
  check_error(with([&](Bytes& b) { put<uint64_t>(b, q2k.offset, ~uint64_t{31}); }), p,
              "tensor 't_q2_k' runs past the end of the file");
  check_error(with([&](Bytes& b) { put<uint64_t>(b, q2k.offset, 8); }), p,
              "tensor 't_q2_k' has offset 8, not a multiple of the alignment 32");
  check_error(with([&](Bytes& b) { put<uint64_t>(b, q40.n_dims + 4, 95); }), p,
              "tensor 't_q4_0' has rows of 95 elements, not a multiple of the Q4_0 block size 32");
  check_error(with([&](Bytes& b) {
                put<uint64_t>(b, q40.n_dims + 4, uint64_t{1} << 40);
                put<uint64_t>(b, q40.n_dims + 12, uint64_t{1} << 40);
              }),
              p, "tensor 't_q4_0' has absurd dimensions");
  check_error(with([&](Bytes& b) {
                const size_t name = find_string(b, "t_q4_1") + 8;
                std::memcpy(b.data() + name, "t_q4_0", 6);
              }),
              p, "duplicate tensor name 't_q4_0'");

  // Truncation anywhere: the header, each metadata entry, each tensor info, the data.
  REQUIRE(q2k.end <= data_offset);
  for (size_t n = 0; n < data_offset; ++n) {
    write_bytes(p, good, n);
    const std::string msg = open_error(p);
    INFO("truncated to " << n << " bytes: " << msg);
    REQUIRE(msg.starts_with(p.string() + ": "));
    if (n < q2k.end)
      REQUIRE(msg.find("truncated while reading") != std::string::npos);
    else
      REQUIRE(msg.find("runs past the end of the file") != std::string::npos);
  }
  const auto cut = [&](size_t n) {
    write_bytes(p, good, n);
    return open_error(p);
  };
  check_error(cut(0), p, "truncated while reading the magic number");
  check_error(cut(6), p, "truncated while reading the version");
  check_error(cut(12), p, "truncated while reading the tensor count");
  check_error(cut(find_string(good, "test.i32") + 3), p, "truncated while reading metadata key 6");
  check_error(cut(find_string(good, "test.strings") + 30), p, "truncated while reading metadata key 15 ('test.strings')");
  check_error(cut(q40.offset), p, "truncated while reading tensor info 4 ('t_q4_0')");
  check_error(cut(data_offset + 100), p, "runs past the end of the file (truncated?)");
  const auto good_file = File::open(dir() / "types.gguf");
  const TensorInfo& last = good_file->tensor("t_q2_k");
  const size_t end = data_offset + last.offset + last.nbytes;  // then padding to the alignment
  check_error(cut(end - 1), p, "tensor 't_q2_k' runs past the end of the file");
  CHECK(cut(end).empty());

  // A general.alignment that is not a power of two.
  const Bytes aligned = read_bytes(dir() / "align64.gguf");
  {
    Bytes b = aligned;
    put<uint32_t>(b, find_string(b, "general.alignment") + 8 + 17 + 4, 48);
    write_bytes(p, b);
    check_error(open_error(p), p, "general.alignment must be a power of two (got 48)");
  }

  check_error(open_error(tmp.path / "missing.gguf"), tmp.path / "missing.gguf", "cannot open");
  check_error(open_error(tmp.path), tmp.path, "not a regular file");
}

TEST_CASE("random corruption never crashes: open and dequantize either work or throw Error") {
  TempDir tmp;
  const Bytes good = read_bytes(dir() / "types.gguf");
  const size_t data_offset = read_json(dir() / "types.json")["data_offset"];
  const fs::path p = tmp.path / "fuzz.gguf";
  std::mt19937_64 rng(7);
  int opened = 0, refused = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    Bytes b = good;
    const int flips = 1 + int(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t at = rng() % data_offset;  // the parser's part; data bytes are all valid
      b[at] = rng() % 3 == 0 ? uint8_t(0xff) : uint8_t(rng());
    }
    write_bytes(p, b, iter % 5 == 0 ? rng() % b.size() : b.size());
    try {
      const auto f = File::open(p);
      for (const auto& t : f->tensors())
        if (dequantize_supported(t.type) && t.elements() < (1u << 24)) dequantize(t);
      ++opened;
    } catch (const troupe::Error& e) {
      REQUIRE(std::string(e.what()).starts_with(p.string() + ": "));
      ++refused;
    }
  }
  MESSAGE("fuzz: " << opened << " opened, " << refused << " refused");
  CHECK(refused > 0);
}

// ---- names and rows ----------------------------------------------------------------------

TEST_CASE("hf_tensor_name maps llama.cpp names to Hugging Face ones") {
  const std::vector<std::pair<std::string, std::string>> names = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
      {"blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"},
      {"blk.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"},
      {"blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"},
      {"blk.3.attn_q.bias", "model.layers.3.self_attn.q_proj.bias"},
      {"blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight"},
      {"blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"},
      {"blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"},
      {"blk.3.attn_v.bias", "model.layers.3.self_attn.v_proj.bias"},
      {"blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"},
      {"blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"},
      {"blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight"},
      {"blk.7.ffn_gate.weight", "model.layers.7.mlp.gate_proj.weight"},
      {"blk.7.ffn_up.weight", "model.layers.7.mlp.up_proj.weight"},
      {"blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"},
  };
  for (const auto& [gguf, hf] : names) CHECK(hf_tensor_name(gguf) == hf);
  CHECK_THROWS_WITH_AS(hf_tensor_name("rope_freqs.weight"), doctest::Contains("skip it"), troupe::Error);
  for (const char* bad : {"blk.x.attn_q.weight", "blk.0.attn_q.scale", "blk.0.attn_qkv.weight", "blk..attn_q.weight",
                          "blk.0", "token_embd.bias", "", "blk.0.ffn_gate_exps.weight"})
    CHECK_THROWS_WITH_AS(hf_tensor_name(bad), doctest::Contains("unknown GGUF tensor name"), troupe::Error);
}

TEST_CASE("unpermute_qk_rows undoes the converter's interleaving") {
  // Two heads of head_dim 6, two columns. The converter stores HF rows (per head) in the
  // order 0,3,1,4,2,5: each rotate-half pair (i, i + 3) becomes adjacent.
  const int perm[6] = {0, 3, 1, 4, 2, 5};
  std::vector<float> w(12 * 2);
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < 6; ++r)
      for (int c = 0; c < 2; ++c) w[(h * 6 + r) * 2 + c] = float(100 * h + 10 * perm[r] + c);
  unpermute_qk_rows(w.data(), 12, 2, 2);
  for (int r = 0; r < 12; ++r)
    for (int c = 0; c < 2; ++c) CHECK(w[r * 2 + c] == float(100 * (r / 6) + 10 * (r % 6) + c));

  std::vector<float> bias = {0, 2, 1, 3};  // one head of 4, cols = 1
  unpermute_qk_rows(bias.data(), 4, 1, 1);
  CHECK(bias == std::vector<float>{0, 1, 2, 3});
  CHECK_THROWS_AS(unpermute_qk_rows(bias.data(), 4, 1, 3), troupe::Error);
  CHECK_THROWS_AS(unpermute_qk_rows(bias.data(), 6, 1, 2), troupe::Error);  // head_dim 3 is odd
}

// ---- config.json -------------------------------------------------------------------------

TEST_CASE("hf_config for qwen3, qwen2 and llama 3 files, and its errors") {
  SUBCASE("qwen3: head_dim from key_length, vocab from the token list, default rope, untied") {
    const auto c = hf_config(*File::open(dir() / "qwen3.gguf"));
    CHECK(c["architectures"] == nlohmann::json{"Qwen3ForCausalLM"});
    CHECK(c["model_type"] == "qwen3");
    CHECK(c["head_dim"] == 32);
    CHECK(c["vocab_size"] == 40);
    CHECK(c["rope_theta"] == 10000.0);
    CHECK(c["tie_word_embeddings"] == false);
    CHECK(c["attention_bias"] == false);
    CHECK(c["hidden_size"] == 64);
    CHECK(c["intermediate_size"] == 96);
    CHECK(c["num_hidden_layers"] == 2);
    CHECK(c["num_attention_heads"] == 4);
    CHECK(c["num_key_value_heads"] == 2);
    CHECK(c["max_position_embeddings"] == 512);
    CHECK(c["rms_norm_eps"] == 1e-6);
    CHECK(c["bos_token_id"] == 5);
    CHECK(c["eos_token_id"] == 6);
    CHECK_FALSE(c.contains("pad_token_id"));
    CHECK(c["torch_dtype"] == "float32");
  }
  SUBCASE("qwen2: biases, explicit vocab and rope base, tied") {
    const auto c = hf_config(*File::open(dir() / "qwen2.gguf"));
    CHECK(c["architectures"] == nlohmann::json{"Qwen2ForCausalLM"});
    CHECK(c["attention_bias"] == true);
    CHECK(c["vocab_size"] == 100);
    CHECK(c["rope_theta"] == 1e6);
    CHECK(c["head_dim"] == 16);
    CHECK(c["tie_word_embeddings"] == true);
    CHECK(c["pad_token_id"] == 7);
  }
  SUBCASE("llama 3: rope_freqs.weight becomes rope_scaling, as transformers computes it") {
    const auto c = hf_config(*File::open(dir() / "llama3.gguf"));
    CHECK(c["rope_scaling"] == nlohmann::json{{"rope_type", "llama3"},
                                              {"factor", 32.0},
                                              {"low_freq_factor", 1.0},
                                              {"high_freq_factor", 4.0},
                                              {"original_max_position_embeddings", 8192}});
    CHECK(c["rope_theta"] == 500000.0);
    const fs::path odd = dir() / "llama3_odd_rope.gguf";
    check_error(error_of([&] { hf_config(*File::open(odd)); }), odd, "rope_freqs.weight is not llama 3 RoPE scaling");
  }
  SUBCASE("unknown architecture, missing key") {
    const fs::path mamba = dir() / "mamba.gguf";
    check_error(error_of([&] { hf_config(*File::open(mamba)); }), mamba, "unsupported architecture 'mamba'");
    const fs::path nb = dir() / "no_block_count.gguf";
    check_error(error_of([&] { hf_config(*File::open(nb)); }), nb, "missing metadata key 'llama.block_count'");
  }
}

// ---- the real model ----------------------------------------------------------------------

TEST_CASE("SmolLM2-135M Q4_1: config, and weights equal to transformers' GGUF loader") {
  const fs::path path = troupe::test::smollm2_gguf();
  REQUIRE_MESSAGE(fs::exists(path), path << " is missing: run scripts/setup.sh");
  const auto f = File::open(path);
  const auto ref = read_json(dir() / "smollm2.json");

  const auto c = hf_config(*f);
  CHECK(c["architectures"] == nlohmann::json{"LlamaForCausalLM"});
  CHECK(c["model_type"] == "llama");
  CHECK(c["hidden_size"] == 576);
  CHECK(c["num_hidden_layers"] == 30);
  CHECK(c["num_attention_heads"] == 9);
  CHECK(c["num_key_value_heads"] == 3);
  CHECK(c["intermediate_size"] == 1536);
  CHECK(c["vocab_size"] == 49152);
  CHECK(c["rope_theta"] == 100000.0);
  CHECK(c["rms_norm_eps"] == 1e-5);
  CHECK(c["tie_word_embeddings"] == true);
  CHECK(c["bos_token_id"] == 1);
  CHECK(c["eos_token_id"] == 2);
  CHECK_FALSE(c.contains("rope_scaling"));
  // Every key both configs have agrees with transformers' own GGUF config.
  for (const char* k : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias"}) {
    INFO(k);
    CHECK(c[k] == ref["config"][k]);
  }
  CHECK(float(c["rms_norm_eps"].get<double>()) == float(ref["config"]["rms_norm_eps"].get<double>()));
  CHECK(c["rope_theta"] == ref["config"]["rope_parameters"]["rope_theta"]);

  const int64_t heads = c["num_attention_heads"], kv_heads = c["num_key_value_heads"];
  int compared = 0;
  for (const auto& t : f->tensors()) {
    if (t.name == "rope_freqs.weight") continue;
    const std::string hf = hf_tensor_name(t.name);
    if (!ref["tensors"].contains(hf)) continue;
    const auto& e = ref["tensors"][hf];
    std::vector<float> ours = dequantize(t);
    const auto shape = t.torch_shape();
    const int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1;
    const std::vector<float> expect = read_f32(dir() / e["file"].get<std::string>());
    const bool q = t.name.find(".attn_q.") != std::string::npos, k = t.name.find(".attn_k.") != std::string::npos;
    if (q || k) {
      // Without the unpermute the weights disagree: the check below is not vacuous.
      CHECK(max_abs_err(ours, expect) > 1e-3);
      unpermute_qk_rows(ours.data(), rows, cols, q ? heads : kv_heads);
    }
    ours.resize(expect.size());  // the embedding reference holds the first rows only
    const double err = max_abs_err(ours, expect);
    MESSAGE(hf << " (" << type_name(t.type) << "): max abs err " << err << " over " << expect.size() << " values");
    CHECK(err <= 1e-6);
    ++compared;
  }
  CHECK(compared == int(ref["tensors"].size()));

  // Every tensor dequantizes to finite values; time the whole model.
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t n = 0;
  bool finite = true;
  for (const auto& t : f->tensors()) {
    const auto v = dequantize(t);
    n += v.size();
    finite = finite && std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("dequantized " << f->tensors().size() << " tensors, " << n << " values in " << s << " s");
  CHECK(finite);
  CHECK(n == 134515008);
}
