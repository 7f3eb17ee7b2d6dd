// Host side of the tensor-core batched GEMV (gemv_mma.h): validation, tiling choice, translation
// of a QMatrix into the kernel's parameter block (gemv_mma_kernels.h).
#include "backend/cuda/gemv_mma.h"

#include <algorithm>

namespace gemma4::cuda {
namespace {

// Blocks a launch aims for: two per SM of an H200 (132 SMs), so that each SM has two blocks' weight
// loads in flight.
constexpr int64_t kTargetBlocks = 264;

// Shared memory that still lets two blocks share an SM.
constexpr int64_t kTwoBlocksSharedBytes = kMmaGemvMaxSharedBytes / 2;

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace

bool gemv_mma_takes(const quant::QMatrix& w, const GemvInput& x) {
  const bool mma_activations = x.type == ActType::kBF16 || x.type == ActType::kQ8 ||
                               (x.type == ActType::kF32 && x.round_to_bf16);
  const bool format_ok = w.format == quant::WeightFormat::kW4G32 ||
                         (w.format == quant::WeightFormat::kNVFP4 && x.type != ActType::kQ8);
  return format_ok && mma_activations && x.rows >= kMmaGemvMinRows && x.rows <= kMmaGemvMaxRows;
}

MmaGemvTiling default_mma_gemv_tiling(int64_t rows, int64_t cols, int m, ActType x_type) {
  // Wide blocks where there are rows enough: every block re-reads the activations of its K range,
  // so 256 rows per block halve that traffic. Then K splits until the launch fills the GPU (each
  // split adds a share of partial sums to the cluster's reduction) and the staged activations fit.
  const int warps = rows >= 8192 ? 8 : 4;
  const int64_t row_blocks = (rows + 32 * warps - 1) / (32 * warps);
  const int max_splits = static_cast<int>(std::min<int64_t>(kMmaGemvMaxSplits, cols / 32));
  MmaGemvTiling tiling = {
      warps, static_cast<int>(std::clamp<int64_t>((kTargetBlocks + row_blocks - 1) / row_blocks, 1,
                                                  max_splits))};
  while (tiling.splits < max_splits &&
         mma_gemv_shared_bytes(tiling, m, cols / 32, x_type) > kTwoBlocksSharedBytes) {
    ++tiling.splits;
  }
  return tiling;
}

cudaError_t gemv_mma(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y,
                     const Launch& launch, MmaGemvTiling tiling) {
  if (!gemv_mma_takes(w, x)) return cudaErrorInvalidValue;
  // kQ8 rows are stride · 5/4 bytes: 8-byte aligned (the kernel's loads) for a stride of 32s.
  const int64_t x_elem = x.type == ActType::kBF16 ? 2 : x.type == ActType::kQ8 ? 1 : 4;
  const int64_t width = y.epilogue == GemvEpilogue::kGeluPairs ? w.rows / 2 : w.rows;
  const bool operands_ok =
      w.rows > 0 && w.cols > 0 && w.cols % 32 == 0 && w.data != nullptr && w.scales != nullptr &&
      aligned16(w.data) && x.data != nullptr && aligned16(x.data) && x.stride >= w.cols &&
      (x.type == ActType::kQ8 ? x.stride % 32 == 0 : (x.stride * x_elem) % 16 == 0) &&
      y.data != nullptr && y.stride >= width &&
      (y.epilogue != GemvEpilogue::kGeluPairs || w.rows % 2 == 0) &&
      (y.epilogue != GemvEpilogue::kGeluMul ||
       (y.multiplier != nullptr && y.multiplier_stride >= w.rows));
  if (!operands_ok) return cudaErrorInvalidValue;
  const int64_t groups = w.cols / 32;
  if (tiling.warps == 0) tiling = default_mma_gemv_tiling(w.rows, w.cols, x.rows, x.type);
  if ((tiling.warps != 4 && tiling.warps != 8) || tiling.splits < 1 ||
      tiling.splits > kMmaGemvMaxSplits || tiling.splits > groups ||
      mma_gemv_shared_bytes(tiling, x.rows, groups, x.type) > kMmaGemvMaxSharedBytes ||
      (w.rows + 32 * tiling.warps - 1) / (32 * tiling.warps) > 0x7FFFFFFF) {
    return cudaErrorInvalidValue;
  }

  MmaGemvArgs args = {};
  args.weights = w.data;
  args.scales = w.scales;
  args.scale_type = static_cast<int>(w.scale_type);
  args.nv_global = w.nv_global.value;
  args.nv_global_is_divisor = w.nv_global.is_divisor ? 1 : 0;
  args.rows = w.rows;
  args.groups = groups;
  args.x = x.data;
  args.x_stride = x.stride;
  args.m = x.rows;
  args.y = y.data;
  args.y_stride = y.stride;
  args.epilogue = y.epilogue;
  args.multiplier = y.multiplier;
  args.multiplier_stride = y.multiplier_stride;
  const PackedFormat format =
      w.format == quant::WeightFormat::kNVFP4 ? PackedFormat::kNVFP4 : PackedFormat::kW4G32;
  return launch_gemv_mma(format, args, x.type, tiling, launch);
}

}  // namespace gemma4::cuda
