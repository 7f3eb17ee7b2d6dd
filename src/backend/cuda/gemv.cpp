// Host side of the decode GEMV (gemv.h): validation, tiling choice, translation of a QMatrix into
// the kernels' parameter block (gemv_kernels.h).
#include "backend/cuda/gemv.h"

namespace gemma4::cuda {
namespace {

using quant::WeightFormat;

// The kernels read scale_type as these integers.
static_assert(static_cast<int>(quant::ScaleType::kBF16) == 0 &&
              static_cast<int>(quant::ScaleType::kF16) == 1 &&
              static_cast<int>(quant::ScaleType::kF32) == 2);

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

int64_t chunk_elements(WeightFormat format) {
  return format == WeightFormat::kBF16 ? 8 : 32;
}

}  // namespace

std::span<const GemvTiling> gemv_tilings() {
  return kGemvTilings;
}

int default_gemv_tiling(const quant::QMatrix& w, int m) {
  const int64_t chunks = w.cols / chunk_elements(w.format);
  if (m > 1) {
    if (chunks <= 24) return 13;
    if (chunks <= 48) return 10;
    if (chunks <= 96) return 11;
    return 12;
  }
  if (w.rows >= 65536) return 4;
  if (chunks <= 24) return 4;
  if (chunks <= 48) return 0;
  if (chunks <= 96) return 6;
  return 7;
}

cudaError_t gemv(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y,
                 const Launch& launch, int tiling) {
  PackedFormat format;
  switch (w.format) {
    case WeightFormat::kW4G32:
      format = PackedFormat::kW4G32;
      break;
    case WeightFormat::kNVFP4:
      format = PackedFormat::kNVFP4;
      break;
    case WeightFormat::kBF16:
      format = PackedFormat::kBF16;
      break;
    default:
      return cudaErrorInvalidValue;
  }
  const int64_t x_elem = x.type == ActType::kBF16 ? 2 : 4;
  const bool shape_ok = w.rows > 0 && w.cols > 0 && w.cols % 32 == 0 && x.rows >= 1 &&
                        x.rows <= 64 && (x.rows == 1 || (x.stride >= w.cols && y.stride >= w.rows));
  const bool pointers_ok = aligned16(w.data) && aligned16(x.data) &&
                           (x.stride * x_elem) % 16 == 0 && y.data != nullptr &&
                           (w.format == WeightFormat::kBF16 || w.scales != nullptr);
  if (!shape_ok || !pointers_ok || tiling >= kNumGemvTilings) return cudaErrorInvalidValue;
  if (tiling < 0) tiling = default_gemv_tiling(w, x.rows);

  GemvArgs args = {};
  args.weights = w.data;
  args.scales = w.scales;
  args.scale_type = static_cast<int>(w.scale_type);
  args.nv_global = w.nv_global.value;
  args.nv_global_is_divisor = w.nv_global.is_divisor ? 1 : 0;
  args.rows = w.rows;
  args.chunks_per_row = w.cols / chunk_elements(w.format);
  args.x = x.data;
  args.x_stride = x.stride;
  args.m = x.rows;
  args.y = y.data;
  args.y_stride = y.stride;
  return launch_gemv_kernel(format, x.type, tiling, args, launch);
}

}  // namespace gemma4::cuda
