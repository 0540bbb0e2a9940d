// JSON parsed without exceptions, with the depth its arrays and objects reach: readers whose
// documents are copied or dumped later (both recurse once per level) refuse deep nesting with it.
// Header-only: the torch-free readers (config.json, adapter_config.json, prompt records) share it.
#pragma once

#include <algorithm>

#include <nlohmann/json.hpp>

namespace troupe {

// `input`: a string or a stream. Returns a discarded value where the text is not valid JSON;
// `depth` is 0 for a scalar, 1 for a flat object or array.
template <class Input>
nlohmann::json parse_json_measuring_depth(Input&& input, int& depth) {
  depth = 0;
  const auto deepest = [&](int d, nlohmann::json::parse_event_t event, nlohmann::json&) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start || event == E::array_start) depth = std::max(depth, d + 1);
    return true;
  };
  return nlohmann::json::parse(std::forward<Input>(input), deepest, /*allow_exceptions=*/false);
}

}  // namespace troupe
