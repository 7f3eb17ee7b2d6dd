#include "quant/qmatrix.h"

#include <bit>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/numeric.h"

namespace gemma4::quant {
namespace {

static_assert(std::endian::native == std::endian::little, "packed weights are little-endian");

constexpr int64_t kW4GroupSize = 32;
constexpr int64_t kNvBlockSize = 16;

template <typename T>
T load(const void* base, int64_t index) {
  T value;
  std::memcpy(&value, static_cast<const std::byte*>(base) + index * int64_t{sizeof(T)}, sizeof(T));
  return value;
}

int scale_bytes(ScaleType type) {
  return type == ScaleType::kF32 ? 4 : 2;
}

float load_scale(ScaleType type, const void* scales, int64_t index) {
  switch (type) {
    case ScaleType::kBF16:
      return bf16_to_float(load<uint16_t>(scales, index));
    case ScaleType::kF16:
      return fp16_to_float(load<uint16_t>(scales, index));
    case ScaleType::kF32:
      return load<float>(scales, index);
  }
  return 0.0f;
}

}  // namespace

const char* weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kF32:
      return "f32";
    case WeightFormat::kBF16:
      return "bf16";
    case WeightFormat::kW4G32:
      return "w4g32";
    case WeightFormat::kNVFP4:
      return "nvfp4";
    case WeightFormat::kW4G32A:
      return "w4g32a";
    case WeightFormat::kW8:
      return "w8";
    case WeightFormat::kF16:
      return "f16";
    case WeightFormat::kW8A:
      return "w8a";
  }
  return "unknown";
}

const char* scale_type_name(ScaleType type) {
  switch (type) {
    case ScaleType::kBF16:
      return "bf16";
    case ScaleType::kF16:
      return "f16";
    case ScaleType::kF32:
      return "f32";
  }
  return "unknown";
}

int64_t row_data_bytes(const QMatrix& m) {
  switch (m.format) {
    case WeightFormat::kF32:
      return m.cols * 4;
    case WeightFormat::kBF16:
    case WeightFormat::kF16:
      return m.cols * 2;
    case WeightFormat::kW4G32:
    case WeightFormat::kNVFP4:
    case WeightFormat::kW4G32A:
      return m.cols / 2;
    case WeightFormat::kW8:
    case WeightFormat::kW8A:
      return m.cols;
  }
  return 0;
}

int64_t row_scale_bytes(const QMatrix& m) {
  switch (m.format) {
    case WeightFormat::kW4G32:
      return m.cols / kW4GroupSize * scale_bytes(m.scale_type);
    case WeightFormat::kNVFP4:
      return m.cols / kNvBlockSize;
    case WeightFormat::kW4G32A:
    case WeightFormat::kW8A:
      return m.cols / kW4GroupSize * 8;  // {scale, min} fp32
    case WeightFormat::kW8:
      return m.group_size > 0 ? m.cols / m.group_size * scale_bytes(m.scale_type) : 0;
    default:
      return 0;
  }
}

int64_t QMatrix::bytes() const {
  const int64_t global_factor = format == WeightFormat::kNVFP4 ? 4 : 0;
  return rows * (row_data_bytes(*this) + row_scale_bytes(*this)) + global_factor;
}

Status validate(const QMatrix& m) {
  const char* name = weight_format_name(m.format);
  if (m.rows <= 0 || m.cols <= 0) {
    return make_error(ErrorCode::kInvalidArgument, "{} matrix has shape [{}, {}]", name, m.rows,
                      m.cols);
  }
  if (m.data == nullptr)
    return make_error(ErrorCode::kInvalidArgument, "{} matrix has no data", name);
  int64_t group = 0;
  switch (m.format) {
    case WeightFormat::kW4G32:
    case WeightFormat::kW4G32A:
    case WeightFormat::kW8A:
      group = kW4GroupSize;
      break;
    case WeightFormat::kNVFP4:
      group = kNvBlockSize;
      break;
    case WeightFormat::kW8:
      if (m.group_size != 16 && m.group_size != 32) {
        return make_error(ErrorCode::kInvalidArgument, "w8 group size {} (16 or 32)", m.group_size);
      }
      group = m.group_size;
      break;
    default:
      return {};
  }
  if (m.cols % group != 0) {
    return make_error(ErrorCode::kInvalidArgument, "{} needs K % {} == 0, K = {}", name, group,
                      m.cols);
  }
  if (m.scales == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "{} matrix has no scales", name);
  }
  if (m.format == WeightFormat::kNVFP4 &&
      (!std::isfinite(m.nv_global.value) || m.nv_global.value == 0.0f)) {
    return make_error(ErrorCode::kInvalidArgument, "nvfp4 global factor {} is not finite non-zero",
                      m.nv_global.value);
  }
  const bool has_scale_min = m.format == WeightFormat::kW4G32A || m.format == WeightFormat::kW8A;
  if ((has_scale_min && m.scale_type != ScaleType::kF32) ||
      (m.format == WeightFormat::kW8 && m.scale_type == ScaleType::kBF16)) {
    return make_error(ErrorCode::kInvalidArgument, "{} matrix with {} scales", name,
                      scale_type_name(m.scale_type));
  }
  return {};
}

