// MoePath::kDecodeByExpert (moe.h, moe_kernels.h): the tensor-core decode path's per-pair
// arithmetic for a few tokens (kMoeByExpertMinTokens .. kMoeByExpertGroupedMinTokens − 1) of NVFP4
// experts, with each selected expert's weights read ONCE for every pair that picked it. The
// per-pair kernels (moe.cu) launch a block set per (token, expert) pair, so at 32 tokens a layer
// reads its ~111 distinct experts 256 times; here the units of work are (picked expert, row
// block). Three launches after the router:
//   1. gate/up: units (expert, 64 inner rows); activations[p] = gelu_tanh(gate · x) ⊙ up · x
//      (fp32) for every pair p of the unit's expert.
//   2. down: units (expert, 256 hidden rows); expert_outputs[p] = w_p · down · activations[p].
//   3. combine: out[t] = Σ_k expert_outputs[t · top_k + k], in ascending (expert id, k) order (the
//      CPU reference's and the grouped combine's): deterministic, no atomics.
// The grid never depends on the routing (graph-capturable, no host round-trip): it is as many
// blocks as the GPU holds at once, and every block counts each expert's pairs on the device (in
// shared memory) and takes its contiguous share of the units, in ascending (expert id, row block,
// tile of pairs) order (by_expert_mma_kernel). An expert's pairs are collected in ascending pair
// order, kTilePairs at a time (the mma N dimension): an expert with more pairs has a unit per
// tile of them, the later ones reading its weights again (from L2).
//
// Arithmetic per pair as moe.cu's "Decode path on tensor cores": weights as the A operand (16
// rows), the tile's pairs as the 8 columns of B, each column's activations staged as fp16 under
// its own power-of-two scale 2^p (the per-pair kernels' p: gate/up from the token's x row, down
// from the pair's weighted activation row, where the per-pair kernel takes the largest over the
// token's top_k rows: the fp16 values are the same unless they fall below fp16's normal range,
// 2^-29 of the row's largest magnitude). Results equal the per-pair path's up to fp32 summation
// order, and the fp16 rounding of down's activations that this order moves across a rounding
// boundary. Other formats keep the per-pair kernels (moe_path_for): their fp32 CUDA-core GEMVs
// are bound by arithmetic, not by reading the weights (moe_bench: w4g32 per expert was slower).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe_decode.cuh"
#include "backend/cuda/moe_kernels.h"
#include "backend/cuda/occupancy.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kTilePairs = 8;  // pairs per tile: the N of m16n8k16
// A staged pair's expert id when the router's is out of range (valid ids are < 256).
constexpr uint16_t kNoExpert = 0xFFFF;

struct ByExpertArgs {
  const MoeExpert* experts;
  int num_experts;
  const int32_t* expert_ids;  // [pairs]
  const float* weights;       // [pairs]: routing weights (down only)
  int pairs;
  int top_k;
  // Pairs a tile holds: kTilePairs, fewer where the shared memory cannot hold as many staged
  // columns (launch_projection).
  int tile_pairs;
  int64_t rows;            // output rows: inner (gate/up) or hidden (down)
  int64_t chunks_per_row;  // 16-byte chunks of one weight row
  // Gate/up: x, row of pair p at source + (p / top_k) · source_stride; down: activations, row p
  // at source + p · source_stride.
  const float* source;
  int64_t source_stride;
  float* out;  // gate/up: activations; down: expert_outputs; row p at out + p · out_stride
  int64_t out_stride;
};

// The block's view of the routing (shared memory): how many pairs picked each expert, where
// each expert's units start, and the current tile of pairs of one expert.
struct ExpertTile {
  int expert_pairs[kMaxRouterExperts];
  // Units of experts 0 .. e-1: an expert's units are (row block, pair tile) in ascending order,
  // row_blocks x its tiles of pairs; the last entry is every expert's.
  int first_unit[kMaxRouterExperts + 1];
  int count;  // pairs in the current tile
  int pairs[kTilePairs];
};

__device__ __forceinline__ int pair_tiles(int pairs, int tile_pairs) {
  return (pairs + tile_pairs - 1) / tile_pairs;
}

// The staged columns of a tile: at most a.tile_pairs, fewer when there are fewer pairs.
__host__ __device__ inline int tile_columns(const ByExpertArgs& a) {
  return a.pairs < a.tile_pairs ? a.pairs : a.tile_pairs;
}

