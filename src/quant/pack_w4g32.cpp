#include "quant/pack_w4g32.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "core/numeric.h"

namespace gemma4::quant {
namespace {

constexpr int64_t kGroup = 32;
constexpr int kLevelMin = -8;
constexpr int kLevelMax = 7;

// Offset-binary levels (q + 8) of one group for scale s, or false if some value is not q·s.
bool levels_for_scale(const std::array<float, kGroup>& values, float s,
                      std::array<uint8_t, kGroup>& offset_levels) {
  for (int64_t i = 0; i < kGroup; ++i) {
    const float q = values[i] / s;
    if (q != std::nearbyint(q) || q < kLevelMin || q > kLevelMax || q * s != values[i])
      return false;
    offset_levels[i] = static_cast<uint8_t>(static_cast<int>(q) - kLevelMin);
  }
  return true;
}

// The scale (bf16 bits) and levels of one group on the grid, or false (pack_w4g32.h explains
// the candidates).
bool exact_group(const std::array<float, kGroup>& values, uint16_t& scale_bits,
                 std::array<uint8_t, kGroup>& offset_levels) {
  float amax = 0.0f;
  for (float v : values) {
    if (!std::isfinite(v)) return false;
    amax = std::max(amax, std::fabs(v));
  }
  if (amax == 0.0f) {
    scale_bits = 0;
    offset_levels.fill(static_cast<uint8_t>(-kLevelMin));
    return true;
  }
  for (float sign : {1.0f, -1.0f}) {
    for (int k = -kLevelMin; k >= 1; --k) {
      // Correctly rounded, so an exactly representable amax / k comes out exact.
      const float s = sign * amax / static_cast<float>(k);
      if (!std::isnormal(s) || round_bf16(s) != s) continue;
      if (levels_for_scale(values, s, offset_levels)) {
        scale_bits = float_to_bf16(s);
        return true;
      }
    }
  }
  return false;
}

struct OffGrid {
  int64_t row = -1;
  int64_t group = -1;
};

// Scans rows [first, last) and, when `out` is set, writes their packed words and scales.
// Stops at the first group off the grid or once `stop` is raised by another thread.
OffGrid scan_rows(const QMatrix& m, int64_t first, int64_t last, PackedMatrix* out,
                  const std::atomic<bool>& stop) {
  const int64_t groups = m.cols / kGroup;
  const auto* base = static_cast<const std::byte*>(m.data);
  std::array<uint16_t, kGroup> bits{};
  std::array<float, kGroup> values{};
  std::array<uint8_t, kGroup> levels{};
  for (int64_t r = first; r < last; ++r) {
    if (stop.load(std::memory_order_relaxed)) return {};
    for (int64_t g = 0; g < groups; ++g) {
      // memcpy: checkpoint tensors need not be aligned (qmatrix.h).
      std::memcpy(bits.data(), base + 2 * (r * m.cols + g * kGroup), sizeof(bits));
      for (int64_t i = 0; i < kGroup; ++i) values[i] = bf16_to_float(bits[i]);
      uint16_t scale = 0;
      if (!exact_group(values, scale, levels)) return {r, g};
      if (out == nullptr) continue;
      std::byte* packed = out->data.data() + r * (m.cols / 2) + g * (kGroup / 2);
      for (int64_t i = 0; i < kGroup / 2; ++i) {
        // Element 2i in the low nibble of byte i: little-endian u32 words, element 0 lowest.
        packed[i] = static_cast<std::byte>(levels[2 * i] | (levels[2 * i + 1] << 4));
      }
      std::memcpy(out->scales.data() + 2 * (r * groups + g), &scale, 2);
    }
  }
  return {};
}

Status scan(const QMatrix& m, int threads, PackedMatrix* out) {
  if (m.format != WeightFormat::kBF16)
    return make_error(ErrorCode::kUnsupported, "w4g32 packing reads bf16 matrices, not {}",
                      weight_format_name(m.format));
  if (m.rows <= 0 || m.cols <= 0 || m.cols % kGroup != 0 || m.data == nullptr)
    return make_error(ErrorCode::kInvalidArgument,
                      "w4g32 packing needs data, positive rows and cols a multiple of 32, got "
                      "[{}, {}]",
                      m.rows, m.cols);
  if (out != nullptr) {
    out->format = WeightFormat::kW4G32;
    out->rows = m.rows;
    out->cols = m.cols;
    out->scale_type = ScaleType::kBF16;
    out->data.resize(static_cast<size_t>(m.rows * m.cols / 2));
    out->scales.resize(static_cast<size_t>(m.rows * (m.cols / kGroup) * 2));
  }
  const int64_t workers = std::clamp<int64_t>(
      threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency()), 1, m.rows);
  std::vector<OffGrid> found(static_cast<size_t>(workers));
  std::atomic<bool> stop{false};
  {
    std::vector<std::jthread> pool;
    for (int64_t w = 0; w < workers; ++w) {
      pool.emplace_back([&, w] {
        const int64_t first = m.rows * w / workers, last = m.rows * (w + 1) / workers;
        found[w] = scan_rows(m, first, last, out, stop);
        if (found[w].row >= 0) stop.store(true, std::memory_order_relaxed);
      });
    }
  }
  for (const OffGrid& off : found) {  // in row order: the first worker that found one
    if (off.row < 0) continue;
    std::array<float, 4> head{};
    const auto* base = static_cast<const std::byte*>(m.data);
    for (size_t i = 0; i < head.size(); ++i) {
      uint16_t bits = 0;
      std::memcpy(&bits, base + 2 * (off.row * m.cols + off.group * kGroup + i), 2);
      head[i] = bf16_to_float(bits);
    }
    return make_error(ErrorCode::kUnsupported,
                      "not on a w4g32 grid: row {}, columns [{}, {}) (starting {}, ...) are not "
                      "q*s for one bf16 scale s and integers q in [-8, 7]",
                      off.row, off.group * kGroup, (off.group + 1) * kGroup, fmt::join(head, ", "));
  }
  return Status::ok_status();
}

}  // namespace

Expected<PackedMatrix> pack_w4g32_exact(const QMatrix& matrix, int threads) {
  PackedMatrix packed;
  GEMMA4_RETURN_IF_ERROR(scan(matrix, threads, &packed));
  return packed;
}

Status check_w4g32_exact(const QMatrix& matrix, int threads) {
  return scan(matrix, threads, nullptr);
}

}  // namespace gemma4::quant
