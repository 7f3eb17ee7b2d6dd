#include "quant/gguf_repack.h"

#include <cstring>

#include "core/numeric.h"
#include "quant/gguf_blocks.h"

namespace gemma4::quant {
namespace {

struct BlockShape {
  int64_t elements = 0;
  int64_t bytes = 0;
};

BlockShape block_shape(uint32_t type) {
  switch (type) {
    case kGgmlQ4_0:
      return {kQ4_0BlockElements, kQ4_0BlockBytes};
    case kGgmlQ4_1:
      return {kQ4_1BlockElements, kQ4_1BlockBytes};
    case kGgmlQ5_0:
      return {kQ5_0BlockElements, kQ5_0BlockBytes};
    case kGgmlQ5_1:
      return {kQ5_1BlockElements, kQ5_1BlockBytes};
    case kGgmlQ8_0:
      return {kQ8_0BlockElements, kQ8_0BlockBytes};
    case kGgmlIQ4_NL:
      return {kIQ4_NLBlockElements, kIQ4_NLBlockBytes};
    case kGgmlQ4_K:
      return {kQ4_KBlockElements, kQ4_KBlockBytes};
    case kGgmlQ5_K:
      return {kQ5_KBlockElements, kQ5_KBlockBytes};
    case kGgmlQ6_K:
      return {kQ6_KBlockElements, kQ6_KBlockBytes};
    default:
      return {};
  }
}

void put_f32(std::byte* out, int64_t index, float value) {
  std::memcpy(out + 4 * index, &value, 4);
}

// kW4G32A from 32-element blocks (Q4_1): u = split nibble, scale = d, min = -m.
void q4_1_block(const std::byte* block, std::byte* data, std::byte* scales) {
  const std::byte* qs = block + 4;
  for (int j = 0; j < 16; ++j) {
    data[j] = static_cast<std::byte>(split_nibble(qs, 2 * j) | (split_nibble(qs, 2 * j + 1) << 4));
  }
  uint16_t d, m;
  std::memcpy(&d, block, 2);
  std::memcpy(&m, block + 2, 2);
  put_f32(scales, 0, fp16_to_float(d));
  put_f32(scales, 1, -fp16_to_float(m));
}

// The 8 fp32 {d * sc, dmin * mn} pairs of a Q4_K / Q5_K super-block (same leading fields).
void put_k_quant_scale_mins(const std::byte* block, std::byte* scales) {
  uint16_t d_bits, dmin_bits;
  std::memcpy(&d_bits, block, 2);
  std::memcpy(&dmin_bits, block + 2, 2);
  const float d = fp16_to_float(d_bits), dmin = fp16_to_float(dmin_bits);
  for (int j = 0; j < 8; ++j) {
    int sc = 0, mn = 0;
    q4_k_scale_min(block, j, sc, mn);
    put_f32(scales, 2 * j, d * static_cast<float>(sc));
    put_f32(scales, 2 * j + 1, dmin * static_cast<float>(mn));
  }
}

// kW4G32A from a Q4_K super-block: 8 groups of 32. Element e: byte qs[32c + r % 32] with
// c = e / 64, r = e % 64, low nibble for r < 32 (spec 4.6).
void q4_k_block(const std::byte* block, std::byte* data, std::byte* scales) {
  put_k_quant_scale_mins(block, scales);
  for (int j = 0; j < 128; ++j) {
    data[j] =
        static_cast<std::byte>(q4_k_level(block, 2 * j) | (q4_k_level(block, 2 * j + 1) << 4));
  }
}

// kW8A from a Q5_1 block: q = 5-bit level, scale = d, min = -m.
void q5_1_block(const std::byte* block, int8_t* q, std::byte* scales) {
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(q5_1_level(block, i));
  uint16_t d, m;
  std::memcpy(&d, block, 2);
  std::memcpy(&m, block + 2, 2);
  put_f32(scales, 0, fp16_to_float(d));
  put_f32(scales, 1, -fp16_to_float(m));
}

// kW8A from a Q5_K super-block: Q4_K's 8 {scale, min} pairs, 5-bit levels.
void q5_k_block(const std::byte* block, int8_t* q, std::byte* scales) {
  put_k_quant_scale_mins(block, scales);
  for (int e = 0; e < 256; ++e) q[e] = static_cast<int8_t>(q5_k_level(block, e));
}

// kW8 g32 fp16 from the 32-element blocks whose d is the leading fp16.
void q8_0_block(const std::byte* block, int8_t* q, std::byte* scale) {
  std::memcpy(scale, block, 2);
  std::memcpy(q, block + 2, 32);
}

void q5_0_block(const std::byte* block, int8_t* q, std::byte* scale) {
  std::memcpy(scale, block, 2);
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(q5_0_level(block, i));
}

void iq4_nl_block(const std::byte* block, int8_t* q, std::byte* scale) {
  std::memcpy(scale, block, 2);
  for (int i = 0; i < 32; ++i) q[i] = kIQ4_NLLevels[split_nibble(block + 2, i)];
}

// kW8 g16 fp32 from a Q6_K super-block (16 groups of 16).
void q6_k_block(const std::byte* block, int8_t* q, std::byte* scales) {
  uint16_t d_bits;
  std::memcpy(&d_bits, block + 208, 2);
  const float d = fp16_to_float(d_bits);
  for (int s = 0; s < 16; ++s) {
    put_f32(scales, s, d * static_cast<float>(static_cast<int8_t>(block[192 + s])));
  }
  for (int e = 0; e < 256; ++e) q[e] = static_cast<int8_t>(q6_k_level(block, e));
}

}  // namespace

bool ggml_type_repackable(uint32_t type) {
  return block_shape(type).elements > 0;
}

Expected<PackedMatrix> repack_ggml(uint32_t type, std::span<const std::byte> data, int64_t rows,
                                   int64_t cols) {
  const BlockShape shape = block_shape(type);
  if (shape.elements == 0) {
    return make_error(ErrorCode::kUnsupported,
                      "ggml type {} has no lossless internal format (supported: Q4_0, Q4_1, "
                      "Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K, Q6_K)",
                      type);
  }
  if (rows <= 0 || cols <= 0 || cols % shape.elements != 0 ||
      static_cast<int64_t>(data.size()) != rows * (cols / shape.elements) * shape.bytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "ggml type {}: {} bytes do not hold [{}, {}] elements", type, data.size(),
                      rows, cols);
  }
  if (type == kGgmlQ4_0) return repack_q4_0_to_w4g32(data, rows, cols);