// Every pair's expert id in `pair_experts` (shared memory, kNoExpert when out of range) for
// collect_tile, one coalesced read of the ids per block; tile.expert_pairs and tile.first_unit.
// Returns the number of units (the same in every thread of the block).
__device__ __forceinline__ int find_units(const ByExpertArgs& a, int tile_pairs, int row_blocks,
                                          ExpertTile& tile, uint16_t* pair_experts) {
  for (int e = static_cast<int>(threadIdx.x); e < kMaxRouterExperts;
       e += static_cast<int>(blockDim.x)) {
    tile.expert_pairs[e] = 0;
  }
  __syncthreads();
  for (int p = static_cast<int>(threadIdx.x); p < a.pairs; p += static_cast<int>(blockDim.x)) {
    const int e = a.expert_ids[p];
    const bool valid = e >= 0 && e < a.num_experts;
    pair_experts[p] = valid ? static_cast<uint16_t>(e) : kNoExpert;
    if (valid) atomicAdd(&tile.expert_pairs[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // an exclusive scan, 32 experts a step
    const int lane = static_cast<int>(threadIdx.x);
    int before = 0;
    for (int base = 0; base < kMaxRouterExperts; base += 32) {
      const int units = row_blocks * pair_tiles(tile.expert_pairs[base + lane], tile_pairs);
      int sum = units;  // inclusive scan within the step
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const int other = __shfl_up_sync(0xFFFFFFFFu, sum, offset);
        if (lane >= offset) sum += other;
      }
      tile.first_unit[base + lane] = before + sum - units;
      before += __shfl_sync(0xFFFFFFFFu, sum, 31);
    }
    if (lane == 0) tile.first_unit[kMaxRouterExperts] = before;
  }
  __syncthreads();
  return tile.first_unit[kMaxRouterExperts];
}

// The expert whose units include `unit` (< find_units' count): the last with first_unit <= unit
// (experts without pairs have no units: the next expert's first_unit equals theirs).
__device__ int unit_expert(const ExpertTile& tile, int unit) {
  int low = 0, high = kMaxRouterExperts;  // first_unit[low] <= unit < first_unit[high]
  while (high - low > 1) {
    const int middle = (low + high) / 2;
    if (tile.first_unit[middle] <= unit) {
      low = middle;
    } else {
      high = middle;
    }
  }
  return low;
}

// Tile `pair_tile` of `expert`'s pairs (its a.tile_pairs · pair_tile-th pair on, in ascending pair
// order) into tile.pairs and their count into tile.count. Every thread of the block calls it; the
// first __syncthreads lets the previous tile's readers finish.
__device__ __forceinline__ void collect_tile(const ByExpertArgs& a, int tile_pairs, int expert,
                                             int pair_tile, const uint16_t* pair_experts,
                                             ExpertTile& tile) {
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const int first = tile_pairs * pair_tile;
    int seen = 0;  // matches before this step's pairs
    for (int base = 0; base < a.pairs && seen < first + tile_pairs; base += 32) {  // warp-uniform
      const int p = base + lane;
      const bool match = p < a.pairs && pair_experts[p] == expert;
      const uint32_t matches = __ballot_sync(0xFFFFFFFFu, match);
      const int in_tile = seen + __popc(matches & ((1u << lane) - 1u)) - first;
      if (match && in_tile >= 0 && in_tile < tile_pairs) tile.pairs[in_tile] = p;
      seen += __popc(matches);
    }
    if (lane == 0) tile.count = min(max(seen - first, 0), tile_pairs);
  }
  __syncthreads();
}

// The activation row of pair p and the factor its staged values carry: gate/up the token's x
// row (factor 1, NVFP4's global scale applied to the sums); down the pair's activations times its
// routing weight with the down matrix's NVFP4 global scale folded in (as decode_down_kernel).
template <bool kGateUp>
__device__ __forceinline__ const float* pair_source(const ByExpertArgs& a, int p) {
  return a.source + static_cast<int64_t>(kGateUp ? p / a.top_k : p) * a.source_stride;
}
template <bool kGateUp>
__device__ __forceinline__ float pair_factor(const ByExpertArgs& a, const MoeMatrix& down, int p) {
  if constexpr (kGateUp) {
    return 1.0f;
  } else {
    return apply_global_scale<PackedFormat::kNVFP4>(down, a.weights[p]);
  }
}

// ---- NVFP4 on tensor cores ----

