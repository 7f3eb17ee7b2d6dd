// The tensor-core batched GEMV's kernel interface (gemv_mma.cu): a plain parameter block, no
// checkpoint types (nvcc cannot parse fmt, which quant/qmatrix.h pulls in). gemv_mma.h is the API
// the engine uses; gemv_mma.cpp validates and translates to this.
//
// The kernel: y[m][n] = epilogue(Σ_k W[n][k] · x[m][k]) for 1..64 activation rows over packed
// w4g32 or NVFP4 weights, on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation). Weights are
// the A operand (16 weight rows per fragment), activations the B operand (8 rows per n tile). A
// lane loads one whole 32-element group per weight row (16 bytes), the 4 lanes of an mma quad 4
// consecutive groups, so one mma sums over 4 groups: the scale is applied to the weights first.
// w4g32 weights are dequantized to bf16 in registers, w = bf16((u − 8) · bf16(scale)): for bf16
// scales exactly the bf16 weights transformers' dequantization of W4A16 makes (f16 / f32 scales
// are rounded to bf16 first). NVFP4 weights enter as e2m1 value × e4m3 block scale (exact in
// bf16), the global factor applied to the sums. Activations (bf16, fp32 rounded to bf16, or kQ8's
// int8 · chunk scale rounded to bf16) are staged once per block in shared memory in the fragment
// order. Products of bf16 weights and activations are exact in fp32 and summed in fp32.
//
// Work split: a row tile is 16 · tiles_per_warp · warps consecutive weight rows (each warp one or
// two 16-row tiles: with two, every activation fragment read from shared memory feeds two mma;
// with one, half the accumulators and weight registers, so that at 33-64 activation rows twice
// the warps fit an SM; k_warps warps per row range take alternate groups); a block owns 1/splits of
// K and one row tile, or (row_blocks != 0) loops over the row tiles blockIdx.x + gridDim.x · i with
// its activations staged once and the next tile's weights in flight while it reduces the last; the
// `splits` blocks of one row range form a thread-block cluster that adds its partial sums through
// distributed shared memory in a fixed order (deterministic) before the epilogue. Looping blocks
// keep their partial sums past the staged activations in two buffers used alternately, so one
// cluster barrier per tile suffices.
#pragma once

#include <cstdint>

#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/launch.h"

