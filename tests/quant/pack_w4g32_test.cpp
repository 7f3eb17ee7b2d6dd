// Lossless bf16 -> w4g32 packing: a matrix built on the grid (levels q in [-8, 7] times a bf16
// scale per group) must pack, and the packed matrix must dequantize (weight-formats.md 2.2:
// w = (u - 8) * scale) to exactly the bf16 values; anything off the grid must be refused.
#include "quant/pack_w4g32.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "quant/qmatrix.h"

namespace gemma4::quant {
namespace {

// A bf16 matrix owning its bytes.
struct Bf16Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<uint16_t> bits;

  Bf16Matrix(int64_t r, int64_t c) : rows(r), cols(c), bits(static_cast<size_t>(r * c)) {}
  void set(int64_t row, int64_t col, float value) {
    bits[row * cols + col] = float_to_bf16(value);
    ASSERT_EQ(bf16_to_float(bits[row * cols + col]), value) << "test value not exact in bf16";
  }
  float at(int64_t row, int64_t col) const { return bf16_to_float(bits[row * cols + col]); }
  QMatrix view() const {
    QMatrix m;
    m.format = WeightFormat::kBF16;
    m.rows = rows;
    m.cols = cols;
    m.data = bits.data();
    return m;
  }
};

// Every value of `packed` dequantized equals the bf16 value (zeros compared by value).
void expect_same_values(const PackedMatrix& packed, const Bf16Matrix& source) {
  ASSERT_EQ(packed.format, WeightFormat::kW4G32);
  ASSERT_EQ(packed.scale_type, ScaleType::kBF16);
  ASSERT_TRUE(validate(packed.view()).ok());
  std::vector<float> row(static_cast<size_t>(source.cols));
  for (int64_t r = 0; r < source.rows; ++r) {
    dequantize_row(packed.view(), r, row.data());
    for (int64_t c = 0; c < source.cols; ++c)
      ASSERT_EQ(row[c], source.at(r, c)) << "row " << r << " col " << c;
  }
}

// Random levels in [-8, 7] and random bf16 scales of up to 5 significant bits (so q * s is
// exact in bf16), some of them negative.
Bf16Matrix random_grid_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> level(-8, 7), mantissa(16, 31), exponent(-14, -2);
  Bf16Matrix m(rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < cols / 32; ++g) {
      float s = std::ldexp(static_cast<float>(mantissa(rng)), exponent(rng));
      if (level(rng) < -6) s = -s;
      for (int64_t i = 0; i < 32; ++i) m.set(r, 32 * g + i, static_cast<float>(level(rng)) * s);
    }
  }
  return m;
}

TEST(PackW4G32Exact, RandomGridMatrixRoundTripsExactly) {
  const Bf16Matrix m = random_grid_matrix(37, 256, 7);
  for (int threads : {1, 4}) {
    auto packed = pack_w4g32_exact(m.view(), threads);
    ASSERT_TRUE(packed.ok()) << packed.error().to_string();
    expect_same_values(*packed, m);
    EXPECT_TRUE(check_w4g32_exact(m.view(), threads).ok());
  }
}

TEST(PackW4G32Exact, AllZeroGroupGetsScaleZero) {
  Bf16Matrix m(1, 64);
  m.set(0, 3, -0.0f);  // a negative zero is still zero
  for (int64_t c = 32; c < 64; ++c) m.set(0, c, 0.25f * static_cast<float>(c % 5));
  auto packed = pack_w4g32_exact(m.view(), 1);
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  uint16_t first_scale = 1;
  std::memcpy(&first_scale, packed->scales.data(), 2);
  EXPECT_EQ(bf16_to_float(first_scale), 0.0f);
  expect_same_values(*packed, m);
}

TEST(PackW4G32Exact, GroupWhoseLargestIsMinusEightTimesTheScale) {
  // s = 0.375: -3 = -8 s is the extreme; amax / 7 = 3/7 is not even a bf16 value, so the plain
  // "amax / 7" rule cannot find this grid.
  Bf16Matrix m(1, 32);
  const int levels[32] = {-8, 7, 0, 1, -1, 3, -5, 6, 2, -2, 4, -4, 5, -3, -6, -7,
                          -8, 7, 0, 1, -1, 3, -5, 6, 2, -2, 4, -4, 5, -3, -6, -7};
  for (int i = 0; i < 32; ++i) m.set(0, i, 0.375f * static_cast<float>(levels[i]));
  auto packed = pack_w4g32_exact(m.view(), 1);
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  uint16_t scale = 0;
  std::memcpy(&scale, packed->scales.data(), 2);
  EXPECT_EQ(bf16_to_float(scale), 0.375f);
  // Offset binary: level -8 is nibble 0, level 7 nibble 15 (element 0 low, element 1 high).
  EXPECT_EQ(static_cast<uint8_t>(packed->data[0]), 0xF0);
  expect_same_values(*packed, m);
}