// Warps per block, each with its own rows and all of K, blocks per SM, and rounds (4 chunks of
// the warp's A rows) a warp's ring of weight copies holds (by_expert_mma_kernel): 2 blocks of 8
// warps, 110 KB of shared memory each at 26B's gate/up shapes (ring 61 KB, staged columns 46 KB),
// registers free for them. moe_bench by-expert PDL µs T=16 / 32 / 48, gate/up geometry (down
// kept): 8 warps, 6 rounds, 2 blocks 112.1 / 161.6 / 188.8; 11, 4, 2 (80 registers) 123.5 / 182.1
// / 203.0; 22, 4, 1 111.1 / 164.1 / 179.6; down 8, 4, 3 or 8, 6, 3 (80 registers) within 1 µs.
// Nothing is asked of L2 beyond the ring: each copy's 256-byte hint brings its row's next rounds.
// Asking L2 for each unit whole as a block started it (96-180 KB, sessions 6-9) made DRAM read
// 1.5-1.7x the expert bytes and lost (moe_bench T=32 211.5 vs 189.7 µs with register loads).
constexpr int kMmaWarps = 8;
constexpr int kMmaBlocksPerSm = 2;
constexpr int kRingRounds = 6;
// Rows of one mma row tile: gate/up 8 inner rows of gate (A rows g) and up (A rows g + 8); down
// 16 rows.
template <bool kGateUp>
constexpr int kMmaTileRows = kGateUp ? 8 : 16;
// Row tiles per warp in a unit of work, one after the other, the copies running on from one
// tile's last rounds into the next one's first: gate/up 1 (64 inner rows of gate and up a unit, K
// = hidden 2816: 180 KB of weights), down 2 (256 hidden rows, K = inner 704: 90 KB).
template <bool kGateUp>
constexpr int kMmaRowTiles = kGateUp ? 1 : 2;
template <bool kGateUp>
constexpr int kMmaBlockRows = kMmaWarps* kMmaRowTiles<kGateUp>* kMmaTileRows<kGateUp>;
// Chunks of a row rounded up to whole rounds (4 chunks: one per lane of a quad).
__host__ __device__ constexpr int64_t mma_round_chunks(int64_t chunks) {
  return (chunks + 3) / 4 * 4;
}
// One staged column: its chunks, then zero chunks up to a whole round (the last round's lanes
// past the row's end multiply by them), kStagedWordsPerChunk words each, plus 8 words that shift
// the next column's banks by 8.
//
// Banks. An mma step's 16-byte B load by lane (g, t) reads 4-word piece i of chunk 4r + t of
// column g; a quarter warp (the unit of a 128-bit shared load) is lanes g = 2q, 2q + 1, t = 0..3.
// Chunks are 16 words, so chunks t and t + 2 of a round fall on the same banks: stored in order,
// every B load took two passes (ncu, session 7: short scoreboard the top stall of both kernels).
// Chunks c with (c >> 1) & 1 = 1 store their pieces pairwise swapped (piece i at i ^ 1): a
// quarter warp's 8 loads then cover banks 4i, 16 + 4i, 4(i ^ 1), 16 + 4(i ^ 1) in column g and the
// same plus 8 in column g + 1, all 32 once.
__host__ __device__ constexpr int64_t mma_column_words(int64_t chunks) {
  return mma_round_chunks(chunks) * kStagedWordsPerChunk + 8;
}
// The staged words of `columns` columns.
__host__ __device__ constexpr int64_t mma_staged_words(int64_t chunks, int columns) {
  return columns * mma_column_words(chunks);
}
// The staged words, then every pair's expert id (find_units).
size_t mma_tile_shared_bytes(int64_t chunks, int columns, int pairs) {
  return sizeof(uint32_t) * static_cast<size_t>(mma_staged_words(chunks, columns)) +
         sizeof(uint16_t) * static_cast<size_t>(pairs);
}

// Per-column staging state of a tile (shared memory).
struct ColumnStaging {
  const float* source[kTilePairs];  // the pair's activation row
  float factor[kTilePairs];         // pair_factor
  uint32_t largest[kTilePairs];  // bits of the largest |value · factor| (ordered as floats >= 0)
  float scale[kTilePairs];       // factor · 2^p
  int exponent[kTilePairs];      // p
};

// Pieces of 8 activations a thread keeps in registers between the two passes (the rest is read
// again): gate/up 4 per thread cover 2.9 columns of hidden 2816 over 256 threads, down 2 cover
// 5.8 columns of inner 704 over 256 (the first rounds of the weights are live meanwhile; down
// spilled 64 bytes with 4).
template <bool kGateUp>
constexpr int kCachedPieces = kGateUp ? 4 : 2;

