// GGUF block decoders against gguf-py's reference dequantization (tests/io/data/reference.gguf
// stores raw blocks next to gguf-py's float output), and the synthetic encoders.
#include <gtest/gtest.h>

#include "test_support.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "io/gguf.h"
#include "quant/gguf_blocks.h"
#include "quant/quantize.h"

namespace gemma4::quant {
namespace {

TEST(GgufBlocks, DecodersMatchGgufPy) {
  const auto path =
      std::filesystem::path(GEMMA4_SOURCE_DIR) / "tests" / "io" / "data" / "reference.gguf";
  auto file = io::GgufFile::open(path);
  ASSERT_TRUE(file.ok()) << file.error().to_string();
  for (const char* name : {"q4_0", "q8_0", "q4_k"}) {
    const io::GgufTensorInfo* raw = file->find(name);
    const io::GgufTensorInfo* expected = file->find(std::string(name) + ".expected");
    ASSERT_TRUE(raw != nullptr && expected != nullptr) << name;
    const int64_t cols = raw->ne[0], rows = raw->ne[1];
    auto values = dequantize_ggml(raw->type, {raw->data, raw->nbytes}, rows, cols);
    ASSERT_TRUE(values.ok()) << values.error().to_string();
    std::vector<float> reference(static_cast<size_t>(rows * cols));
    ASSERT_EQ(expected->nbytes, reference.size() * 4);
    std::memcpy(reference.data(), expected->data, expected->nbytes);
    EXPECT_EQ(*values, reference) << name;
  }
  // Q4_0 -> w4g32 (f16 scales) is lossless: the same values as gguf-py's dequantization.
  const io::GgufTensorInfo* q4_0 = file->find("q4_0");
  auto repacked = repack_q4_0_to_w4g32({q4_0->data, q4_0->nbytes}, q4_0->ne[1], q4_0->ne[0]);
  ASSERT_TRUE(repacked.ok()) << repacked.error().to_string();
  EXPECT_EQ(repacked->view().scale_type, ScaleType::kF16);
  const io::GgufTensorInfo* q4_0_expected = file->find("q4_0.expected");
  std::vector<float> q4_0_reference(q4_0_expected->nbytes / 4);
  std::memcpy(q4_0_reference.data(), q4_0_expected->data, q4_0_expected->nbytes);
  EXPECT_EQ(dequantize(repacked->view()), q4_0_reference);

  const io::GgufTensorInfo* f16 = file->find("plain.f16");
  auto halves = dequantize_ggml(f16->type, {f16->data, f16->nbytes}, 1, 2);
  ASSERT_TRUE(halves.ok());
  EXPECT_EQ(*halves, (std::vector<float>{1.5f, -2.0f}));
}

TEST(GgufBlocks, Q4_0HandComputedBlock) {
  // d = 0.5 (fp16 0x3800); qs[i] = 0x?? with low nibble i (elements 0..15) and high nibble 15 - i
  // (elements 16..31): value(i) = 0.5 * (i - 8), value(16 + i) = 0.5 * (7 - i).
  std::vector<std::byte> block(18);
  const uint16_t d = 0x3800;
  std::memcpy(block.data(), &d, 2);
  for (int i = 0; i < 16; ++i) block[2 + i] = static_cast<std::byte>(i | ((15 - i) << 4));
  float out[32];
  dequantize_q4_0_block(block.data(), out);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(out[i], 0.5f * static_cast<float>(i - 8));
    EXPECT_EQ(out[16 + i], 0.5f * static_cast<float>(7 - i));
  }
  // A negative d (ggml's d = max / -8) keeps its sign through the repack.
  const uint16_t negative_d = 0xB800;  // fp16 -0.5
  std::memcpy(block.data(), &negative_d, 2);
  dequantize_q4_0_block(block.data(), out);
  EXPECT_EQ(out[0], 4.0f);  // -0.5 * (0 - 8)
  auto repacked = repack_q4_0_to_w4g32(block, 1, 32);
  ASSERT_TRUE(repacked.ok());
  EXPECT_EQ(dequantize(repacked->view()), std::vector<float>(out, out + 32));
  EXPECT_EQ(dequantize_ggml(99, block, 1, 32).error().code, ErrorCode::kUnsupported);
  EXPECT_EQ(dequantize_ggml(kGgmlQ4_0, block, 1, 64).error().code, ErrorCode::kInvalidArgument);
}

TEST(GgufBlocks, Q4_0EncoderMatchesW4g32Twin) {
  const int64_t rows = 4, cols = 128;
  const auto values = testing::random_normal(rows * cols, 3, 0.03f);
  auto q4_0 = quantize_q4_0(values, rows, cols);
  auto w4 = quantize_w4g32(values, rows, cols);
  ASSERT_TRUE(q4_0.ok() && w4.ok());
  auto from_gguf = dequantize_ggml(kGgmlQ4_0, *q4_0, rows, cols);
  ASSERT_TRUE(from_gguf.ok());
  EXPECT_EQ(*from_gguf, dequantize(w4->view()));
  for (float v : *from_gguf) EXPECT_EQ(round_bf16(v), v);
}

TEST(GgufBlocks, Q4_KEncoderIsBf16ExactAndClose) {
  const int64_t rows = 3, cols = 512;
  auto values = testing::random_normal(rows * cols, 5, 0.03f);
  for (int64_t k = 0; k < 32; ++k) values[k] = 0.01f + 0.001f * k;  // an all-positive sub-block
  auto blocks = quantize_q4_k(values, rows, cols);
  ASSERT_TRUE(blocks.ok()) << blocks.error().to_string();
  EXPECT_EQ(blocks->size(), static_cast<size_t>(rows * cols / 256 * 144));
  auto restored = dequantize_ggml(kGgmlQ4_K, *blocks, rows, cols);
  ASSERT_TRUE(restored.ok());
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = (*restored)[i];
    EXPECT_EQ(round_bf16(v), v) << i;
    // Sub-block step d * sc <= range / 15 rounded up to a power of two: generous bound.
    EXPECT_NEAR(v, values[i], 0.03f) << i;
  }
  EXPECT_FALSE(quantize_q4_k(std::span(values).first(300), 3, 100).ok());  // cols % 256
}

}  // namespace
}  // namespace gemma4::quant