  PackedMatrix packed;
  packed.rows = rows;
  packed.cols = cols;
  const int64_t blocks = rows * cols / shape.elements;
  const bool asymmetric_int4 = type == kGgmlQ4_1 || type == kGgmlQ4_K;
  const bool asymmetric_int8 = type == kGgmlQ5_1 || type == kGgmlQ5_K;
  if (asymmetric_int4 || asymmetric_int8) {
    packed.format = asymmetric_int4 ? WeightFormat::kW4G32A : WeightFormat::kW8A;
    packed.scale_type = ScaleType::kF32;
    packed.data.resize(static_cast<size_t>(asymmetric_int4 ? rows * cols / 2 : rows * cols));
    packed.scales.resize(static_cast<size_t>(rows * cols / 32 * 8));  // fp32 {scale, min}
  } else {
    packed.format = WeightFormat::kW8;
    packed.group_size = type == kGgmlQ6_K ? 16 : 32;
    packed.scale_type = type == kGgmlQ6_K ? ScaleType::kF32 : ScaleType::kF16;
    const int64_t scale_bytes = packed.scale_type == ScaleType::kF32 ? 4 : 2;
    packed.data.resize(static_cast<size_t>(rows * cols));
    packed.scales.resize(static_cast<size_t>(rows * cols / packed.group_size * scale_bytes));
  }
  // Every source block maps to a fixed number of output bytes and scale bytes.
  const int64_t data_per_block = static_cast<int64_t>(packed.data.size()) / blocks;
  const int64_t scales_per_block = static_cast<int64_t>(packed.scales.size()) / blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* block = data.data() + b * shape.bytes;
    std::byte* out = packed.data.data() + b * data_per_block;
    auto* q = reinterpret_cast<int8_t*>(out);
    std::byte* scales = packed.scales.data() + b * scales_per_block;
    switch (type) {
      case kGgmlQ4_1:
        q4_1_block(block, out, scales);
        break;
      case kGgmlQ4_K:
        q4_k_block(block, out, scales);
        break;
      case kGgmlQ5_1:
        q5_1_block(block, q, scales);
        break;
      case kGgmlQ5_K:
        q5_k_block(block, q, scales);
        break;
      case kGgmlQ8_0:
        q8_0_block(block, q, scales);
        break;
      case kGgmlQ5_0:
        q5_0_block(block, q, scales);
        break;
      case kGgmlIQ4_NL:
        iq4_nl_block(block, q, scales);
        break;
      case kGgmlQ6_K:
        q6_k_block(block, q, scales);
        break;
    }
  }
  return packed;
}

}  // namespace gemma4::quant