// Stages the tile's columns as fp16 pairs in mma order, each under its own 2^p (staging_exponent
// of the column's largest |value · factor|, as stage_mma_activations does for one), and their zero
// chunks up to a whole round. The whole block works on all columns at once: the loads of a column
// go out together, not one warp's row at a time.
template <bool kGateUp>
__device__ void stage_mma_tile(const ByExpertArgs& a, const MoeMatrix& down, const ExpertTile& tile,
                               int chunks, uint32_t* staged, ColumnStaging& columns) {
  const int count = tile.count;
  const int column_pieces = 4 * chunks;  // of 8 floats
  const int pieces = count * column_pieces;
  if (threadIdx.x < static_cast<unsigned>(count)) {
    const int c = static_cast<int>(threadIdx.x);
    columns.source[c] = pair_source<kGateUp>(a, tile.pairs[c]);
    columns.factor[c] = pair_factor<kGateUp>(a, down, tile.pairs[c]);
    columns.largest[c] = 0;
  }
  const int tail_words = static_cast<int>(mma_round_chunks(chunks) - chunks) * kStagedWordsPerChunk;
  for (int i = static_cast<int>(threadIdx.x); i < count * tail_words;
       i += static_cast<int>(blockDim.x)) {
    const int c = i / tail_words;
    staged[c * mma_column_words(chunks) + chunks * kStagedWordsPerChunk + i - c * tail_words] = 0;
  }
  __syncthreads();
  auto load_piece = [&](int piece, float4& lo, float4& hi) {
    const int c = piece / column_pieces;
    const float4* source =
        reinterpret_cast<const float4*>(columns.source[c]) + 2 * (piece - c * column_pieces);
    lo = __ldg(source);
    hi = __ldg(source + 1);
    return c;
  };
  auto largest_of = [](float4 v, float f) {
    return fmaxf(fmaxf(fabsf(v.x * f), fabsf(v.y * f)), fmaxf(fabsf(v.z * f), fabsf(v.w * f)));
  };
  auto note_largest = [&](int c, float4 lo, float4 hi) {
    const float f = columns.factor[c];
    // |v| >= 0 (NaN aside: staging_exponent then gives 0 as for the per-pair kernels, which
    // drop NaN in fmaxf alike): the float order is the bits' order.
    atomicMax(&columns.largest[c], __float_as_uint(fmaxf(largest_of(lo, f), largest_of(hi, f))));
  };
  float4 cached[kCachedPieces<kGateUp>][2];
#pragma unroll
  for (int j = 0; j < kCachedPieces<kGateUp>; ++j) {
    const int piece = static_cast<int>(threadIdx.x + j * blockDim.x);
    if (piece < pieces) load_piece(piece, cached[j][0], cached[j][1]);
  }
#pragma unroll
  for (int j = 0; j < kCachedPieces<kGateUp>; ++j) {
    const int piece = static_cast<int>(threadIdx.x + j * blockDim.x);
    if (piece < pieces) note_largest(piece / column_pieces, cached[j][0], cached[j][1]);
  }
  for (int piece = static_cast<int>(threadIdx.x + kCachedPieces<kGateUp> * blockDim.x);
       piece < pieces; piece += blockDim.x) {
    float4 lo, hi;
    note_largest(load_piece(piece, lo, hi), lo, hi);
  }
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(count)) {
    const int c = static_cast<int>(threadIdx.x);
    const int exponent = staging_exponent(__uint_as_float(columns.largest[c]));
    columns.exponent[c] = exponent;
    columns.scale[c] = columns.factor[c] * ldexpf(1.0f, exponent);
  }
  __syncthreads();
  // Piece (c, i) of a column = elements 32c + 8i .. + 7 → words 16c + 4i .. + 3 (4 (i ^ 1) when
  // (c >> 1) & 1: mma_column_words), pairs (v0, v4) ... (v3, v7): nibble pairs (s, s + 4) of the
  // weight word.
  auto store_piece = [&](int piece, float4 lo, float4 hi) {
    const int c = piece / column_pieces;
    const float f = columns.scale[c];
    auto pair = [f](float x, float y) {
      const __half2 h = __floats2half2_rn(x * f, y * f);
      return *reinterpret_cast<const uint32_t*>(&h);
    };
    const int in_column = piece - c * column_pieces;  // 4 · chunk + i
    reinterpret_cast<uint4*>(staged +
                             c * mma_column_words(chunks))[in_column ^ ((in_column >> 3) & 1)] =
        make_uint4(pair(lo.x, hi.x), pair(lo.y, hi.y), pair(lo.z, hi.z), pair(lo.w, hi.w));
  };
#pragma unroll
  for (int j = 0; j < kCachedPieces<kGateUp>; ++j) {
    const int piece = static_cast<int>(threadIdx.x + j * blockDim.x);
    if (piece < pieces) store_piece(piece, cached[j][0], cached[j][1]);
  }
  for (int piece = static_cast<int>(threadIdx.x + kCachedPieces<kGateUp> * blockDim.x);
       piece < pieces; piece += blockDim.x) {
    float4 lo, hi;
    load_piece(piece, lo, hi);
    store_piece(piece, lo, hi);
  }
}

// A unit of work: rows block_row ... + kMmaBlockRows - 1 of `expert` (gate/up: inner rows, gate
// and up each; down: hidden rows) for tile `pair_tile` of its pairs.
struct Work {
  int unit;
  int expert;
  int pair_tile;
  int64_t block_row;
};

// Weights reach the tensor cores through a per-warp ring of cp.async copies: each lane copies its
// rounds' chunks and scales into shared memory (its own bytes only: no warp or block sync) and
// waits with cp.async.wait_group, which counts groups, so kRingRounds - 2 rounds stay in flight
// while two are multiplied, across row tiles, units and the staging of a tile's columns. Loads
// into registers R rounds ahead (sessions 6-12) gave no real lookahead: ptxas put every weight
// load of the loop on one scoreboard, and a round's first use waited for that scoreboard whole,
// i.e. for the loads issued one round before (SASS: every round waited on SB5), whatever R was
// (moe_bench PDL µs T=16 / 32 / 48: 128.9 / 190.1 / 217.7 with them; ncu gate/up T=32 125 -> 110
// µs, DRAM bytes 334 -> 262 MB, the experts' own).

