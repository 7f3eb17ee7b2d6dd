// The split-K single-row GEMV (gemv_splitk.cu) for matrices with few rows and long K (the 31B
// o_proj 5376x8192 and down 5376x21504, E2B's 1536-row o_proj / down): its tilings and launch.
// Plain header (no checkpoint types), like gemv_kernels.h, whose GemvArgs it takes.
//
// Why: with 5,376 rows (41 a SM) the register GEMV's blocks each walk a whole long row in several
// passes (load, then multiply), and its grid ends in a partly filled wave: 31B o_proj / down ran
// at 11.8 / 27.1 µs against floors of 5.8 / 15.3 (session 8, kernel_bench). Here a thread-block
// cluster of `splits` blocks shares a block's rows, each block owning 1/splits of K, so that a
// block's every weight load fits one pass, goes out before the PDL wait, and the grid has many
// small blocks (a short last wave). The blocks' row sums meet in the cluster's rank-0 block
// through distributed shared memory, in rank order (deterministic): no workspace, no atomics.
//
// Method per block: the register GEMV's thread layout (gemv_kernel.cuh) within the block's part
// of K: teams of lanes_per_row lanes share rows_per_thread rows, `warps` warps split the part
// further (lane l of warp w reads chunks (j · warps + w) · lanes_per_row + l % lanes_per_row of
// the part, j < chunks_per_thread), each product the register GEMV's dot_chunk with bf16
// activations (kBF16, or kF32 rounded to bf16 in registers). Team sums by shuffles, the warps'
// sums in shared memory, the block's row sums stored into rank 0's shared memory, one cluster
// barrier, and rank 0 adds the ranks' sums in order and stores through the GEMV epilogues.
#pragma once

#include <cstdint>

#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda {

struct GemvSplitKTiling {
  int rows_per_thread;    // even: a thread stores whole gate/up pairs
  int lanes_per_row;      // 8, 16 or 32 lanes of a warp share a row
  int warps;              // warps per block, splitting the block's part of K
  int chunks_per_thread;  // 16-byte weight chunks per row a lane loads, all at once
  int splits;             // blocks along K (a cluster of at most 8)
};

// Tiling indices that gemv() takes for this kernel: kGemvSplitKTilingBase + i selects
// kGemvSplitKTilings[i] (register tilings 0.., streaming tilings 100..).
inline constexpr int kGemvSplitKTilingBase = 200;
// A part's coverage lanes_per_row · warps · chunks_per_thread is best its whole length (K /
// 32 / splits chunks): 31B down 672 chunks, o_proj 256; E2B down 192 / 384, o_proj 64.
inline constexpr GemvSplitKTiling kGemvSplitKTilings[] = {
    {2, 32, 1, 3, 7},  // 200: 31B down, part 96, 2 rows, 32 threads
    {2, 16, 2, 3, 7},  // 201: 31B down, part 96, 4 rows, 64 threads
    {2, 8, 4, 3, 7},   // 202: 31B down, part 96, 8 rows, 128 threads
    {2, 8, 7, 3, 4},   // 203: 31B down, part 168, 8 rows, 224 threads
    {2, 16, 7, 3, 2},  // 204: 31B down, part 336, 4 rows, 224 threads
    {2, 8, 4, 3, 8},   // 205: 31B down, part 84 (coverage 96), 8 rows
    {2, 32, 2, 2, 2},  // 206: 31B o_proj, part 128, 2 rows, 64 threads
    {2, 16, 4, 2, 2},  // 207: 31B o_proj, part 128, 4 rows, 128 threads
    {2, 16, 2, 2, 4},  // 208: 31B o_proj, part 64, 4 rows, 64 threads
    {2, 8, 4, 2, 4},   // 209: 31B o_proj, part 64, 8 rows, 128 threads
    {2, 8, 2, 2, 8},   // 210: 31B o_proj, part 32, 8 rows, 64 threads
    {2, 16, 4, 3, 1},  // 211: E2B down K 6144 (192) in one block, 4 rows
    {2, 16, 4, 3, 2},  // 212: E2B down K 12288 (384), part 192, 4 rows
    {2, 8, 4, 3, 2},   // 213: E2B down K 6144, part 96, 8 rows
    {2, 8, 4, 2, 1},   // 214: E2B o_proj K 2048 (64), 8 rows
    {2, 8, 2, 2, 2},   // 215: E2B o_proj, part 32, 8 rows, 64 threads
    {4, 8, 4, 3, 7},   // 216: 202 with 4 rows a thread (12 loads a lane)
    {4, 16, 4, 2, 2},  // 217: 207 with 4 rows a thread
    {2, 8, 6, 2, 7},   // 218: 31B down, part 96, 8 rows, 192 threads, 4 loads a lane
    {2, 16, 3, 2, 7},  // 219: 31B down, part 96, 4 rows, 96 threads, 4 loads a lane
    {2, 8, 8, 2, 2},   // 220: 31B o_proj, part 128, 8 rows, 256 threads
    // Four rows a thread (each activation chunk, unpacked once, serves four rows), as 217, which
    // measured best at the E2B shapes (session 8): its one-pass variants, few or no splits.
    {4, 16, 4, 3, 1},  // 221: E2B down K 6144 (192) in one pass, 8 rows
    {4, 16, 4, 3, 2},  // 222: E2B down K 12288, part 192
    {4, 8, 4, 2, 1},   // 223: E2B o_proj K 2048 (64) in one pass, 16 rows
    {4, 32, 4, 2, 1},  // 224: 31B o_proj K 8192 (256) in one pass, 4 rows (tiling 9 with 4 rows)
    {4, 16, 7, 3, 2},  // 225: 31B down, part 336 in one pass, 8 rows, 224 threads
    {4, 32, 7, 3, 1},  // 226: 31B down K 21504 (672) in one pass, 4 rows, 224 threads
};
inline constexpr int kNumGemvSplitKTilings =
    sizeof(kGemvSplitKTilings) / sizeof(kGemvSplitKTilings[0]);

// The split-K tilings default_gemv_tiling picks: all a normal build compiles (every one with
// GEMMA4_GEMV_ALL_TILINGS). Keep in step with default_gemv_tiling (gemv.cpp).
inline constexpr int kDefaultGemvSplitKTilings[] = {217};

constexpr bool is_gemv_splitk_tiling(int tiling) {
  return tiling >= kGemvSplitKTilingBase && tiling < kGemvSplitKTilingBase + kNumGemvSplitKTilings;
}

constexpr bool gemv_splitk_tiling_compiled(int tiling) {
  return gemv_family_tiling_compiled(tiling, kGemvSplitKTilingBase, kNumGemvSplitKTilings,
                                     kDefaultGemvSplitKTilings);
}

constexpr int gemv_splitk_rows_per_block(const GemvSplitKTiling& t) {
  return (32 / t.lanes_per_row) * t.rows_per_thread;
}

// Enqueues the split-K kernel of tiling kGemvSplitKTilings[index] for one activation row: w4g32
// weights (any scale type), activations kBF16 or kF32 (rounded to bf16), any epilogue, bf16
// companions only, no residual step folded into the input. gemv() validates that.
// cudaErrorInvalidValue for a tiling this build did not compile.
cudaError_t launch_gemv_splitk(ActType x_type, int index, const GemvArgs& args,
                               const Launch& launch);

}  // namespace gemma4::cuda
