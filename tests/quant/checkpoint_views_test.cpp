// QMatrix views over real safetensors files (written, mapped, then viewed zero-copy).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "io/safetensors.h"
#include "quant/checkpoint_views.h"
#include "test_support.h"

namespace gemma4::quant {
namespace {

using io::Checkpoint;
using io::TensorData;

// Tensors with owned bytes, written into one checkpoint file.
class CheckpointBuilder {
 public:
  template <typename T>
  CheckpointBuilder& add(std::string name, DType dtype, std::vector<int64_t> shape,
                         const std::vector<T>& values) {
    std::vector<std::byte> bytes(values.size() * sizeof(T));
    std::memcpy(bytes.data(), values.data(), bytes.size());
    storage_.push_back(std::move(bytes));
    specs_.push_back({std::move(name), dtype, std::move(shape)});
    return *this;
  }

  Checkpoint write(const std::string& test_name) {
    const auto dir = testing::scratch_dir(test_name);
    std::vector<TensorData> tensors;
    for (size_t i = 0; i < specs_.size(); ++i) tensors.push_back({specs_[i], storage_[i]});
    EXPECT_TRUE(io::write_safetensors(dir / "model.safetensors", tensors).ok());
    auto checkpoint = Checkpoint::open(dir);
    EXPECT_TRUE(checkpoint.ok()) << checkpoint.error().to_string();
    return std::move(checkpoint).value();
  }