TEST(PackW4G32Exact, GroupWhoseLargestIsPlusEightTimesTheScaleTakesANegativeScale) {
  Bf16Matrix m(1, 32);
  for (int i = 0; i < 32; ++i) m.set(0, i, 0.5f * static_cast<float>(i % 16 - 7));  // -3.5..4
  auto packed = pack_w4g32_exact(m.view(), 1);
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  uint16_t scale = 0;
  std::memcpy(&scale, packed->scales.data(), 2);
  EXPECT_EQ(bf16_to_float(scale), -0.5f);
  expect_same_values(*packed, m);
}

TEST(PackW4G32Exact, GridsWithFewLevelsStillPack) {
  // Only 0 and +-amax: every k works for some scale; the result must still be exact.
  Bf16Matrix m(2, 32);
  for (int i = 0; i < 32; ++i) {
    m.set(0, i, i % 3 == 0 ? 1.5f : (i % 3 == 1 ? -1.5f : 0.0f));
    m.set(1, i, i == 5 ? 6.0f : 0.0f);
  }
  auto packed = pack_w4g32_exact(m.view(), 1);
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  expect_same_values(*packed, m);
}

TEST(PackW4G32Exact, OffGridValuesAreRefusedWithTheirPlace) {
  Bf16Matrix m = random_grid_matrix(64, 128, 3);
  // Row 41, group 2: 1.0 = q s with |q| <= 8 needs s >= 1/8, and 13/128 = q' s needs s <= 13/128.
  m.set(41, 64, 1.0f);
  m.set(41, 65, 13.0f / 128.0f);
  for (int threads : {1, 3}) {
    const Status status = check_w4g32_exact(m.view(), threads);
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.error().code, ErrorCode::kUnsupported);
    EXPECT_NE(status.error().message.find("row 41, columns [64, 96)"), std::string::npos)
        << status.error().message;
    EXPECT_FALSE(pack_w4g32_exact(m.view(), threads).ok());
  }
}

TEST(PackW4G32Exact, MoreThanSixteenLevelsAreRefused) {
  // Multiples of 0.25 from -2.25 to 2.25: q = -9..9 would be needed.
  Bf16Matrix m(1, 32);
  for (int i = 0; i < 32; ++i) m.set(0, i, 0.25f * static_cast<float>(i % 19 - 9));
  EXPECT_FALSE(check_w4g32_exact(m.view(), 1).ok());
}

TEST(PackW4G32Exact, ScalesOfMoreThanFiveBitsThatStayExact) {
  // s = 1 + 2^-7 (8 significant bits): q * s is exact in bf16 only for q in {0, +-1, +-2, +-4,
  // -8}; a group of exactly those levels is on the grid and must pack.
  const float s = 1.0f + 0x1.0p-7f;
  const int levels[] = {0, 1, -1, 2, -2, 4, -4, -8};
  Bf16Matrix m(1, 32);
  for (int i = 0; i < 32; ++i) m.set(0, i, s * static_cast<float>(levels[i % 8]));
  auto packed = pack_w4g32_exact(m.view(), 1);
  ASSERT_TRUE(packed.ok()) << packed.error().to_string();
  expect_same_values(*packed, m);
}

TEST(PackW4G32Exact, NonFiniteValuesAreOffTheGrid) {
  Bf16Matrix m(1, 32);
  m.bits[7] = 0x7F80;  // +inf
  EXPECT_FALSE(check_w4g32_exact(m.view(), 1).ok());
  m.bits[7] = 0x7FC0;  // NaN
  EXPECT_FALSE(check_w4g32_exact(m.view(), 1).ok());
}

TEST(PackW4G32Exact, RejectsOtherFormatsAndShapes) {
  Bf16Matrix m(2, 48);
  QMatrix view = m.view();
  EXPECT_EQ(check_w4g32_exact(view).error().code, ErrorCode::kInvalidArgument);  // 48 % 32
  view.cols = 32;
  view.format = WeightFormat::kF32;
  EXPECT_EQ(check_w4g32_exact(view).error().code, ErrorCode::kUnsupported);
  view.format = WeightFormat::kBF16;
  view.data = nullptr;
  EXPECT_EQ(check_w4g32_exact(view).error().code, ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace gemma4::quant
