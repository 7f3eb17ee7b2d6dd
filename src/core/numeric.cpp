#include "core/numeric.h"

#include <algorithm>
#include <limits>

namespace gemma4 {

float fp16_to_float(uint16_t bits) {
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const int exponent = (bits >> 10) & 0x1F;
  const uint32_t mantissa = bits & 0x3FFu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN()
                         : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

uint16_t float_to_fp16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = std::fabs(value);
  if (std::isnan(value)) return sign | 0x7E00u;
  if (a >= 65520.0f) return sign | 0x7C00u;  // rounds to inf
  if (a < std::ldexp(1.0f, -14)) {           // subnormal: units of 2^-24, ties to even
    const float units = std::nearbyint(a * std::ldexp(1.0f, 24));
    return sign | static_cast<uint16_t>(units);
  }
  int exponent;
  std::frexp(a, &exponent);  // a = f * 2^exponent, f in [0.5, 1)
  const float step = std::ldexp(1.0f, exponent - 11);
  const float rounded = std::nearbyint(a / step) * step;
  std::frexp(rounded, &exponent);
  const uint32_t mantissa =
      static_cast<uint32_t>(rounded / std::ldexp(1.0f, exponent - 11)) & 0x3FFu;
  return sign | static_cast<uint16_t>(((exponent + 14) << 10) | mantissa);
}

float e4m3_to_float(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 7;
  if ((bits & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                                        : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return (bits & 0x80) ? -magnitude : magnitude;
}

uint8_t float_to_e4m3(float value) {
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0;
  // Exhaustive nearest search over the 127 finite magnitudes, ties to the even code: e4m3 is
  // small enough that clarity wins over bit tricks here (this runs at synth/pack time only).
  const float a = std::min(std::fabs(value), 448.0f);
  uint8_t best = 0;
  float best_diff = std::numeric_limits<float>::infinity();
  for (uint8_t code = 0; code < 0x7F; ++code) {
    const float diff = std::fabs(e4m3_to_float(code) - a);
    if (diff < best_diff || (diff == best_diff && (code & 1) == 0)) {
      best = code;
      best_diff = diff;
    }
  }
  return sign | best;
}

}  // namespace gemma4
