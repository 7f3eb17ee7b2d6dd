// The streaming single-row GEMV (gemv_stream.cu) for large w4g32 matrices: its tilings and launch.
// Plain header (no checkpoint types), like gemv_kernels.h, whose GemvArgs it takes.
//
// Why: the register GEMV (gemv_kernel.cuh) multiplies in fp32 on the CUDA cores, ~3 warp
// instructions per 16-byte weight chunk, and loads a pass, then computes it: at the 31B shapes and
// the lm_heads it reaches 60-68 % of the read bandwidth. This kernel streams the weights through a
// shared-memory ring with cp.async (stages - 1 slices in flight per warp, always) and multiplies
// on the tensor cores (~1.5 warp instructions per chunk in the SASS).
// Measured (session 7, H200, PDL µs): 31B gate+up 43008x5376 49.6 -> 44.7, lm_head 262144x5376
// 280 -> 262, QKV 16384x5376 20.4 -> 20.2 (tiling 112), E2B double-wide gate+up 10.85 -> 10.7;
// still only ~70 % of the read ceiling, faster with more warps per SM, slower than the register
// kernel at the E2B lm_head and the 5,376-row o_proj / down. Session 8 (all tilings): 113 (six
// warps) QKV 18.3, gate+up 42.9; 107 lm_head 254.8; 100 E2B double-wide 10.5, E2B lm_head 73.9
// (register kernel 87.2); the per-warp bulk copies (115-117, 120-122), the L2 hint (118-119) and
// the clusters (108-111) were no faster anywhere.
//
// Method. A block owns 16-row tiles blockIdx.x + gridDim.x · i (a persistent grid: as many blocks
// as fit the GPU, or one per tile); its `warps` warps split each tile's K range into equal runs of
// whole 4-chunk quads, each warp streaming its run, slice by slice (stage_chunks chunks of the 16
// rows plus their scales), through its own ring. mma.sync m16n8k16 (bf16, fp32 accumulation),
// weights as A: lane (g, t) takes chunk 4s + t of rows g and g + 8 in step s, whole (one 16-byte
// shared-memory load each): its 32 nibbles, as the exact bf16 integers 128 + u (one LOP3 per pair),
// fill the lane's A slots of 8 mma, pairs (e, e + 4) as in gemv_mma_kernel.cuh. The 4 lanes of a
// quad thus hold 4 different groups (scales) in one mma. The B operand separates them: lane (g, t)
// supplies column g, the activations of its chunk when g == t and zeros otherwise, so column n of
// the product is the sum over quad lane n's chunk alone, Σ(128 + u)·x; the group scale then
// applies in fp32 after adding −136·Σx (the chunk's bf16 activation sum, staged): the same
// exact products as the CUDA-core GEMV with bf16 activations, summed in another order. The warps'
// partial row sums meet in shared memory at the tile's end, and the GEMV epilogues apply.
//
// The producer-warp tilings (GemvStreamTiling::producer, session 8) take the copy work out of the
// multiplying warps: one warp per block copies whole 16-row tiles (two 1-D bulk copies each) into
// rings completing on mbarriers; groups of consumer warps multiply a tile with the same
// tensor-core step and store it. Session 8 (MID, PDL µs): 31B QKV 17.9, gate+up 35.9 (113: 18.3,
// 43.1); E2B double-wide gate+up 8.4, lm_head 56.1 (100: 10.4, 73.3) — 95 % of the read ceiling.
// The split-K producer tilings (session 9, gemv_stream_split_producer below) do the same for
// matrices whose 16-row tiles no stage holds (the 31B down and full o_proj): a cluster of blocks
// shares each tile, a K part a block, copied by 2-D tensor copies, the parts' sums meeting in the
// cluster's rank 0.
#pragma once

#include <cstdint>

#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda {

struct GemvStreamTiling {
  int warps;         // warps per block, each streaming a 1/warps share of a tile's K range
  int stage_chunks;  // chunks of each of the 16 rows per ring stage: a multiple of 4, <= 32
  int stages;        // ring stages per warp (stages - 1 slices in flight)
  // Blocks along K (a thread-block cluster, at most 8): each owns 1/splits of K's quads and the
  // cluster adds its blocks' sums through distributed shared memory, in rank order (deterministic).
  // More, shorter work units: with few tiles (5,376-row matrices: 336) the last round of tiles
  // then leaves less of the GPU idle.
  int splits = 1;
  // The weight slices by bulk copies (one per row, through the TMA unit, completing on a
  // barrier per stage) instead of per-lane cp.async; the scales stay on cp.async.
  bool bulk = false;
  // cp.async weight copies with the L2 256-byte prefetch-size hint.
  bool l2_prefetch = false;
  // The producer-warp design (gemv_stream.cu, gemv_tile_ring_kernel): one extra warp per block
  // copies whole 16-row tiles (all of K: two bulk copies) into rings of `stages` stages, one per
  // group of tile_warps consumer warps, which multiply a tile together (each 1/tile_warps of K,
  // in stage_chunks pieces; their sums meet in shared memory) and store it; one block per SM.
  // `bulk` and `l2_prefetch` do not apply; `splits` > 1 selects the split-K producer kernel
  // (gemv_split_ring_kernel, below).
  bool producer = false;
  int tile_warps = 1;
};

// A producer-warp tiling: `warps` consumer warps, `chunks` a consumer's piece (a multiple of 4),
// `stages` a ring, `tile_warps` warps a tile.
constexpr GemvStreamTiling gemv_stream_producer(int warps, int chunks, int stages, int tile_warps) {
  return {.warps = warps,
          .stage_chunks = chunks,
          .stages = stages,
          .producer = true,
          .tile_warps = tile_warps};
}

// The split-K producer tilings (session 9, gemv_split_ring_kernel): for 16-row tiles too big for a
// ring stage (31B down 5376x21504: 193 KB; full o_proj 5376x16384: 147 KB). A cluster of `splits`
// blocks (one per SM) shares a sequence of tiles, each block a part of K (whole quads, all parts
// but the last the same length), so that a stage holds a tile's part (down over 8: 16 x 84 chunks,
// 24 KB). The producer warp copies each part with two 2-D tensor copies (weights, scales: one TMA
// instruction each, where per-row bulk copies were limited by their count) into the ring of a
// group of tile_warps consumer warps; the groups' 16-row partial sums go to the cluster's rank 0
// through distributed shared memory, which adds them in rank order (deterministic, no workspace)
// and stores. With 336 tiles (the 5,376-row shapes) over 16 clusters of 8, every SM streams the
// same 21 parts: no partly filled last round. Session 9 (MID, kernel_bench M=1, PDL µs): 135 (8
// warps in 4 groups of 2) 31B down 21.76 (register 9: 27.10), full o_proj 18.87 (9: 20.80); 128
// 22.9 / 19.9; one warp a group (127, 134) ~25; one or two groups (129, 130, 133, 136) 27-40: a
// group's rounds are latency-bound (~1.9 µs each), more groups hide it.
constexpr GemvStreamTiling gemv_stream_split_producer(int warps, int chunks, int stages,
                                                      int tile_warps, int splits) {
  return {.warps = warps,
          .stage_chunks = chunks,
          .stages = stages,
          .splits = splits,
          .producer = true,
          .tile_warps = tile_warps};
}

// Weight rows per tile: the mma A fragment's.
inline constexpr int kGemvStreamTileRows = 16;

