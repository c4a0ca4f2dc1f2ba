// Byte sizes as users write them on command lines and in JSON files, and as memplan prints them.
// The one parser and formatter of sizes: every flag and field that takes a size goes through it,
// so `--cpu-mem 1GB`, `bench nvme --size 1GB` and `"cpu_memory_bytes": "1GB"` mean the same.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace memplan {

// Parses a size: a non-negative decimal number (digits, `_` allowed between them, an optional
// fraction) followed by an optional unit, case-insensitive, with spaces or underscores allowed
// between the number and the unit:
//   (none) or B: bytes;  K, Ki, KiB / M, Mi, MiB / G, Gi, GiB / T, Ti, TiB / P, Pi, PiB: powers
//   of 1024;  KB, MB, GB, TB, PB: powers of 1000 (as `free -h --si`, disk vendors and Hugging
//   Face's "10GB" shard sizes mean them).
// A fraction is rounded to the nearest byte ("1.5 KiB" is 1536). The size must be at least one
// byte (a 0 would read as "unknown" or "off" in the structs it fills, turning a check off
// silently) and below 2^63. On failure: InvalidArgument "<what>: '<text>' is not a size (...)"
// or "<what>: ... must be at least 1 byte", naming `what` (a flag or a JSON field).
Result<uint64_t> ParseByteSize(std::string_view text, std::string_view what);

// A decimal number as people type one, for every flag and flag value memplan parses itself that
// is not a size (`--price`, `--tokens`) and the check of CLI11's float options (tools/cli.cc,
// Note [Number flags]): an optional sign, digits with an optional fraction (".5" and "5." too),
// an optional exponent (e or E, an optional sign, digits). Nothing else: no hexadecimal ("0x10",
// "0x1p4", which strtod and std::stod read as 16), no "inf" or "nan", no spaces. nullopt when
// `text` is not such a number. A number too small for a double reads as its nearest double
// (1e-400 as 0, 1e-320 as a subnormal), one too large as an infinity, so a caller's range check,
// not the parser, refuses both, with one message.
std::optional<double> ParseDecimalNumber(std::string_view text);

// "512 B", "128 KiB", "1.5 GiB": powers of 1024, exact where the size is a whole number of the
// unit, else one decimal.
std::string FormatByteSize(uint64_t bytes);

}  // namespace memplan