namespace gemma4::cuda {

// Activation rows (1..64) the tensor-core GEMV multiplies when called directly (gemv_mma), and the
// fewest that gemv() sends to it: single rows stay on the CUDA-core GEMV (kernel_bench measures
// both at one row).
inline constexpr int kMmaGemvMinRows = 1;
inline constexpr int kMmaGemvMaxRows = 64;
inline constexpr int kMmaGemvRoutedMinRows = 2;

// Largest thread-block cluster (the portable size).
inline constexpr int kMmaGemvMaxSplits = 8;

// MmaGemvTiling::row_blocks: as many clusters as the GPU holds at once (the launch asks the
// occupancy calculator), each looping over row tiles.
inline constexpr int kMmaGemvResidentRowBlocks = -1;

// Where a block lets the next kernel of the stream be scheduled (PDL): at its start (the
// dependent's weight loads overlap all of this kernel), once its activations are staged, or once
// its products are summed (before the K-split reduction and the epilogue).
enum class MmaGemvTrigger : int { kAtStart = 0, kAfterStaging = 1, kAfterProducts = 2 };

struct MmaGemvTiling {
  int warps;        // warps along the rows: 16 · tiles_per_warp · warps weight rows per row tile
  int splits;       // 1..kMmaGemvMaxSplits blocks along K, one cluster
  int k_warps = 1;  // warps along the block's K range (their partial sums added in the block)
  // Blocks along the rows: 0, one per row tile; n > 0, n blocks (at most one per tile) that loop
  // over the tiles; kMmaGemvResidentRowBlocks, the clusters that fit the GPU at once, looping,
  // balanced (the fewest blocks for the same tiles per block). Wave-quantized grids (a second
  // wave of a few clusters) become one wave, and a block stages its activations once.
  int row_blocks = 0;
  int tiles_per_warp = 2;  // 16-row mma tiles per warp: 2 or 1
  MmaGemvTrigger trigger = MmaGemvTrigger::kAtStart;
  // One block per SM: shared memory padded past half an SM's (kMmaGemvExclusiveSharedBytes), so
  // that a PDL dependent of the same shape cannot be packed two blocks to an SM into the slots
  // this kernel leaves free (its blocks land one an SM, as without PDL).
  bool sm_exclusive = false;
  // Blocks along the activation rows (gridDim.z): each multiplies ceil(m / activation_blocks)
  // of them (rounded up to whole n tiles). Two at 64 rows: twice the blocks, each with the
  // accumulators, staging and K-split reduction of 32 rows (the weights read twice, the second
  // time mostly from L2).
  int activation_blocks = 1;
  // The streamed kernel (gemv_mma_streamed.cu: NVFP4 weights, bf16 activations, up to 32 rows a
  // block): a layout of kMmaGemvStreamedLayouts, one k warp, row_blocks 0.
  bool streamed = false;
};

// Weight rows of one row tile of the tiling.
constexpr int mma_gemv_tile_rows(const MmaGemvTiling& tiling) {
  return 16 * tiling.tiles_per_warp * tiling.warps;
}

// Activation rows one block multiplies (the n tiles of its kernel: mma_gemv_n_tiles of it).
constexpr int mma_gemv_block_m(const MmaGemvTiling& tiling, int m) {
  return (m + tiling.activation_blocks - 1) / tiling.activation_blocks;
}

// The compiled warp layouts {warps, k_warps, tiles_per_warp}: 4 or 8 warps of 32 rows, or 4 of
// them twice along K (twice the warps for the shapes with few rows: 1,536-row down / o_proj);
// and warps of one 16-row tile held to 128 registers: 8 warps (two blocks an SM), 16 warps, 8
// warps twice along K (16 warps an SM where one block per SM fits shared memory: 33-64 rows over
// a long K range; up to 16 rows, the deeper weight prefetch that 16 warps leave registers for).
struct MmaGemvWarpLayout {
  int warps;
  int k_warps;
  int tiles_per_warp = 2;
};
inline constexpr MmaGemvWarpLayout kMmaGemvWarpLayouts[] = {{4, 1},    {8, 1},     {4, 2},
                                                            {8, 1, 1}, {16, 1, 1}, {8, 2, 1}};
inline constexpr int kNumMmaGemvWarpLayouts = 6;

// The streamed kernel's layouts: 128-row blocks of 8 one-tile or 4 two-tile warps, 256-row
// blocks of 8 two-tile warps (16 one-tile warps: never the fastest in session 12's sweep).
inline constexpr MmaGemvWarpLayout kMmaGemvStreamedLayouts[] = {{8, 1, 1}, {4, 1, 2}, {8, 1, 2}};
inline constexpr int kNumMmaGemvStreamedLayouts = 3;

// The index of the tiling's layout in kMmaGemvWarpLayouts, -1 if none.
constexpr int mma_gemv_warp_layout(const MmaGemvTiling& tiling) {
  for (int i = 0; i < kNumMmaGemvWarpLayouts; ++i) {
    if (kMmaGemvWarpLayouts[i].warps == tiling.warps &&
        kMmaGemvWarpLayouts[i].k_warps == tiling.k_warps &&
        kMmaGemvWarpLayouts[i].tiles_per_warp == tiling.tiles_per_warp) {
      return i;
    }
  }
  return -1;
}

// The tiling `layout` of `splits` blocks along K (row_blocks as given).
constexpr MmaGemvTiling mma_gemv_tiling(const MmaGemvWarpLayout& layout, int splits,
                                        int row_blocks = 0) {
  return {layout.warps, splits, layout.k_warps, row_blocks, layout.tiles_per_warp};
}

// n tiles (8 activation rows each) a kernel covers for m rows: 1, 2, 4 or 8 (one instantiation
// each; rows past m are zeros that are never stored).
constexpr int mma_gemv_n_tiles(int m) {
  return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
}

// K groups one block of a cluster multiplies (the last one may have fewer, and a block past the
// end none): whole quads of 4 groups, the kernel's unit along K (gemv_mma_kernel.cuh).
constexpr int64_t mma_gemv_groups_per_split(int64_t groups, int splits) {
  return ((groups + splits - 1) / splits + 3) / 4 * 4;
}

// Floats per activation row of a block's partial sums: its tile_rows weight rows (a multiple of
// 32) plus 4, so that the 4 lanes of a quad (rows 2t, 2t + 1 apart by twice the stride) store to
// distinct banks.
constexpr int64_t mma_gemv_partial_stride(int tile_rows) {
  return tile_rows + 4;
}

// Bytes of the staged activations of a block's K range (whole quads) for `m` rows: 64 (bf16) per
// group and padded row, whatever the activation type; a multiple of 16.
constexpr int64_t mma_gemv_staged_bytes(int m, int64_t groups_per_split) {
  return int64_t{8} * mma_gemv_n_tiles(m) * 64 * groups_per_split;
}

// Bytes of one buffer of a block's partial sums [k warp][activation row][tile row].
constexpr int64_t mma_gemv_partial_bytes(const MmaGemvTiling& tiling, int m) {
  return int64_t{tiling.k_warps} * 8 * mma_gemv_n_tiles(m) *
         mma_gemv_partial_stride(mma_gemv_tile_rows(tiling)) * 4;
}

// The most dynamic shared memory one block may use (the H200's opt-in maximum, 227 KB).
inline constexpr int64_t kMmaGemvMaxSharedBytes = 227 * 1024;

// Dynamic shared memory of an sm_exclusive block at least: two such blocks (plus the 1 KB the
// GPU reserves per block) exceed the H200's 228 KB an SM.
inline constexpr int64_t kMmaGemvExclusiveSharedBytes = 114 * 1024;

// Dynamic shared memory the kernel needs for `m` activation rows (a block's share of them),
// `groups` 32-element K groups
// and this tiling: the staged activations, reused for the partial sums by a block of one row
// tile; followed by two partial-sum buffers when blocks may loop (row_blocks != 0); at least
// kMmaGemvExclusiveSharedBytes for sm_exclusive.
constexpr int64_t mma_gemv_shared_bytes(const MmaGemvTiling& tiling, int m, int64_t groups) {
  const int block_m = mma_gemv_block_m(tiling, m);
  const int64_t staged =
      mma_gemv_staged_bytes(block_m, mma_gemv_groups_per_split(groups, tiling.splits));
  const int64_t partial = mma_gemv_partial_bytes(tiling, block_m);
  const int64_t needed = tiling.row_blocks != 0 ? staged + 2 * partial
                         : staged > partial     ? staged
                                                : partial;
  return tiling.sm_exclusive && needed < kMmaGemvExclusiveSharedBytes ? kMmaGemvExclusiveSharedBytes
                                                                      : needed;
}

struct MmaGemvArgs {
  const void* weights;  // w4g32: u32 words [rows][groups · 4]; NVFP4: bytes [rows][groups · 16]
  const void* scales;   // w4g32: [rows][groups] of scale_type; NVFP4: e4m3 [rows][groups · 2]
  int scale_type;       // quant::ScaleType value (w4g32)
  float nv_global;      // quant::NvGlobalScale (NVFP4)
  int nv_global_is_divisor;
  int64_t rows;
  int64_t groups;  // K / 32
  // kF32 (rounded to bf16 here) or kBF16: row m at x + m · x_stride elements; kQ8 (the layout of
  // gemv_kernels.h, x_stride a multiple of 32): row m at byte m · x_stride · 5/4.
  const void* x;
  int64_t x_stride;
  int m;
  float* y;  // kGeluPairs: rows / 2 outputs per activation row
  int64_t y_stride;
  // bf16 and/or (kGeluPairs only) kQ8 copies of what is stored in y (gemv.h).
  ActivationCompanions y_companions;
  GemvEpilogue epilogue;
  const float* multiplier;  // kGeluMul: [m][rows] at multiplier_stride
  int64_t multiplier_stride;
  // 0: one row tile per block, its partial sums over the staged activations; else the byte offset
  // of two partial-sum buffers past them (blocks loop over the row tiles, gridDim.x of them).
  int64_t partial_offset;
  MmaGemvTrigger trigger;  // the tiling's
};

// Dynamic shared memory of the streamed kernel for `m` activation rows: its ring of stages.
int64_t mma_gemv_streamed_shared_bytes(const MmaGemvTiling& tiling, int m);

// Enqueues the streamed kernel (NVFP4, bf16 activations; arguments validated as for
// launch_gemv_mma, groups even, at most 32 activation rows a block). Returns
// cudaErrorInvalidValue for a tiling outside its layouts.
cudaError_t launch_gemv_mma_streamed(const MmaGemvArgs& args, const MmaGemvTiling& tiling,
                                     const Launch& launch);

// Enqueues the kernel; arguments already validated (rows, groups > 0, m in 1..64, x type kF32,
// kBF16 or kQ8, tiling within bounds, shared memory within kMmaGemvMaxSharedBytes) but for
// args.partial_offset and args.trigger, which it sets from the tiling. Returns
// cudaErrorInvalidValue for a format other than kW4G32 / kNVFP4 and for NVFP4 with kQ8.
cudaError_t launch_gemv_mma(PackedFormat format, const MmaGemvArgs& args, ActType x_type,
                            const MmaGemvTiling& tiling, const Launch& launch);

}  // namespace gemma4::cuda
