#include "quant/quantize_w8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "core/numeric.h"

namespace gemma4::quant {
namespace {

constexpr int64_t kGroup = 32;
constexpr float kLevels = 127.0f;

// The smallest fp16 >= value (value >= 0, finite), as its bits; 0x7C00 (inf) when none is.
uint16_t fp16_at_least(float value) {
  uint16_t bits = float_to_fp16(value);
  if (fp16_to_float(bits) < value) ++bits;  // positive fp16 bits order like their values
  return bits;
}

// Quantizes rows [first, end) of `source` into `out`; the first bad value's message in `error`.
void quantize_rows(const QMatrix& source, int64_t first, int64_t end, PackedMatrix& out,
                   std::string& error) {
  std::vector<float> row(source.cols);
  const int64_t groups = source.cols / kGroup;
  auto* q = reinterpret_cast<int8_t*>(out.data.data());
  auto* scales = reinterpret_cast<uint16_t*>(out.scales.data());
  for (int64_t r = first; r < end; ++r) {
    dequantize_row(source, r, row.data());
    for (int64_t g = 0; g < groups; ++g) {
      const float* w = row.data() + g * kGroup;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t k = 0; k < kGroup; ++k) {
        finite = finite && std::isfinite(w[k]);
        amax = std::max(amax, std::fabs(w[k]));
      }
      if (!finite) {
        error = fmt::format("row {}, columns {}..{}: a value is not finite", r, g * kGroup,
                            g * kGroup + kGroup - 1);
        return;
      }
      const uint16_t scale_bits = fp16_at_least(amax / kLevels);
      if (scale_bits >= 0x7C00) {
        error = fmt::format(
            "row {}, columns {}..{}: |w| up to {} needs a scale beyond fp16's "
            "range",
            r, g * kGroup, g * kGroup + kGroup - 1, amax);
        return;
      }
      const float scale = fp16_to_float(scale_bits);
      std::memcpy(&scales[r * groups + g], &scale_bits, sizeof scale_bits);
      int8_t* out_q = q + r * source.cols + g * kGroup;
      for (int64_t k = 0; k < kGroup; ++k) {
        const float level = scale == 0.0f ? 0.0f : std::nearbyint(w[k] / scale);
        out_q[k] = static_cast<int8_t>(std::clamp(level, -kLevels, kLevels));
      }
    }
  }
}

}  // namespace

QMatrix w8g32_layout(int64_t rows, int64_t cols) {
  QMatrix layout;
  layout.format = WeightFormat::kW8;
  layout.rows = rows;
  layout.cols = cols;
  layout.scale_type = ScaleType::kF16;
  layout.group_size = static_cast<int>(kGroup);
  return layout;
}

Expected<PackedMatrix> quantize_w8g32(const QMatrix& source, int threads) {
  GEMMA4_RETURN_IF_ERROR(validate(source));
  if (source.format != WeightFormat::kF32 && source.format != WeightFormat::kBF16 &&
      source.format != WeightFormat::kF16) {
    return make_error(ErrorCode::kInvalidArgument,
                      "8-bit quantization reads f32, bf16 or f16 matrices, not {}",
                      weight_format_name(source.format));
  }
  if (source.cols % kGroup != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "8-bit quantization needs columns a multiple of {}, got {}", kGroup,
                      source.cols);
  }
  const QMatrix layout = w8g32_layout(source.rows, source.cols);
  PackedMatrix out;
  out.format = layout.format;
  out.rows = layout.rows;
  out.cols = layout.cols;
  out.scale_type = layout.scale_type;
  out.group_size = layout.group_size;
  out.data.resize(static_cast<size_t>(layout.rows * row_data_bytes(layout)));
  out.scales.resize(static_cast<size_t>(layout.rows * row_scale_bytes(layout)));

  const int64_t workers = std::clamp<int64_t>(
      threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency()), 1, source.rows);
  std::vector<std::string> errors(static_cast<size_t>(workers));
  {
    std::vector<std::jthread> pool;
    for (int64_t t = 0; t < workers; ++t) {
      pool.emplace_back([&, t] {
        quantize_rows(source, source.rows * t / workers, source.rows * (t + 1) / workers, out,
                      errors[static_cast<size_t>(t)]);
      });
    }
  }
  for (const std::string& error : errors) {
    if (!error.empty())
      return make_error(ErrorCode::kInvalidArgument, "8-bit quantization: {}", error);
  }
  return out;
}

}  // namespace gemma4::quant
