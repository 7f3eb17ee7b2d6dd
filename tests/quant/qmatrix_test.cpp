// CPU reference formats against values computed by hand from weight-formats.md's formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/numeric.h"
#include "quant/qmatrix.h"

namespace gemma4::quant {
namespace {

// A QMatrix with the fields every format has; the rest are set by the test.
QMatrix matrix(WeightFormat format, int64_t rows, int64_t cols, const void* data,
               const void* scales = nullptr) {
  QMatrix m;
  m.format = format;
  m.rows = rows;
  m.cols = cols;
  m.data = data;
  m.scales = scales;
  return m;
}

std::vector<float> row_values(const QMatrix& m, int64_t row) {
  std::vector<float> out(static_cast<size_t>(m.cols));
  dequantize_row(m, row, out.data());
  return out;
}

TEST(W4G32, PackedNibblesDecodeLowNibbleFirst) {
  // Spec 2.3: element k in word k/8, bits 4(k%8)..; u = q + 8; w = (u - 8) * s (2.4).
  // Row 0: words 0x76543210 0xFEDCBA98 repeated -> u = 0..15, 0..15; scale 0.5 (bf16 0x3F00).
  // Row 1: all u = 9 (q = 1); scale -2 (bf16 0xC000).
  const std::vector<uint32_t> words = {0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98,
                                       0x99999999, 0x99999999, 0x99999999, 0x99999999};
  const std::vector<uint16_t> scales = {0x3F00, 0xC000};
  QMatrix m = matrix(WeightFormat::kW4G32, 2, 32, words.data(), scales.data());
  m.scale_type = ScaleType::kBF16;
  ASSERT_TRUE(validate(m).ok());
  const auto row0 = row_values(m, 0);
  const std::vector<float> expected_row0 = {
      -4, -3.5, -3, -2.5, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5,
      -4, -3.5, -3, -2.5, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5};
  EXPECT_EQ(row0, expected_row0);
  EXPECT_EQ(row_values(m, 1), std::vector<float>(32, -2.0f));

  std::vector<float> x(32, 1.0f);
  x[0] = 2.0f;  // row 0: sum of expected_row0 (= -8) plus one more -4
  EXPECT_EQ(dot_row(m, 0, x.data()), -12.0f);
  EXPECT_EQ(dot_row(m, 1, x.data()), -66.0f);
  EXPECT_EQ(m.bytes(), 2 * 16 + 2 * 2);
}

TEST(W4G32, Fp16AndFp32Scales) {
  const std::vector<uint32_t> words = {0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F};
  // u alternates 15, 0 -> q = 7, -8.
  const std::vector<uint16_t> f16_scale = {0x3800};  // fp16 0.5
  QMatrix m = matrix(WeightFormat::kW4G32, 1, 32, words.data(), f16_scale.data());
  m.scale_type = ScaleType::kF16;
  auto values = row_values(m, 0);
  EXPECT_EQ(values[0], 3.5f);
  EXPECT_EQ(values[1], -4.0f);
  const std::vector<float> f32_scale = {0.1f};
  m.scales = f32_scale.data();
  m.scale_type = ScaleType::kF32;
  values = row_values(m, 0);
  EXPECT_EQ(values[0], 7.0f * 0.1f);
  EXPECT_EQ(values[1], -8.0f * 0.1f);
  EXPECT_EQ(m.bytes(), 16 + 4);
}

TEST(W4G32, UnalignedPointersAreRead) {
  // Checkpoint tensors may start at any byte (spec 1.3).
  std::vector<std::byte> storage(1 + 16 + 2);
  const uint32_t word = 0x89ABCDEF;  // elements 0.. = F, E, D, C, B, A, 9, 8
  for (int i = 0; i < 4; ++i) std::memcpy(storage.data() + 1 + 4 * i, &word, 4);
  const uint16_t scale = float_to_bf16(1.0f);
  std::memcpy(storage.data() + 17, &scale, 2);
  QMatrix m = matrix(WeightFormat::kW4G32, 1, 32, storage.data() + 1, storage.data() + 17);
  const auto values = row_values(m, 0);
  EXPECT_EQ(values[0], 7.0f);
  EXPECT_EQ(values[7], 0.0f);
}

TEST(Nvfp4, DecodesCodesAndBlockScales) {
  // Byte 0x2F: element 0 = low nibble 0xF (-6), element 1 = high nibble 0x2 (1.0) (spec 3.1/3.2).
  // e4m3 0x40 = 2^(8-7) = 2; divisor 4 -> block factor 0.5.
  std::vector<uint8_t> packed(8, 0x2F);
  packed[1] = 0x71;  // elements 2, 3 = 0.5, 6
  const std::vector<uint8_t> scales = {0x40};
  QMatrix m = matrix(WeightFormat::kNVFP4, 1, 16, packed.data(), scales.data());
  m.nv_global = NvGlobalScale{4.0f, /*is_divisor=*/true};
  ASSERT_TRUE(validate(m).ok());
  auto values = row_values(m, 0);
  EXPECT_EQ(values[0], -3.0f);
  EXPECT_EQ(values[1], 0.5f);
  EXPECT_EQ(values[2], 0.25f);
  EXPECT_EQ(values[3], 3.0f);
  // ModelOpt multiplier 0.25 = 1 / 4 encodes the same weights.
  m.nv_global = {0.25f, /*is_divisor=*/false};
  EXPECT_EQ(row_values(m, 0), values);
  // Mixing the conventions up (4 as a multiplier) is off by 16x: the bug spec 3.3 warns of.
  m.nv_global = {4.0f, /*is_divisor=*/false};
  EXPECT_EQ(row_values(m, 0)[0], -48.0f);
  EXPECT_EQ(m.bytes(), 8 + 1 + 4);
}

TEST(Nvfp4, DivisionAndMultiplicationRoundDifferently) {
  // e4m3 0x05 = 5/8 * 2^-6 = 0.009765625. torch fp32: 0.009765625 / 3 = 0.0032552082557231188,
  // 0.009765625 * (1 / 3) = 0.0032552084885537624. Each convention must reproduce its own.
  const std::vector<uint8_t> packed(8, 0x22);  // every element 1.0
  const std::vector<uint8_t> scales = {0x05};
  QMatrix m = matrix(WeightFormat::kNVFP4, 1, 16, packed.data(), scales.data());
  m.nv_global = NvGlobalScale{3.0f, /*is_divisor=*/true};
  EXPECT_EQ(row_values(m, 0)[0], 0.0032552082557231188f);
  m.nv_global = {1.0f / 3.0f, /*is_divisor=*/false};
  EXPECT_EQ(row_values(m, 0)[0], 0.0032552084885537624f);
}

TEST(Dense, Bf16AndF32Rows) {
  const std::vector<uint16_t> bf16 = {float_to_bf16(1.5f), float_to_bf16(-2.0f), 0x3F81, 0};
  QMatrix m = matrix(WeightFormat::kBF16, 2, 2, bf16.data());
  EXPECT_EQ(row_values(m, 0), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(row_values(m, 1)[0], 1.0f + 1.0f / 128);
  const float x[2] = {2.0f, 1.0f};
  EXPECT_EQ(dot_row(m, 0, x), 1.0f);
  EXPECT_EQ(m.bytes(), 8);
  const std::vector<float> f32 = {0.1f, 0.2f, 0.3f};
  QMatrix f = matrix(WeightFormat::kF32, 1, 3, f32.data());
  EXPECT_EQ(row_values(f, 0), f32);
  EXPECT_EQ(f.bytes(), 12);
}

TEST(QMatrixTest, RowSliceAndValidation) {
  const std::vector<uint32_t> words = {0x88888888, 0x88888888, 0x88888888, 0x88888888,
                                       0x99999999, 0x99999999, 0x99999999, 0x99999999};
  const std::vector<uint16_t> scales = {float_to_bf16(1.0f), float_to_bf16(3.0f)};
  QMatrix m = matrix(WeightFormat::kW4G32, 2, 32, words.data(), scales.data());
  const QMatrix second = row_slice(m, 1, 1);
  EXPECT_EQ(second.rows, 1);
  EXPECT_EQ(row_values(second, 0), std::vector<float>(32, 3.0f));

  QMatrix bad = m;
  bad.cols = 24;
  EXPECT_FALSE(validate(bad).ok());
  bad = m;
  bad.scales = nullptr;
  EXPECT_FALSE(validate(bad).ok());
  QMatrix nv = matrix(WeightFormat::kNVFP4, 1, 16, words.data(), scales.data());
  nv.nv_global = NvGlobalScale{0.0f, true};
  EXPECT_FALSE(validate(nv).ok());
  EXPECT_STREQ(weight_format_name(WeightFormat::kW4G32), "w4g32");
  EXPECT_STREQ(weight_format_name(WeightFormat::kNVFP4), "nvfp4");
  EXPECT_STREQ(weight_format_name(WeightFormat::kBF16), "bf16");
  EXPECT_STREQ(weight_format_name(WeightFormat::kF32), "f32");
}

}  // namespace
}  // namespace gemma4::quant
