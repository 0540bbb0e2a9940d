// safetensors reader and writer against files written by the Python safetensors package and
// transformers' save_pretrained, plus a clear error for each kind of broken file. No tensors.
#include <doctest/doctest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
namespace st = troupe::safetensors;
using json = nlohmann::json;

static_assert(std::endian::native == std::endian::little, "expected values are decoded as little-endian");

namespace {

constexpr st::Dtype kAllDtypes[] = {st::Dtype::F64, st::Dtype::F32, st::Dtype::F16, st::Dtype::BF16, st::Dtype::I64,
                                    st::Dtype::I32, st::Dtype::I16, st::Dtype::I8,  st::Dtype::U8,   st::Dtype::BOOL};

fs::path fixture_dir() { return troupe::test::fixtures() / "safetensors"; }

json read_json(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in, "cannot open " << path);
  return json::parse(in);
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string hex(const std::byte* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    auto b = static_cast<unsigned>(data[i]);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

// Decoded here by hand rather than by any library the reader might share a bug with.
double f16_value(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
  double v = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return sign ? -v : v;
}
double bf16_value(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T>
T element(const st::TensorView& t, size_t i) {
  T v;
  std::memcpy(&v, t.data + i * sizeof(T), sizeof(T));
  return v;
}

double float_element(const st::TensorView& t, size_t i) {
  switch (t.dtype) {
    case st::Dtype::F64:
      return element<double>(t, i);
    case st::Dtype::F32:
      return element<float>(t, i);
    case st::Dtype::F16:
      return f16_value(element<uint16_t>(t, i));
    case st::Dtype::BF16:
      return bf16_value(element<uint16_t>(t, i));
    default:
      FAIL("not a float dtype");
      return 0;
  }
}

int64_t int_element(const st::TensorView& t, size_t i) {
  switch (t.dtype) {
    case st::Dtype::I64:
      return element<int64_t>(t, i);
    case st::Dtype::I32:
      return element<int32_t>(t, i);
    case st::Dtype::I16:
      return element<int16_t>(t, i);
    case st::Dtype::I8:
      return element<int8_t>(t, i);
    case st::Dtype::U8:
      return element<uint8_t>(t, i);
    case st::Dtype::BOOL:
      return element<uint8_t>(t, i);
    default:
      FAIL("not an integer dtype");
      return 0;
  }
}

bool is_float(st::Dtype d) {
  return d == st::Dtype::F64 || d == st::Dtype::F32 || d == st::Dtype::F16 || d == st::Dtype::BF16;
}

// Checks one view against an expected record {dtype, shape, hex, values} made from torch.
void check_tensor(const st::TensorView& t, const json& expected) {
  INFO("tensor ", t.name);
  CHECK(st::dtype_name(t.dtype) == expected["dtype"].get<std::string>());
  CHECK(t.shape == expected["shape"].get<std::vector<int64_t>>());
  CHECK(hex(t.data, t.nbytes) == expected["hex"].get<std::string>());
  if (!expected.contains("values")) return;
  const auto& values = expected["values"];
  REQUIRE(t.nbytes == values.size() * st::dtype_size(t.dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (is_float(t.dtype))
      CHECK(float_element(t, i) == values[i].get<double>());
    else
      CHECK(int_element(t, i) == values[i].get<int64_t>());
  }
}

// A fresh folder under the system temp dir, removed with everything in it.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "troupe_safetensors_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path operator/(const std::string& name) const { return path / name; }
};

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// A file with this header text and `data_size` data bytes (a counting pattern).
fs::path make_file(const fs::path& path, const std::string& header, size_t data_size) {
  std::string data(data_size, '\0');
  for (size_t i = 0; i < data_size; ++i) data[i] = static_cast<char>(i);
  write_bytes(path, le64(header.size()) + header + data);
  return path;
}

// The call must throw troupe::Error whose message names `file` and contains `phrase`.
void check_error(const std::function<void()>& call, const fs::path& file, const std::string& phrase) {
  try {
    call();
    FAIL("no error thrown; expected one containing \"" << phrase << "\"");
  } catch (const troupe::Error& e) {
    std::string message = e.what();
    INFO("message: ", message);
    CHECK(message.find(file.string()) != std::string::npos);
    CHECK(message.find(phrase) != std::string::npos);
  }
}

void check_open_error(const fs::path& file, const std::string& phrase) {
  try {
    st::File::open(file);
    FAIL("no error thrown; expected one containing \"" << phrase << "\"");
  } catch (const troupe::Error& e) {
    std::string message = e.what();
    INFO("message: ", message);
    CHECK(message.starts_with(file.string() + ": "));
    CHECK(message.find(phrase) != std::string::npos);
  }
}

std::vector<st::TensorRef> refs_of(const std::vector<st::TensorView>& views) {
  std::vector<st::TensorRef> refs;
  for (const auto& v : views) refs.push_back({v.name, v.dtype, v.shape, v.data, v.nbytes});
  return refs;
}

std::string python_command() {
  auto src = troupe::test::source();
  return "'" + (src / ".venv" / "bin" / "python").string() + "' '" +
         (src / "tests" / "policy" / "make_safetensors_fixtures.py").string() + "'";
}

// What the reference reader (Python safetensors) sees in `path`, a file or a folder.
json python_dump(const fs::path& path, const fs::path& out) {
  std::string cmd = python_command() + " --dump '" + path.string() + "' '" + out.string() + "'";
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, "failed: " << cmd);
  return read_json(out);
}

}  // namespace

TEST_CASE("dtype names and sizes are the safetensors header's") {
  const std::pair<const char*, size_t> expected[] = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                                     {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  for (size_t i = 0; i < std::size(kAllDtypes); ++i) {
    CHECK(st::dtype_name(kAllDtypes[i]) == expected[i].first);
    CHECK(st::dtype_size(kAllDtypes[i]) == expected[i].second);
  }
}

TEST_CASE("File reads every dtype, shape and metadata written by Python safetensors") {
  const json expected = read_json(fixture_dir() / "dtypes.json");
  auto file = st::File::open(fixture_dir() / "dtypes.safetensors");

  CHECK(file->metadata() == expected["metadata"].get<std::map<std::string, std::string>>());
  REQUIRE(file->tensors().size() == expected["tensors"].size());
  for (const auto& [name, record] : expected["tensors"].items()) {
    const st::TensorView* t = file->find(name);
    REQUIRE_MESSAGE(t, "missing " << name);
    check_tensor(*t, record);
    CHECK(&file->at(name) == t);
  }
  CHECK(file->find("nope") == nullptr);
  check_error([&] { file->at("nope"); }, fixture_dir() / "dtypes.safetensors", "no tensor 'nope'");

  // Views lie in the mapping, back to back in data-offset order, ending at the file's end.
  const auto& ts = file->tensors();
  for (size_t i = 1; i < ts.size(); ++i) CHECK(ts[i - 1].data + ts[i - 1].nbytes == ts[i].data);
  const std::string raw = read_bytes(fixture_dir() / "dtypes.safetensors");
  CHECK(std::memcmp(ts.back().data + ts.back().nbytes - 4, raw.data() + raw.size() - 4, 4) == 0);

  const auto& empty = file->at("empty");
  CHECK(empty.nbytes == 0);
  CHECK(empty.shape == std::vector<int64_t>{0, 3});
  CHECK(file->at("scalar").shape.empty());
}

TEST_CASE("a file with no tensors is valid") {
  auto python = st::File::open(fixture_dir() / "no_tensors.safetensors");
  CHECK(python->tensors().empty());
  CHECK(python->metadata().empty());

  TempDir tmp;
  st::write_file(tmp / "empty.safetensors", {}, {});
  CHECK(read_bytes(tmp / "empty.safetensors") == le64(8) + "{}      ");
  CHECK(st::File::open(tmp / "empty.safetensors")->tensors().empty());
  make_file(tmp / "bare.safetensors", "{}", 0);
  CHECK(st::File::open(tmp / "bare.safetensors")->tensors().empty());
}

TEST_CASE("Checkpoint reads sharded and single-file folders saved by transformers") {
  const json expected = read_json(fixture_dir() / "model.json");
  for (const char* folder : {"sharded", "single"}) {
    INFO("folder ", folder);
    auto ckpt = st::Checkpoint::open_dir(fixture_dir() / folder);
    std::vector<std::string> names;
    for (const auto& [name, record] : expected["tensors"].items()) names.push_back(name);
    std::sort(names.begin(), names.end());
    CHECK(ckpt.names() == names);
    for (const auto& [name, record] : expected["tensors"].items()) check_tensor(ckpt.at(name), record);
    CHECK(ckpt.files().size() == (std::string(folder) == "sharded" ? 3u : 1u));
    CHECK(ckpt.find("model.missing") == nullptr);
    check_error([&] { ckpt.at("model.missing"); }, fixture_dir() / folder, "no tensor 'model.missing'");
  }
  // Every tensor is found in the shard the index names.
  auto ckpt = st::Checkpoint::open_dir(fixture_dir() / "sharded");
  for (const auto& [name, shard] : expected["index"]["weight_map"].items()) {
    bool found = false;
    for (const auto& f : ckpt.files())
      if (f->path().filename() == shard.get<std::string>()) found = f->find(name) == &ckpt.at(name);
    CHECK_MESSAGE(found, name);
  }
}

TEST_CASE("write_file round-trips every dtype through File") {
  auto source = st::File::open(fixture_dir() / "dtypes.safetensors");
  const json expected = read_json(fixture_dir() / "dtypes.json");
  auto refs = refs_of(source->tensors());
  std::reverse(refs.begin(), refs.end());  // an order unlike Python's, kept as given

  TempDir tmp;
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"step", "12"}, {"note", "h\u00e9llo"}};
  st::write_file(tmp / "out.safetensors", refs, metadata);
  CHECK_FALSE(fs::exists(tmp / "out.safetensors.tmp"));

