// Checkpoint::open_dir on a sharded folder, model.safetensors.index.json and up to two shards: an
// accepted one reads each tensor the index names from the shard it names. Errors must be troupe::Error.
// Input: the index, NUL, the first shard's header JSON, NUL, the second's (a part left out: no file).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "tests/fuzz/fuzz_util.hpp"

namespace st = troupe::safetensors;
namespace fs = std::filesystem;
using json = nlohmann::json;
using troupe::fuzz::fail;

namespace {

constexpr const char* kShardNames[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
constexpr uint64_t kMaxData = uint64_t{1} << 16;

const fs::path& dir() { return troupe::fuzz::scratch_dir("safetensors_index"); }

void write(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A shard's data section is zeros, as many as its largest data_offsets end asks (up to 64 KiB): the
// index reader never looks at tensor bytes, and binary bytes could not sit between NUL separators.
// A header this cannot read gets none; judging it is open_dir's job.
uint64_t data_size(std::string_view header) {
  const json h = json::parse(header, nullptr, /*allow_exceptions=*/false);
  uint64_t end = 0;
  if (h.is_object())
    for (const auto& [name, entry] : h.items()) {
      if (!entry.is_object()) continue;
      const auto offsets = entry.find("data_offsets");
      if (offsets != entry.end() && offsets->is_array() && offsets->size() == 2 && (*offsets)[1].is_number_unsigned())
        end = std::max(end, (*offsets)[1].get<uint64_t>());
    }
  return end <= kMaxData ? end : 0;
}

void write_shard(const fs::path& path, std::string_view header) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(uint64_t(header.size()) >> (8 * i));
  bytes.append(header);
  bytes.append(data_size(header), '\0');
  write(path, bytes);
}

const st::File* holder(const st::Checkpoint& ckpt, const st::TensorView* t) {
  for (const auto& f : ckpt.files())
    for (const auto& mine : f->tensors())
      if (&mine == t) return f.get();
  return nullptr;
}

void check_accepted(const st::Checkpoint& ckpt, std::string_view index_text) {
  std::set<std::string> entries;
  for (const auto& e : fs::directory_iterator(dir())) entries.insert(e.path().filename().string());
  std::set<fs::path> opened;
  size_t tensors = 0;
  for (const auto& f : ckpt.files()) {
    if (f->path().parent_path() != dir() || !entries.count(f->path().filename().string()))
      fail("opened '" + f->path().string() + "', which is not a file in the checkpoint folder");
    if (!opened.insert(f->path()).second) fail("opened shard '" + f->path().string() + "' twice");
    tensors += f->tensors().size();
  }
  const auto names = ckpt.names();
  // Each tensor name must have one source: a name in two shards is ambiguous, not kept twice.
  if (names.size() != tensors) fail("the shards hold " + std::to_string(tensors) + " tensors, names() lists " +
                                     std::to_string(names.size()));
  for (const auto& name : names) {
    const st::TensorView* t = ckpt.find(name);
    if (!t || t->name != name || !holder(ckpt, t)) fail("tensor '" + name + "' is listed but not found in a shard");
  }
  const json index = json::parse(index_text, nullptr, /*allow_exceptions=*/false);
  for (const auto& [tensor, shard] : index.at("weight_map").items()) {
    const st::TensorView* t = ckpt.find(tensor);
    if (!t) fail("tensor '" + tensor + "' from the weight_map is not in the checkpoint");
    if (holder(ckpt, t)->path().filename().string() != shard.get<std::string>())
      fail("tensor '" + tensor + "' is read from '" + holder(ckpt, t)->path().string() + "', the weight_map says '" +
           shard.get<std::string>() + "'");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = troupe::fuzz::split_nul(data, size, 3);
  write(dir() / "model.safetensors.index.json", parts[0]);
  for (size_t i = 0; i < 2; ++i) {
    const fs::path shard = dir() / kShardNames[i];
    if (i + 1 < parts.size())
      write_shard(shard, parts[i + 1]);
    else
      fs::remove(shard);
  }
  std::optional<st::Checkpoint> ckpt;
  try {
    ckpt = st::Checkpoint::open_dir(dir());
  } catch (const troupe::Error&) {
    return 0;
  }
  check_accepted(*ckpt, parts[0]);
  return 0;
}
