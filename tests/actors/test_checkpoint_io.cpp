// The checkpoint files a resume reads: rollouts.msgpack (rollout groups) and trainer_state.json.
// Groups round-trip exactly; broken files (the reproducers tests/fuzz/ found among them) are
// errors naming the file, the group and the field. No actors, no LibTorch.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "actors/rollout_io.hpp"
#include "actors/trainer_state.hpp"
#include "policy/error.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;

namespace {

fs::path regression(const std::string& name) { return test::source() / "tests/fuzz/regressions" / name; }

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string rollouts_error(const fs::path& path) {
  try {
    rollouts_from_msgpack(read_bytes(path), path.string());
  } catch (const Error& e) {
    return e.what();
  }
  return "(no troupe::Error thrown)";
}

// trainer_state.json with these contents, read from a folder of its own.
std::string trainer_state_error(const fs::path& file) {
  const fs::path dir = fs::temp_directory_path() / ("troupe_test_checkpoint_io_" + file.stem().string());
  fs::create_directories(dir);
  fs::copy_file(file, dir / "trainer_state.json", fs::copy_options::overwrite_existing);
  try {
    read_trainer_state(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no troupe::Error thrown)";
}

RolloutGroup example_group() {
  RolloutGroup g;
  g.prompt_id = 7;
  g.batch = 3;
  g.prompt_ids = {1, 2, 3};
  g.completion_ids = {{4, 5}, {6}};
  g.behaviour_logprobs = {{-0.5f, -1.25f}, {-0.125f}};
  g.reference_logprobs = {{-0.75f, -1.0f}, {-0.25f}};
  g.min_version = {2, 3};
  g.max_version = {3, 3};
  g.truncated = {0, 1};
  g.rewards = {{"correct", {1.0, 0.0}}};
  g.reward = {1.0, 0.0};
  g.metadata = R"({"answer": "7"})";
  g.ticket = 12;
  g.generate_s = 0.5;
  return g;
}

}  // namespace

TEST_CASE("rollout groups round-trip through msgpack; a failed group needs no scores") {
  RolloutGroup failed = example_group();
  failed.reward.clear();
  failed.rewards.clear();
  failed.error = "reward: timed out";
  const std::vector<RolloutGroup> groups = {example_group(), failed};
  const auto bytes = rollouts_to_msgpack(groups);
  const auto back = rollouts_from_msgpack(bytes, "rollouts.msgpack");
  REQUIRE(back.size() == 2);
  CHECK(rollouts_to_msgpack(back) == bytes);
  CHECK(back[0].completion_ids == groups[0].completion_ids);
  CHECK(back[0].behaviour_logprobs == groups[0].behaviour_logprobs);
  CHECK(back[1].error == "reward: timed out");
}

// Each found by tests/fuzz/ (fuzz_rollouts): a float where an integer belongs was cast with undefined
// behaviour (UBSan); groups whose per-completion fields were short loaded, and the trainer then read
// reward[i] and max_version[i] past their ends; deep nesting overflowed the msgpack reader's stack.
TEST_CASE("broken rollouts.msgpack files are errors naming the group and the field") {
  const auto expect = [](const std::string& name, const std::string& problem) {
    const fs::path path = regression("rollouts/" + name);
    const std::string message = rollouts_error(path);
    CAPTURE(message);
    CHECK(message.find(path.string() + ": ") == 0);
    CHECK(message.find(problem) != std::string::npos);
  };
  expect("float_token_id.msgpack", "group 0: prompt_ids[0] is 1e+30, expected an integer in [-2147483648, 2147483647]");
  expect("no_rewards.msgpack", "group 0: reward holds 0 entries for 1 completions");
  expect("no_max_version.msgpack", "group 0: max_version holds 0 entries for 1 completions");
  expect("deep_nesting.msgpack", "msgpack nested deeper than 16 levels, not rollout groups");

  RolloutGroup g = example_group();
  g.behaviour_logprobs[1].push_back(-2.0f);
  const auto bytes = rollouts_to_msgpack(std::vector<RolloutGroup>{example_group(), g});
  CHECK_THROWS_WITH_AS(rollouts_from_msgpack(bytes, "r.msgpack"),
                       "r.msgpack: group 1: behaviour_logprobs[1] holds 2 entries for 1 tokens of completion 1", Error);
  CHECK_THROWS_WITH_AS(rollouts_from_msgpack(std::vector<uint8_t>{0x91, 0x01}, "r.msgpack"),
                       "r.msgpack: group 0: is 1, expected an object of rollout fields", Error);
}

// Found by tests/fuzz/ (fuzz_trainer_state): step 1e300 was cast to int64 with undefined behaviour,
// and a cursor nested 16k deep was copied and written back recursively until the stack overflowed.
TEST_CASE("broken trainer_state.json files are errors naming the field") {
  const std::string step = trainer_state_error(regression("trainer_state/float_step.json"));
  CAPTURE(step);
  CHECK(step.find("trainer_state.json: step is 1e+300, expected an integer") != std::string::npos);
  const std::string cursor = trainer_state_error(regression("trainer_state/deep_cursor.json"));
  CAPTURE(cursor);
  CHECK(cursor.find("trainer_state.json: cursor is an array, expected {\"epoch\": e, \"position\": p}") != std::string::npos);
  // Resume reads checkpoint_dir / rollouts: a path that leaves the folder is refused.
  const std::string outside = trainer_state_error(regression("trainer_state/rollouts_outside_checkpoint.json"));
  CAPTURE(outside);
  CHECK(outside.find("trainer_state.json: rollouts is '../../../etc/passwd', expected a file name in the checkpoint folder") !=
        std::string::npos);
}
