// Overflow-checked 64-bit arithmetic. Every size memplan computes from user input goes through
// these: a model whose shapes overflow 64 bits is an error, never a wrapped number.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>

namespace memplan {

namespace internal {
template <typename T>
std::optional<T> Mul(T a, T b) {
  T out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}
template <typename T>
std::optional<T> Add(T a, T b) {
  T out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}
}  // namespace internal

inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) { return internal::Mul(a, b); }
inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) { return internal::Add(a, b); }

// Signed forms, for counts a user gives as int64 (batch sizes, accumulation steps, GPUs): a
// product that does not fit is nullopt, never a wrapped number (signed overflow is undefined; a
// wrap to 0 once made `check` divide by zero).
inline std::optional<int64_t> CheckedMulInt64(int64_t a, int64_t b) { return internal::Mul(a, b); }
inline std::optional<int64_t> CheckedAddInt64(int64_t a, int64_t b) { return internal::Add(a, b); }

// a x b x ...; nullopt when any partial product overflows.
inline std::optional<int64_t> CheckedProductInt64(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) {
    auto next = CheckedMulInt64(out, f);
    if (!next) return std::nullopt;
    out = *next;
  }
  return out;
}

// floor(value x numerator / denominator) without overflow (numerator, denominator > 0 and small):
// a fraction of a byte size, e.g. 85% of RAM.
inline uint64_t ScaleDown(uint64_t value, uint64_t numerator, uint64_t denominator) {
  return value / denominator * numerator + value % denominator * numerator / denominator;
}

// `x` rounded down and up to a multiple of `a` (> 0; RoundUp: x + a - 1 must not overflow), and
// whether `x` is a power of two (0 is not): the alignments of I/O sizes and offsets.
inline uint64_t RoundDown(uint64_t x, uint64_t a) { return x - x % a; }
inline uint64_t RoundUp(uint64_t x, uint64_t a) { return RoundDown(x + a - 1, a); }
inline bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

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