// Two rounds of a warp (a step of the products): weights[h][p][l], lane l = (g, t)'s chunk of round
// p of the step, of its A row g (h = 0) or g + 8 (h = 1); scales[p][h][l], the aligned 4 bytes that
// hold that chunk's 2-byte scale pair (cp.async copies 4, 8 or 16 bytes).
struct RingStep {
  uint4 weights[2][2][32];
  uint32_t scales[2][2][32];
};

// Ring bytes of a block.
constexpr size_t kRingSharedBytes = sizeof(RingStep) * kMmaWarps * (kRingRounds / 2);

// The grid is sized to the blocks the GPU holds at once (launch_projection), not to the routing:
// the units of work present, (picked expert, row block, tile of its pairs) in ascending order,
// are split into gridDim.x contiguous ranges, one per block, of equal size to a unit. A block
// thus finds the routing once, stages a tile's columns once for all the row blocks of its range
// that share them (ranges span 1-2 experts at 26B shapes), and keeps its warps' copies running
// from one unit's last rounds into the next unit's first; no block waits in a tail wave or exits
// idle after finding no expert, and an expert picked by more than kTilePairs pairs weighs as its
// tiles of pairs do. An expert's tiles of one row block follow each other: the second one's
// weights come from L2.
// Row tile i of warp w of a unit covers rows block_row + (i · kMmaWarps + w) · kMmaTileRows on
// (every warp's first tile, then its second).
// The copies run kRingRounds - 2 rounds ahead of the products along the block's whole range:
// (unit, row tile, round) in order, the next unit's first rounds in flight during this one's last.
template <bool kGateUp>
__global__ void __launch_bounds__(kMmaWarps * 32, kMmaBlocksPerSm)
    by_expert_mma_kernel(ByExpertArgs a) {
  constexpr int S = kRingRounds;
  constexpr int kWarps = kMmaWarps;
  constexpr int kTiles = kMmaRowTiles<kGateUp>;
  constexpr int kBlockRows = kMmaBlockRows<kGateUp>;
  static_assert(S % 2 == 0 && S >= 4, "rounds go two a step, with at least one step in flight");
  __shared__ ExpertTile tile;
  __shared__ ColumnStaging columns;
  extern __shared__ uint4 dynamic_words[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  constexpr int Q = S / 2;  // steps a warp's ring holds
  RingStep* ring = reinterpret_cast<RingStep*>(dynamic_words) + warp * Q;
  uint32_t* staged =
      reinterpret_cast<uint32_t*>(reinterpret_cast<RingStep*>(dynamic_words) + kWarps * Q);
  const int chunks = static_cast<int>(a.chunks_per_row);
  uint16_t* pair_experts =
      reinterpret_cast<uint16_t*>(staged + mma_staged_words(chunks, tile_columns(a)));
  // As the per-pair kernels: gate/up waits first and triggers after, so down may read the
  // router's output (and copy its weights) before its own wait.
  if constexpr (kGateUp) {
    pdl_wait_for_predecessors();
    pdl_trigger_dependents();
  } else {
    pdl_trigger_dependents();
  }
  const int row_blocks = static_cast<int>((a.rows + kBlockRows - 1) / kBlockRows);
  const int64_t units = find_units(a, a.tile_pairs, row_blocks, tile, pair_experts);
  const int first_unit = static_cast<int>(units * blockIdx.x / gridDim.x);
  const int end_unit = static_cast<int>(units * (blockIdx.x + 1) / gridDim.x);
  if (first_unit >= end_unit) return;  // the whole block: fewer units than blocks
  auto unit_work = [&](int unit) {
    const int expert = unit_expert(tile, unit);
    const int tiles = pair_tiles(tile.expert_pairs[expert], a.tile_pairs);
    const int in_expert = unit - tile.first_unit[expert];
    return Work{unit, expert, in_expert % tiles,
                static_cast<int64_t>(in_expert / tiles) * kBlockRows};
  };
  // The unit after w's (there is one): the same expert's next tile of pairs or row block, else
  // the next expert with pairs (cheaper than unit_work's search and divisions).
  auto next_work = [&](Work w) {
    ++w.unit;
    if (w.unit < tile.first_unit[w.expert + 1]) {
      if (++w.pair_tile == pair_tiles(tile.expert_pairs[w.expert], a.tile_pairs)) {
        w.pair_tile = 0;
        w.block_row += kBlockRows;
      }
    } else {
      do {
        ++w.expert;
      } while (tile.first_unit[w.expert + 1] <= w.unit);
      w.pair_tile = 0;
      w.block_row = 0;
    }
    return w;
  };
  const int g = lane >> 2;
  const int t = lane & 3;
  // A row g (h = 0) or g + 8 (h = 1) of row tile `row_tile` of `w`: gate and up of one inner row,
  // or two down rows.
  auto a_row = [&](const Work& w, int row_tile, int h) {
    return w.block_row + static_cast<int64_t>(row_tile * kWarps + warp) * kMmaTileRows<kGateUp> +
           g + (kGateUp ? 0 : 8 * h);
  };
  auto matrix = [&](int expert, int h) -> const MoeMatrix& {
    const MoeExpert& e = a.experts[expert];
    return kGateUp ? (h == 0 ? e.gate : e.up) : e.down;
  };
  const int rounds = (chunks + 3) / 4;
  // Rounds go two a step (the products below), an odd count padded by a round of zero weights.
  const int steps = (rounds + 1) / 2;
  // Chunk t of A row h of a row tile; a row past the matrix reads the last one (its outputs are
  // not stored). Its scale pair is 2-byte aligned: the aligned 4 bytes that hold it start at most
  // 2 bytes before it, in the same 4-byte word (never past an allocation's mapped bytes).
  auto row_chunk = [&](const Work& w, int row_tile, int h) {
    return std::min(a_row(w, row_tile, h), a.rows - 1) * a.chunks_per_row + t;
  };
  auto scale_pair = [&](const Work& w, int row_tile, int h) {
    return reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(matrix(w.expert, h).scales) +
                                       row_chunk(w, row_tile, h));
  };

  // The copy cursor: (copy_work, copy_tile, copy_step), and the next step's chunk and aligned
  // scale bytes of both rows (a step is 8 chunks, 128 bytes and 16 scale bytes on).
  Work copy_work = unit_work(first_unit);
  int copy_tile = 0;
  int copy_step = 0;
  bool copies_done = false;
  const uint4* copy_chunks[2];
  const uint32_t* copy_scales[2];
  auto aim_copies = [&] {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      copy_chunks[h] = static_cast<const uint4*>(matrix(copy_work.expert, h).weights) +
                       row_chunk(copy_work, copy_tile, h);
      copy_scales[h] =
          reinterpret_cast<const uint32_t*>(scale_pair(copy_work, copy_tile, h) & ~uintptr_t{3});
    }
  };
  // This lane's chunks are past the row's end from round `lane_rounds` on: those copy zeros,
  // which multiply zero columns of B (stale bytes could hold NaN).
  const int lane_rounds = (chunks - t + 3) / 4;
  // Copies the cursor's step into ring step `slot` and moves the cursor on; commits a group
  // either way (empty past the range), so that the group count stays one per step.
  auto copy_step_to = [&](int slot) {
    if (!copies_done) {
      RingStep& r = ring[slot];
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const bool valid = 2 * copy_step + p < lane_rounds;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          copy_async16_l2_256_or_zeros(&r.weights[h][p][lane], copy_chunks[h] + 4 * p, valid);
          copy_async4_or_zeros(&r.scales[p][h][lane], copy_scales[h] + 2 * p, valid);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        copy_chunks[h] += 8;
        copy_scales[h] += 4;
      }
      if (++copy_step == steps) {
        copy_step = 0;
        if (++copy_tile == kTiles) {
          copy_tile = 0;
          if (copy_work.unit + 1 < end_unit) {
            copy_work = next_work(copy_work);
          } else {
            copies_done = true;
          }
        }
        if (!copies_done) aim_copies();
      }
    }
    commit_copies();
  };
  // The weights depend on the routing only: in flight while the first tile is found and staged
  // (down: before the wait for the activations).
  aim_copies();
