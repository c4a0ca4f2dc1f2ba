// Byte sizes as users write them on command lines and in JSON files, and as memplan prints them.
// The one parser and formatter of sizes: every flag and field that takes a size goes through it,
// so `--cpu-mem 1GB`, `bench nvme --size 1GB` and `"cpu_memory_bytes": "1GB"` mean the same.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
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

// "512 B", "128 KiB", "1.5 GiB": powers of 1024, exact where the size is a whole number of the
// unit, else one decimal.
std::string FormatByteSize(uint64_t bytes);

}  // namespace memplan
