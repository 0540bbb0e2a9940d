// The run config: parse_run_config on arbitrary YAML plus key=value overrides, then to_yaml and
// summary. A config that loads must load again from its to_yaml (runs/NAME/config.yaml says
// "run it again with troupe run" it), to the same text. Input: the YAML, then NUL-separated
// overrides. Errors must be troupe::Error.
#include <string>
#include <vector>

#include "actors/config.hpp"
#include "policy/error.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using troupe::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = troupe::fuzz::split_nul(data, size, 9);
  std::vector<std::string> overrides(parts.begin() + 1, parts.end());
  troupe::RunConfig c;
  try {
    c = troupe::parse_run_config(std::string(parts[0]), "fuzz.yaml", overrides);
  } catch (const troupe::Error&) {
    return 0;
  }
  const std::string yaml = troupe::to_yaml(c);
  (void)troupe::summary(c);
  troupe::RunConfig again;
  try {
    again = troupe::parse_run_config(yaml, "fuzz.yaml/config.yaml", {});
  } catch (const troupe::Error& e) {
    fail(std::string("to_yaml wrote a config that does not load again: ") + e.what() + "\n--- to_yaml:\n" + yaml);
  }
  if (!(again == c)) fail("the config reloaded from to_yaml differs from the one written:\n" + yaml);
  if (troupe::to_yaml(again) != yaml) fail("to_yaml of the reloaded config differs:\n" + yaml + "\n---\n" + troupe::to_yaml(again));
  return 0;
}