#pragma unroll
  for (int i = 0; i < Q - 1; ++i) copy_step_to(i);
  if constexpr (!kGateUp) pdl_wait_for_predecessors();
  int slot = 0;  // the ring step multiplied next
  Work work = unit_work(first_unit);
  int staged_expert = -1;  // the tile whose columns are staged (block-uniform)
  int staged_pair_tile = 0;
  for (;;) {
    if (work.expert != staged_expert || work.pair_tile != staged_pair_tile) {
      collect_tile(a, a.tile_pairs, work.expert, work.pair_tile, pair_experts, tile);
      stage_mma_tile<kGateUp>(a, matrix(work.expert, 0), tile, chunks, staged, columns);
      __syncthreads();
      staged_expert = work.expert;
      staged_pair_tile = work.pair_tile;
    }
    // Column g of B (pair g of the tile), from this lane's chunk t on. Past the tile's pairs the
    // lanes read its last column: mma output column g depends on B column g alone, and those
    // outputs are not stored. Lanes t = 2, 3 find their pieces pairwise swapped
    // (mma_column_words): even pieces 4 words on, odd ones 4 words back.
    const int column_count = tile.count;
    const uint32_t* column =
        staged + min(g, column_count - 1) * mma_column_words(chunks) + t * kStagedWordsPerChunk;
    const int swap_words = 4 * ((t >> 1) & 1);
    const uint32_t* even_pieces = column + swap_words;
    const uint32_t* odd_pieces = column - swap_words;
    for (int row_tile = 0; row_tile < kTiles; ++row_tile) {
      // Where in its aligned 4 bytes each row's scale pair sits (the same for every round).
      int scale_shift[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        scale_shift[h] = 8 * static_cast<int>(scale_pair(work, row_tile, h) & 2);
      }
      // A step multiplies two rounds, the even one into acc[0] and the odd one into acc[1]: two
      // independent mma chains in one stretch of code, which ptxas interleaves.
      float acc[2][4] = {};
      for (int step = 0; step < steps; ++step) {
        // The ring step multiplied last step takes the next one; then this step's group is
        // complete once at most Q - 1 newer ones are in flight.
        copy_step_to(slot == 0 ? Q - 1 : slot - 1);
        wait_copies<Q - 1>();
        const RingStep& r = ring[slot];
        const uint4 weights[2][2] = {{r.weights[0][0][lane], r.weights[1][0][lane]},
                                     {r.weights[0][1][lane], r.weights[1][1][lane]}};
        const uint32_t scale_bits[2][2] = {
            {r.scales[0][0][lane] >> scale_shift[0], r.scales[0][1][lane] >> scale_shift[1]},
            {r.scales[1][0][lane] >> scale_shift[0], r.scales[1][1][lane] >> scale_shift[1]}};
#pragma unroll
        for (int parity = 0; parity < 2; ++parity) {
          // The padding round of an odd count multiplies zero weights by the last round's
          // (finite) activations.
          const int round_words = 4 * kStagedWordsPerChunk * min(2 * step + parity, rounds - 1);
          mma_round(acc[parity], weights[parity], scale_bits[parity], even_pieces + round_words,
                    odd_pieces + round_words);
        }
        slot = slot == Q - 1 ? 0 : slot + 1;
      }
      // Lane (g, t) holds columns 2t and 2t + 1 of A rows g (acc[.][0], acc[.][1]) and g + 8
      // (acc[.][2], acc[.][3]).
      const int64_t rows[2] = {a_row(work, row_tile, 0), a_row(work, row_tile, 1)};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = 2 * t + j;
        if (c >= column_count) continue;
        const int64_t p = tile.pairs[c];
        const float back = ldexpf(1.0f, kMmaWeightShift - columns.exponent[c]);
        if constexpr (kGateUp) {
          const float gate = apply_global_scale<PackedFormat::kNVFP4>(
              matrix(work.expert, 0), (acc[0][j] + acc[1][j]) * back);
          const float up = apply_global_scale<PackedFormat::kNVFP4>(
              matrix(work.expert, 1), (acc[0][2 + j] + acc[1][2 + j]) * back);
          if (rows[0] < a.rows) a.out[p * a.out_stride + rows[0]] = gelu_tanh(gate) * up;
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (rows[h] < a.rows) {
              a.out[p * a.out_stride + rows[h]] = (acc[0][2 * h + j] + acc[1][2 * h + j]) * back;
            }
          }
        }
      }
    }
    if (work.unit + 1 == end_unit) break;
    work = next_work(work);
  }
}

