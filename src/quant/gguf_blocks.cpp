#include "quant/gguf_blocks.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "quant/quantize.h"

namespace gemma4::quant {
namespace {

constexpr int64_t kQ4_KSubBlocks = 8;
constexpr int64_t kQ4_KSubBlockElements = 32;

uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void store_u16(std::byte* p, uint16_t v) {
  std::memcpy(p, &v, 2);
}

uint8_t byte_at(const std::byte* p, int64_t i) {
  return static_cast<uint8_t>(p[i]);
}

// Inverse of q4_k_scale_min for all 8 sub-blocks.
void pack_q4_k_scales(const std::array<int, 8>& sc, const std::array<int, 8>& mn,
                      std::byte* scales) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = static_cast<std::byte>(sc[j] | ((sc[j + 4] >> 4) << 6));
    scales[j + 4] = static_cast<std::byte>(mn[j] | ((mn[j + 4] >> 4) << 6));
    scales[j + 8] = static_cast<std::byte>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
}

Status check_input(std::span<const float> values, int64_t rows, int64_t cols, int64_t block,
                   const char* format) {
  if (rows <= 0 || cols <= 0 || cols % block != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} needs positive rows and cols a multiple of {}, got [{}, {}]", format,
                      block, rows, cols);
  }
  if (static_cast<int64_t>(values.size()) != rows * cols) {
    return make_error(ErrorCode::kInvalidArgument, "{}: {} values for a [{}, {}] matrix", format,
                      values.size(), rows, cols);
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return make_error(ErrorCode::kInvalidArgument, "{}: value at index {} is not finite", format,
                        i);
    }
  }
  return {};
}

void quantize_q4_k_block(std::span<const float> block, std::byte* out) {
  std::array<float, kQ4_KSubBlocks> lo{}, hi{};
  float bound = 0.0f;
  for (int j = 0; j < kQ4_KSubBlocks; ++j) {
    const auto sub = block.subspan(j * kQ4_KSubBlockElements, kQ4_KSubBlockElements);
    lo[j] = std::min(0.0f, *std::min_element(sub.begin(), sub.end()));
    hi[j] = std::max(0.0f, *std::max_element(sub.begin(), sub.end()));
    bound = std::max({bound, (hi[j] - lo[j]) / 225.0f, -lo[j] / 63.0f});
  }
  // Smallest power of two >= bound, within fp16 (2^-24 .. 2^15).
  int exponent = -24;
  if (bound > 0.0f) {
    std::frexp(bound, &exponent);  // bound = f * 2^exponent, f in [0.5, 1)
    if (std::ldexp(1.0f, exponent - 1) >= bound) --exponent;
    exponent = std::clamp(exponent, -24, 15);
  }
  const float d = std::ldexp(1.0f, exponent);
  std::array<int, kQ4_KSubBlocks> sc{}, mn{};
  for (int j = 0; j < kQ4_KSubBlocks; ++j) {
    sc[j] = std::clamp(static_cast<int>(std::ceil((hi[j] - lo[j]) / (15.0f * d))), 0, 15);
    mn[j] = std::clamp(static_cast<int>(std::nearbyint(-lo[j] / d)), 0, 63);
  }
  const uint16_t d_bits = float_to_fp16(d);
  store_u16(out, d_bits);
  store_u16(out + 2, d_bits);  // dmin = d
  pack_q4_k_scales(sc, mn, out + 4);
  std::byte* qs = out + 16;
  std::memset(qs, 0, 128);
  for (int64_t e = 0; e < kQ4_KBlockElements; ++e) {
    const int j = static_cast<int>(e / kQ4_KSubBlockElements);
    const float step = d * static_cast<float>(sc[j]);
    const int q =
        step == 0.0f
            ? 0
            : std::clamp(static_cast<int>(std::nearbyint((block[e] + d * mn[j]) / step)), 0, 15);
    const int64_t c = e / 64, r = e % 64;
    qs[32 * c + r % 32] |= static_cast<std::byte>(r < 32 ? q : q << 4);
  }
}

}  // namespace

int split_nibble(const std::byte* qs, int i) {
  const uint8_t byte = byte_at(qs, i % 16);
  return i < 16 ? (byte & 15) : (byte >> 4);
}

namespace {

// Element i of a 32-element block whose u32 `qh` (bit i: the level's bit 4) is followed by the
// split-nibble `qs` (Q5_0, Q5_1).
int five_bit_level(const std::byte* qh_then_qs, int i) {
  uint32_t qh;
  std::memcpy(&qh, qh_then_qs, 4);
  return split_nibble(qh_then_qs + 4, i) | static_cast<int>(((qh >> i) & 1) << 4);
}

}  // namespace

int q5_0_level(const std::byte* block, int i) {
  return five_bit_level(block + 2, i) - 16;
}

int q5_1_level(const std::byte* block, int i) {
  return five_bit_level(block + 4, i);
}