  const std::string raw = read_bytes(tmp / "out.safetensors");
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  CHECK(header_len % 8 == 0);

  auto back = st::File::open(tmp / "out.safetensors");
  CHECK(back->metadata() == metadata);
  REQUIRE(back->tensors().size() == refs.size());
  for (size_t i = 0; i < refs.size(); ++i) CHECK(back->tensors()[i].name == refs[i].name);
  for (const auto& [name, record] : expected["tensors"].items()) check_tensor(back->at(name), record);

  // Writing over a file that is still mapped leaves the old mapping intact.
  const std::string before = hex(back->at("f32").data, back->at("f32").nbytes);
  st::write_file(tmp / "out.safetensors", std::span(refs).first(1));
  CHECK(hex(back->at("f32").data, back->at("f32").nbytes) == before);
  CHECK(st::File::open(tmp / "out.safetensors")->tensors().size() == 1);
  CHECK(st::File::open(tmp / "out.safetensors")->metadata() == std::map<std::string, std::string>{{"format", "pt"}});
}

TEST_CASE("write_dir shards exactly like transformers' save_pretrained") {
  const json expected = read_json(fixture_dir() / "model.json");
  auto source = st::Checkpoint::open_dir(fixture_dir() / "sharded");
  std::vector<st::TensorRef> refs;
  for (const auto& name : expected["order"]) refs.push_back(refs_of({source.at(name.get<std::string>())}).front());

  TempDir tmp;
  const fs::path dir = tmp / "nested" / "ckpt";  // made if missing
  st::write_dir(dir, refs, expected["max_shard_bytes"].get<size_t>());

  const json index = read_json(dir / "model.safetensors.index.json");
  CHECK(index["weight_map"] == expected["index"]["weight_map"]);
  CHECK(index["metadata"]["total_size"] == expected["index"]["metadata"]["total_size"]);
  for (const auto& name :
       {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"})
    CHECK_MESSAGE(fs::exists(dir / name), name);
  CHECK_FALSE(fs::exists(dir / "model.safetensors"));
  // Same layout as transformers' json.dumps(index, indent=2, sort_keys=True) + "\n".
  CHECK(read_bytes(dir / "model.safetensors.index.json") == index.dump(2) + "\n");

  auto back = st::Checkpoint::open_dir(dir);
  CHECK(back.names() == source.names());
  for (const auto& [name, record] : expected["tensors"].items()) check_tensor(back.at(name), record);

  SUBCASE("under the limit: one model.safetensors, and the old shards and index are gone") {
    st::write_dir(dir, refs);
    CHECK(fs::exists(dir / "model.safetensors"));
    CHECK_FALSE(fs::exists(dir / "model.safetensors.index.json"));
    CHECK_FALSE(fs::exists(dir / "model-00001-of-00003.safetensors"));
    auto single = st::Checkpoint::open_dir(dir);
    CHECK(single.files().size() == 1);
    CHECK(single.files().front()->metadata() == std::map<std::string, std::string>{{"format", "pt"}});
    for (const auto& [name, record] : expected["tensors"].items()) check_tensor(single.at(name), record);
  }
  SUBCASE("a tensor over the limit gets a shard of its own, before the one being filled") {
    // huggingface_hub's rule: sizes 8, 20, 8 with limit 10 give shards [20], [8], [8].
    std::vector<float> a(2, 1.f), big(5, 2.f), c(2, 3.f);
    std::vector<st::TensorRef> three{{"a", st::Dtype::F32, {2}, a.data(), 8},
                                     {"big", st::Dtype::F32, {5}, big.data(), 20},
                                     {"c", st::Dtype::F32, {2}, c.data(), 8}};
    st::write_dir(dir, three, 10);
    const json idx = read_json(dir / "model.safetensors.index.json");
    CHECK(idx["weight_map"] == json{{"big", "model-00001-of-00003.safetensors"},
                                    {"a", "model-00002-of-00003.safetensors"},
                                    {"c", "model-00003-of-00003.safetensors"}});
    CHECK(idx["metadata"]["total_size"] == 36);
    CHECK(st::Checkpoint::open_dir(dir).names() == std::vector<std::string>{"a", "big", "c"});
  }
}

TEST_CASE("files and folders written by troupe load in Python safetensors") {
  const json expected_dtypes = read_json(fixture_dir() / "dtypes.json");
  const json expected_model = read_json(fixture_dir() / "model.json");
  auto dtypes = st::File::open(fixture_dir() / "dtypes.safetensors");
  auto model = st::Checkpoint::open_dir(fixture_dir() / "sharded");

  TempDir tmp;
  st::write_file(tmp / "dtypes.safetensors", refs_of(dtypes->tensors()), {{"format", "pt"}, {"by", "troupe"}});
  json seen = python_dump(tmp / "dtypes.safetensors", tmp / "dtypes.json");
  CHECK(seen["metadata"] == json{{"format", "pt"}, {"by", "troupe"}});
  CHECK(seen["tensors"] == expected_dtypes["tensors"]);

  std::vector<st::TensorRef> refs;
  for (const auto& name : expected_model["order"]) refs.push_back(refs_of({model.at(name.get<std::string>())}).front());
  st::write_dir(tmp / "sharded", refs, expected_model["max_shard_bytes"].get<size_t>());
  seen = python_dump(tmp / "sharded", tmp / "sharded.json");
  CHECK(seen["tensors"] == expected_model["tensors"]);
  CHECK(seen["shard_of"] == expected_model["index"]["weight_map"]);
  CHECK(seen["metadata"] == json{{"format", "pt"}});
}

TEST_CASE("write_file and write_dir reject bad tensors and write nothing") {
  TempDir tmp;
  std::vector<float> six(6, 1.f);
  const fs::path out = tmp / "bad.safetensors";
  auto write_one = [&](st::TensorRef ref) { return [&, ref] { st::write_file(out, std::span(&ref, 1)); }; };

  check_error(write_one({"w", st::Dtype::F32, {2, 3}, six.data(), 20}), out,
              "tensor 'w' has 20 bytes but shape [2, 3] of F32 needs 24");
  check_error(write_one({"w", st::Dtype::F32, {-2, 3}, six.data(), 24}), out, "tensor 'w' has shape [-2, 3]");
  check_error(write_one({"w", st::Dtype::F32, {int64_t(1) << 62, 8}, six.data(), 24}), out, "overflowing");
  check_error(write_one({"__metadata__", st::Dtype::F32, {6}, six.data(), 24}), out, "reserved");
  check_error(write_one({"w", st::Dtype::F32, {6}, nullptr, 24}), out, "no data pointer");

  std::vector<st::TensorRef> twice{{"w", st::Dtype::F32, {6}, six.data(), 24},
                                   {"w", st::Dtype::F32, {6}, six.data(), 24}};
  check_error([&] { st::write_file(out, twice); }, out, "tensor 'w' appears twice");
  check_error([&] { st::write_dir(tmp / "dir", twice, 30); }, tmp / "dir", "tensor 'w' appears twice");
  CHECK_FALSE(fs::exists(out));
  CHECK_FALSE(fs::exists(tmp / "dir" / "model-00001-of-00002.safetensors"));

  check_error([&] { st::write_file(tmp / "no" / "such" / "dir.safetensors", {}); },
              tmp / "no" / "such" / "dir.safetensors", "cannot create");
}

TEST_CASE("File::open names the file and the problem for every kind of broken file") {
  TempDir tmp;
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  auto entry = [](const std::string& body) { return R"({"w":)" + body + "}"; };

  SUBCASE("the valid baseline opens") {
    CHECK(st::File::open(make_file(tmp / "ok.safetensors", ok, 8))->tensors().size() == 1);
  }
  SUBCASE("missing file") { check_open_error(tmp / "absent.safetensors", "cannot open"); }
  SUBCASE("a folder") { check_open_error(tmp.path, "not a regular file"); }
  SUBCASE("empty and too-short files") {
    write_bytes(tmp / "zero.safetensors", "");
    check_open_error(tmp / "zero.safetensors", "too short");
    write_bytes(tmp / "five.safetensors", std::string("\x08\0\0\0\0", 5));
    check_open_error(tmp / "five.safetensors", "too short");
  }
  SUBCASE("header length past the end of the file") {
    write_bytes(tmp / "long.safetensors", le64(100) + "{}");
    check_open_error(tmp / "long.safetensors", "header length 100 runs past the end of the file");
    write_bytes(tmp / "huge.safetensors", le64(~uint64_t{0}) + "{}");
    check_open_error(tmp / "huge.safetensors", "runs past the end of the file");
  }
  SUBCASE("truncated copies of a real file") {
    const std::string raw = read_bytes(fixture_dir() / "dtypes.safetensors");
    write_bytes(tmp / "cut_data.safetensors", raw.substr(0, raw.size() - 3));
    check_open_error(tmp / "cut_data.safetensors", "past the end of the data section");
    write_bytes(tmp / "cut_header.safetensors", raw.substr(0, 40));
    check_open_error(tmp / "cut_header.safetensors", "runs past the end of the file");
  }
  SUBCASE("invalid JSON") {
    check_open_error(make_file(tmp / "j1.safetensors", R"({"w": {"dtype": "F32",)", 0), "not valid JSON");
    check_open_error(make_file(tmp / "j2.safetensors", "", 8), "not valid JSON");
    check_open_error(make_file(tmp / "j3.safetensors", "{\"\xff\": 1}", 0), "not valid JSON");
    check_open_error(make_file(tmp / "j4.safetensors", "[1, 2]", 0), "not a JSON object");
  }
  SUBCASE("entries missing a field or of the wrong JSON type") {
    check_open_error(make_file(tmp / "a.safetensors", entry(R"({"shape":[2],"data_offsets":[0,8]})"), 8),
                     "tensor 'w' is missing \"dtype\"");
    check_open_error(make_file(tmp / "b.safetensors", entry(R"({"dtype":"F32","data_offsets":[0,8]})"), 8),
                     "tensor 'w' is missing \"shape\"");
    check_open_error(make_file(tmp / "c.safetensors", entry(R"({"dtype":"F32","shape":[2]})"), 8),
                     "tensor 'w' is missing \"data_offsets\"");
    check_open_error(make_file(tmp / "d.safetensors", entry("[1]"), 8), "tensor 'w' is not a JSON object");
    check_open_error(make_file(tmp / "e.safetensors", entry(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})"), 8),
                     "\"dtype\" must be a string");
    check_open_error(make_file(tmp / "f.safetensors", entry(R"({"dtype":"F32","shape":"2","data_offsets":[0,8]})"), 8),
                     "\"shape\" must be an array");
    check_open_error(
        make_file(tmp / "g.safetensors", entry(R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})"), 8),
        "non-negative integers");
    check_open_error(make_file(tmp / "h.safetensors", entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0]})"), 8),
                     "\"data_offsets\" must be [begin, end]");
    check_open_error(
        make_file(tmp / "i.safetensors", entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0,"8"]})"), 8),
        "\"data_offsets\" must be [begin, end]");
    check_open_error(make_file(tmp / "k.safetensors", entry(R"({"dtype":"F32","shape":[2],"data_offsets":[-1,8]})"), 8),
                     "\"data_offsets\" must be [begin, end]");
    check_open_error(make_file(tmp / "m.safetensors", R"({"__metadata__":{"format":1}})", 0),
                     "\"__metadata__\" value for 'format' is not a string");
    check_open_error(make_file(tmp / "n.safetensors", R"({"__metadata__":"pt"})", 0),
                     "\"__metadata__\" must be an object");
  }
  SUBCASE("deeply nested JSON in a field (found by tests/fuzz/)") {
    // The message quoted the field with dump(), which recurses once per level: 16k levels overflowed the stack.
    const fs::path path = troupe::test::source() / "tests/fuzz/regressions/safetensors/deep_data_offsets.safetensors";
    check_open_error(path, "tensor 't': \"data_offsets\" must be [begin, end] with non-negative integers, not an array of 1");
  }
  SUBCASE("unknown dtype") {
    check_open_error(
        make_file(tmp / "dt.safetensors", entry(R"({"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]})"), 2),
        "tensor 'w' has unknown dtype 'F8_E4M3'");
  }
  SUBCASE("negative dimension") {
    check_open_error(
        make_file(tmp / "neg.safetensors", entry(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), 8),
        "tensor 'w' has a negative dimension (-2)");
  }
  SUBCASE("shape product overflow") {
    // 2^32 * 2^32 * 4 wraps to 0 in 64 bits, which would match these empty offsets.
    check_open_error(make_file(tmp / "ovf.safetensors",
                               entry(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]})"), 0),
                     "overflows");
  }
  SUBCASE("data_offsets that end before they begin or run past the data") {
    check_open_error(make_file(tmp / "rev.safetensors", entry(R"({"dtype":"U8","shape":[0],"data_offsets":[8,4]})"), 8),
                     "end before they begin");
    check_open_error(
        make_file(tmp / "out.safetensors", entry(R"({"dtype":"F32","shape":[2],"data_offsets":[4,12]})"), 8),
        "tensor 'w' has data_offsets [4,12] past the end of the data section (8 bytes");
  }
  SUBCASE("byte size that does not match the shape") {
    check_open_error(
        make_file(tmp / "size.safetensors", entry(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), 8),
        "tensor 'w' holds 8 bytes but shape [3] of F32 needs 12 (size mismatch)");
  }
  SUBCASE("overlapping tensors") {
    const std::string h =
        R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
    check_open_error(make_file(tmp / "overlap.safetensors", h, 12),
                     "tensor 'b' (bytes 4..12) overlaps tensor 'a' (bytes 0..8)");
    const std::string same =
        R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})";
    check_open_error(make_file(tmp / "alias.safetensors", same, 8), "overlaps");
  }
  SUBCASE("holes and trailing bytes, which the safetensors crate rejects too") {
    const std::string gap =
        R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
    check_open_error(make_file(tmp / "gap.safetensors", gap, 12), "4 unused bytes (a gap) before tensor 'b'");
    check_open_error(make_file(tmp / "tail.safetensors", ok, 9), "1 unused bytes after the last tensor");
  }
  SUBCASE("a tensor named twice") {
    const std::string h =
        R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
    check_open_error(make_file(tmp / "dup.safetensors", h, 8), "tensor 'w' appears twice");
  }
  SUBCASE("zero-size tensors anywhere are fine") {
    const std::string h =
        R"({"z0":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
        R"("z1":{"dtype":"BF16","shape":[3,0],"data_offsets":[8,8]},"x":{"dtype":"U8","shape":[1],"data_offsets":[8,9]}})";
    auto f = st::File::open(make_file(tmp / "zeros.safetensors", h, 9));
    std::vector<std::string> names;
    for (const auto& t : f->tensors()) names.push_back(t.name);
    CHECK(names == std::vector<std::string>{"z0", "w", "z1", "x"});
    CHECK(f->at("x").nbytes == 1);
    CHECK(static_cast<int>(f->at("x").data[0]) == 8);
  }
}