// Tiling indices that gemv() takes for the streaming kernel: kGemvStreamTilingBase + i selects
// kGemvStreamTilings[i] (register tilings are 0 .. kNumGemvTilings − 1).
inline constexpr int kGemvStreamTilingBase = 100;
// A warp's run of K is best a whole number of slices (full slices are unrolled).
inline constexpr GemvStreamTiling kGemvStreamTilings[] = {
    {2, 28, 3},     // 100: K 5376 (168 chunks): 3 slices a warp, 3 blocks per SM
    {3, 28, 4},     // 101: K 5376: 2 slices a warp, 2 blocks per SM
    {3, 16, 4},     // 102: K 1536 (48 chunks): 1 slice a warp, 3 blocks per SM
    {6, 28, 3},     // 103: K 5376: 1 slice a warp; K 21504 (672): 4
    {2, 24, 4},     // 104: K 1536: 1 slice a warp
    {4, 24, 4},     // 105: K 21504: 7 slices a warp
    {8, 16, 3},     // 106: K 8192 (256): 2 slices a warp
    {4, 28, 3},     // 107: K 21504: 6 slices a warp
    {4, 24, 3, 7},  // 108: K 21504: clusters of 7 blocks, 1 slice a warp
    {2, 24, 4, 7},  // 109: K 21504: clusters of 7 blocks, 2 slices a warp
    {4, 16, 3, 4},  // 110: K 8192: clusters of 4 blocks, 1 slice a warp
    {2, 16, 4, 8},  // 111: K 8192: clusters of 8 blocks, 1 slice a warp
    {4, 16, 4},     // 112: K 5376: 40 or 44 chunks a warp (session 7's best at the 31B shapes)
    {6, 16, 3},     // 113: K 5376: 28 chunks a warp, 12 warps per SM
    {7, 12, 3},     // 114: K 5376: 2 slices a warp, 14 warps per SM
    {4, 16, 4, 1, true},         // 115: 112 with bulk copies
    {3, 28, 4, 1, true},         // 116: 101 with bulk copies (448-byte row pieces)
    {6, 16, 3, 1, true},         // 117: 113 with bulk copies
    {4, 16, 4, 1, false, true},  // 118: 112 with the L2 prefetch hint
    {3, 16, 4, 1, false, true},  // 119: 102 with the L2 prefetch hint
    {3, 16, 4, 1, true},         // 120: 102 with bulk copies
    {4, 24, 3, 7, true},         // 121: 108 with bulk copies
    {4, 16, 3, 4, true},         // 122: 110 with bulk copies
    // Producer-warp tilings (gemv_stream_producer: consumer warps, chunks a piece, stages a
    // ring, warps a tile). K 5376: 48 KB a stage; K 1536: 14 KB.
    gemv_stream_producer(8, 24, 4, 8),  // 123: one tile at once, 21 chunks a warp at K 5376
    gemv_stream_producer(8, 24, 2, 4),  // 124: K 5376: two tiles at once, 42 chunks a warp
    gemv_stream_producer(4, 12, 7, 4),  // 125: K 1536: 12 chunks a warp; <= 113 KB
    gemv_stream_producer(8, 24, 4, 2),  // 126: K 1536: four tiles at once, 24 chunks a warp
    // Split-K producer tilings (gemv_stream_split_producer: consumer warps, chunks a piece, stages
    // a group's ring, warps a tile, blocks a cluster). Parts over 8 blocks: K 21504 84 chunks (24
    // KB a stage), K 16384 64 chunks (18 KB); over 4: K 8192 64 chunks.
    gemv_stream_split_producer(4, 44, 2, 1, 8),  // 127: four tiles at once, a warp each
    gemv_stream_split_producer(8, 44, 2, 2, 8),  // 128: four tiles at once, two warps each
    gemv_stream_split_producer(8, 24, 4, 4, 8),  // 129: two tiles at once, four warps each
    gemv_stream_split_producer(8, 12, 8, 8, 8),  // 130: one tile at once, eight warps
    gemv_stream_split_producer(8, 44, 2, 2, 4),  // 131: 128 over clusters of 4
    // The same with every warp's share of a part one whole piece (unrolled): K 21504 over 8 (21
    // quads a part), K 16384 over 8 (16), K 8192 over 8 (8) or 4 (16).
    gemv_stream_split_producer(6, 28, 4, 3, 8),   // 132: K 21504: 7 quads a warp, two tiles at once
    gemv_stream_split_producer(7, 12, 8, 7, 8),   // 133: K 21504: 3 quads a warp, one tile at once
    gemv_stream_split_producer(4, 84, 2, 1, 8),   // 134: K 21504: 21 quads a warp, four tiles
    gemv_stream_split_producer(8, 32, 2, 2, 8),   // 135: K 16384: 8 quads a warp, four tiles
    gemv_stream_split_producer(8, 16, 4, 4, 8),   // 136: K 16384: 4 quads a warp, two tiles
    gemv_stream_split_producer(8, 16, 4, 2, 8),   // 137: K 8192: 4 quads a warp, four tiles
    gemv_stream_split_producer(8, 32, 2, 2, 4),   // 138: K 8192 over 4: 8 quads a warp, four tiles
    gemv_stream_split_producer(12, 28, 2, 3, 8),  // 139: K 21504: 7 quads a warp, four tiles
};
inline constexpr int kNumGemvStreamTilings =
    sizeof(kGemvStreamTilings) / sizeof(kGemvStreamTilings[0]);

