// safetensors: validates and memory-maps files, writes files and sharded folders the way
// transformers does. It never converts dtypes or copies tensor bytes on read.
#include "policy/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <system_error>
#include <tuple>
#include <utility>

#include "policy/error.hpp"

namespace troupe::safetensors {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr std::string_view kSingleName = "model.safetensors";
constexpr std::string_view kIndexName = "model.safetensors.index.json";
constexpr std::string_view kMetadataKey = "__metadata__";

struct DtypeInfo {
  Dtype dtype;
  std::string_view name;
  size_t size;
};
constexpr std::array<DtypeInfo, 10> kDtypes{{
    {Dtype::F64, "F64", 8},
    {Dtype::F32, "F32", 4},
    {Dtype::F16, "F16", 2},
    {Dtype::BF16, "BF16", 2},
    {Dtype::I64, "I64", 8},
    {Dtype::I32, "I32", 4},
    {Dtype::I16, "I16", 2},
    {Dtype::I8, "I8", 1},
    {Dtype::U8, "U8", 1},
    {Dtype::BOOL, "BOOL", 1},
}};

const DtypeInfo& info(Dtype dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d;
  throw Error("safetensors: invalid Dtype value " + std::to_string(static_cast<int>(dtype)));
}

std::optional<Dtype> parse_dtype(std::string_view name) {
  for (const auto& d : kDtypes)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

std::string known_dtypes() {
  std::string s;
  for (const auto& d : kDtypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

Error error(const fs::path& path, const std::string& what) { return Error(path.string() + ": " + what); }

std::string squote(std::string_view name) { return "'" + std::string(name) + "'"; }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Element count times dtype size; nullopt on overflow, so a hostile header cannot wrap
// the product around into a size that happens to match its offsets.
std::optional<size_t> byte_size(const std::vector<int64_t>& shape, size_t elem_size) {
  size_t n = elem_size;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, static_cast<size_t>(d), &n)) return std::nullopt;
  return n;
}

// A header value for a message: short flat values as JSON, anything else by its type and size.
// (dump() recurses once per level of nesting: a header of 100k '[' would overflow the stack.)
std::string brief(const json& j) {
  const bool flat = !j.is_structured() || (j.size() <= 8 && std::all_of(j.begin(), j.end(), [](const json& x) {
                                             return x.is_primitive();
                                           }));
  if (!flat) return std::string(j.is_array() ? "an array" : "an object") + " of " + std::to_string(j.size());
  std::string s = j.dump();
  return s.size() <= 80 ? s : s.substr(0, 77) + "...";
}

// A non-negative JSON integer that fits in int64 (so it is also a valid shape dim or offset).
std::optional<uint64_t> as_count(const json& j) {
  if (j.is_number_unsigned() && j.get<uint64_t>() <= uint64_t(INT64_MAX)) return j.get<uint64_t>();
  return std::nullopt;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw error(path, std::string("cannot open: ") + std::strerror(errno));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw error(path, std::string("cannot read: ") + std::strerror(errno));
  return s;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

void write_all(int fd, const void* data, size_t n, const fs::path& path) {
  auto p = static_cast<const char*>(data);
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; larger tensors take several.
    ssize_t k = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (k < 0) {
      if (errno == EINTR) continue;
      throw error(path, std::string("cannot write: ") + std::strerror(errno));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

// Writes through "<path>.tmp" and renames, so readers (and a File that still maps the old
// file) see either the old or the new file, whole. fsync before rename so that a power
// loss cannot leave the new name pointing at unwritten blocks.
template <typename WriteBody>
void write_atomically(const fs::path& path, WriteBody&& body) {
  fs::path tmp = path;
  tmp += ".tmp";
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw error(path, std::string("cannot create ") + tmp.string() + ": " + std::strerror(errno));
  try {
    body(fd.get(), tmp);
    if (::fsync(fd.get()) != 0) throw error(tmp, std::string("cannot sync: ") + std::strerror(errno));
    if (::close(fd.release()) != 0) throw error(tmp, std::string("cannot close: ") + std::strerror(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw error(path, std::string("cannot rename ") + tmp.string() + " to it: " + std::strerror(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

void write_text(const fs::path& path, const std::string& text) {
  write_atomically(path, [&](int fd, const fs::path& tmp) { write_all(fd, text.data(), text.size(), tmp); });
}

// Everything write_file would reject, checked before a byte is written, so that write_dir
// does not leave half a set of shards behind.
void validate(const fs::path& path, std::span<const TensorRef> tensors) {
  std::set<std::string_view> names;
  for (const TensorRef& t : tensors) {
    const std::string where = "tensor " + squote(t.name);
    if (t.name == kMetadataKey) throw error(path, where + " uses the name reserved for metadata");
    if (!names.insert(t.name).second) throw error(path, where + " appears twice (duplicate name)");
    auto expected = byte_size(t.shape, dtype_size(t.dtype));
    if (!expected)
      throw error(path, where + " has shape " + shape_str(t.shape) + " with a negative or overflowing dimension");
    if (t.nbytes != *expected)
      throw error(path, where + " has " + std::to_string(t.nbytes) + " bytes but shape " + shape_str(t.shape) + " of " +
                            std::string(dtype_name(t.dtype)) + " needs " + std::to_string(*expected));
    if (t.nbytes && !t.data) throw error(path, where + " has no data pointer");
  }
}

std::string shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

// Removes what an earlier write_dir left in `dir` that the new checkpoint does not use, so
// that open_dir cannot pick up a stale index or shard. Only names write_dir itself makes.
void remove_stale(const fs::path& dir, const std::set<std::string>& keep) {
  static const std::regex shard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    bool ours = name == kSingleName || name == kIndexName || std::regex_match(name, shard);
    if (ours && !keep.count(name)) fs::remove(entry.path(), ec);
  }
}

}  // namespace

size_t dtype_size(Dtype dtype) { return info(dtype).size; }
std::string_view dtype_name(Dtype dtype) { return info(dtype).name; }

// ---------------------------------------------------------------------------------------
// File

std::shared_ptr<const File> File::open(const fs::path& path) {
  std::shared_ptr<File> file(new File());
  file->path_ = path;

  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw error(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw error(path, std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw error(path, "not a regular file");
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8)
    throw error(path, "file is " + std::to_string(size) +
                          " bytes, too short for a safetensors header (needs at least 8; truncated?)");

  // Bytes are mapped, not read: a checkpoint costs no memory until its tensors are used.
  // A file truncated by someone else while mapped would fault on access; our own writer
  // never does that, it renames a new file over the old one.
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) throw error(path, std::string("cannot mmap: ") + std::strerror(errno));
  file->map_ = map;
  file->map_size_ = size;
  const auto* bytes = static_cast<const unsigned char*>(map);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > size - 8)
    throw error(path, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                          std::to_string(size) + " bytes; truncated or not a safetensors file?)");
  const char* header_begin = reinterpret_cast<const char*>(bytes + 8);
  const std::byte* data = reinterpret_cast<const std::byte*>(bytes + 8 + header_len);
  const size_t data_size = size - 8 - header_len;

  // nlohmann keeps the last of duplicate keys silently; a tensor named twice is a broken file.
  std::string duplicate;
  auto find_duplicates = [seen = std::set<std::string>(), &duplicate](int depth, json::parse_event_t event,
                                                                      json& parsed) mutable {
    if (event == json::parse_event_t::key && depth == 1 && !seen.insert(parsed.get<std::string>()).second &&
        duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    header = json::parse(header_begin, header_begin + header_len, find_duplicates);
  } catch (const json::exception& e) {
    throw error(path, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw error(path, "header is not a JSON object");
  if (!duplicate.empty()) throw error(path, "tensor " + squote(duplicate) + " appears twice in the header");

  struct Span {
    size_t index;
    uint64_t begin, end;
  };
  std::vector<Span> spans;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) throw error(path, "\"__metadata__\" must be an object of strings");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) throw error(path, "\"__metadata__\" value for " + squote(key) + " is not a string");
        file->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor " + squote(name);
    if (!entry.is_object()) throw error(path, where + " is not a JSON object");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(field)) throw error(path, where + " is missing \"" + field + "\"");

    const json& dtype_j = entry["dtype"];
    if (!dtype_j.is_string()) throw error(path, where + ": \"dtype\" must be a string");
    auto dtype = parse_dtype(dtype_j.get<std::string>());
    if (!dtype)
      throw error(path, where + " has unknown dtype " + squote(dtype_j.get<std::string>()) + " (troupe reads " +
                            known_dtypes() + ")");

    const json& shape_j = entry["shape"];
    if (!shape_j.is_array()) throw error(path, where + ": \"shape\" must be an array of integers");
    std::vector<int64_t> shape;
    for (const json& d : shape_j) {
      if (d.is_number_integer() && !d.is_number_unsigned())
        throw error(path, where + " has a negative dimension (" + brief(d) + ") in its shape " + brief(shape_j));
      auto n = as_count(d);
      if (!n) throw error(path, where + ": shape " + brief(shape_j) + " must hold non-negative integers");
      shape.push_back(static_cast<int64_t>(*n));
    }

    const json& offsets_j = entry["data_offsets"];
    std::optional<uint64_t> begin, end;
    if (offsets_j.is_array() && offsets_j.size() == 2) {
      begin = as_count(offsets_j[0]);
      end = as_count(offsets_j[1]);
    }
    if (!begin || !end)
      throw error(
          path, where + ": \"data_offsets\" must be [begin, end] with non-negative integers, not " + brief(offsets_j));
    if (*begin > *end)
      throw error(path, where + " has data_offsets " + brief(offsets_j) + " that end before they begin");
    if (*end > data_size)
      throw error(path, where + " has data_offsets " + brief(offsets_j) + " past the end of the data section (" +
                            std::to_string(data_size) + " bytes; truncated?)");

    auto expected = byte_size(shape, info(*dtype).size);
    if (!expected) throw error(path, where + " has shape " + brief(shape_j) + " whose byte size overflows");
    const size_t nbytes = *end - *begin;
    if (nbytes != *expected)
      throw error(path, where + " holds " + std::to_string(nbytes) + " bytes but shape " + brief(shape_j) + " of " +
                            std::string(dtype_name(*dtype)) + " needs " + std::to_string(*expected) +
                            " (size mismatch)");

    spans.push_back({file->tensors_.size(), *begin, *end});
    file->tensors_.push_back({name, *dtype, std::move(shape), data + *begin, nbytes});
  }

  // Like the Rust safetensors crate (and so every file Python can load), tensors must tile
  // the data section exactly: no overlaps, no holes, nothing after the last tensor. A hole
  // is harmless to read but only a broken or hand-edited writer makes one.
  std::sort(spans.begin(), spans.end(), [&](const Span& a, const Span& b) {
    return std::tie(a.begin, a.end, file->tensors_[a.index].name) <
           std::tie(b.begin, b.end, file->tensors_[b.index].name);
  });
  uint64_t cursor = 0;
  const Span* previous = nullptr;
  auto describe = [&](const Span& s) {
    return squote(file->tensors_[s.index].name) + " (bytes " + std::to_string(s.begin) + ".." + std::to_string(s.end) +
           ")";
  };
  for (const Span& s : spans) {
    if (s.begin < cursor) throw error(path, "tensor " + describe(s) + " overlaps tensor " + describe(*previous));
    if (s.begin > cursor)
      throw error(path, std::to_string(s.begin - cursor) + " unused bytes (a gap) before tensor " + describe(s) +
                            "; tensors must tile the data section as the safetensors crate requires");
    cursor = s.end;
    previous = &s;
  }
  if (cursor != data_size)
    throw error(path, std::to_string(data_size - cursor) +
                          " unused bytes after the last tensor; tensors must tile the data section as the "
                          "safetensors crate requires");

  std::vector<TensorView> ordered;
  ordered.reserve(spans.size());
  for (const Span& s : spans) ordered.push_back(std::move(file->tensors_[s.index]));
  file->tensors_ = std::move(ordered);
  return file;
}

File::~File() {
  if (map_) ::munmap(map_, map_size_);
}

// Linear: files hold hundreds of tensors at most, and bulk lookups go through Checkpoint's map.
const TensorView* File::find(std::string_view name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const TensorView& File::at(std::string_view name) const {
  if (const auto* t = find(name)) return *t;
  throw error(path_, "no tensor " + squote(name) + " in this file");
}

// ---------------------------------------------------------------------------------------
// Checkpoint

Checkpoint Checkpoint::open_dir(const fs::path& dir) {
  Checkpoint ckpt;
  ckpt.dir_ = dir;
  const fs::path index_path = dir / kIndexName;
  const fs::path single_path = dir / kSingleName;

  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    if (!fs::exists(single_path, ec))
      throw Error("no model.safetensors or model.safetensors.index.json in " + dir.string());
    ckpt.files_.push_back(File::open(single_path));
    for (const auto& t : ckpt.files_.back()->tensors()) ckpt.by_name_.emplace(t.name, &t);
    return ckpt;
  }

  json index;
  try {
    index = json::parse(read_text(index_path));
  } catch (const json::exception& e) {
    throw error(index_path, std::string("not valid JSON (") + e.what() + ")");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw error(index_path, "has no \"weight_map\" object mapping tensor names to shard files");

  // "metadata" (total_size) is not checked: transformers versions count it differently
  // (tied weights, quantized storage), and the shards themselves are validated.
  // Shards in file-name order, so files() is the same on every run.
  std::map<std::string, std::vector<std::string>> tensors_by_shard;
  for (const auto& [tensor, shard_j] : index["weight_map"].items()) {
    if (!shard_j.is_string())
      throw error(index_path, "weight_map entry for tensor " + squote(tensor) + " is not a file name string");
    std::string shard = shard_j.get<std::string>();
    // A plain name in this folder: an index must not make us open files elsewhere. A NUL byte ends
    // the name the system sees (a name of a, NUL, b opened a), so the name is shown JSON-escaped.
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
        shard.find('\0') != std::string::npos)
      throw error(index_path, "weight_map sends tensor " + squote(tensor) + " to " + json(shard).dump() +
                                  ", which is not a file name in this folder");
    tensors_by_shard[shard].push_back(tensor);
  }

  std::map<std::string, std::string> shard_of;
  for (const auto& [shard, tensors] : tensors_by_shard) {
    const fs::path shard_path = dir / shard;
    if (!fs::exists(shard_path, ec))
      throw error(index_path, "weight_map names shard " + squote(shard) + " (for tensor " + squote(tensors.front()) +
                                  "), which is missing from " + dir.string());
    auto file = File::open(shard_path);
    for (const auto& tensor : tensors)
      if (!file->find(tensor))
        throw error(index_path, "tensor " + squote(tensor) + " is listed in shard " + squote(shard) +
                                    " but that file has no such tensor");
    // Tensors a shard holds beyond its weight_map entries are kept, as transformers loads
    // whole shards; only a name held by two shards is ambiguous.
    for (const auto& t : file->tensors()) {
      auto [it, inserted] = shard_of.emplace(t.name, shard);
      if (!inserted)
        throw error(index_path,
                    "tensor " + squote(t.name) + " is in two shards, " + squote(it->second) + " and " + squote(shard));
      ckpt.by_name_.emplace(t.name, &t);
    }
    ckpt.files_.push_back(std::move(file));
  }
  return ckpt;
}

const TensorView* Checkpoint::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

const TensorView& Checkpoint::at(std::string_view name) const {
  if (const auto* t = find(name)) return *t;
  throw error(dir_, "no tensor " + squote(name) + " in this checkpoint");
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(by_name_.size());
  for (const auto& [name, view] : by_name_) out.push_back(name);
  return out;
}

// ---------------------------------------------------------------------------------------
// Writing

void write_file(const fs::path& path, std::span<const TensorRef> tensors,
                const std::map<std::string, std::string>& metadata) {
  validate(path, tensors);
  // ordered_json: the header lists tensors in the order their bytes follow, which is what
  // a person reading it with `head -c` expects.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  uint64_t offset = 0;
  for (const TensorRef& t : tensors) {
    header[t.name] = {
        {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  std::string text = header.dump();
  // Padding to 8 keeps the data section 8-aligned in the file (and so in the mapping).
  text.append((8 - text.size() % 8) % 8, ' ');

  write_atomically(path, [&](int fd, const fs::path& tmp) {
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(uint64_t(text.size()) >> (8 * i));
    write_all(fd, len, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const TensorRef& t : tensors) write_all(fd, t.data, t.nbytes, tmp);
  });
}

void write_dir(const fs::path& dir, std::span<const TensorRef> tensors, size_t max_shard_bytes) {
  validate(dir, tensors);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw error(dir, "cannot create folder: " + ec.message());

  // huggingface_hub's split_state_dict_into_shards_factory, step for step, so a folder we
  // write shards exactly like save_pretrained: in the given order, a new shard when the
  // next tensor would tip over the limit, and a tensor larger than the limit alone in a
  // shard of its own, placed before the shard being filled.
  std::vector<std::vector<TensorRef>> shards;
  std::vector<TensorRef> current;
  size_t current_size = 0, total_size = 0;
  for (const TensorRef& t : tensors) {
    total_size += t.nbytes;
    if (t.nbytes > max_shard_bytes) {
      shards.push_back({t});
      continue;
    }
    if (current_size + t.nbytes > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(t);
    current_size += t.nbytes;
  }
  if (!current.empty()) shards.push_back(std::move(current));

  if (shards.size() <= 1) {
    write_file(dir / kSingleName, shards.empty() ? std::span<const TensorRef>{} : std::span(shards.front()));
    remove_stale(dir, {std::string(kSingleName)});
    return;
  }

  json weight_map = json::object();
  std::set<std::string> written{std::string(kIndexName)};
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shard_name(i + 1, shards.size());
    write_file(dir / name, shards[i]);
    for (const TensorRef& t : shards[i]) weight_map[t.name] = name;
    written.insert(name);
  }
  // Same layout as transformers: sorted keys, two-space indent, trailing newline. The index
  // goes last so that a reader never sees it before the shards it names.
  json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", std::move(weight_map)}};
  write_text(dir / kIndexName, index.dump(2) + "\n");
  remove_stale(dir, written);
}

}  // namespace troupe::safetensors
