// Reads reward samples from JSONL and scores them with one reward named on the command line.
#include "reward/score_file.hpp"

#include <filesystem>
#include <fstream>

#include "policy/error.hpp"

namespace troupe {

std::vector<RewardSample> read_reward_samples(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open");
  std::vector<RewardSample> samples;
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::string where = path + ":" + std::to_string(line_no);
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) throw Error(where + ": not valid JSON");
    if (!j.is_object()) throw Error(where + ": expected a JSON object with \"completion\" and \"answer\"");
    auto completion = j.find("completion");
    if (completion == j.end()) throw Error(where + ": no field 'completion'");
    if (!completion->is_string()) throw Error(where + ": field 'completion' is not a string");
    auto answer = j.find("answer");
    if (answer == j.end()) throw Error(where + ": no field 'answer'");
    if (!answer->is_string() && !answer->is_number()) throw Error(where + ": field 'answer' is not a string or number");
    RewardSample s;
    s.completion = completion->get<std::string>();
    if (auto prompt = j.find("prompt"); prompt != j.end()) {
      if (!prompt->is_string()) throw Error(where + ": field 'prompt' is not a string");
      s.prompt = prompt->get<std::string>();
    }
    j.erase("completion");
    j.erase("prompt");
    s.metadata = std::move(j);
    samples.push_back(std::move(s));
  }
  if (in.bad()) throw Error(path + ": read error");
  return samples;
}

RewardSpec reward_spec_from_name(const std::string& name) {
  RewardSpec spec;
  spec.name = name;
  for (const auto& k : builtin_reward_kinds())
    if (name == k) spec.kind = k;
  if (!spec.kind.empty()) return spec;
  if (name.starts_with("http://") || name.starts_with("https://")) {
    spec.kind = "http";
    spec.url = name;
  } else {
    std::error_code ec;
    if (!std::filesystem::exists(name, ec))
      throw Error("--reward '" + name + "': not a built-in reward (math_answer, format), an http(s):// URL or an " +
                  "existing plugin file");
    spec.kind = "plugin";
    spec.plugin = name;
  }
  return spec;
}

std::vector<double> score_file(const std::string& reward_name, const std::string& path) {
  auto reward = make_reward(reward_spec_from_name(reward_name));
  auto samples = read_reward_samples(path);
  return reward->score_batch(samples);
}

}  // namespace troupe
