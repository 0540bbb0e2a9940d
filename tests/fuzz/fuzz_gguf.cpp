// gguf::File::open on arbitrary bytes, then what loading a model does with it: the Hugging Face
// config, tensor names, and dequantizing every tensor. Each either works or throws troupe::Error.
#include <cmath>

#include <nlohmann/json.hpp>

#include "policy/error.hpp"
#include "policy/gguf.hpp"
#include "tests/fuzz/fuzz_util.hpp"

namespace gguf = troupe::gguf;
using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("model.gguf");
  std::shared_ptr<const gguf::File> f;
  try {
    f = gguf::File::open(file.write(data, size));
  } catch (const troupe::Error&) {
    return 0;
  }
  try {
    (void)gguf::hf_config(*f).dump();
  } catch (const troupe::Error&) {
  }
  for (const gguf::TensorInfo& t : f->tensors()) {
    try {
      (void)gguf::hf_tensor_name(t.name);
    } catch (const troupe::Error&) {
    }
    if (t.nbytes > size) fail("tensor '" + t.name + "' is larger than the file");
    if (!gguf::dequantize_supported(t.type)) continue;
    std::vector<float> values;
    try {
      values = gguf::dequantize(t);
    } catch (const troupe::Error&) {
      continue;
    }
    if (values.size() != t.elements()) fail("tensor '" + t.name + "' dequantized to the wrong number of values");
    volatile float sink = 0;
    for (float v : values) sink = sink + v;  // reads every value
  }
  return 0;
}
