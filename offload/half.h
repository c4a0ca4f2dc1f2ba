// Scalar float -> bf16 / fp16 conversions, the reference every SIMD kernel in offload/ matches bit
// for bit. Both round to nearest, ties to even; a NaN stays a NaN (quieted, sign and top payload
// bits kept, as F16C's vcvtps2ph and AVX512-BF16's vcvtneps2bf16 do); fp16 overflows to infinity.
//
// Thread safety: pure functions.
#pragma once

#include <bit>
#include <cstdint>

namespace memplan::offload {

inline uint16_t FloatToBf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  // Adding 0x7fff plus the kept lowest bit rounds half-way cases to the even neighbour; a carry
  // into the exponent is the correct round-up (to the next binade or to infinity).
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Bf16ToFloat(uint16_t half) { return std::bit_cast<float>(uint32_t{half} << 16); }

inline uint16_t FloatToFp16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  // 65520 is half-way between 65504 (the largest fp16) and 65536; ties go to the even neighbour,
  // which is infinity.
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {
    // Below 2^-14 the result is subnormal (or zero). Adding 0.5 makes the float unit in the last
    // place 2^-24, the fp16 subnormal step, so the FPU does the rounding (ties to even) for us.
    float shifted = std::bit_cast<float>(abs) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(shifted) - 0x3f000000u));
  }
  uint32_t odd = (abs >> 13) & 1u;
  // Re-bias the exponent (127 -> 15) and round the 13 dropped bits to nearest even in one add.
  abs += 0xc8000fffu + odd;
  return static_cast<uint16_t>(sign | (abs >> 13));
}

inline float Fp16ToFloat(uint16_t half) {
  uint32_t sign = uint32_t{half & 0x8000u} << 16;
  uint32_t exponent = (half >> 10) & 0x1fu;
  uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24, exact in float.
    float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace memplan::offload