 private:
  std::vector<io::TensorSpec> specs_;
  std::vector<std::vector<std::byte>> storage_;
};

TensorLookup lookup_in(const Checkpoint& checkpoint) {
  return [&checkpoint](std::string_view name) { return checkpoint.find(name); };
}

std::vector<float> row_values(const QMatrix& m, int64_t row) {
  std::vector<float> out(static_cast<size_t>(m.cols));
  dequantize_row(m, row, out.data());
  return out;
}

using testing::expect_error;

const std::vector<uint16_t> kBf16Scales = {float_to_bf16(0.5f), float_to_bf16(2.0f)};

// Two rows of K = 32: row 0 all u = 15 (q = 7), row 1 all u = 0 (q = -8).
std::vector<int32_t> int4_rows() {
  std::vector<int32_t> words(8, static_cast<int32_t>(0xFFFFFFFFu));
  for (int i = 4; i < 8; ++i) words[i] = 0;
  return words;
}

TEST(CheckpointViews, CompressedInt4) {
  const auto checkpoint = CheckpointBuilder()
                              .add("m.weight_packed", DType::kI32, {2, 4}, int4_rows())
                              .add("m.weight_scale", DType::kBF16, {2, 1}, kBf16Scales)
                              .add("m.weight_shape", DType::kI64, {2}, std::vector<int64_t>{2, 32})
                              .write("views_int4");
  auto m = qmatrix_from_tensors(lookup_in(checkpoint), "m");
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(m->format, WeightFormat::kW4G32);
  EXPECT_EQ(m->scale_type, ScaleType::kBF16);
  EXPECT_EQ(m->rows, 2);
  EXPECT_EQ(m->cols, 32);
  EXPECT_EQ(m->data, checkpoint.find("m.weight_packed")->data);  // zero-copy
  EXPECT_EQ(row_values(*m, 0), std::vector<float>(32, 3.5f));    // 7 * 0.5
  EXPECT_EQ(row_values(*m, 1), std::vector<float>(32, -16.0f));  // -8 * 2
}

TEST(CheckpointViews, StackedInt4ExpertSlice) {
  std::vector<int32_t> words = int4_rows();
  const std::vector<int32_t> second(8, 0x99999999);  // q = 1 everywhere
  words.insert(words.end(), second.begin(), second.end());
  std::vector<uint16_t> scales = kBf16Scales;
  scales.push_back(float_to_bf16(0.25f));
  scales.push_back(float_to_bf16(4.0f));
  const auto checkpoint =
      CheckpointBuilder()
          .add("e.weight_packed", DType::kI32, {2, 2, 4}, words)
          .add("e.weight_scale", DType::kF32, {2, 2, 1},
               std::vector<float>{0.5f, 2.0f, 0.25f, 4.0f})
          .add("e.weight_shape", DType::kI64, {3}, std::vector<int64_t>{2, 2, 32})
          .write("views_int4_stacked");
  auto m = qmatrix_from_tensors(lookup_in(checkpoint), "e", 1);
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(m->scale_type, ScaleType::kF32);
  EXPECT_EQ(row_values(*m, 0), std::vector<float>(32, 0.25f));
  EXPECT_EQ(row_values(*m, 1), std::vector<float>(32, 4.0f));
  expect_error(qmatrix_from_tensors(lookup_in(checkpoint), "e", 2), ErrorCode::kOutOfRange,
               {"e.weight_packed", "expert 2"});
  expect_error(qmatrix_from_tensors(lookup_in(checkpoint), "e"), ErrorCode::kInvalidArgument,
               {"e.weight_packed", "2-D"});
}

TEST(CheckpointViews, CompressedInt4Rejections) {
  auto base = [] {
    CheckpointBuilder builder;
    builder.add("m.weight_packed", DType::kI32, {2, 4}, int4_rows())
        .add("m.weight_shape", DType::kI64, {2}, std::vector<int64_t>{2, 32});
    return builder;
  };
  {
    auto c = base()
                 .add("m.weight_scale", DType::kBF16, {2, 1}, kBf16Scales)
                 .add("m.weight_zero_point", DType::kI32, {1, 1}, std::vector<int32_t>{0})
                 .write("views_int4_zero_point");
    expect_error(qmatrix_from_tensors(lookup_in(c), "m"), ErrorCode::kUnsupported,
                 {"m.weight_zero_point", "asymmetric"});
  }
  {
    auto c = base()
                 .add("m.weight_scale", DType::kBF16, {2, 1}, kBf16Scales)
                 .add("m.weight_g_idx", DType::kI32, {32}, std::vector<int32_t>(32, 0))
                 .write("views_int4_g_idx");
    expect_error(qmatrix_from_tensors(lookup_in(c), "m"), ErrorCode::kUnsupported,
                 {"m.weight_g_idx", "actorder"});
  }
  {
    auto c = base()
                 .add("m.weight_scale", DType::kBF16, {2, 3}, std::vector<uint16_t>(6, 0x3F80))
                 .write("views_int4_scale_shape");
    expect_error(qmatrix_from_tensors(lookup_in(c), "m"), ErrorCode::kInvalidArgument,
                 {"m.weight_scale", "[2, 1]"});
  }
  {
    auto c = base()
                 .add("m.weight_scale", DType::kI32, {2, 1}, std::vector<int32_t>{1, 1})
                 .write("views_int4_scale_dtype");
    expect_error(qmatrix_from_tensors(lookup_in(c), "m"), ErrorCode::kUnsupported,
                 {"m.weight_scale", "BF16, F16 or F32"});
  }
  {
    auto c = base().write("views_int4_no_scale");
    expect_error(qmatrix_from_tensors(lookup_in(c), "m"), ErrorCode::kNotFound, {"m.weight_scale"});
  }
  {
    // Group 128: K = 128, one scale per row.
    auto c = CheckpointBuilder()
                 .add("g.weight_packed", DType::kI32, {2, 16}, std::vector<int32_t>(32, 0))
                 .add("g.weight_scale", DType::kBF16, {2, 1}, kBf16Scales)
                 .add("g.weight_shape", DType::kI64, {2}, std::vector<int64_t>{2, 128})
                 .write("views_int4_group128");
    expect_error(qmatrix_from_tensors(lookup_in(c), "g"), ErrorCode::kUnsupported,
                 {"g.weight_scale", "group size 128"});
  }
  {
    auto c = CheckpointBuilder()
                 .add("s.weight_packed", DType::kI32, {2, 4}, int4_rows())
                 .add("s.weight_scale", DType::kBF16, {2, 1}, kBf16Scales)
                 .add("s.weight_shape", DType::kI64, {2}, std::vector<int64_t>{2, 64})
                 .write("views_int4_logical_shape");
    expect_error(qmatrix_from_tensors(lookup_in(c), "s"), ErrorCode::kInvalidArgument,
                 {"s.weight_packed", "[2, 64]", "s.weight_shape"});
  }
}

TEST(CheckpointViews, CompressedNvfp4DividesByGlobalScale) {
  // Byte 0x2F: codes F (-6) then 2 (1.0); block scale e4m3 0x40 = 2; divisor 4 -> factor 0.5.
  const auto checkpoint =
      CheckpointBuilder()
          .add("n.weight_packed", DType::kU8, {1, 8}, std::vector<uint8_t>(8, 0x2F))
          .add("n.weight_scale", DType::kF8E4M3, {1, 1}, std::vector<uint8_t>{0x40})
          .add("n.weight_global_scale", DType::kF32, {1}, std::vector<float>{4.0f})
          .add("n.input_global_scale", DType::kF32, {1}, std::vector<float>{9.0f})
          .write("views_ct_nvfp4");
  auto m = qmatrix_from_tensors(lookup_in(checkpoint), "n");
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(m->format, WeightFormat::kNVFP4);
  EXPECT_TRUE(m->nv_global.is_divisor);
  EXPECT_EQ(m->cols, 16);
  const auto values = row_values(*m, 0);
  EXPECT_EQ(values[0], -3.0f);
  EXPECT_EQ(values[1], 0.5f);
}

TEST(CheckpointViews, ModelOptNvfp4MultipliesByScale2) {
  const auto checkpoint =
      CheckpointBuilder()
          .add("o.weight", DType::kU8, {1, 8}, std::vector<uint8_t>(8, 0x2F))
          .add("o.weight_scale", DType::kF8E4M3, {1, 1}, std::vector<uint8_t>{0x40})
          .add("o.weight_scale_2", DType::kF32, {}, std::vector<float>{0.25f})
          .add("o.input_scale", DType::kF32, {}, std::vector<float>{1.0f})
          .write("views_modelopt");
  auto m = qmatrix_from_tensors(lookup_in(checkpoint), "o");
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_FALSE(m->nv_global.is_divisor);
  EXPECT_EQ(m->nv_global.value, 0.25f);
  EXPECT_EQ(row_values(*m, 0)[0], -3.0f);
}

TEST(CheckpointViews, Nvfp4Rejections) {
  {
    auto c = CheckpointBuilder()
                 .add("o.weight", DType::kU8, {1, 8}, std::vector<uint8_t>(8, 0))
                 .add("o.weight_scale", DType::kF8E4M3, {1, 1}, std::vector<uint8_t>{0x40})
                 .write("views_modelopt_no_scale2");
    expect_error(qmatrix_from_tensors(lookup_in(c), "o"), ErrorCode::kNotFound,
                 {"o.weight_scale_2"});
  }
  {
    auto c = CheckpointBuilder()
                 .add("o.weight", DType::kU8, {1, 8}, std::vector<uint8_t>(8, 0))
                 .add("o.weight_scale", DType::kU8, {16}, std::vector<uint8_t>(16, 0))
                 .add("o.weight_scale_2", DType::kF32, {}, std::vector<float>{1.0f})
                 .write("views_modelopt_swizzled");
    expect_error(qmatrix_from_tensors(lookup_in(c), "o"), ErrorCode::kUnsupported,
                 {"o.weight_scale", "swizzled"});
  }
  {
    auto c = CheckpointBuilder()
                 .add("n.weight_packed", DType::kU8, {1, 8}, std::vector<uint8_t>(8, 0))
                 .add("n.weight_scale", DType::kF8E4M3, {1, 2}, std::vector<uint8_t>{1, 1})
                 .add("n.weight_global_scale", DType::kF32, {1}, std::vector<float>{1.0f})
                 .write("views_ct_nvfp4_scale_shape");
    expect_error(qmatrix_from_tensors(lookup_in(c), "n"), ErrorCode::kInvalidArgument,
                 {"n.weight_scale", "[1, 1]"});
  }
  {
    auto c = CheckpointBuilder()
                 .add("n.weight_packed", DType::kU8, {1, 8}, std::vector<uint8_t>(8, 0))
                 .add("n.weight_scale", DType::kF8E4M3, {1, 1}, std::vector<uint8_t>{1})
                 .add("n.weight_global_scale", DType::kF32, {1}, std::vector<float>{0.0f})
                 .write("views_ct_nvfp4_zero_global");
    expect_error(qmatrix_from_tensors(lookup_in(c), "n"), ErrorCode::kInvalidArgument,
                 {"n.weight_global_scale", "positive"});
  }
}

TEST(CheckpointViews, StackedNvfp4UsesPerExpertGlobalScale) {
  std::vector<uint8_t> packed(16, 0x22);                       // expert 0: all 1.0
  std::fill(packed.begin() + 8, packed.end(), uint8_t{0x77});  // expert 1: all 6.0
  const auto checkpoint =
      CheckpointBuilder()
          .add("x.weight_packed", DType::kU8, {2, 1, 8}, packed)
          .add("x.weight_scale", DType::kF8E4M3, {2, 1, 1}, std::vector<uint8_t>{0x38, 0x38})
          .add("x.weight_global_scale", DType::kF32, {2}, std::vector<float>{2.0f, 8.0f})
          .write("views_nvfp4_stacked");
  auto e0 = qmatrix_from_tensors(lookup_in(checkpoint), "x", 0);
  auto e1 = qmatrix_from_tensors(lookup_in(checkpoint), "x", 1);
  ASSERT_TRUE(e0.ok() && e1.ok());
  EXPECT_EQ(row_values(*e0, 0)[0], 0.5f);   // 1 * 1 / 2
  EXPECT_EQ(row_values(*e1, 0)[0], 0.75f);  // 6 * 1 / 8
}

TEST(CheckpointViews, DenseWeightsAndFusedExperts) {
  const auto checkpoint =
      CheckpointBuilder()
          .add("d.weight", DType::kBF16, {1, 2},
               std::vector<uint16_t>{float_to_bf16(1.5f), float_to_bf16(-1.0f)})
          .add("f.weight", DType::kF32, {2, 1}, std::vector<float>{0.1f, 0.2f})
          .add("h.weight", DType::kF16, {1, 1}, std::vector<uint16_t>{0x3C00})
          .add("experts.down_proj", DType::kBF16, {2, 1, 2},
               std::vector<uint16_t>{0, 0, float_to_bf16(3.0f), float_to_bf16(4.0f)})
          .write("views_dense");
  const auto find = lookup_in(checkpoint);
  auto d = qmatrix_from_tensors(find, "d");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->format, WeightFormat::kBF16);
  EXPECT_EQ(row_values(*d, 0), (std::vector<float>{1.5f, -1.0f}));
  auto f = qmatrix_from_tensors(find, "f");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->format, WeightFormat::kF32);
  EXPECT_EQ(row_values(*f, 1)[0], 0.2f);
  expect_error(qmatrix_from_tensors(find, "h"), ErrorCode::kUnsupported, {"h.weight", "F16"});
  auto expert = qmatrix_from_tensors(find, "experts.down_proj", 1);
  ASSERT_TRUE(expert.ok()) << expert.error().to_string();
  EXPECT_EQ(row_values(*expert, 0), (std::vector<float>{3.0f, 4.0f}));
  expect_error(qmatrix_from_tensors(find, "missing"), ErrorCode::kNotFound, {"missing"});
}

}  // namespace
}  // namespace gemma4::quant
