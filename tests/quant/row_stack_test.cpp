// quant/row_stack: a stacked matrix's row r decodes to the source row it was copied from, for the
// packed formats with scales (w4g32, nvfp4, w8a) and a plain one (bf16); matrices whose rows decode
// differently are not stackable.
#include "quant/row_stack.h"

#include <gtest/gtest.h>

#include "test_support.h"

#include <cstring>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "quant/gguf_blocks.h"
#include "quant/gguf_repack.h"
#include "quant/quantize.h"

namespace gemma4::quant {
namespace {

std::vector<float> row_of(const QMatrix& m, int64_t row) {
  std::vector<float> out(m.cols);
  dequantize_row(m, row, out.data());
  return out;
}

// [rows, 64] as w8a: Q5_1 blocks of random levels (d = 1, m = -0.5 in fp16), repacked.
PackedMatrix random_w8a(int64_t rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> blocks(static_cast<size_t>(rows * 2 * kQ5_1BlockBytes));
  for (auto& b : blocks) b = static_cast<std::byte>(rng());
  for (size_t at = 0; at < blocks.size(); at += kQ5_1BlockBytes) {
    const uint16_t d = float_to_fp16(1.0f), m = float_to_fp16(-0.5f);
    std::memcpy(&blocks[at], &d, 2);
    std::memcpy(&blocks[at + 2], &m, 2);
  }
  return *repack_ggml(kGgmlQ5_1, blocks, rows, 64);
}

// Two packed matrices [rows_a, 64] and [rows_b, 64] of one format.
std::pair<PackedMatrix, PackedMatrix> packed_pair(WeightFormat format, int64_t rows_a,
                                                  int64_t rows_b) {
  if (format == WeightFormat::kW8A) return {random_w8a(rows_a, 1), random_w8a(rows_b, 2)};
  const auto a = testing::random_normal(rows_a * 64, 1), b = testing::random_normal(rows_b * 64, 2);
  if (format == WeightFormat::kW4G32)
    return {*quantize_w4g32(a, rows_a, 64), *quantize_w4g32(b, rows_b, 64)};
  const NvGlobalScale global{0.5f, true};
  return {*quantize_nvfp4(a, rows_a, 64, global), *quantize_nvfp4(b, rows_b, 64, global)};
}

class RowStack : public ::testing::TestWithParam<WeightFormat> {};

TEST_P(RowStack, ConcatenatedRowsFollowEachOther) {
  const auto [a, b] = packed_pair(GetParam(), 3, 5);
  const QMatrix parts[] = {a.view(), b.view(), a.view()};
  const StackedRows stacked = concatenate_rows(parts);
  const QMatrix m = stacked.view();
  ASSERT_EQ(m.rows, 11);
  ASSERT_TRUE(validate(m).ok());
  for (int64_t r = 0; r < 3; ++r) EXPECT_EQ(row_of(m, r), row_of(a.view(), r));
  for (int64_t r = 0; r < 5; ++r) EXPECT_EQ(row_of(m, 3 + r), row_of(b.view(), r));
  for (int64_t r = 0; r < 3; ++r) EXPECT_EQ(row_of(m, 8 + r), row_of(a.view(), r));
  // The slices the engine takes of a stacked q|k|v are the parts again.
  EXPECT_EQ(dequantize(row_slice(m, 3, 5)), dequantize(b.view()));
}

TEST_P(RowStack, InterleavedRowsAlternate) {
  const auto [a, b] = packed_pair(GetParam(), 4, 4);
  const StackedRows stacked = interleave_rows(a.view(), b.view());
  const QMatrix m = stacked.view();
  ASSERT_EQ(m.rows, 8);
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(row_of(m, 2 * r), row_of(a.view(), r));
    EXPECT_EQ(row_of(m, 2 * r + 1), row_of(b.view(), r));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, RowStack,
                         ::testing::Values(WeightFormat::kW4G32, WeightFormat::kNVFP4,
                                           WeightFormat::kW8A),
                         [](const auto& info) { return weight_format_name(info.param); });

TEST(RowStackPlain, Bf16RowsHaveNoScales) {
  std::vector<uint16_t> a(2 * 32), b(2 * 32);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = float_to_bf16(static_cast<float>(i));
    b[i] = float_to_bf16(-static_cast<float>(i));
  }
  const auto bf16_matrix = [](const std::vector<uint16_t>& values) {
    QMatrix m;
    m.format = WeightFormat::kBF16;
    m.rows = 2;
    m.cols = 32;
    m.data = values.data();
    return m;
  };
  const QMatrix ma = bf16_matrix(a), mb = bf16_matrix(b);
  const StackedRows stacked = interleave_rows(ma, mb);
  EXPECT_TRUE(stacked.scales.empty());
  EXPECT_EQ(row_of(stacked.view(), 1), row_of(mb, 0));
  EXPECT_EQ(row_of(stacked.view(), 2), row_of(ma, 1));
}

TEST(RowStackPlain, RowsThatDecodeDifferentlyAreNotStackable) {
  const auto [a, b] = packed_pair(WeightFormat::kNVFP4, 2, 2);
  QMatrix other_global = b.view();
  other_global.nv_global.value = 0.25f;
  EXPECT_TRUE(same_row_encoding(a.view(), b.view()));
  EXPECT_FALSE(same_row_encoding(a.view(), other_global));
  const auto [c, d] = packed_pair(WeightFormat::kW4G32, 2, 2);
  QMatrix f16_scales = d.view();
  f16_scales.scale_type = ScaleType::kF16;
  EXPECT_TRUE(same_row_encoding(c.view(), d.view()));
  EXPECT_FALSE(same_row_encoding(c.view(), f16_scales));
  EXPECT_FALSE(same_row_encoding(a.view(), c.view()));  // format
  QMatrix narrower = c.view();
  narrower.cols = 32;
  EXPECT_FALSE(same_row_encoding(c.view(), narrower));
  QMatrix w8_a = c.view(), w8_b = c.view();
  w8_a.format = w8_b.format = WeightFormat::kW8;
  w8_b.group_size = 16;
  EXPECT_FALSE(same_row_encoding(w8_a, w8_b));
}

}  // namespace
}  // namespace gemma4::quant
