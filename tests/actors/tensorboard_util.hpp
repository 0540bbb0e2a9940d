// A run's TensorBoard folder as TensorBoard reads it (tests/actors/read_tensorboard.py, from the
// project's Python, TROUPE_PYTHON), and the check that it equals metrics.jsonl and samples.jsonl.
#pragma once

#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "tests/test_util.hpp"

namespace troupe::test {

// {"files", "file_version", "scalars": [{tag, step, value, wall_time}], "texts": [{tag, step, plugin, text}]}
inline nlohmann::json read_board(const std::filesystem::path& tb) {
  auto r = run_command(shell_quote(env_dir("TROUPE_PYTHON").string()) + " " +
                       shell_quote((source() / "tests" / "actors" / "read_tensorboard.py").string()) + " " +
                       shell_quote(tb.string()) + " 2>&1");
  REQUIRE_MESSAGE(r.status == 0, r.out);
  return nlohmann::json::parse(r.out.substr(r.out.find('{')));  // past any warning TensorBoard prints first
}

// The scalar `tag` at `step`: (value, wall time), or nothing.
inline std::optional<std::pair<double, double>> scalar_at(const nlohmann::json& board, const std::string& tag, int64_t step) {
  for (const auto& s : board["scalars"])
    if (s["tag"] == tag && s["step"] == step) return std::pair{s["value"].get<double>(), s["wall_time"].get<double>()};
  return std::nullopt;
}

// Every number of every RUN/metrics.jsonl line but "step" is TensorBoard's scalar of that tag at
// that step, compared in float32 (TensorBoard keeps scalars as float32, metrics.jsonl as double),
// and TensorBoard holds no other scalar; every RUN/samples.jsonl line is one "samples" text at its
// step showing each completion. Returns the number of scalars.
inline size_t check_board_matches(const std::filesystem::path& run, const nlohmann::json& board) {
  std::map<std::pair<std::string, int64_t>, double> shown;
  for (const auto& s : board["scalars"]) {
    auto key = std::pair{s["tag"].get<std::string>(), s["step"].get<int64_t>()};
    CHECK_MESSAGE(!shown.count(key), key.first << " twice at step " << key.second);
    shown[key] = s["value"].get<double>();
  }
  size_t expected = 0, mismatched = 0;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    const int64_t step = j["step"].get<int64_t>();
    for (const auto& [tag, v] : j.items()) {
      if (tag == "step" || !v.is_number()) continue;
      ++expected;
      auto it = shown.find({tag, step});
      if (it == shown.end() || static_cast<float>(it->second) != static_cast<float>(v.get<double>())) {
        ++mismatched;
        MESSAGE(tag << " at step " << step << ": metrics.jsonl " << v << ", TensorBoard "
                    << (it == shown.end() ? std::string("none") : std::to_string(it->second)));
      }
    }
  }
  CHECK(mismatched == 0);
  CHECK(shown.size() == expected);
  size_t texts = 0;
  std::ifstream samples(run / "samples.jsonl");
  for (std::string line; std::getline(samples, line); ++texts) {
    auto j = nlohmann::json::parse(line);
    nlohmann::json text;
    for (const auto& t : board["texts"])
      if (t["tag"] == "samples" && t["step"] == j["step"]) text = t;
    REQUIRE_MESSAGE(text.is_object(), "no samples text at step " << j["step"]);
    CHECK(text["plugin"] == "text");
    for (const auto& s : j["samples"]) {
      std::string block = "    ";  // as samples_markdown indents each line of a code block
      for (char c : s["completion"].get<std::string>()) block += c == '\n' ? std::string("\n    ") : std::string(1, c);
      CHECK(text["text"][0].get<std::string>().find(block) != std::string::npos);
    }
  }
  CHECK(board["texts"].size() == texts);
  return shown.size();
}

}  // namespace troupe::test