// ---- Combine ----

constexpr int kCombineThreads = 256;

struct ByExpertCombineArgs {
  const int32_t* expert_ids;  // [tokens, top_k]
  int top_k;
  int num_experts;
  const float* expert_outputs;  // [pairs, hidden], weighted
  int64_t hidden;
  float* out;
  int64_t out_stride;
};

// Block (x, t): out[t][256x ...] = Σ over the token's valid picks in ascending (expert id, k).
__global__ void __launch_bounds__(kCombineThreads) by_expert_combine_kernel(ByExpertCombineArgs a) {
  __shared__ int order[kMaxTopK];
  __shared__ int valid_picks;
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t token = blockIdx.y;
  const int32_t* ids = a.expert_ids + token * a.top_k;
  auto valid = [&](int id) { return id >= 0 && id < a.num_experts; };
  if (threadIdx.x < static_cast<unsigned>(a.top_k)) {
    const int k = static_cast<int>(threadIdx.x);
    const int id = ids[k];
    if (valid(id)) {
      int rank = 0;
      for (int other = 0; other < a.top_k; ++other) {
        const int other_id = ids[other];
        rank += valid(other_id) && (other_id < id || (other_id == id && other < k)) ? 1 : 0;
      }
      order[rank] = k;
    }
  }
  if (threadIdx.x == 0) {
    int count = 0;
    for (int k = 0; k < a.top_k; ++k) count += valid(ids[k]) ? 1 : 0;
    valid_picks = count;
  }
  __syncthreads();
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x;
  if (j >= a.hidden) return;
  float sum = 0.0f;
  for (int i = 0; i < valid_picks; ++i) {
    sum += a.expert_outputs[(token * a.top_k + order[i]) * a.hidden + j];
  }
  a.out[token * a.out_stride + j] = sum;
}

