// Host side of the tensor-core batched GEMV (gemv_mma.h): validation, tiling choice, translation
// of a QMatrix into the kernel's parameter block (gemv_mma_kernels.h).
#include "backend/cuda/gemv_mma.h"

#include <algorithm>

namespace gemma4::cuda {
namespace {

// SMs of the H200, the GPU the choice is tuned for, and the whole thread-block clusters it holds
// at once per block slot of an SM: a cluster runs within one GPC (8 of 16-18 SMs each), so
// clusters of `splits` blocks fit about 8 · floor(16 · blocks per SM / splits) at a time.
constexpr int64_t kSms = 132;
constexpr int64_t kGpcs = 8;
constexpr int64_t kSmsPerGpc = 16;

// The default tiling takes warps of one 16-row tile (twice the warps per SM of two-tile warps,
// each multiplying half the rows) from 17 activation rows for matrices of 8,192+ rows: there
// they won in kernel_bench's sweep (H200, PDL µs, fp32 rows rounded to bf16: E2B gate+up
// 12288x1536 M=64 23.7 -> 22.2, M=32 16.2 -> 15.5; lm_head M=64 312 -> 256); on fewer rows
// (E2B down, o_proj; 26B gate+up, down) the two-tile ones were as fast or faster.
constexpr int kOneTileMinRows = 17;
constexpr int64_t kOneTileMinMatrixRows = 8192;

// Tilings measured faster than the cost model's choice (kernel_bench sweeps, H200, PDL µs) for a
// weight shape and a range of activation rows; the first match. Sessions 8 to 10; sessions 9 and
// 10 with the activations the engine passes: bf16 companions (session 9's o_proj: fp32 rows
// rounded to bf16, what the engine passed above 16 rows until session 10).
struct MeasuredTiling {
  int64_t rows, cols;
  int min_m, max_m;
  MmaGemvTiling tiling;
};
constexpr MmaGemvTrigger kLateTrigger = MmaGemvTrigger::kAfterProducts;
constexpr MeasuredTiling kMeasuredTilings[] = {
    // E2B 1,536-row outputs at 33-64 rows: two blocks along the activation rows of 32 each
    // (twice the blocks of one, each with half the staging and K-split reduction), 8 splits,
    // dependents triggered after the products. down (bf16 rows): one-tile warps of 128-row tiles
    // (M=64 K 6144 15.12 -> 13.51, K 12288 24.62 -> 22.63); o_proj (fp32 rows): two-tile warps of
    // 256-row tiles (K 2048 9.92 -> 7.72, K 4096 11.05).
    {1536, 6144, 33, 64, {8, 8, 1, 0, 1, kLateTrigger, false, 2}},
    {1536, 12288, 33, 64, {8, 8, 1, 0, 1, kLateTrigger, false, 2}},
    {1536, 2048, 33, 64, {8, 8, 1, 0, 2, kLateTrigger, false, 2}},
    {1536, 4096, 33, 64, {8, 8, 1, 0, 2, kLateTrigger, false, 2}},
    // E2B q / qkv at 33-64 rows: one-tile warps of 128-row tiles, 4 splits, dependents triggered
    // after the products (earlier, a PDL dependent packed into the second block slots slowed
    // them: 10144 at 2560 rows plain 9.81, PDL 11.78); two blocks along the activation rows at
    // 2,048-2,560 rows. M=64: 2560 9.69 -> 8.61, 2048 8.65 -> 8.40, 4096 19.20 -> 12.34, 5120
    // 22.54 -> 12.59.
    {2560, 1536, 33, 64, {8, 4, 1, 0, 1, kLateTrigger, false, 2}},
    {2048, 1536, 33, 64, {8, 4, 1, 0, 1, kLateTrigger, false, 2}},
    {4096, 1536, 33, 64, {8, 4, 1, 0, 1, kLateTrigger}},
    {5120, 1536, 33, 64, {8, 4, 1, 0, 1, kLateTrigger}},
    // E2B QKV up to 32 rows: 8 splits of 256-row tiles (M=32 7.62 -> 7.43, M=16 6.63 -> 5.86,
    // M=8 5.42 -> 4.89); o_proj the same at 9-16 rows (M=16 6.48 -> 6.00).
    {2560, 1536, 2, 32, {8, 8, 1}},
    {1536, 2048, 9, 16, {8, 8, 1}},
    // E2B 1,536-row outputs up to 16 rows (up to 8 for o_proj 1536x2048): two-tile warps two
    // along K per 128-row tile, 8 splits, two blocks an SM, dependents triggered after the
    // products. M=8: o_proj K 2048 4.91 -> 4.28, K 4096 7.33 -> 5.61, down (bf16 rows) K 6144
    // 7.72 -> 6.61, K 12288 10.67 -> 10.18; M=16 down 8.55 -> 7.79, 12.35 -> 12.21.
    {1536, 2048, 2, 8, {4, 8, 2, 0, 2, kLateTrigger}},
    {1536, 4096, 2, 16, {4, 8, 2, 0, 2, kLateTrigger}},
    {1536, 6144, 2, 16, {4, 8, 2, 0, 2, kLateTrigger}},
    {1536, 12288, 2, 16, {4, 8, 2, 0, 2, kLateTrigger}},
    // E2B gate+up (GELU pairs, bf16 companion) at 33-64 rows: two blocks along the activation
    // rows, 2 splits, dependents triggered after the products; 12288 rows: two-tile warps of
    // 128-row tiles (M=64 21.40 -> 20.19), double-wide 24576: looping two-tile warps of 256-row
    // tiles (35.71 -> 33.33). Double-wide at 17-32 rows: two-tile warps of 128-row tiles, 2 splits
    // (M=32 22.51 -> 20.69).
    {12288, 1536, 33, 64, {4, 2, 1, 0, 2, kLateTrigger, false, 2}},
    {24576, 1536, 33, 64, {8, 2, 1, kMmaGemvResidentRowBlocks, 2, kLateTrigger, false, 2}},
    {24576, 1536, 17, 32, {4, 2, 1, 0, 2, kLateTrigger}},
    // E2B PLE gate (GELU-mul) and projection at 17-64 rows: one block per 8 activation rows (the
    // cost model's 12-24 blocks left most SMs idle). Gate: two-tile warps of 128-row tiles, 8
    // splits, late trigger up to 32 rows (M=32 6.19 -> 4.06); 33-64 one-tile warps, 4 splits,
    // trigger at the start (M=64 8.33 -> 4.37). Projection (K 256): two-tile warps two along K,
    // one split, late trigger (M=32 5.10 -> 2.86, M=64 7.40 -> 3.02).
    {256, 1536, 17, 32, {4, 8, 1, 0, 2, kLateTrigger, false, 8}},
    {256, 1536, 33, 64, {8, 4, 1, 0, 1, MmaGemvTrigger::kAtStart, false, 8}},
    {1536, 256, 17, 64, {4, 1, 2, 0, 2, kLateTrigger, false, 8}},
    // 26B-A4B QKV (NVFP4): 16 one-tile warps (two along K) per 128-row tile, 2 splits (M=32
    // 21.6 -> 18.9), looping up to 8 rows (M=8 14.48 -> 11.84); o_proj: looping 256-row tiles,
    // 8 splits (M=32 13.2 -> 11.2).
    {8192, 2816, 17, 32, {8, 2, 2, 0, 1}},
    {8192, 2816, 2, 8, {8, 2, 2, kMmaGemvResidentRowBlocks, 1}},
    {2816, 4096, 17, 32, {8, 8, 1, kMmaGemvResidentRowBlocks}},
};

// Blocks of this tiling one SM holds at once, by registers (ptxas: at most 128 a thread up to 16
// activation rows and for one-tile warps, 199-217 up to 32, 242-255 up to 64, of 64 K an SM) and
// by shared memory.
int64_t blocks_per_sm(const MmaGemvTiling& tiling, int m, int64_t groups) {
  const int64_t registers = m <= 16 || tiling.tiles_per_warp == 1 ? 128 : m <= 32 ? 224 : 255;
  const int64_t by_registers = 65536 / (registers * 32 * tiling.warps * tiling.k_warps);
  const int64_t by_shared =
      (kMmaGemvMaxSharedBytes + 1024) / (mma_gemv_shared_bytes(tiling, m, groups) + 1024);
  return std::max<int64_t>(1, std::min(by_registers, by_shared));
}

// Clusters of this tiling the GPU holds at once (one block each when not split).
int64_t resident_clusters(const MmaGemvTiling& tiling, int m, int64_t groups) {
  const int64_t per_sm = blocks_per_sm(tiling, m, groups);
  if (tiling.splits == 1) return kSms * per_sm;
  return std::max<int64_t>(1, kGpcs * (kSmsPerGpc * per_sm / tiling.splits));
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Whether the kernel can multiply these operands (gemv_mma_takes, any row count of the kernel).
bool mma_operands_ok(const quant::QMatrix& w, const GemvInput& x) {
  const bool mma_activations = x.type == ActType::kBF16 || x.type == ActType::kQ8 ||
                               (x.type == ActType::kF32 && x.round_to_bf16);
  // NVFP4 block scales are loaded in pairs (a group's two): 2-byte aligned.
  const bool format_ok = w.format == quant::WeightFormat::kW4G32 ||
                         (w.format == quant::WeightFormat::kNVFP4 && x.type != ActType::kQ8 &&
                          (reinterpret_cast<uintptr_t>(w.scales) & 1) == 0);
  if (!format_ok || !mma_activations || x.rows < kMmaGemvMinRows || x.rows > kMmaGemvMaxRows ||
      w.cols < 32) {
    return false;
  }
  // The most splits stage the least: a K whose slice does not fit even then stays on the GEMV.
  const int64_t groups = w.cols / 32;
  const MmaGemvTiling most_split = {
      4, static_cast<int>(std::min<int64_t>(kMmaGemvMaxSplits, groups)), 2};
  return mma_gemv_shared_bytes(most_split, x.rows, groups) <= kMmaGemvMaxSharedBytes;
}

// Whether the streamed kernel can multiply these operands at `tiling` (gemv_mma_kernels.h).
bool streamed_operands_ok(const quant::QMatrix& w, const GemvInput& x,
                          const MmaGemvTiling& tiling) {
  // Block scales copied 4 bytes (two groups) at a time.
  return w.format == quant::WeightFormat::kNVFP4 && x.type == ActType::kBF16 &&
         (reinterpret_cast<uintptr_t>(w.scales) & 3) == 0 && (w.cols / 32) % 2 == 0 &&
         mma_gemv_block_m(tiling, x.rows) <= 32 && tiling.k_warps == 1 && tiling.row_blocks == 0 &&
         mma_gemv_streamed_shared_bytes(tiling, x.rows) <= kMmaGemvMaxSharedBytes;
}

// The streamed kernel where kernel_bench measured it faster than the register kernel's default
// (H200, PDL µs, session 12, bf16 rows; elsewhere, the 26B QKV at 17-32 and 2-8 rows and gate+up
// at 2-8 included, it was slower or equal). 17-32 rows, 256-row blocks of 8 two-tile warps:
// gate+up 12.86 -> 10.51, down 9.01 -> 8.08, o_proj 10.72 -> 9.91; 9-16 rows, 256-row blocks for
// QKV (15.86 -> 13.05), 128-row blocks of 4 two-tile warps for gate+up (8.69 -> 7.96), down
// (7.58 -> 6.08) and o_proj (8.74 -> 7.34); 2-8 rows, 128-row blocks of 8 one-tile warps for down
// (6.32 -> 5.28) and o_proj (7.29 -> 6.48).
struct StreamedTiling {
  int64_t rows, cols;
  int min_m, max_m;
  MmaGemvWarpLayout layout;
  int splits;
};
constexpr MmaGemvWarpLayout kStreamed256 = {8, 1, 2};
constexpr MmaGemvWarpLayout kStreamed128TwoTile = {4, 1, 2};
constexpr MmaGemvWarpLayout kStreamed128OneTile = {8, 1, 1};
constexpr StreamedTiling kStreamedTilings[] = {
    {4224, 2816, 17, 32, kStreamed256, 6},       {2816, 2112, 17, 32, kStreamed256, 6},
    {2816, 4096, 17, 32, kStreamed256, 8},       {8192, 2816, 9, 16, kStreamed256, 3},
    {4224, 2816, 9, 16, kStreamed128TwoTile, 6}, {2816, 2112, 9, 16, kStreamed128TwoTile, 8},
    {2816, 4096, 9, 16, kStreamed128TwoTile, 8}, {2816, 2112, 2, 8, kStreamed128OneTile, 6},
    {2816, 4096, 2, 8, kStreamed128OneTile, 8},
};

// The streamed tiling measured for this shape and row count; warps 0 where there is none.
MmaGemvTiling default_streamed_tiling(int64_t rows, int64_t cols, int m) {
  for (const StreamedTiling& measured : kStreamedTilings) {
    if (measured.rows == rows && measured.cols == cols && m >= measured.min_m &&
        m <= measured.max_m) {
      MmaGemvTiling tiling = mma_gemv_tiling(measured.layout, measured.splits);
      tiling.streamed = true;
      return tiling;
    }
  }
  return {0, 0};
}

}  // namespace

bool gemv_mma_takes(const quant::QMatrix& w, const GemvInput& x) {
  return x.rows >= kMmaGemvRoutedMinRows && mma_operands_ok(w, x);
}

MmaGemvTiling default_mma_gemv_tiling(int64_t rows, int64_t cols, int m, ActType x_type) {
  // A measured tiling where there is one (kMeasuredTilings). Else wide tiles where there are rows
  // enough: every block re-reads the activations of its K range, so 256 rows per tile halve that
  // traffic; else 128 rows with two warps along K each (few rows: more warps for the same
  // activation traffic). Then the K splits and row blocks of the least time on a block's critical
  // path, counted in 32-element groups of weights per row tile: its K range per tile plus a
  // reduction, and the staging of its activations (about one group per group of K at 64 fp32 rows),
  // once per block. Blocks of one tile each run in waves of clusters; looping blocks (the clusters
  // that fit at once) take ceil(tiles / clusters) tiles each and stage once, where their two
  // partial-sum buffers fit. A split more only for a clearly shorter path: each adds partial sums
  // to the cluster's reduction.
  for (const MeasuredTiling& measured : kMeasuredTilings) {
    if (measured.rows == rows && measured.cols == cols && m >= measured.min_m &&
        m <= measured.max_m &&
        mma_gemv_shared_bytes(measured.tiling, m, cols / 32) <= kMmaGemvMaxSharedBytes) {
      return measured.tiling;
    }
  }
  constexpr double kReductionGroups = 2.0;
  const int64_t groups = cols / 32;
  // The staging reads the activations as given: fp32 twice bf16's bytes, kQ8 1.25 a value.
  const double staged_bytes_per_element = x_type == ActType::kF32    ? 4.0
                                          : x_type == ActType::kBF16 ? 2.0
                                                                     : 1.25;
  // The same row tiles with twice the warps of one 16-row tile each (kOneTileMinRows).
  const int tiles_per_warp = m >= kOneTileMinRows && rows >= kOneTileMinMatrixRows ? 1 : 2;
  const int tile_rows = rows >= 8192 ? 256 : 128;
  const int warps = tile_rows / (16 * tiles_per_warp);
  const int k_warps = tile_rows == 128 ? 2 : 1;
  const int64_t row_tiles = (rows + tile_rows - 1) / tile_rows;
  const int max_splits = static_cast<int>(std::min<int64_t>(kMmaGemvMaxSplits, groups));
  MmaGemvTiling best = {warps, max_splits, k_warps, 0, tiles_per_warp};
  double best_cost = 0.0;
  for (int splits = 1; splits <= max_splits; ++splits) {
    for (const int row_blocks : {0, kMmaGemvResidentRowBlocks}) {
      const MmaGemvTiling tiling = {warps, splits, k_warps, row_blocks, tiles_per_warp};
      if (mma_gemv_shared_bytes(tiling, m, groups) > kMmaGemvMaxSharedBytes) continue;
      const int64_t clusters = resident_clusters(tiling, m, groups);
      const auto per_split = static_cast<double>(mma_gemv_groups_per_split(groups, splits));
      const double per_tile = per_split + kReductionGroups;
      const double staging = per_split * m / 64.0 * staged_bytes_per_element / 4.0;
      const auto rounds = static_cast<double>((row_tiles + clusters - 1) / clusters);
      const double cost = row_blocks == 0 ? rounds * (per_tile + staging)  // waves
                                          : rounds * per_tile + staging;   // tiles per block
      if (best_cost == 0.0 || cost < best_cost * 0.95) {
        best = tiling;
        best_cost = cost;
      }
    }
  }
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
  if (tiling.warps == 0) {
    const MmaGemvTiling streamed = default_streamed_tiling(w.rows, w.cols, x.rows);
    tiling = streamed.warps != 0 && streamed_operands_ok(w, x, streamed)
                 ? streamed
                 : default_mma_gemv_tiling(w.rows, w.cols, x.rows, x.type);
  }
  // The kernel indexes (row, group) in 32 bits.
  const bool tiling_ok =
      tiling.splits >= 1 && tiling.splits <= kMmaGemvMaxSplits && tiling.splits <= groups &&
      tiling.activation_blocks >= 1 && tiling.activation_blocks <= kMmaGemvMaxRows / 8 &&
      w.rows * groups <= 0x7FFFFFFF &&
      (tiling.streamed
           ? streamed_operands_ok(w, x, tiling)
           : mma_gemv_warp_layout(tiling) >= 0 && tiling.row_blocks >= kMmaGemvResidentRowBlocks &&
                 mma_gemv_shared_bytes(tiling, x.rows, groups) <= kMmaGemvMaxSharedBytes);
  if (!tiling_ok) return cudaErrorInvalidValue;

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
  if (tiling.streamed) return launch_gemv_mma_streamed(args, tiling, launch);
  return launch_gemv_mma(format, args, x.type, tiling, launch);
}

}  // namespace gemma4::cuda
