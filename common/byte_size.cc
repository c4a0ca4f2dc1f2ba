#include "common/byte_size.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/checked_math.h"

namespace memplan {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMaxSize = uint64_t{1} << 63;

char Lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

struct Unit {
  const char* name;
  uint64_t bytes;
};

constexpr uint64_t Pow(uint64_t base, int n) { return n == 0 ? 1 : base * Pow(base, n - 1); }

constexpr Unit kUnits[] = {
    {"", 1},
    {"b", 1},
    {"k", Pow(kKiB, 1)},
    {"ki", Pow(kKiB, 1)},
    {"kib", Pow(kKiB, 1)},
    {"m", Pow(kKiB, 2)},
    {"mi", Pow(kKiB, 2)},
    {"mib", Pow(kKiB, 2)},
    {"g", Pow(kKiB, 3)},
    {"gi", Pow(kKiB, 3)},
    {"gib", Pow(kKiB, 3)},
    {"t", Pow(kKiB, 4)},
    {"ti", Pow(kKiB, 4)},
    {"tib", Pow(kKiB, 4)},
    {"p", Pow(kKiB, 5)},
    {"pi", Pow(kKiB, 5)},
    {"pib", Pow(kKiB, 5)},
    {"kb", Pow(1000, 1)},
    {"mb", Pow(1000, 2)},
    {"gb", Pow(1000, 3)},
    {"tb", Pow(1000, 4)},
    {"pb", Pow(1000, 5)},
};

}  // namespace

std::optional<double> ParseDecimalNumber(std::string_view text) {
  size_t i = 0;
  auto digits = [&] {
    const size_t start = i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
    return i - start;
  };
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
  size_t mantissa = digits();
  if (i < text.size() && text[i] == '.') {
    ++i;
    mantissa += digits();
  }
  if (mantissa == 0) return std::nullopt;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
    if (digits() == 0) return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  // The grammar above is a subset of strtod's in the C locale, which rounds to the nearest double
  // (ERANGE on underflow or overflow is the caller's range check's to report).
  const std::string copy(text);
  return std::strtod(copy.c_str(), nullptr);
}

Result<uint64_t> ParseByteSize(std::string_view text, std::string_view what) {
  auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(std::string(what) + ": '" + std::string(text) +
                                   "' is not a size (" + std::string(why) + ")");
  };
  constexpr std::string_view kForm =
      "a number of bytes, or with K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024) or KB, MB, GB, TB "
      "(powers of 1000)";
  size_t pos = 0;
  uint64_t whole = 0;
  size_t whole_digits = 0;
  auto digit = [&](size_t i) { return i < text.size() && text[i] >= '0' && text[i] <= '9'; };
  while (digit(pos) || (whole_digits > 0 && text[pos] == '_' && digit(pos + 1))) {
    if (text[pos] == '_') {  // a digit group separator: 1_000_000
      ++pos;
      continue;
    }
    auto next = CheckedMul(whole, 10);
    if (next) next = CheckedAdd(*next, static_cast<uint64_t>(text[pos] - '0'));
    if (!next) return bad("too large");
    whole = *next;
    ++pos;
    ++whole_digits;
  }
  // The fraction, kept as digits: its value is fraction / 10^fraction_digits.
  uint64_t fraction = 0;
  int fraction_digits = 0;
  if (pos < text.size() && text[pos] == '.') {
    ++pos;
    while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') {
      if (fraction_digits < 18) {  // further digits are below any byte of any unit
        fraction = fraction * 10 + static_cast<uint64_t>(text[pos] - '0');
        ++fraction_digits;
      }
      ++pos;
    }
    if (fraction_digits == 0 && whole_digits == 0) return bad(kForm);
  } else if (whole_digits == 0) {
    return bad(kForm);
  }
  while (pos < text.size() && (text[pos] == ' ' || text[pos] == '_')) ++pos;
  std::string unit;
  for (; pos < text.size(); ++pos) unit.push_back(Lower(text[pos]));
  const Unit* found = nullptr;
  for (const Unit& u : kUnits) {
    if (unit == u.name) found = &u;
  }
  if (found == nullptr) return bad(kForm);
  auto bytes = CheckedMul(whole, found->bytes);
  if (!bytes) return bad("too large");
  if (fraction_digits > 0) {
    // fraction / 10^d of a unit, to the nearest byte; long double holds a unit (<= 2^50) and 18
    // digits well enough for that.
    const long double part = static_cast<long double>(fraction) / std::pow(10.0L, fraction_digits) *
                             static_cast<long double>(found->bytes);
    bytes = CheckedAdd(*bytes, static_cast<uint64_t>(std::llround(part)));
    if (!bytes) return bad("too large");
  }
  if (*bytes >= kMaxSize) return bad("too large: the limit is 2^63 bytes");
  if (*bytes == 0) {
    return Status::InvalidArgument(std::string(what) + ": '" + std::string(text) +
                                   "' must be at least 1 byte");
  }
  return *bytes;
}

std::string FormatByteSize(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int unit = 0;
  uint64_t scale = 1;
  while (unit < 6 && bytes / scale >= kKiB) {
    scale *= kKiB;
    ++unit;
  }
  char text[48];
  if (bytes % scale == 0) {
    std::snprintf(text, sizeof(text), "%llu %s", static_cast<unsigned long long>(bytes / scale),
                  kNames[unit]);
  } else {
    std::snprintf(text, sizeof(text), "%.1f %s",
                  static_cast<double>(bytes) / static_cast<double>(scale), kNames[unit]);
  }
  return text;
}

}  // namespace memplan
