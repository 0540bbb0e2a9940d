// An enum's names as written in YAML and in messages, one table per enum found by
// names_of(value): the run config reads, checks and writes enums from these tables alone, and
// the layers below it declare their own tables next to their enums. No behaviour beyond that.
#pragma once

#include <optional>
#include <span>
#include <string_view>

namespace troupe {

template <class E>
struct Named {
  std::string_view name;
  E value;
};

template <class E>
concept ConfigEnum = requires(E e) { names_of(e); };

template <ConfigEnum E>
constexpr std::string_view to_string(E v) {
  for (const auto& n : names_of(v))
    if (n.value == v) return n.name;
  return "?";
}

// The value named `name`, or nullopt when the table has no such name.
template <ConfigEnum E>
constexpr std::optional<E> from_name(std::string_view name) {
  for (const auto& n : names_of(E{}))
    if (n.name == name) return n.value;
  return std::nullopt;
}

}  // namespace troupe