TEST_CASE("Checkpoint::open_dir names the folder or index and the problem") {
  TempDir tmp;
  const fs::path dir = tmp / "ckpt";
  fs::copy(fixture_dir() / "sharded", dir);
  const fs::path index_path = dir / "model.safetensors.index.json";
  json index = read_json(index_path);
  auto write_index = [&](const json& j) { write_bytes(index_path, j.dump(2)); };
  auto open = [&] { st::Checkpoint::open_dir(dir); };

  SUBCASE("an empty folder") {
    fs::create_directory(tmp / "empty");
    check_error([&] { st::Checkpoint::open_dir(tmp / "empty"); }, tmp / "empty",
                "no model.safetensors or model.safetensors.index.json in");
  }
  SUBCASE("a folder that does not exist") {
    check_error([&] { st::Checkpoint::open_dir(tmp / "nowhere"); }, tmp / "nowhere", "no model.safetensors");
  }
  SUBCASE("index naming a tensor its shard lacks") {
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00003.safetensors";
    write_index(index);
    check_error(open, index_path, "tensor 'model.ghost.weight' is listed in shard 'model-00001-of-00003.safetensors'");
  }
  SUBCASE("index naming a tensor that lives in another shard") {
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors";
    write_index(index);
    check_error(open, index_path, "tensor 'lm_head.weight' is listed in shard");
  }
  SUBCASE("index naming a missing shard") {
    fs::remove(dir / "model-00002-of-00003.safetensors");
    check_error(open, index_path, "names shard 'model-00002-of-00003.safetensors'");
  }
  SUBCASE("index pointing outside the folder") {
    index["weight_map"]["lm_head.weight"] = "../model-00003-of-00003.safetensors";
    write_index(index);
    check_error(open, index_path, "not a file name in this folder");
  }
  SUBCASE("a shard name with a NUL byte, which opened the name before the NUL (a tests/fuzz/ reproducer)") {
    // The reproducer is fuzz_safetensors_index's input: the index, NUL, the shard's header, whose
    // one tensor takes 3 data bytes. Written as the harness writes it, the shard is there to open.
    const std::string input =
        read_bytes(troupe::test::source() / "tests/fuzz/regressions/safetensors_index/shard_name_with_nul");
    const size_t nul = input.find('\0');
    REQUIRE(nul != std::string::npos);
    write_bytes(index_path, input.substr(0, nul));
    make_file(dir / "model-00001-of-00002.safetensors", input.substr(nul + 1), 3);
    check_error(open, index_path,
                "weight_map sends tensor 'w' to \"model-00001-of-00002.safetensors\\u0000x\", which is not a file name "
                "in this folder");
  }
  SUBCASE("invalid or incomplete index") {
    write_bytes(index_path, "{\"weight_map\": {");
    check_error(open, index_path, "not valid JSON");
    write_index(json{{"metadata", {{"total_size", 1}}}});
    check_error(open, index_path, "no \"weight_map\"");
    write_index(json{{"weight_map", {{"lm_head.weight", 3}}}});
    check_error(open, index_path, "weight_map entry for tensor 'lm_head.weight' is not a file name");
  }
  SUBCASE("a tensor in two shards") {
    auto shard3 = st::File::open(dir / "model-00003-of-00003.safetensors");
    auto shard2 = st::File::open(dir / "model-00002-of-00003.safetensors");
    auto refs = refs_of(shard2->tensors());
    refs.push_back(refs_of(shard3->tensors()).front());  // lm_head.weight
    st::write_file(dir / "model-00002-of-00003.safetensors", refs);
    check_error(open, index_path, "tensor 'lm_head.weight' is in two shards");
  }
  SUBCASE("a corrupt shard names the shard") {
    const fs::path shard = dir / "model-00002-of-00003.safetensors";
    const std::string raw = read_bytes(shard);
    write_bytes(shard, raw.substr(0, raw.size() / 2));
    check_error(open, shard, "past the end of the data section");
  }
  SUBCASE("tensors a shard holds beyond its index entries are still readable") {
    REQUIRE(index["weight_map"]["model.norm.weight"] == "model-00002-of-00003.safetensors");
    index["weight_map"].erase("model.norm.weight");
    write_index(index);
    CHECK(st::Checkpoint::open_dir(dir).find("model.norm.weight") != nullptr);
  }
}
