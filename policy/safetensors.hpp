// safetensors files: a memory-mapped reader, a writer, and sharded checkpoint folders
// (model.safetensors.index.json). Plain bytes only: turning views into tensors is checkpoint.cpp's job.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::safetensors {

enum class Dtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

size_t dtype_size(Dtype dtype);
std::string_view dtype_name(Dtype dtype);  // the header's spelling: "F32", "BF16", ...

// One tensor inside a mapped file; `data` stays valid while the File lives. It need not be
// aligned for the dtype (offsets are packed), so read it with memcpy or copy it out.
struct TensorView {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  const std::byte* data;
  size_t nbytes;
};

// A memory-mapped .safetensors file, validated on open: header length within the file,
// known dtypes, offsets inside the data section, sizes that match the shapes, no overlaps.
// Every problem throws troupe::Error naming the file.
class File {
 public:
  static std::shared_ptr<const File> open(const std::filesystem::path& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<TensorView>& tensors() const { return tensors_; }  // in data-offset order
  const TensorView* find(std::string_view name) const;
  const TensorView& at(std::string_view name) const;  // throws naming the file and tensor
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  File() = default;
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint folder: `model.safetensors`, or the shards listed in
// `model.safetensors.index.json` (whose weight_map must agree with the shards' contents).
class Checkpoint {
 public:
  static Checkpoint open_dir(const std::filesystem::path& dir);

  const std::vector<std::shared_ptr<const File>>& files() const { return files_; }
  const TensorView* find(std::string_view name) const;
  const TensorView& at(std::string_view name) const;  // throws naming the folder and tensor
  std::vector<std::string> names() const;             // sorted

 private:
  std::filesystem::path dir_;
  std::vector<std::shared_ptr<const File>> files_;
  std::map<std::string, const TensorView*, std::less<>> by_name_;
};

// A tensor to write: the caller keeps `data` alive for the call.
struct TensorRef {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  const void* data;
  size_t nbytes;
};

// Writes one file (header padded to 8 bytes, tensors in the given order). The file is
// written to a temporary name and renamed, so a crash never leaves a half-written file.
void write_file(const std::filesystem::path& path, std::span<const TensorRef> tensors,
                const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Writes `model.safetensors` when everything fits in max_shard_bytes, else shards
// `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`, as transformers does.
void write_dir(const std::filesystem::path& dir, std::span<const TensorRef> tensors,
               size_t max_shard_bytes = size_t{5} << 30);

}  // namespace troupe::safetensors
