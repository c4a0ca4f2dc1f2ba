// Overflow-checked 64-bit arithmetic. Every size memplan computes from user input goes through
// these: a model whose shapes overflow 64 bits is an error, never a wrapped number.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace memplan {

inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// Product of dims; nullopt when a dim is negative or the product overflows. Empty span -> 1
// (a scalar).
inline std::optional<uint64_t> CheckedProduct(std::span<const int64_t> dims) {
  uint64_t out = 1;
  for (int64_t d : dims) {
    if (d < 0) return std::nullopt;
    auto next = CheckedMul(out, static_cast<uint64_t>(d));
    if (!next) return std::nullopt;
    out = *next;
  }
  return out;
}

}  // namespace memplan
