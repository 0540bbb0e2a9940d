// A reward plugin in a few lines: 1.0 for a completion that shows its work ("because", "so",
// "therefore") and stays under 200 words, falling linearly to 0 at 400 words.
// Build: cmake --build build --target my_reward   (-> build/examples/libmy_reward.so)
// Use:   rewards: [{name: concise, plugin: build/examples/libmy_reward.so, weight: 0.5}]
//        troupe score --reward build/examples/libmy_reward.so samples.jsonl
#include <algorithm>
#include <sstream>

#include "reward/plugin.hpp"

double concise_reasoning(const troupe::RewardSample& s) {
  std::istringstream in(s.completion);
  std::string word;
  int words = 0;
  bool reasons = false;
  while (in >> word) {
    ++words;
    std::transform(word.begin(), word.end(), word.begin(), ::tolower);
    reasons |= word == "because" || word == "so" || word == "therefore";
  }
  if (!reasons) return 0.0;
  return std::clamp((400.0 - words) / 200.0, 0.0, 1.0);
}

TROUPE_REWARD(concise_reasoning)
