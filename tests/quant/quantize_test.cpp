// Producers: hand-computed cases of spec 2.4 / 3.2, and round trips whose dequantized values
// must be exact in bf16 (the bf16 twin of a quantized synthetic checkpoint holds them).
#include <gtest/gtest.h>

#include "test_support.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "quant/quantize.h"

namespace gemma4::quant {
namespace {

int significant_bits(float value) {
  if (value == 0.0f) return 0;
  int exponent = 0;
  float mantissa = std::frexp(std::fabs(value), &exponent);
  int bits = 0;
  while (mantissa != 0.0f) {
    mantissa = mantissa * 2.0f - std::floor(mantissa * 2.0f);
    ++bits;
  }
  return bits;
}

TEST(QuantizeW4G32, HandComputedGroup) {
  // amax 7.5 -> s = 7.5 / 7.5 = 1 (already 5-bit); q = clamp(round_half_even(w / s), -8, 7).
  std::vector<float> group(32, 0.0f);
  const std::vector<float> head = {0.5f, 1.5f, 2.5f, -0.5f, 7.5f, -7.5f, 3.49f, -2.51f, 6.6f};
  const std::vector<float> expected = {0.0f, 2.0f, 2.0f, 0.0f, 7.0f, -8.0f, 3.0f, -3.0f, 7.0f};
  std::copy(head.begin(), head.end(), group.begin());
  auto packed = quantize_w4g32(group, 1, 32);
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  uint16_t scale_bits = 0;
  std::memcpy(&scale_bits, packed->scales.data(), 2);
  EXPECT_EQ(scale_bits, float_to_bf16(1.0f));
  uint32_t word0 = 0;
  std::memcpy(&word0, packed->data.data(), 4);
  // u = q + 8 = 8, 10, 10, 8, 15, 0, 11, 5 in nibbles 0..7.
  EXPECT_EQ(word0, 0x5B0F8AA8u);
  const auto values = dequantize(packed->view());
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(values[i], expected[i]) << i;
  for (size_t i = expected.size(); i < 32; ++i) EXPECT_EQ(values[i], 0.0f);
}

TEST(QuantizeW4G32, ScaleRoundsToFiveSignificantBits) {
  // amax 7.5 * (1 + 2^-7): s = 1 + 2^-7 would make 7s need 10 bits; rounded to 5 bits s = 1.
  std::vector<float> group(32, 0.0f);
  group[0] = 7.5f * (1.0f + 1.0f / 128);
  auto packed = quantize_w4g32(group, 1, 32);
  ASSERT_TRUE(packed.ok());
  uint16_t scale_bits = 0;
  std::memcpy(&scale_bits, packed->scales.data(), 2);
  EXPECT_EQ(bf16_to_float(scale_bits), 1.0f);
  EXPECT_EQ(dequantize(packed->view())[0], 7.0f);  // 7.5586 / 1 -> 8, clamped to 7
}

TEST(QuantizeW4G32, RoundTripIsBf16ExactAndWithinHalfAStep) {
  const int64_t rows = 16, cols = 256;
  auto values = testing::random_normal(rows * cols, 1, 0.02f);
  for (int64_t k = 0; k < 32; ++k) values[k] = 0.0f;  // an all-zero group
  auto packed = quantize_w4g32(values, rows, cols);
  ASSERT_TRUE(packed.ok());
  EXPECT_EQ(packed->data.size(), static_cast<size_t>(rows * cols / 2));
  EXPECT_EQ(packed->scales.size(), static_cast<size_t>(rows * cols / 32 * 2));
  const auto restored = dequantize(packed->view());
  for (int64_t i = 0; i < rows * cols; ++i) {
    uint16_t scale_bits = 0;
    std::memcpy(&scale_bits, packed->scales.data() + (i / 32) * 2, 2);
    const float scale = bf16_to_float(scale_bits);
    EXPECT_LE(significant_bits(scale), 5);
    EXPECT_EQ(round_bf16(restored[i]), restored[i]) << i;  // exact in bf16
    // Symmetric rule: |w - deq| <= s/2 except where +amax clamps to 7 (error < 1.5 s).
    EXPECT_LE(std::fabs(values[i] - restored[i]), 1.5f * scale + 1e-12f) << i;
  }
  for (int64_t k = 0; k < 32; ++k) EXPECT_EQ(restored[k], 0.0f);
}

TEST(QuantizeW4G32, RejectsBadInput) {
  std::vector<float> values(48, 1.0f);
  EXPECT_FALSE(quantize_w4g32(values, 1, 48).ok());  // K % 32
  EXPECT_FALSE(quantize_w4g32(values, 2, 32).ok());  // size
  values[3] = NAN;
  std::vector<float> nan_values(values.begin(), values.begin() + 32);
  const auto result = quantize_w4g32(nan_values, 1, 32);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error().message.find("index 3"), std::string::npos);
}

TEST(QuantizeNvfp4, HandComputedTiesGoToEvenCodes) {
  // amax 6, divisor 1: block scale e4m3(1 * 6 / 6) = 1.0 (0x38); code = nearest e2m1 of w, ties
  // to the even code (compressed-tensors cast_to_fp4: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
  // 2.5->2, 3.5->4, 5->4).
  const std::vector<float> block = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f,  3.5f, 5.0f,  6.0f,
                                    -6.0f, -0.3f, 0.0f,  2.9f,  -1.4f, 0.6f, -4.4f, 1.1f};
  const std::vector<float> expected = {0.0f,  1.0f,  1.0f, 2.0f, 2.0f,  4.0f, 4.0f,  6.0f,
                                       -6.0f, -0.5f, 0.0f, 3.0f, -1.5f, 0.5f, -4.0f, 1.0f};
  auto packed = quantize_nvfp4(block, 1, 16, {1.0f, /*is_divisor=*/true});
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  EXPECT_EQ(static_cast<uint8_t>(packed->scales[0]), 0x38);
  // Elements 0, 1 = codes 0 (0.0) and 2 (1.0): byte 0x20.
  EXPECT_EQ(static_cast<uint8_t>(packed->data[0]), 0x20);
  EXPECT_EQ(dequantize(packed->view()), expected);
}