// How a projection launches at a shape: pairs a tile holds (kTilePairs, fewer where their staged
// columns do not fit beside the ring: hidden 13312 takes 6 columns of 26 KB), the dynamic shared
// bytes, and the blocks the current GPU holds at once (0 where the occupancy calculator refuses).
// Asked once per kernel, shape and device (host queries each launch would cost every graph-less
// decode step ~60 of them).
struct ProjectionGeometry {
  int tile_pairs;
  size_t shared;
  int resident;
};

template <typename Kernel>
ProjectionGeometry projection_geometry(Kernel kernel, int threads, int64_t chunks, int pairs) {
  auto shared_bytes = [&](int tile_pairs) {
    return kRingSharedBytes + mma_tile_shared_bytes(chunks, std::min(pairs, tile_pairs), pairs);
  };
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return {kTilePairs, shared_bytes(kTilePairs), 0};
  using Key = std::tuple<const void*, int64_t, int, int>;
  static std::mutex mutex;
  static std::map<Key, ProjectionGeometry> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const Key key = {reinterpret_cast<const void*>(kernel), chunks, pairs, device};
  if (const auto found = known.find(key); found != known.end()) return found->second;
  ProjectionGeometry geometry = {kTilePairs, 0, 0};
  while (geometry.tile_pairs > 1 && !shared_bytes_fit(kernel, shared_bytes(geometry.tile_pairs))) {
    --geometry.tile_pairs;
  }
  geometry.shared = shared_bytes(geometry.tile_pairs);
  // The kernel's static shared memory counts against the same 48 KiB default: allow_shared_bytes
  // is asked for both (the limit it lifts is then a little above the dynamic bytes, harmlessly).
  if (allow_shared_bytes(kernel, geometry.shared + sizeof(ExpertTile) + sizeof(ColumnStaging)) ==
      cudaSuccess) {
    cudaLaunchConfig_t config = {};
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = geometry.shared;
    geometry.resident = occupancy_clusters(kernel, config, 1, device);
  }
  known.emplace(key, geometry);
  return geometry;
}

// One projection (gate/up or down) of every picked expert: as many blocks as the GPU holds at
// once, or as units of work could be present (slots x row blocks) when fewer.
template <bool kGateUp>
cudaError_t launch_projection(ByExpertArgs args, int slots, const Launch& launch) {
  const auto kernel = by_expert_mma_kernel<kGateUp>;
  constexpr int kThreads = kMmaWarps * 32;
  const ProjectionGeometry geometry =
      projection_geometry(kernel, kThreads, args.chunks_per_row, args.pairs);
  args.tile_pairs = geometry.tile_pairs;
  // Again at every launch: the limit is one value per kernel, and another shape's launch may
  // have set it lower since this geometry was found.
  const cudaError_t allowed =
      allow_shared_bytes(kernel, geometry.shared + sizeof(ExpertTile) + sizeof(ColumnStaging));
  if (allowed != cudaSuccess) return allowed;
  const int64_t most_units =
      static_cast<int64_t>(slots) * blocks(args.rows, kMmaBlockRows<kGateUp>);
  const int64_t grid =
      geometry.resident > 0 ? std::min<int64_t>(geometry.resident, most_units) : most_units;
  return launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), geometry.shared,
                       launch, args);
}

}  // namespace

cudaError_t launch_decode_by_expert(const MoeRunArgs& args, float* activations,
                                    float* expert_outputs, const Launch& launch) {
  const MoeShape& shape = args.shape;
  if (!moe_by_expert_formats(shape)) return cudaErrorInvalidValue;
  const int pairs = args.tokens * args.top_k;
  const int slots = std::min(pairs, shape.num_experts);
  const ByExpertArgs gate_up = {
      args.experts,  shape.num_experts, args.expert_ids, args.weights,      pairs,
      args.top_k,    kTilePairs,        shape.inner,     shape.hidden / 32, args.x,
      args.x_stride, activations,       shape.inner};
  cudaError_t status = launch_projection<true>(gate_up, slots, launch);
  if (status != cudaSuccess) return status;
  const ByExpertArgs down = {
      args.experts, shape.num_experts, args.expert_ids, args.weights,     pairs,
      args.top_k,   kTilePairs,        shape.hidden,    shape.inner / 32, activations,
      shape.inner,  expert_outputs,    shape.hidden};
  status = launch_projection<false>(down, slots, launch);
  if (status != cudaSuccess) return status;
  const ByExpertCombineArgs combine = {args.expert_ids, args.top_k,   shape.num_experts,
                                       expert_outputs,  shape.hidden, args.out,
                                       args.out_stride};
  return launch_kernel(
      by_expert_combine_kernel,
      dim3(blocks(shape.hidden, kCombineThreads), static_cast<unsigned>(args.tokens)),
      dim3(kCombineThreads), 0, launch, combine);
}

}  // namespace gemma4::cuda
