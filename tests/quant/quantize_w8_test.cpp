// quantize_w8g32 (the `--lm-head q8` copy): a hand-computed group (numpy's fp16 and rint give
// the expected scale and levels), and the rule's guarantees on random rows of very different
// magnitudes: the scale is the smallest fp16 >= amax / 127, levels stay in [-127, 127], every
// dequantized value is within half a scale of the source; values already on such a grid come
// back exactly; bad input is a clear error.
#include "quant/quantize_w8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/numeric.h"
#include "test_support.h"

namespace gemma4::quant {
namespace {

QMatrix f32_view(const std::vector<float>& values, int64_t rows, int64_t cols) {
  QMatrix m;
  m.format = WeightFormat::kF32;
  m.rows = rows;
  m.cols = cols;
  m.data = values.data();
  return m;
}

uint16_t scale_bits(const PackedMatrix& packed, int64_t group) {
  uint16_t bits = 0;
  std::memcpy(&bits, packed.scales.data() + 2 * group, 2);
  return bits;
}

TEST(QuantizeW8G32, HandComputedGroup) {
  // amax 12.7: 12.7f / 127 = 0.1f, whose nearest fp16 0x2E66 (0.099976) is below it, so the scale
  // is the next one up, 0x2E67 = 0.10003662109375 (numpy). Levels rint(w / s): 12.7 -> 126.95 ->
  // 127, 0.05 -> 0.4998 -> 0, 0.15 -> 1.4995 -> 1, -0.25 -> -2.4991 -> -2, 6.35 -> 63.48 -> 63.
  std::vector<float> group(32, 0.0f);
  const std::vector<float> head = {12.7f, 0.05f, 0.15f, -0.25f, -12.7f, 6.35f};
  const std::vector<int8_t> levels = {127, 0, 1, -2, -127, 63};
  std::copy(head.begin(), head.end(), group.begin());
  auto packed = quantize_w8g32(f32_view(group, 1, 32));
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  EXPECT_EQ(packed->format, WeightFormat::kW8);
  EXPECT_EQ(packed->scale_type, ScaleType::kF16);
  EXPECT_EQ(packed->group_size, 32);
  EXPECT_EQ(scale_bits(*packed, 0), 0x2E67);
  for (size_t i = 0; i < 32; ++i) {
    const int8_t want = i < levels.size() ? levels[i] : 0;
    EXPECT_EQ(static_cast<int8_t>(packed->data[i]), want) << i;
  }
  const std::vector<float> values = dequantize(packed->view());
  EXPECT_EQ(values[0], 127 * 0.10003662109375f);
}

TEST(QuantizeW8G32, RandomRowsStayWithinHalfAScale) {
  // bf16 rows of 4 groups each; group g of row r scaled by 10^(r % 9 - 6 + g): from 1e-6 (fp16
  // subnormal scales) to 1e5, plus one all-zero group.
  const int64_t rows = 45, cols = 128;
  std::vector<float> normal = testing::random_normal(rows * cols, 31);
  std::vector<uint16_t> bf16(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < cols; ++k) {
      const float magnitude = std::pow(10.0f, static_cast<float>(r % 9 - 6 + k / 32));
      const bool zero_group = r == 7 && k / 32 == 2;
      bf16[r * cols + k] = float_to_bf16(zero_group ? 0.0f : normal[r * cols + k] * magnitude);
    }
  }
  QMatrix source;
  source.format = WeightFormat::kBF16;
  source.rows = rows;
  source.cols = cols;
  source.data = bf16.data();
  auto packed = quantize_w8g32(source, 3);
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  auto single_thread = quantize_w8g32(source, 1);
  ASSERT_TRUE(single_thread.ok());
  EXPECT_EQ(packed->data, single_thread->data);
  EXPECT_EQ(packed->scales, single_thread->scales);

  const std::vector<float> got = dequantize(packed->view());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < cols / 32; ++g) {
      float amax = 0.0f;
      for (int64_t k = g * 32; k < g * 32 + 32; ++k)
        amax = std::max(amax, std::fabs(bf16_to_float(bf16[r * cols + k])));
      const uint16_t bits = scale_bits(*packed, r * (cols / 32) + g);
      const float scale = fp16_to_float(bits);
      const float wanted = amax / 127.0f;
      EXPECT_GE(scale, wanted) << r << " " << g;
      if (bits > 0) {
        EXPECT_LT(fp16_to_float(static_cast<uint16_t>(bits - 1)), wanted);
      }
      for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
        const float w = bf16_to_float(bf16[r * cols + k]);
        const int level = static_cast<int8_t>(packed->data[r * cols + k]);
        EXPECT_LE(std::abs(level), 127);
        // Half a scale, and the fp32 rounding of w / s (relative 2^-24 of |w / s| <= 127).
        EXPECT_LE(std::fabs(got[r * cols + k] - w), scale * (0.5f + 127 * 0x1p-23f))
            << r << " " << k;
      }
    }
  }
}

TEST(QuantizeW8G32, ValuesOnTheGridComeBackExactly) {
  // Levels -127..127 times an fp16 scale s, with +-127 present: amax / 127 = s exactly.
  const float s = fp16_to_float(0x1C00);  // 2^-8
  std::vector<float> values(2 * 32);
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = s * static_cast<float>(static_cast<int>(i * 37 % 255) - 127);
  values[0] = 127 * s;
  values[32] = -127 * s;
  auto packed = quantize_w8g32(f32_view(values, 2, 32));
  ASSERT_TRUE(packed.ok());
  EXPECT_EQ(dequantize(packed->view()), values);
}

TEST(QuantizeW8G32, BadInputIsAClearError) {
  std::vector<float> values(32, 1.0f);
  values[5] = std::nanf("");
  testing::expect_error(quantize_w8g32(f32_view(values, 1, 32)), ErrorCode::kInvalidArgument,
                        {"row 0", "not finite"});
  values[5] = 1e7f;  // 1e7 / 127 is beyond fp16's 65504
  testing::expect_error(quantize_w8g32(f32_view(values, 1, 32)), ErrorCode::kInvalidArgument,
                        {"fp16"});
  std::vector<float> narrow(16, 1.0f);
  testing::expect_error(quantize_w8g32(f32_view(narrow, 1, 16)), ErrorCode::kInvalidArgument,
                        {"multiple of 32"});
  QMatrix packed_source = f32_view(values, 1, 32);
  packed_source.format = WeightFormat::kW4G32;
  packed_source.scales = values.data();
  testing::expect_error(quantize_w8g32(packed_source), ErrorCode::kInvalidArgument,
                        {"f32, bf16 or f16", "w4g32"});
}

}  // namespace
}  // namespace gemma4::quant