// The streaming tilings default_gemv_tiling picks: all a normal build compiles (every one with
// GEMMA4_GEMV_ALL_TILINGS). Keep in step with default_gemv_tiling (gemv.cpp).
inline constexpr int kDefaultGemvStreamTilings[] = {106, 123, 124, 126, 135};

constexpr bool is_gemv_stream_tiling(int tiling) {
  return tiling >= kGemvStreamTilingBase && tiling < kGemvStreamTilingBase + kNumGemvStreamTilings;
}

constexpr bool gemv_stream_tiling_compiled(int tiling) {
  return gemv_family_tiling_compiled(tiling, kGemvStreamTilingBase, kNumGemvStreamTilings,
                                     kDefaultGemvStreamTilings);
}

// Bytes of a row of a ring stage's weight slice: padded to 64 mod 128 bytes, so that the 8 lanes
// of a shared-memory load phase (rows g, g + 1, four chunks each) hit 32 distinct banks.
constexpr int64_t gemv_stream_row_pitch(const GemvStreamTiling& t) {
  const int64_t bytes = int64_t{16} * t.stage_chunks;
  return bytes + (64 - bytes % 128 + 128) % 128;
}
// A ring stage: the weight slice, then the slice's 16-bit scales ([16][stage_chunks]).
constexpr int64_t gemv_stream_stage_bytes(const GemvStreamTiling& t) {
  return kGemvStreamTileRows * (gemv_stream_row_pitch(t) + 2 * t.stage_chunks);
}

// The bulk copies' barriers, one per stage and warp, after the rings (padded to 16 bytes).
constexpr int64_t gemv_stream_barrier_bytes(const GemvStreamTiling& t) {
  return t.bulk ? (int64_t{8} * t.warps * t.stages + 15) / 16 * 16 : 0;
}

// The most chunks of a row that one block of a cluster owns: ceil(quads / splits) quads.
constexpr int64_t gemv_stream_block_chunks(const GemvStreamTiling& t, int64_t chunks_per_row) {
  return 4 * ((chunks_per_row / 4 + t.splits - 1) / t.splits);
}

// Split-K producer tilings: the chunks of a block's part of K (its tensor copies' box), the bytes
// of a part's row of scales in a stage (a multiple of 16: the copies' box, which starts at a
// multiple of 8 chunks, 16 bytes, at or before the part's first chunk: 4 chunks more where the
// parts are an odd number of quads), a stage (weights, then
// scales, padded to 128 bytes), the partial-sum buffers each group has in rank 0 (stage
// kGemvStreamSplitBuffers rounds ahead) and the shared memory before the stages: the groups'
// full and empty stage barriers, their buffers' full and empty barriers, then the buffers
// ([group][buffer][rank][warp][16] fp32), padded to 128 bytes.
inline constexpr int kGemvStreamSplitBuffers = 4;
constexpr int64_t gemv_stream_split_part_chunks(const GemvStreamTiling& t, int64_t chunks_per_row) {
  return gemv_stream_block_chunks(t, chunks_per_row);
}
constexpr int64_t gemv_stream_split_scale_row_bytes(int64_t part_chunks) {
  return 2 * (part_chunks + part_chunks % 8);
}
constexpr int64_t gemv_stream_split_stage_bytes(int64_t part_chunks) {
  return (kGemvStreamTileRows *
              (16 * part_chunks + gemv_stream_split_scale_row_bytes(part_chunks)) +
          127) /
         128 * 128;
}
constexpr int64_t gemv_stream_split_header_bytes(const GemvStreamTiling& t) {
  const int64_t groups = t.warps / t.tile_warps;
  const int64_t barriers = 2 * groups * (t.stages + kGemvStreamSplitBuffers);
  const int64_t sums =
      groups * kGemvStreamSplitBuffers * t.splits * t.tile_warps * kGemvStreamTileRows;
  return (8 * barriers + 4 * sums + 127) / 128 * 128;
}