void q4_k_scale_min(const std::byte* block, int j, int& sc, int& mn) {
  const std::byte* scales = block + 4;
  if (j < 4) {
    sc = byte_at(scales, j) & 63;
    mn = byte_at(scales, j + 4) & 63;
  } else {
    sc = (byte_at(scales, j + 4) & 15) | ((byte_at(scales, j - 4) >> 6) << 4);
    mn = (byte_at(scales, j + 4) >> 4) | ((byte_at(scales, j) >> 6) << 4);
  }
}

int q4_k_level(const std::byte* block, int e) {
  const int c = e / 64, r = e % 64;
  const uint8_t byte = byte_at(block + 16, 32 * c + r % 32);
  return r < 32 ? (byte & 15) : (byte >> 4);
}

int q5_k_level(const std::byte* block, int e) {
  const int c = e / 64, r = e % 64;
  const uint8_t low_byte = byte_at(block + 48, 32 * c + r % 32);  // qs
  const int low = r < 32 ? (low_byte & 15) : (low_byte >> 4);
  const int high = (byte_at(block + 16, e % 32) >> (e / 32)) & 1;  // qh
  return low | (high << 4);
}

int q6_k_level(const std::byte* block, int e) {
  const int h = e / 128, t = e % 128, k = t / 32, l = t % 32;
  const uint8_t low_byte = byte_at(block, 64 * h + (k % 2) * 32 + l);  // ql
  const int low = k < 2 ? (low_byte & 15) : (low_byte >> 4);
  const int high = (byte_at(block + 128, 32 * h + l) >> (2 * k)) & 3;  // qh
  return (low | (high << 4)) - 32;
}

void dequantize_q4_0_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block));
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(split_nibble(block + 2, i) - 8) * d;
}

void dequantize_q4_1_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block));
  const float m = fp16_to_float(load_u16(block + 2));
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(split_nibble(block + 4, i)) * d + m;
}

void dequantize_q5_0_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block));
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q5_0_level(block, i)) * d;
}

void dequantize_q5_1_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block));
  const float m = fp16_to_float(load_u16(block + 2));
  for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q5_1_level(block, i)) + m;
}

void dequantize_iq4_nl_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block));
  for (int i = 0; i < 32; ++i) {
    out[i] = d * static_cast<float>(kIQ4_NLLevels[split_nibble(block + 2, i)]);
  }
}

void dequantize_q6_k_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block + 208));
  for (int e = 0; e < kQ6_KBlockElements; ++e) {
    const auto scale = static_cast<int8_t>(byte_at(block + 192, e / 16));
    out[e] = d * static_cast<float>(scale) * static_cast<float>(q6_k_level(block, e));
  }
}

void dequantize_q8_0_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block));
  for (int i = 0; i < 32; ++i)
    out[i] = static_cast<float>(static_cast<int8_t>(byte_at(block + 2, i))) * d;
}

void dequantize_q4_k_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block));
  const float dmin = fp16_to_float(load_u16(block + 2));
  for (int e = 0; e < kQ4_KBlockElements; ++e) {
    int sc = 0, mn = 0;
    q4_k_scale_min(block, e / kQ4_KSubBlockElements, sc, mn);
    out[e] = (d * static_cast<float>(sc)) * static_cast<float>(q4_k_level(block, e)) -
             dmin * static_cast<float>(mn);
  }
}

void dequantize_q5_k_block(const std::byte* block, float* out) {
  const float d = fp16_to_float(load_u16(block));
  const float dmin = fp16_to_float(load_u16(block + 2));
  for (int e = 0; e < kQ5_KBlockElements; ++e) {
    int sc = 0, mn = 0;
    q4_k_scale_min(block, e / kQ4_KSubBlockElements, sc, mn);
    out[e] = (d * static_cast<float>(sc)) * static_cast<float>(q5_k_level(block, e)) -
             dmin * static_cast<float>(mn);
  }
}

