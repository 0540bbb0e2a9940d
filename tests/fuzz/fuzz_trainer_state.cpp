// trainer_state.json (read_trainer_state), the file that marks a checkpoint complete, on
// arbitrary text; what loads writes back and loads to the same state. Errors must be troupe::Error.
#include <filesystem>
#include <fstream>

#include "actors/trainer_state.hpp"
#include "policy/error.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using troupe::fuzz::fail;
namespace fs = std::filesystem;

namespace {

const fs::path& dir() { return troupe::fuzz::scratch_dir("trainer_state"); }

bool same(const troupe::TrainerState& a, const troupe::TrainerState& b) {
  return a.recipe == b.recipe && a.model == b.model && a.step == b.step && a.policy_version == b.policy_version &&
         a.rollout_batches == b.rollout_batches && (!a.rollout_batches || (a.rollouts == b.rollouts && a.refilled == b.refilled)) &&
         (a.rollout_batches || a.cursor == b.cursor);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream out(dir() / "trainer_state.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  troupe::TrainerState s;
  try {
    s = troupe::read_trainer_state(dir());
  } catch (const troupe::Error&) {
    return 0;
  }
  troupe::write_trainer_state(dir(), s);
  if (!same(troupe::read_trainer_state(dir()), s)) fail("a trainer state written back reads as another");
  return 0;
}
