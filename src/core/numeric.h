// Scalar number formats shared by every module: bf16, fp16, e4m3, e2m1 <-> float.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace gemma4 {

inline float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

// Round-to-nearest-even, as PyTorch does; NaN stays a quiet NaN.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// The float that bf16 rounding of `value` gives (the bf16 rounding points of the reference).
inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

float fp16_to_float(uint16_t bits);
uint16_t float_to_fp16(float value);  // round-to-nearest-even, saturating to inf

// F8_E4M3 (e4m3fn: bias 7, no inf, 0x7F/0xFF NaN, max 448).
float e4m3_to_float(uint8_t bits);
uint8_t float_to_e4m3(float value);  // round-to-nearest-even, saturating to +-448

// E2M1 element code (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
inline float e2m1_to_float(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[code & 7];
  return (code & 8) ? -m : m;
}

}  // namespace gemma4
