// EnumName: one table per enum gives its name, its parse and the error for an unknown name, so the
// two directions cannot drift apart and every "unknown ..." message reads the same:
//
//   constexpr EnumName<Tier> kTiers[] = {{Tier::kGpu, "gpu"}, {Tier::kCpu, "cpu"}};
//   std::string_view TierName(Tier t) { return NameOf(kTiers, t); }
//   Result<Tier> ParseTier(std::string_view s) { return ParseName(kTiers, s, "tier"); }
//
// ParseName's error: "unknown tier 'disk' (expected gpu or cpu)". Aliases that parse but are never
// printed (e.g. "io_uring" for "uring") are checked by the caller before ParseName.
//
// Thread safety: stateless functions over constant tables.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "common/status.h"

namespace memplan {

template <typename E>
struct EnumName {
  E value;
  std::string_view name;
};

// The name of `value`, or "?" for a value the table lacks (a cast from an out-of-range integer).
template <typename E, size_t N>
std::string_view NameOf(const EnumName<E> (&table)[N], E value) {
  for (const EnumName<E>& n : table) {
    if (n.value == value) return n.name;
  }
  return "?";
}

// "a", "a or b", "a, b or c": the names of the table in order, for messages.
template <typename E, size_t N>
std::string NameList(const EnumName<E> (&table)[N]) {
  std::string list;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) list += i + 1 == N ? " or " : ", ";
    list += table[i].name;
  }
  return list;
}

// The value named `text` exactly; InvalidArgument naming `what` and the accepted names otherwise.
template <typename E, size_t N>
Result<E> ParseName(const EnumName<E> (&table)[N], std::string_view text, std::string_view what) {
  for (const EnumName<E>& n : table) {
    if (n.name == text) return n.value;
  }
  return Status::InvalidArgument("unknown " + std::string(what) + " '" + std::string(text) +
                                 "' (expected " + NameList(table) + ")");
}

}  // namespace memplan
