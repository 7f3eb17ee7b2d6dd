#include <gtest/gtest.h>

#include <cmath>

#include "core/numeric.h"
#include "core/status.h"

namespace gemma4 {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even).
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_FLOAT_EQ(round_bf16(std::sqrt(1536.0f)), 39.25f);  // E2B's embedding scale (spec 2.2)
}

TEST(Fp16, RoundTripsEveryFiniteValue) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    if (((h >> 10) & 0x1F) == 0x1F) continue;  // inf / NaN
    const float f = fp16_to_float(h);
    EXPECT_EQ(float_to_fp16(f), h) << bits;
  }
  EXPECT_EQ(fp16_to_float(0x3C00), 1.0f);
  EXPECT_EQ(fp16_to_float(0x0001), std::ldexp(1.0f, -24));
}

TEST(E4m3, DecodesSpecExamplesAndRoundTrips) {
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);  // e=7, m=0
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f / 8, -6));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    const float f = e4m3_to_float(static_cast<uint8_t>(code));
    if (f == 0.0f) continue;  // -0 and +0
    EXPECT_EQ(float_to_e4m3(f), code);
  }
  EXPECT_EQ(float_to_e4m3(1000.0f), 0x7E);  // saturates
}

TEST(E2m1, MatchesSpecTable) {
  const float expected[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int code = 0; code < 16; ++code) EXPECT_EQ(e2m1_to_float(code), expected[code]);
}

Expected<int> half_of(int x) {
  if (x % 2) return make_error(ErrorCode::kInvalidArgument, "{} is odd", x);
  return x / 2;
}

Expected<int> quarter_of(int x) {
  GEMMA4_ASSIGN_OR_RETURN(int half, half_of(x));
  return half_of(half);
}

TEST(Expected, PropagatesErrors) {
  ASSERT_TRUE(quarter_of(8).ok());
  EXPECT_EQ(*quarter_of(8), 2);
  const auto bad = quarter_of(6);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(bad.error().message, "3 is odd");
}

}  // namespace
}  // namespace gemma4
