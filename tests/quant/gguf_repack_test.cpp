// GGUF block decoders and the lossless repacks (weight-formats.md 5) against gguf-py's reference
// dequantization: tests/quant/data/gguf_blocks.gguf (make_gguf_block_reference.py) stores random
// raw blocks of each type next to gguf-py's float output.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "io/gguf.h"
#include "quant/gguf_blocks.h"
#include "quant/gguf_repack.h"
#include "quant/qmatrix.h"

namespace gemma4::quant {
namespace {

struct RepackCase {
  const char* name;
  WeightFormat format;
  ScaleType scale_type;
  int group_size;
};

class GgufRepack : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto opened = io::GgufFile::open(std::filesystem::path(GEMMA4_SOURCE_DIR) / "tests" / "quant" /
                                     "data" / "gguf_blocks.gguf");
    ASSERT_TRUE(opened.ok()) << opened.error().to_string();
    file_ = new io::GgufFile(std::move(opened).value());
  }
  static void TearDownTestSuite() {
    delete file_;
    file_ = nullptr;
  }

  // The raw tensor and gguf-py's values for it.
  static std::pair<const io::GgufTensorInfo*, std::vector<float>> load(const std::string& name) {
    const io::GgufTensorInfo* raw = file_->find(name);
    const io::GgufTensorInfo* expected = file_->find(name + ".expected");
    EXPECT_TRUE(raw != nullptr && expected != nullptr) << name;
    if (raw == nullptr || expected == nullptr) return {nullptr, {}};
    std::vector<float> values(expected->nbytes / 4);
    std::memcpy(values.data(), expected->data, expected->nbytes);
    return {raw, values};
  }

  static io::GgufFile* file_;
};

io::GgufFile* GgufRepack::file_ = nullptr;

TEST_F(GgufRepack, DecodersMatchGgufPy) {
  for (const char* name :
       {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q4_k", "q5_k", "q6_k"}) {
    auto [raw, expected] = load(name);
    ASSERT_NE(raw, nullptr);
    auto values = dequantize_ggml(raw->type, {raw->data, raw->nbytes}, raw->ne[1], raw->ne[0]);
    ASSERT_TRUE(values.ok()) << values.error().to_string();
    EXPECT_EQ(*values, expected) << name;  // bit-exact, as ggml's fp32 arithmetic
  }
}

TEST_F(GgufRepack, RepacksAreBitExact) {
  const RepackCase cases[] = {
      {"q4_0", WeightFormat::kW4G32, ScaleType::kF16, 32},
      {"q4_1", WeightFormat::kW4G32A, ScaleType::kF32, 32},
      {"q4_k", WeightFormat::kW4G32A, ScaleType::kF32, 32},
      {"q5_0", WeightFormat::kW8, ScaleType::kF16, 32},
      {"q8_0", WeightFormat::kW8, ScaleType::kF16, 32},
      {"iq4_nl", WeightFormat::kW8, ScaleType::kF16, 32},
      {"q6_k", WeightFormat::kW8, ScaleType::kF32, 16},
      {"q5_1", WeightFormat::kW8A, ScaleType::kF32, 32},
      {"q5_k", WeightFormat::kW8A, ScaleType::kF32, 32},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto [raw, expected] = load(c.name);
    ASSERT_NE(raw, nullptr);
    const int64_t rows = raw->ne[1], cols = raw->ne[0];
    auto packed = repack_ggml(raw->type, {raw->data, raw->nbytes}, rows, cols);
    ASSERT_TRUE(packed.ok()) << packed.error().to_string();
    const QMatrix m = packed->view();
    ASSERT_TRUE(validate(m).ok()) << validate(m).error().to_string();
    EXPECT_EQ(m.format, c.format);
    EXPECT_EQ(m.scale_type, c.scale_type);
    if (m.format == WeightFormat::kW8) {
      EXPECT_EQ(m.group_size, c.group_size);
    }
    EXPECT_EQ(m.bytes(), static_cast<int64_t>(packed->data.size() + packed->scales.size()));
    // Element for element, bit for bit: every value, and every row on its own.
    EXPECT_EQ(dequantize(m), expected);
    std::vector<float> x(static_cast<size_t>(cols));
    for (int64_t k = 0; k < cols; ++k) x[k] = static_cast<float>(k % 7) - 3.0f;
    for (int64_t r = 0; r < rows; ++r) {
      double reference = 0.0;
      for (int64_t k = 0; k < cols; ++k) reference += double{expected[r * cols + k]} * x[k];
      EXPECT_FLOAT_EQ(dot_row(m, r, x.data()), static_cast<float>(reference));
    }
    // A row slice reads the same rows.
    const QMatrix tail = row_slice(m, 1, rows - 1);
    std::vector<float> row(static_cast<size_t>(cols));
    dequantize_row(tail, 0, row.data());
    EXPECT_EQ(row, std::vector<float>(expected.begin() + cols, expected.begin() + 2 * cols));
  }
}

TEST(GgufRepackErrors, UnsupportedTypesAndSizes) {
  std::vector<std::byte> bytes(24);
  auto q2_k = repack_ggml(10, bytes, 1, 256);  // Q2_K has no lossless internal format here
  ASSERT_FALSE(q2_k.ok());
  EXPECT_EQ(q2_k.error().code, ErrorCode::kUnsupported);
  EXPECT_NE(q2_k.error().message.find("Q5_K"), std::string::npos);  // lists what is supported
  EXPECT_FALSE(ggml_type_repackable(10));
  EXPECT_TRUE(ggml_type_repackable(kGgmlQ5_1));
  EXPECT_TRUE(ggml_type_repackable(kGgmlQ5_K));
  EXPECT_TRUE(ggml_type_repackable(kGgmlQ6_K));
  auto short_data = repack_ggml(kGgmlQ8_0, bytes, 1, 32);  // 24 bytes, one Q8_0 block is 34
  ASSERT_FALSE(short_data.ok());
  EXPECT_EQ(short_data.error().code, ErrorCode::kInvalidArgument);
  auto bad_cols = repack_ggml(kGgmlQ6_K, bytes, 1, 32);  // K-quants need cols % 256 == 0
  EXPECT_FALSE(bad_cols.ok());
}

TEST(W8, ValidateChecksGroupAndScaleType) {
  const int8_t q[32] = {};
  const float scales[2] = {1.0f, 1.0f};
  QMatrix m;
  m.format = WeightFormat::kW8;
  m.rows = 1;
  m.cols = 32;
  m.data = q;
  m.scales = scales;
  m.scale_type = ScaleType::kF32;
  m.group_size = 16;
  EXPECT_TRUE(validate(m).ok());
  m.group_size = 8;
  EXPECT_FALSE(validate(m).ok());
  m.group_size = 32;
  m.scale_type = ScaleType::kBF16;
  EXPECT_FALSE(validate(m).ok());
  m.format = WeightFormat::kW4G32A;
  EXPECT_FALSE(validate(m).ok());  // {scale, min} are fp32
  m.format = WeightFormat::kW8A;
  EXPECT_FALSE(validate(m).ok());
  m.scale_type = ScaleType::kF32;
  EXPECT_TRUE(validate(m).ok());
  m.cols = 16;  // one {scale, min} pair per 32
  EXPECT_FALSE(validate(m).ok());
}

}  // namespace
}  // namespace gemma4::quant
