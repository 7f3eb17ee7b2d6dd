#include "quant/quantize.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/numeric.h"

namespace gemma4::quant {
namespace {

constexpr int64_t kW4GroupSize = 32;
constexpr int64_t kNvBlockSize = 16;
constexpr float kE2m1Max = 6.0f;
constexpr float kE4m3Max = 448.0f;

Status check_input(std::span<const float> values, int64_t rows, int64_t cols, int64_t group,
                   const char* format) {
  if (rows <= 0 || cols <= 0 || cols % group != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} needs positive rows and cols a multiple of {}, got [{}, {}]", format,
                      group, rows, cols);
  }
  if (static_cast<int64_t>(values.size()) != rows * cols) {
    return make_error(ErrorCode::kInvalidArgument, "{}: {} values for a [{}, {}] matrix", format,
                      values.size(), rows, cols);
  }
  const auto bad =
      std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
  if (bad != values.end()) {
    return make_error(ErrorCode::kInvalidArgument, "{}: value {} at index {} is not finite", format,
                      *bad, bad - values.begin());
  }
  return {};
}

float max_abs(std::span<const float> values) {
  float amax = 0.0f;
  for (float v : values) amax = std::max(amax, std::fabs(v));
  return amax;
}

// Nearest value with `bits` significant bits, ties to even (the default FP rounding mode).
float round_to_significant_bits(float value, int bits) {
  if (value == 0.0f) return 0.0f;
  int exponent = 0;
  std::frexp(value, &exponent);  // value = f * 2^exponent, f in [0.5, 1)
  return std::ldexp(std::nearbyint(std::ldexp(value, bits - exponent)), exponent - bits);
}

// e2m1 code of the nearest grid value to `x` (ties to the even code, i.e. to the even mantissa
// as compressed-tensors' cast_to_fp4 does), clamped to +-6.
uint8_t nearest_e2m1(float x) {
  const float magnitude = std::fabs(x);
  uint8_t best = 0;
  for (uint8_t code = 1; code < 8; ++code) {
    const float diff = std::fabs(e2m1_to_float(code) - magnitude);
    const float best_diff = std::fabs(e2m1_to_float(best) - magnitude);
    if (diff < best_diff || (diff == best_diff && code % 2 == 0)) best = code;
  }
  return (x < 0.0f && best != 0) ? static_cast<uint8_t>(best | 8) : best;
}

}  // namespace

QMatrix PackedMatrix::view() const {
  QMatrix m;
  m.format = format;
  m.rows = rows;
  m.cols = cols;
  m.data = data.data();
  m.scales = scales.empty() ? nullptr : scales.data();
  m.scale_type = scale_type;
  m.nv_global = nv_global;
  m.group_size = group_size;
  return m;
}

float quantize_int4_group(std::span<const float, 32> group, std::span<int8_t, 32> q) {
  const float scale = round_bf16(round_to_significant_bits(max_abs(group) / 7.5f, 5));
  for (size_t j = 0; j < group.size(); ++j) {
    q[j] = scale == 0.0f
               ? 0
               : static_cast<int8_t>(std::clamp(std::nearbyint(group[j] / scale), -8.0f, 7.0f));
  }
  return scale;
}

Expected<PackedMatrix> quantize_w4g32(std::span<const float> values, int64_t rows, int64_t cols) {
  GEMMA4_RETURN_IF_ERROR(check_input(values, rows, cols, kW4GroupSize, "w4g32"));
  PackedMatrix packed;
  packed.format = WeightFormat::kW4G32;
  packed.rows = rows;
  packed.cols = cols;
  packed.scale_type = ScaleType::kBF16;
  std::vector<uint32_t> words(static_cast<size_t>(rows * cols / 8), 0);
  std::vector<uint16_t> scales(static_cast<size_t>(rows * cols / kW4GroupSize));
  for (int64_t group = 0; group < rows * cols / kW4GroupSize; ++group) {
    std::array<int8_t, kW4GroupSize> q;
    const float scale =
        quantize_int4_group(values.subspan(group * kW4GroupSize).first<kW4GroupSize>(), q);
    scales[group] = float_to_bf16(scale);
    for (int64_t j = 0; j < kW4GroupSize; ++j) {
      const auto u = static_cast<uint32_t>(q[j] + 8);
      const int64_t k = group * kW4GroupSize + j;  // element index in the flat matrix
      words[k / 8] |= u << (4 * (k % 8));
    }
  }
  packed.data.resize(words.size() * 4);
  std::memcpy(packed.data.data(), words.data(), packed.data.size());
  packed.scales.resize(scales.size() * 2);
  std::memcpy(packed.scales.data(), scales.data(), packed.scales.size());
  return packed;
}

Expected<PackedMatrix> quantize_nvfp4(std::span<const float> values, int64_t rows, int64_t cols,
                                      NvGlobalScale global) {
  GEMMA4_RETURN_IF_ERROR(check_input(values, rows, cols, kNvBlockSize, "nvfp4"));
  if (!std::isfinite(global.value) || global.value <= 0.0f) {
    return make_error(ErrorCode::kInvalidArgument, "nvfp4 global factor {} is not positive",
                      global.value);
  }
  PackedMatrix packed;
  packed.format = WeightFormat::kNVFP4;
  packed.rows = rows;
  packed.cols = cols;
  packed.nv_global = global;
  packed.data.assign(static_cast<size_t>(rows * cols / 2), std::byte{0});
  packed.scales.resize(static_cast<size_t>(rows * cols / kNvBlockSize));
  for (int64_t block_index = 0; block_index < rows * cols / kNvBlockSize; ++block_index) {
    const auto block = values.subspan(block_index * kNvBlockSize, kNvBlockSize);
    const float amax = max_abs(block);
    const float scale_in_global_units =
        global.is_divisor ? global.value * amax / kE2m1Max : amax / (kE2m1Max * global.value);
    const uint8_t scale_code = float_to_e4m3(std::min(scale_in_global_units, kE4m3Max));
    packed.scales[block_index] = static_cast<std::byte>(scale_code);
    const float block_scale = global.apply(e4m3_to_float(scale_code));
    for (int64_t j = 0; j < kNvBlockSize; ++j) {
      const uint8_t code = block_scale == 0.0f ? 0 : nearest_e2m1(block[j] / block_scale);
      const int64_t k = block_index * kNvBlockSize + j;
      auto& byte = packed.data[k / 2];
      byte |= static_cast<std::byte>(k % 2 == 0 ? code : code << 4);
    }
  }
  return packed;
}

float nvfp4_power_of_two_global_scale(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  const float exact = kE4m3Max * kE2m1Max / amax;
  int exponent = 0;
  std::frexp(exact, &exponent);  // exact = f * 2^exponent, f in [0.5, 1)
  return std::ldexp(1.0f, exponent - 1);
}

std::vector<float> dequantize(const QMatrix& m) {
  std::vector<float> values(static_cast<size_t>(m.rows * m.cols));
  for (int64_t row = 0; row < m.rows; ++row) dequantize_row(m, row, values.data() + row * m.cols);
  return values;
}

}  // namespace gemma4::quant