QMatrix row_slice(const QMatrix& m, int64_t first, int64_t count) {
  assert(first >= 0 && count >= 0 && first + count <= m.rows);
  QMatrix slice = m;
  slice.rows = count;
  slice.data = static_cast<const std::byte*>(m.data) + first * row_data_bytes(m);
  if (m.scales != nullptr) {
    slice.scales = static_cast<const std::byte*>(m.scales) + first * row_scale_bytes(m);
  }
  return slice;
}

void dequantize_row(const QMatrix& m, int64_t row, float* out) {
  const int64_t k_count = m.cols;
  switch (m.format) {
    case WeightFormat::kF32:
      std::memcpy(out, static_cast<const std::byte*>(m.data) + row * k_count * 4, k_count * 4);
      return;
    case WeightFormat::kBF16:
      for (int64_t k = 0; k < k_count; ++k) {
        out[k] = bf16_to_float(load<uint16_t>(m.data, row * k_count + k));
      }
      return;
    case WeightFormat::kF16:
      for (int64_t k = 0; k < k_count; ++k) {
        out[k] = fp16_to_float(load<uint16_t>(m.data, row * k_count + k));
      }
      return;
    case WeightFormat::kW4G32A: {
      const auto* bytes = static_cast<const uint8_t*>(m.data) + row * (k_count / 2);
      const int64_t groups_per_row = k_count / kW4GroupSize;
      for (int64_t g = 0; g < groups_per_row; ++g) {
        const float scale = load<float>(m.scales, 2 * (row * groups_per_row + g));
        const float min = load<float>(m.scales, 2 * (row * groups_per_row + g) + 1);
        for (int64_t j = 0; j < kW4GroupSize / 2; ++j) {
          const uint8_t byte = bytes[g * (kW4GroupSize / 2) + j];
          out[g * kW4GroupSize + 2 * j] = scale * static_cast<float>(byte & 15) - min;
          out[g * kW4GroupSize + 2 * j + 1] = scale * static_cast<float>(byte >> 4) - min;
        }
      }
      return;
    }
    case WeightFormat::kW8A: {
      const auto* q = static_cast<const int8_t*>(m.data) + row * k_count;
      const int64_t groups_per_row = k_count / kW4GroupSize;
      for (int64_t g = 0; g < groups_per_row; ++g) {
        const float scale = load<float>(m.scales, 2 * (row * groups_per_row + g));
        const float min = load<float>(m.scales, 2 * (row * groups_per_row + g) + 1);
        for (int64_t j = g * kW4GroupSize; j < (g + 1) * kW4GroupSize; ++j) {
          out[j] = scale * static_cast<float>(q[j]) - min;
        }
      }
      return;
    }
    case WeightFormat::kW8: {
      const auto* q = static_cast<const int8_t*>(m.data) + row * k_count;
      const int64_t groups_per_row = k_count / m.group_size;
      for (int64_t g = 0; g < groups_per_row; ++g) {
        const float scale = load_scale(m.scale_type, m.scales, row * groups_per_row + g);
        for (int64_t j = g * m.group_size; j < (g + 1) * m.group_size; ++j) {
          out[j] = static_cast<float>(q[j]) * scale;
        }
      }
      return;
    }
    case WeightFormat::kW4G32: {
      const int64_t words_per_row = k_count / 8;
      const int64_t groups_per_row = k_count / kW4GroupSize;
      for (int64_t k = 0; k < k_count; ++k) {
        const uint32_t word = load<uint32_t>(m.data, row * words_per_row + k / 8);
        const int u = static_cast<int>((word >> (4 * (k % 8))) & 0xF);
        const float scale =
            load_scale(m.scale_type, m.scales, row * groups_per_row + k / kW4GroupSize);
        out[k] = static_cast<float>(u - 8) * scale;
      }
      return;
    }
    case WeightFormat::kNVFP4: {
      const int64_t bytes_per_row = k_count / 2;
      const int64_t blocks_per_row = k_count / kNvBlockSize;
      for (int64_t k = 0; k < k_count; ++k) {
        const uint8_t byte = load<uint8_t>(m.data, row * bytes_per_row + k / 2);
        const uint8_t code = (k % 2 == 0) ? (byte & 0xF) : (byte >> 4);
        const uint8_t scale_code = load<uint8_t>(m.scales, row * blocks_per_row + k / kNvBlockSize);
        const float block_scale = m.nv_global.apply(e4m3_to_float(scale_code));
        out[k] = e2m1_to_float(code) * block_scale;
      }
      return;
    }
  }
}

float dot_row(const QMatrix& m, int64_t row, const float* x) {
  std::vector<float> w(static_cast<size_t>(m.cols));
  dequantize_row(m, row, w.data());
  double sum = 0.0;
  for (int64_t k = 0; k < m.cols; ++k) sum += static_cast<double>(w[k]) * x[k];
  return static_cast<float>(sum);
}

}  // namespace gemma4::quant