Expected<std::vector<float>> dequantize_ggml(uint32_t type, std::span<const std::byte> data,
                                             int64_t rows, int64_t cols) {
  int64_t block_elements = 1, block_bytes = 0;
  void (*decode_block)(const std::byte*, float*) = nullptr;
  switch (type) {
    case kGgmlF32:
      block_bytes = 4;
      break;
    case kGgmlF16:
    case kGgmlBF16:
      block_bytes = 2;
      break;
    case kGgmlQ4_0:
      block_elements = kQ4_0BlockElements, block_bytes = kQ4_0BlockBytes;
      decode_block = dequantize_q4_0_block;
      break;
    case kGgmlQ4_1:
      block_elements = kQ4_1BlockElements, block_bytes = kQ4_1BlockBytes;
      decode_block = dequantize_q4_1_block;
      break;
    case kGgmlQ5_0:
      block_elements = kQ5_0BlockElements, block_bytes = kQ5_0BlockBytes;
      decode_block = dequantize_q5_0_block;
      break;
    case kGgmlQ5_1:
      block_elements = kQ5_1BlockElements, block_bytes = kQ5_1BlockBytes;
      decode_block = dequantize_q5_1_block;
      break;
    case kGgmlQ8_0:
      block_elements = kQ8_0BlockElements, block_bytes = kQ8_0BlockBytes;
      decode_block = dequantize_q8_0_block;
      break;
    case kGgmlIQ4_NL:
      block_elements = kIQ4_NLBlockElements, block_bytes = kIQ4_NLBlockBytes;
      decode_block = dequantize_iq4_nl_block;
      break;
    case kGgmlQ4_K:
      block_elements = kQ4_KBlockElements, block_bytes = kQ4_KBlockBytes;
      decode_block = dequantize_q4_k_block;
      break;
    case kGgmlQ5_K:
      block_elements = kQ5_KBlockElements, block_bytes = kQ5_KBlockBytes;
      decode_block = dequantize_q5_k_block;
      break;
    case kGgmlQ6_K:
      block_elements = kQ6_KBlockElements, block_bytes = kQ6_KBlockBytes;
      decode_block = dequantize_q6_k_block;
      break;
    default:
      return make_error(ErrorCode::kUnsupported,
                        "ggml type {} cannot be dequantized (supported: F32, F16, BF16, Q4_0, "
                        "Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K, Q6_K)",
                        type);
  }
  if (rows < 0 || cols < 0 || cols % block_elements != 0 ||
      static_cast<int64_t>(data.size()) != rows * (cols / block_elements) * block_bytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "ggml type {}: {} bytes do not hold [{}, {}] elements", type, data.size(),
                      rows, cols);
  }
  std::vector<float> out(static_cast<size_t>(rows * cols));
  const int64_t blocks = rows * cols / block_elements;
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* block = data.data() + b * block_bytes;
    float* dst = out.data() + b * block_elements;
    if (decode_block != nullptr) {
      decode_block(block, dst);
    } else if (type == kGgmlF32) {
      std::memcpy(dst, block, 4);
    } else {
      *dst = type == kGgmlF16 ? fp16_to_float(load_u16(block)) : bf16_to_float(load_u16(block));
    }
  }
  return out;
}

Expected<std::vector<std::byte>> quantize_q4_0(std::span<const float> values, int64_t rows,
                                               int64_t cols) {
  GEMMA4_RETURN_IF_ERROR(check_input(values, rows, cols, kQ4_0BlockElements, "Q4_0"));
  const int64_t blocks = rows * cols / kQ4_0BlockElements;
  std::vector<std::byte> out(static_cast<size_t>(blocks * kQ4_0BlockBytes));
  for (int64_t b = 0; b < blocks; ++b) {
    std::array<int8_t, kQ4_0BlockElements> q;
    const float scale =
        quantize_int4_group(values.subspan(b * kQ4_0BlockElements).first<kQ4_0BlockElements>(), q);
    std::byte* block = out.data() + b * kQ4_0BlockBytes;
    store_u16(block, float_to_fp16(scale));
    for (int i = 0; i < 16; ++i) {
      block[2 + i] = static_cast<std::byte>((q[i] + 8) | ((q[i + 16] + 8) << 4));
    }
  }
  return out;
}

Expected<std::vector<std::byte>> quantize_q4_k(std::span<const float> values, int64_t rows,
                                               int64_t cols) {
  GEMMA4_RETURN_IF_ERROR(check_input(values, rows, cols, kQ4_KBlockElements, "Q4_K"));
  const int64_t blocks = rows * cols / kQ4_KBlockElements;
  std::vector<std::byte> out(static_cast<size_t>(blocks * kQ4_KBlockBytes));
  for (int64_t b = 0; b < blocks; ++b) {
    quantize_q4_k_block(values.subspan(b * kQ4_KBlockElements, kQ4_KBlockElements),
                        out.data() + b * kQ4_KBlockBytes);
  }
  return out;
}

Expected<PackedMatrix> repack_q4_0_to_w4g32(std::span<const std::byte> data, int64_t rows,
                                            int64_t cols) {
  if (rows <= 0 || cols <= 0 || cols % kQ4_0BlockElements != 0 ||
      static_cast<int64_t>(data.size()) != rows * cols / kQ4_0BlockElements * kQ4_0BlockBytes) {
    return make_error(ErrorCode::kInvalidArgument, "Q4_0: {} bytes do not hold [{}, {}] elements",
                      data.size(), rows, cols);
  }
  PackedMatrix packed;
  packed.format = WeightFormat::kW4G32;
  packed.rows = rows;
  packed.cols = cols;
  packed.scale_type = ScaleType::kF16;
  const int64_t blocks = rows * cols / kQ4_0BlockElements;
  packed.data.resize(static_cast<size_t>(rows * cols / 2));
  packed.scales.resize(static_cast<size_t>(blocks * 2));
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* block = data.data() + b * kQ4_0BlockBytes;
    std::memcpy(packed.scales.data() + b * 2, block, 2);  // fp16 d, unchanged
    // Element i < 16 is the low nibble of qs[i], element 16 + i its high nibble; w4g32 wants
    // element 2j in the low and 2j + 1 in the high nibble of byte j (both offset-binary).
    std::byte* out = packed.data.data() + b * (kQ4_0BlockElements / 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<std::byte>(split_nibble(block + 2, 2 * j) |
                                      (split_nibble(block + 2, 2 * j + 1) << 4));
    }
  }
  return packed;
}

}  // namespace gemma4::quant
