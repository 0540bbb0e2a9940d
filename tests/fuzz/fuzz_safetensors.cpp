// safetensors::File::open on arbitrary bytes: it either throws troupe::Error or returns views that
// tile the data section and hold exactly the file's bytes there.
#include <cstring>

#include "policy/error.hpp"
#include "policy/safetensors.hpp"
#include "tests/fuzz/fuzz_util.hpp"

namespace st = troupe::safetensors;
using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("model.safetensors");
  std::shared_ptr<const st::File> f;
  try {
    f = st::File::open(file.write(data, size));
  } catch (const troupe::Error&) {
    return 0;
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  size_t offset = 8 + header_len;
  for (const st::TensorView& t : f->tensors()) {
    size_t n = st::dtype_size(t.dtype);
    for (int64_t d : t.shape) n *= static_cast<size_t>(d);
    if (n != t.nbytes) fail("tensor '" + t.name + "': nbytes disagrees with its shape");
    if (t.nbytes > size - offset) fail("tensor '" + t.name + "' runs past the end of the file");
    if (t.nbytes && std::memcmp(t.data, data + offset, t.nbytes) != 0)
      fail("tensor '" + t.name + "' does not view the file's bytes at its offsets");
    if (f->find(t.name) == nullptr) fail("tensor '" + t.name + "' is not found by name");
    offset += t.nbytes;
  }
  if (offset != size) fail("the tensors do not tile the data section");
  return 0;
}
