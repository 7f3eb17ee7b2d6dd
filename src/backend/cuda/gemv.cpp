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

// Fastest tiling per shape in the first H200 run (bench/RESULTS.md, graph replays with PDL).
int default_gemv_tiling(const quant::QMatrix& w, int m, ActType x_type) {
  const int64_t chunks = w.cols / chunk_elements(w.format);
  if (m > 1) return m == 2 && chunks <= 48 ? 11 : 12;
  if (chunks <= 24) return 2;  // 26B expert down (K 704)
  if (chunks <= 48) {
    if (w.rows >= 131072) return x_type == ActType::kF32 ? 5 : 4;  // lm_head
    if (w.rows >= 16384) return 4;                                 // double-wide gate+up
    if (w.rows >= 8192) return 1;                                  // gate+up
    return 3;                                                      // QKV
  }
  if (chunks <= 64) return 8;  // o_proj
  if (chunks <= 96) return 7;  // 26B expert gate+up (K 2816)
  return 8;                    // down projections
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
  // kQ8 rows are stride · 5/4 bytes; alignment of the stride is checked in elements.
  const int64_t x_elem = x.type == ActType::kBF16 ? 2 : x.type == ActType::kQ8 ? 1 : 4;
  if (x.type == ActType::kQ8 && (w.format != WeightFormat::kW4G32 || x.stride % 32 != 0)) {
    return cudaErrorInvalidValue;
  }
  const bool shape_ok = w.rows > 0 && w.cols > 0 && w.cols % 32 == 0 && x.rows >= 1 &&
                        x.rows <= 64 && (x.rows == 1 || (x.stride >= w.cols && y.stride >= w.rows));
  const bool pointers_ok = aligned16(w.data) && aligned16(x.data) &&
                           (x.stride * x_elem) % 16 == 0 && y.data != nullptr &&
                           (w.format == WeightFormat::kBF16 || w.scales != nullptr);
  if (!shape_ok || !pointers_ok || tiling >= kNumGemvTilings) return cudaErrorInvalidValue;
  if (tiling < 0) tiling = default_gemv_tiling(w, x.rows, x.type);

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

cudaError_t quantize_activations_q8(const float* x, int rows, int64_t cols, int64_t x_stride,
                                    void* out, int64_t out_stride, const Launch& launch) {
  if (x == nullptr || out == nullptr || rows < 1 || rows > 65535 || cols <= 0 || cols % 32 != 0 ||
      x_stride < cols || out_stride < cols || out_stride % 32 != 0 || !aligned16(out)) {
    return cudaErrorInvalidValue;
  }
  return launch_quantize_q8({x, x_stride, cols, out, out_stride}, rows, launch);
}

}  // namespace gemma4::cuda