// Producer tilings' stages: a tile's weights and scales (16 · chunks_per_row · 18 bytes), padded
// to 128 bytes.
constexpr int64_t gemv_stream_whole_tile_bytes(int64_t chunks_per_row) {
  return (kGemvStreamTileRows * chunks_per_row * 18 + 127) / 128 * 128;
}
// Producer tilings' shared memory before the stages: the full and empty barriers of `stages`
// stages and the partial row sums of `warps` warps (two rounds' worth), padded to 128 bytes.
constexpr int64_t gemv_stream_whole_tile_header_bytes(int stages, int warps) {
  return (16 * stages + 2 * 4 * warps * kGemvStreamTileRows + 127) / 128 * 128;
}

// A block's dynamic shared memory at chunks_per_row 16-byte chunks a row: the warps' partial row
// sums (two tiles' worth; first, at the same offset in every block of a cluster), the staged
// activations of the block's chunks (64 bytes a chunk, then 64 bytes of zeros), their per-chunk
// biases (fp32, padded to 16 bytes), the warps' rings, then (bulk) their barriers. Producer
// tilings: the header (barriers, partial sums), the groups' stages, then the staged activations
// of all of K, their zeros and biases.
constexpr int64_t gemv_stream_shared_bytes(const GemvStreamTiling& t, int64_t chunks_per_row) {
  const int64_t chunks = gemv_stream_block_chunks(t, chunks_per_row);
  const int64_t staged_x = 64 * (chunks + 1) + (4 * chunks + 15) / 16 * 16;
  if (t.producer && t.splits > 1) {
    const int64_t part = gemv_stream_split_part_chunks(t, chunks_per_row);
    return gemv_stream_split_header_bytes(t) +
           t.warps / t.tile_warps * t.stages * gemv_stream_split_stage_bytes(part) + staged_x;
  }
  if (t.producer) {
    const int stages = t.warps / t.tile_warps * t.stages;
    return gemv_stream_whole_tile_header_bytes(stages, t.warps) +
           stages * gemv_stream_whole_tile_bytes(chunks_per_row) + staged_x;
  }
  return 4 * 2 * t.warps * kGemvStreamTileRows + staged_x +
         int64_t{t.warps} * t.stages * gemv_stream_stage_bytes(t) + gemv_stream_barrier_bytes(t);
}

// Whether the layout of a w4g32 matrix (chunks_per_row, the addresses of its weights and 16-bit
// scales) suits tiling t: whole quads a row, 8-byte aligned scales; producer tilings copy tiles
// in bulk: 16-byte aligned weights and scales, and a partial last tile's scales a multiple of
// 16 bytes (chunks_per_row % 8 == 0). Split-K producer tilings copy tensor boxes: 16-byte aligned
// weights and scales, row strides multiples of 16 bytes (chunks_per_row % 8 == 0), a part's weight
// row at most 256 8-byte elements (128 chunks).
constexpr bool gemv_stream_layout_ok(const GemvStreamTiling& t, int64_t chunks_per_row,
                                     uintptr_t weights, uintptr_t scales) {
  if (t.producer && t.splits > 1) {
    return chunks_per_row % 8 == 0 && weights % 16 == 0 && scales % 16 == 0 &&
           gemv_stream_split_part_chunks(t, chunks_per_row) <= 128;
  }
  if (t.producer) return chunks_per_row % 8 == 0 && weights % 16 == 0 && scales % 16 == 0;
  return chunks_per_row % 4 == 0 && scales % 8 == 0;
}

// Dynamic shared memory a block may opt into on sm_90 (227 KB).
inline constexpr int64_t kGemvStreamMaxSharedBytes = 227 * 1024;

// Enqueues the streaming kernel of tiling kGemvStreamTilings[index] for one activation row:
// w4g32 weights with 16-bit scales (args.scale_type bf16 or fp16), gemv_stream_layout_ok,
// activations kBF16 or kF32 (rounded to bf16 as staged), no q8 companions, no residual step,
// shared bytes within kGemvStreamMaxSharedBytes; gemv() validates that. cudaErrorInvalidValue for a
// tiling this build did not compile.
cudaError_t launch_gemv_stream(ActType x_type, int index, const GemvArgs& args,
                               const Launch& launch);

}  // namespace gemma4::cuda
