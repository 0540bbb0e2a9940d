// The YAML tree of a run config (overrides applied) to RunConfig; config.cpp calls it.
#pragma once

#include <string>

#include "actors/config_fields.hpp"

namespace troupe::cfg {

// `stem` names run.dir's default (runs/<stem>). Throws Error naming file, line and key.
RunConfig parse_root(const Source& s, const YAML::Node& root, const std::string& stem);

}  // namespace troupe::cfg