TEST(QuantizeNvfp4, PowerOfTwoGlobalScaleGivesBf16ExactValues) {
  const int64_t rows = 8, cols = 128;
  const auto values = testing::random_normal(rows * cols, 2, 0.05f);
  float amax = 0.0f;
  for (float v : values) amax = std::max(amax, std::fabs(v));
  const float gs = nvfp4_power_of_two_global_scale(amax);
  EXPECT_EQ(significant_bits(gs), 1);
  EXPECT_LE(gs, 448.0f * 6.0f / amax);
  EXPECT_GT(2.0f * gs, 448.0f * 6.0f / amax);

  auto ct = quantize_nvfp4(values, rows, cols, {gs, /*is_divisor=*/true});
  auto modelopt = quantize_nvfp4(values, rows, cols, {1.0f / gs, /*is_divisor=*/false});
  ASSERT_TRUE(ct.ok() && modelopt.ok());
  // Same bytes either way when the factor is a power of two (spec 3.3: scale_2 = 1 / gs).
  EXPECT_EQ(ct->data, modelopt->data);
  EXPECT_EQ(ct->scales, modelopt->scales);
  const auto restored = dequantize(ct->view());
  EXPECT_EQ(restored, dequantize(modelopt->view()));
  for (int64_t i = 0; i < rows * cols; ++i) {
    EXPECT_EQ(round_bf16(restored[i]), restored[i]) << i;
    // A block's step is at most block_scale (the 4 -> 6 gap is 2 units of block_scale / 2).
    const float block_scale = e4m3_to_float(static_cast<uint8_t>(ct->scales[i / 16])) / gs;
    EXPECT_LE(std::fabs(values[i] - restored[i]), block_scale * 1.0f + 1e-9f) << i;
  }
}

TEST(QuantizeNvfp4, RejectsBadInput) {
  std::vector<float> values(16, 1.0f);
  EXPECT_FALSE(quantize_nvfp4(values, 1, 16, {0.0f, true}).ok());
  EXPECT_FALSE(quantize_nvfp4(values, 1, 8, {1.0f, true}).ok());
  EXPECT_EQ(nvfp4_power_of_two_global_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_power_of_two_global_scale(2688.0f), 1.0f);  // 448 * 6 / 2688 = 1
  EXPECT_EQ(nvfp4_power_of_two_global_scale(1.0f), 2048.0f);  // 2688 -> 2^11
}

}  // namespace
}  // namespace gemma4::quant
