// `troupe score`: a reward run over a JSONL file of samples, to dry-run a reward before training.
// Reads and checks every line before scoring, so a bad line fails before any score is printed.
#pragma once

#include <string>
#include <vector>

#include "reward/registry.hpp"

namespace troupe {

// One sample per non-blank line: a JSON object with "completion" (string) and "answer" (string
// or number), optionally "prompt" (string). The metadata is the object without prompt and
// completion, so a plugin sees the answer and any other field. Throws troupe::Error naming
// FILE:LINE for a line that is not a JSON object or lacks a field.
std::vector<RewardSample> read_reward_samples(const std::string& path);

// NAME as given to `--reward`: a built-in kind (math_answer, format), an http(s):// URL, or
// otherwise a plugin path. The spec's name is NAME.
RewardSpec reward_spec_from_name(const std::string& name);

// The reward NAME on every sample of the file, in order.
std::vector<double> score_file(const std::string& reward_name, const std::string& path);

}  // namespace troupe
