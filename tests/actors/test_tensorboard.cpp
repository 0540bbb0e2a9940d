// TensorBoard event files read back by TensorBoard itself (its EventAccumulator, through
// tests/actors/read_tensorboard.py): every scalar equal to the float32 of what was written,
// text for the text plugin, and runs/NAME/tb kept equal to metrics.jsonl when a run resumes.
#include <doctest/doctest.h>

#include <unistd.h>

#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/tensorboard.hpp"
#include "policy/error.hpp"
#include "tests/actors/tensorboard_util.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::test;

namespace {

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("troupe_tb_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_lines(const fs::path& file, const std::vector<nlohmann::json>& lines) {
  std::ofstream out(file, std::ios::trunc);
  for (const auto& j : lines) out << j.dump() << "\n";
}

}  // namespace

TEST_CASE("masked CRC32C: the Castagnoli check value, masked as TensorBoard masks it") {
  // CRC32C("123456789") = 0xE3069283 (RFC 3720's check value).
  const uint32_t crc = 0xE3069283u;
  CHECK(masked_crc32c("123456789", 9) == ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST_CASE("EventAccumulator reads back every scalar as the float32 of what was written, and the text") {
  auto dir = fresh_dir("writer");
  // Values float32 cannot hold exactly (0.1, 1/3, 123456789, 2^53 + 1), tiny, negative and large ones.
  const std::vector<std::tuple<std::string, int64_t, double>> written = {
      {"loss", 1, 0.1},         {"loss", 2, 1.0 / 3.0},          {"loss", 3, -2.5e-7},
      {"reward/correct/mean", 1, -1.5}, {"reward/correct/mean", 2, 123456789.0}, {"weights/bytes", 1, 9007199254740993.0},
      {"grad_norm", 7, 1e20},   {"grad_norm", 8, -3.4e38},       {"tokens_per_s", 1, 0.0},
  };
  const std::string text = "**sample 1**: reward 1\n\nprompt:\n\n    What is 2+3? ünïcode ✓\n    <|im_end|>\n";
  double wall = 1.7e9 + 0.125;
  {
    EventWriter w(dir);
    CHECK(w.path().filename().string().rfind("events.out.tfevents.", 0) == 0);
    std::map<int64_t, std::vector<EventWriter::Scalar>> by_step;
    for (const auto& [tag, step, v] : written) by_step[step].push_back({tag, static_cast<float>(v)});
    for (const auto& [step, values] : by_step) w.scalars(step, values, wall);
    w.text("samples", 4, text, wall + 1);
  }
  auto board = read_board(dir);
  CHECK(board["file_version"] == 2.0);  // "brain.Event:2", as the accumulator parses it
  REQUIRE(board["scalars"].size() == written.size());
  for (const auto& [tag, step, v] : written) {
    auto got = scalar_at(board, tag, step);
    REQUIRE_MESSAGE(got, tag << " at step " << step);
    // The accumulator hands the float32 back widened to double: exactly float32(v), no rounding on the way.
    CHECK_MESSAGE(got->first == static_cast<double>(static_cast<float>(v)), tag << " " << step << ": " << got->first << " vs " << v);
    CHECK(got->second == wall);
  }
  REQUIRE(board["texts"].size() == 1);
  const auto& t = board["texts"][0];
  CHECK(t["tag"] == "samples");
  CHECK(t["step"] == 4);
  CHECK(t["plugin"] == "text");
  CHECK(t["dtype"] == 7);  // DT_STRING
  CHECK(t["dims"] == 0);
  CHECK(t["text"] == nlohmann::json::array({text}));
  fs::remove_all(dir);
}

TEST_CASE("RunBoard: tb holds every number of metrics.jsonl, and after a resume cut it back, exactly what is left") {
  auto run = fresh_dir("run");
  std::vector<nlohmann::json> lines;
  for (int64_t s = 1; s <= 6; ++s)
    lines.push_back({{"step", s}, {"loss", 1.0 / (s + 2)}, {"reward/mean", s * 0.1}, {"policy_version", s},
                     {"kl", s == 2 ? nlohmann::json() : nlohmann::json(-s * 1e-9)},  // null: skipped
                     {"memory/params_bytes/per_rank", {1, 2}}, {"ok", true}, {"note", "text"}});
  std::vector<nlohmann::json> samples = {
      {{"step", 1}, {"samples", {{{"prompt", "1+1="}, {"completion", "2"}, {"reward", 1.0}, {"rewards", {{"correct", 1.0}}}}}}},
      {{"step", 5}, {"samples", {{{"prompt", "2+2="}, {"completion", "5\nno"}, {"reward", 0.0}, {"rewards", {{"correct", 0.0}}}}}}}};
  // A first run of three steps: two from the files when the board opens, one as it runs.
  write_lines(run / "metrics.jsonl", {lines[0], lines[1]});
  write_lines(run / "samples.jsonl", {samples[0]});
  {
    RunBoard b(run);
    std::ofstream(run / "metrics.jsonl", std::ios::app) << lines[2].dump() << "\n";
    b.metrics(lines[2]);
  }
  auto first = read_board(run / "tb");
  check_board_matches(run, first);
  const double wall_1 = scalar_at(first, "loss", 1)->second;

  // It went on to step 6, then died; resuming from step 3 cut metrics.jsonl back to 3 lines.
  {
    RunBoard b(run);
    std::ofstream m(run / "metrics.jsonl", std::ios::app);
    for (int s = 3; s < 6; ++s) {
      m << lines[s].dump() << "\n" << std::flush;
      b.metrics(lines[s]);
    }
    std::ofstream(run / "samples.jsonl", std::ios::app) << samples[1].dump() << "\n";
    b.samples(samples[1]);
  }
  check_board_matches(run, read_board(run / "tb"));
  write_lines(run / "metrics.jsonl", {lines[0], lines[1], lines[2]});
  write_lines(run / "samples.jsonl", {samples[0]});
  sleep(1);  // a new file name second, so the replaced file cannot be the one that remains
  RunBoard resumed(run);
  std::ofstream(run / "metrics.jsonl", std::ios::app) << lines[3].dump() << "\n";
  resumed.metrics(lines[3]);
  auto after = read_board(run / "tb");
  CHECK(after["files"].size() == 1);
  const size_t scalars = check_board_matches(run, after);
  CHECK(scalars == 4 * 3 + 3);  // loss, reward/mean, policy_version each step, kl but at step 2
  CHECK(!scalar_at(after, "loss", 5));
  CHECK(!scalar_at(after, "ok", 1));
  CHECK(!scalar_at(after, "step", 1));
  // The lines the earlier files showed keep their wall times.
  CHECK(scalar_at(after, "loss", 1)->second == wall_1);
  REQUIRE(after["texts"].size() == 1);
  CHECK(after["texts"][0]["step"] == 1);
  CHECK(after["texts"][0]["text"][0] == samples_markdown(samples[0]));
  fs::remove_all(run);
}

TEST_CASE("samples_markdown shows prompt and completion as code blocks, with the rewards") {
  nlohmann::json line = {{"step", 3},
                         {"samples", {{{"prompt", "a\n# b"}, {"completion", "*c*"}, {"reward", 0.5}, {"rewards", {{"x", 1}}}}}}};
  CHECK(samples_markdown(line) == "**sample 1**: reward 0.5 (x 1)\n\nprompt:\n\n    a\n    # b\n\ncompletion:\n\n    *c*\n\n");
}

TEST_CASE("an unwritable tb folder is an error naming it") {
  auto run = fresh_dir("unwritable");
  std::ofstream(run / "tb") << "a file where the folder should be";
  CHECK_THROWS_WITH_AS(RunBoard{run}, doctest::Contains("tb"), Error);
  fs::remove_all(run);
}
