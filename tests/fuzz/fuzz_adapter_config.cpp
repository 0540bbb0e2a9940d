// read_adapter_config on arbitrary adapter_config.json text (PEFT's LoRA settings): an accepted
// config passes LoraConfig::validate, which attach and save rely on, and scales by a finite factor.
#include <cmath>
#include <string>

#include "policy/error.hpp"
#include "policy/lora_config.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static troupe::fuzz::MemFile file("adapter_config.json");
  troupe::LoraConfig c;
  try {
    c = troupe::read_adapter_config(file.write(data, size));
  } catch (const troupe::Error&) {
    return 0;
  }
  try {
    c.validate();
  } catch (const troupe::Error& e) {
    fail(std::string("an accepted adapter config does not validate: ") + e.what());
  }
  // The adapter's term is multiplied by scale() in every forward pass.
  if (!std::isfinite(c.scale())) fail("scale() is not finite for r = " + std::to_string(c.rank));
  return 0;
}
