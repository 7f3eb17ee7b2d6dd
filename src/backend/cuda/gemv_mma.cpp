// Host side of the tensor-core batched GEMV (gemv_mma.h): validation, tiling choice, translation
// of a QMatrix into the kernel's parameter block (gemv_mma_kernels.h).
#include "backend/cuda/gemv_mma.h"

#include <algorithm>

namespace gemma4::cuda {
namespace {

// SMs of the H200, the GPU the choice is tuned for.
constexpr int64_t kSms = 132;

// Blocks of this tiling one SM holds at once by registers (ptxas: about 128 a thread up to 16
// activation rows, 170 up to 32, 250 up to 64, of 64 K an SM). Shared memory is left out: it
// would make the splits that stage less look emptier, not faster.
int64_t blocks_per_sm(const MmaGemvTiling& tiling, int m) {
  const int64_t registers = m <= 16 ? 128 : m <= 32 ? 170 : 250;
  return std::max<int64_t>(1, 65536 / (registers * 32 * tiling.warps * tiling.k_warps));
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Whether the kernel can multiply these operands (gemv_mma_takes, any row count of the kernel).
bool mma_operands_ok(const quant::QMatrix& w, const GemvInput& x) {
  const bool mma_activations = x.type == ActType::kBF16 || x.type == ActType::kQ8 ||
                               (x.type == ActType::kF32 && x.round_to_bf16);
  const bool format_ok = w.format == quant::WeightFormat::kW4G32 ||
                         (w.format == quant::WeightFormat::kNVFP4 && x.type != ActType::kQ8);
  if (!format_ok || !mma_activations || x.rows < kMmaGemvMinRows || x.rows > kMmaGemvMaxRows ||
      w.cols < 32) {
    return false;
  }
  // The most splits stage the least: a K whose slice does not fit even then stays on the GEMV.
  const int64_t groups = w.cols / 32;
  const MmaGemvTiling most_split = {
      4, static_cast<int>(std::min<int64_t>(kMmaGemvMaxSplits, groups)), 2};
  return mma_gemv_shared_bytes(most_split, x.rows, groups, x.type) <= kMmaGemvMaxSharedBytes;
}

}  // namespace

bool gemv_mma_takes(const quant::QMatrix& w, const GemvInput& x) {
  return x.rows >= kMmaGemvRoutedMinRows && mma_operands_ok(w, x);
}

MmaGemvTiling default_mma_gemv_tiling(int64_t rows, int64_t cols, int m, ActType x_type) {
  // Wide blocks where there are rows enough: every block re-reads the activations of its K range,
  // so 256 rows per block halve that traffic; else 128 rows with two warps each (few rows: more
  // warps for the same activation traffic). Then the K splits that fill the GPU's block slots
  // most evenly (whole waves); a split more only for a clearly fuller GPU, since each adds a
  // share of partial sums to the cluster's reduction. Not yet measured (kernel_bench sweeps every
  // tiling).
  const int64_t groups = cols / 32;
  const int warps = rows >= 8192 ? 8 : 4;
  const int k_warps = warps == 4 ? 2 : 1;
  const int64_t row_blocks = (rows + 32 * warps - 1) / (32 * warps);
  const int max_splits = static_cast<int>(std::min<int64_t>(kMmaGemvMaxSplits, groups));
  MmaGemvTiling best = {warps, max_splits, k_warps};
  double best_fill = 0.0;
  for (int splits = 1; splits <= max_splits; ++splits) {
    const MmaGemvTiling tiling = {warps, splits, k_warps};
    if (mma_gemv_shared_bytes(tiling, m, groups, x_type) > kMmaGemvMaxSharedBytes) continue;
    const int64_t slots = kSms * blocks_per_sm(tiling, m);
    const int64_t blocks = row_blocks * splits;
    const int64_t waves = (blocks + slots - 1) / slots;
    const double fill = static_cast<double>(blocks) / static_cast<double>(waves * slots);
    if (fill > best_fill * 1.05) {
      best = tiling;
      best_fill = fill;
    }
  }
  // Then no second wave: the clusters that fit at once (the launch asks the occupancy calculator:
  // a GPC holds whole clusters only, so even blocks = SMs may not fit), each looping over row
  // tiles where there are more (its activations staged once, the next tile's weights loading
  // during the last one's reduction); one tile per block where all fit. Only where the two
  // partial-sum buffers fit beside the activations.
  const MmaGemvTiling looping = {best.warps, best.splits, best.k_warps, kMmaGemvResidentRowBlocks};
  if (mma_gemv_shared_bytes(looping, m, groups, x_type) <= kMmaGemvMaxSharedBytes) return looping;
  return best;
}

cudaError_t gemv_mma(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y,
                     const Launch& launch, MmaGemvTiling tiling) {
  if (!mma_operands_ok(w, x)) return cudaErrorInvalidValue;
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
       (y.multiplier != nullptr && y.multiplier_stride >= w.rows)) &&
      companions_fit(y.companions, width) &&
      (y.companions.q8 == nullptr || y.epilogue == GemvEpilogue::kGeluPairs);
  if (!operands_ok) return cudaErrorInvalidValue;
  const int64_t groups = w.cols / 32;
  if (tiling.warps == 0) tiling = default_mma_gemv_tiling(w.rows, w.cols, x.rows, x.type);
  if (mma_gemv_warp_layout(tiling) < 0 || tiling.splits < 1 || tiling.splits > kMmaGemvMaxSplits ||
      tiling.splits > groups || tiling.row_blocks < kMmaGemvResidentRowBlocks ||
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
  args.y_companions = y.companions;
  args.epilogue = y.epilogue;
  args.multiplier = y.multiplier;
  args.multiplier_stride = y.multiplier_stride;
  const PackedFormat format =
      w.format == quant::WeightFormat::kNVFP4 ? PackedFormat::kNVFP4 : PackedFormat::kW4G32;
  return launch_gemv_mma(format, args, x.type, tiling, launch);
}

}  // namespace gemma4::cuda
