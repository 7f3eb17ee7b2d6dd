// Prefill attention (prefill_kernels.h): flash attention on bf16 tensor cores (mma.sync
// m16n8k16, fp32 accumulation), FlashAttention-2 style: scores, softmax statistics and the
// output accumulator stay in registers.
//
// Rows. The work of one kv head is the pairs (query t, q head g of its group), flattened as
// t · group + g; block (x, kv head, split) takes kRows of them, so every K/V tile it loads into
// shared memory serves all q heads of the group and several queries (GQA). A warp owns 16 rows
// and 256 head dims of the output (128 fp32 accumulators a thread): head_dim 256 gives each warp
// its own rows; at head_dim 512 two warps share 16 rows, each accumulating half of the dims and
// computing half of every score's dot product, the halves summed through shared memory in a
// fixed order (both warps then hold bit-identical scores and softmax statistics).
//
// Keys. The slots a block may need are [0, scanned) (position p lives in slot p % slots, so
// slots past the block's largest query position hold none it can see) of the cache and, for
// prefill_chunk_attention, of the staged chunk (a second source numbered after the cache's
// tiles); they are cut into tiles of kKeys, and with splits > 1 each split block takes a contiguous
// share of the tiles and writes unnormalised partials that prefill_merge_kernel combines (what
// fills the GPU when a pass has few row tiles: E2B's one kv head). A block first lists the tiles
// some row of it can see (positions read from slot_positions: ring slots and sliding windows make
// that set irregular), then walks the list with the next tile's K/V loading (cp.async for bf16
// caches) while the current one is multiplied. Keys no row can see are not read but zeroed (a
// never-written slot must not reach the sums even with weight 0: 0 · NaN = NaN), and the
// list-building pass records which they are, so a tile load never waits for memory.
//
// Softmax per row: scores scaled by scale · log2(e) (exp2), masked by the recorded positions,
// running max per row; weights rounded to bf16 for the tensor cores and the running sum adds
// those rounded weights, so the normalisation matches what was multiplied. out = O / sum (zeros
// where nothing was visible, as the CPU reference).
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "backend/cuda/attention_kv.cuh"
#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/prefill_kernels.h"

namespace gemma4::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = 16;   // rows of an mma.sync m16n8k16 tile
constexpr int kWarpDims = 256;  // head dims of O one warp accumulates
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory of the kernel for head_dim HD: Q (bf16, the block's rows), two K and two V
// tiles (bf16), the score halves exchanged at HD 512, two tiles' key positions, the block's
// rows' positions and the list of tiles to visit. Rows are padded by 16 bytes, which makes the
// eight 16-byte rows an ldmatrix reads fall in distinct bank groups. ~101 KB at HD 256, ~108 KB
// at HD 512: two blocks per SM.
template <int HD>
struct Layout {
  static constexpr int kDimParts = HD / kWarpDims;  // warps sharing a row tile
  static constexpr int kRowTiles = kWarps / kDimParts;
  static constexpr int kRows = kRowTiles * kWarpRows;
  static constexpr int kKeys = HD == 256 ? 32 : 16;
  static constexpr int kScoreRegs = kKeys / 8 * 4;  // a thread's score fragment floats
  static constexpr int kLd = HD + 8;                // bf16 elements per Q/K/V row
  static constexpr size_t kTileBytes = sizeof(bf16) * kKeys * kLd;
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(bf16) * kRows * kLd;  // [2] tiles
  static constexpr size_t kV = kK + 2 * kTileBytes;              // [2] tiles
  static constexpr size_t kExchange = kV + 2 * kTileBytes;       // [warp][kScoreRegs][lane]
  static constexpr size_t kKeyPosition =
      kExchange + (kDimParts > 1 ? sizeof(float) * kWarps * kScoreRegs * 32 : 0);  // [2][kKeys]
  static constexpr size_t kRowPosition = kKeyPosition + sizeof(int32_t) * 2 * kKeys;
  static constexpr size_t kTileList = kRowPosition + sizeof(int32_t) * kRows;    // [kThreads]
  static constexpr size_t kTileLoaded = kTileList + sizeof(int32_t) * kThreads;  // [kThreads]
  static constexpr size_t kWarpCounts = kTileLoaded + sizeof(uint32_t) * kThreads;
  static constexpr size_t kBytes = kWarpCounts + sizeof(int32_t) * kWarps;
  static_assert(kDimParts * kRowTiles == kWarps && kKeys % 16 == 0 && kKeys <= 32);
  static_assert(kK % 16 == 0 && kV % 16 == 0 && (kLd * sizeof(bf16)) % 16 == 0);
  static_assert(2 * (kBytes + 1024) <= 228 * 1024, "two blocks per SM");
};

// Where keys come from: a cache (slots == 0: none), K/V of the args' kv_heads and element type.
struct KeySource {
  const void* keys;
  const void* values;
  const int32_t* slot_positions;
  int64_t slots;
};

struct PrefillArgs {
  const float* q;
  int64_t q_stride;
  const int32_t* positions;
  int64_t queries;
  int group;  // q heads per kv head
  int kv_heads;
  KeySource cache;
  KeySource staged;  // the chunk's own K/V (prefill_chunk_attention), or none
  int window;
  float scale_log2;  // scale · log2(e)
  int splits;
  float* out;  // splits == 1
  int64_t out_stride;
  float* partials;  // splits > 1: prefill_attention_partials_floats
};

__device__ __forceinline__ bool visible(int32_t key_position, int32_t query_position, int window) {
  return key_position >= 0 && key_position <= query_position &&
         (window == 0 || query_position - key_position < window);
}

// Two floats as the bf16 pair of an mma fragment (the lower column in the low half).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ __forceinline__ float unpacked_sum(uint32_t pair) {
  const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&pair);
  return __low2float(v) + __high2float(v);
}

// The tiles a block may visit: those of slots [0, scanned) of the cache, then those of the staged
// chunk (position p lives in slot p % slots of either, so slots past the block's largest query
// position hold none it can see). A tile is numbered in that order.
struct TileSpace {
  int64_t cache_scanned, staged_scanned;
  int64_t cache_tiles, tiles;
};

template <int kKeys>
__device__ __forceinline__ TileSpace tile_space(const PrefillArgs& a, int32_t max_position) {
  TileSpace space;
  space.cache_scanned = min(a.cache.slots, int64_t{max_position} + 1);
  space.staged_scanned = min(a.staged.slots, int64_t{max_position} + 1);
  space.cache_tiles = (space.cache_scanned + kKeys - 1) / kKeys;
  space.tiles = space.cache_tiles + (space.staged_scanned + kKeys - 1) / kKeys;
  return space;
}

// Tile `tile` of the space as slots [first_slot, first_slot + kKeys) of one source.
struct TileSlots {
  KeySource source;
  int64_t first_slot;
  int64_t scanned;
};

template <int kKeys>
__device__ __forceinline__ TileSlots tile_slots(const PrefillArgs& a, const TileSpace& space,
                                                int64_t tile) {
  const bool staged = tile >= space.cache_tiles;
  return {staged ? a.staged : a.cache, (staged ? tile - space.cache_tiles : tile) * kKeys,
          staged ? space.staged_scanned : space.cache_scanned};
}

// Starts loading tile `tile` of kv head `kv_head` into K/V buffer `buffer`, with its slot
// positions (-1 past the source's slots). Keys whose bit in `loaded` is clear (empty slots, slots
// no row can see) are zeros, not read. bf16 caches: cp.async throughout (the caller commits and
// waits: nothing here waits for memory); other caches: K/V converted through registers, 4
// elements per load, complete on return.
template <int HD, typename Kv>
__device__ void load_tile(const PrefillArgs& a, const TileSpace& space, int kv_head, int64_t tile,
                          uint32_t loaded, int buffer, unsigned char* shared) {
  using L = Layout<HD>;
  constexpr bool kAsync = std::is_same_v<Kv, bf16>;
  constexpr int kElementsPerChunk = kAsync ? 8 : 4;
  constexpr int kChunksPerKey = HD / kElementsPerChunk;
  constexpr int kChunksPerThread = L::kKeys * kChunksPerKey / kThreads;
  static_assert(L::kKeys * kChunksPerKey % kThreads == 0);
  const TileSlots at = tile_slots<L::kKeys>(a, space, tile);
  const int64_t first_slot = at.first_slot;
  int32_t* key_position = reinterpret_cast<int32_t*>(shared + L::kKeyPosition) + buffer * L::kKeys;
  bf16* k_tile = reinterpret_cast<bf16*>(shared + L::kK + buffer * L::kTileBytes);
  bf16* v_tile = reinterpret_cast<bf16*>(shared + L::kV + buffer * L::kTileBytes);
  if (threadIdx.x < L::kKeys) {
    const int64_t slot = first_slot + threadIdx.x;
    if (slot < at.source.slots) {
      copy_async4(key_position + threadIdx.x, at.source.slot_positions + slot);
    } else {
      key_position[threadIdx.x] = -1;
    }
  }
  const int64_t row_elements = int64_t{a.kv_heads} * HD;
  const Kv* keys = static_cast<const Kv*>(at.source.keys) + int64_t{kv_head} * HD;
  const Kv* values = static_cast<const Kv*>(at.source.values) + int64_t{kv_head} * HD;
  if constexpr (kAsync) {
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
      const int i = threadIdx.x + j * kThreads;
      const int key = i / kChunksPerKey;
      const int column = i % kChunksPerKey * kElementsPerChunk;
      const bool valid = (loaded >> key) & 1u;
      const int64_t offset = valid ? (first_slot + key) * row_elements + column : 0;
      copy_async16_or_zeros(k_tile + key * L::kLd + column, keys + offset, valid);
      copy_async16_or_zeros(v_tile + key * L::kLd + column, values + offset, valid);
    }
  } else {
    constexpr int kBatch = 4;  // float4s of K and of V in flight per thread
    static_assert(kChunksPerThread % kBatch == 0);
#pragma unroll
    for (int first = 0; first < kChunksPerThread; first += kBatch) {
      float4 k[kBatch], v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = threadIdx.x + (first + j) * kThreads;
        const int key = i / kChunksPerKey;
        const int64_t offset = (first_slot + key) * row_elements + i % kChunksPerKey * 4;
        k[j] = v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if ((loaded >> key) & 1u) {
          k[j] = load_kv4(keys + offset);
          v[j] = load_kv4(values + offset);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = threadIdx.x + (first + j) * kThreads;
        const int at = i / kChunksPerKey * L::kLd + i % kChunksPerKey * 4;
        uint2 k_out, v_out;
        k_out.x = pack_bf16(k[j].x, k[j].y);
        k_out.y = pack_bf16(k[j].z, k[j].w);
        v_out.x = pack_bf16(v[j].x, v[j].y);
        v_out.y = pack_bf16(v[j].z, v[j].w);
        *reinterpret_cast<uint2*>(k_tile + at) = k_out;
        *reinterpret_cast<uint2*>(v_tile + at) = v_out;
      }
    }
  }
}

template <int HD, typename Kv>
__global__ void __launch_bounds__(kThreads, 2) prefill_attention_kernel(PrefillArgs a) {
  using L = Layout<HD>;
  constexpr int kRows = L::kRows, kKeys = L::kKeys;
  constexpr int kKeyTiles = kKeys / 8;      // n-tiles of a score fragment
  constexpr int kDimTiles = kWarpDims / 8;  // n-tiles of the output fragment
  pdl_trigger_dependents();
  extern __shared__ __align__(128) unsigned char shared[];
  bf16* q_tile = reinterpret_cast<bf16*>(shared + L::kQ);
  float* exchange = reinterpret_cast<float*>(shared + L::kExchange);
  int32_t* row_position = reinterpret_cast<int32_t*>(shared + L::kRowPosition);
  int32_t* tile_list = reinterpret_cast<int32_t*>(shared + L::kTileList);
  uint32_t* tile_loaded = reinterpret_cast<uint32_t*>(shared + L::kTileLoaded);
  int32_t* warp_counts = reinterpret_cast<int32_t*>(shared + L::kWarpCounts);
  pdl_wait_for_predecessors();

  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int64_t first_row = int64_t{blockIdx.x} * kRows;
  const int64_t total_rows = a.queries * a.group;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row_tile = warp % L::kRowTiles;
  const int dim_part = warp / L::kRowTiles;
  const int quad_row = lane / 4;     // the fragment row (and row + 8) this lane holds
  const int quad_column = lane % 4;  // its column pair within each 8-wide n-tile

  // Q rows → bf16 (zeros past the last query) and their positions (-1: sees nothing).
  for (int r = warp; r < kRows; r += kWarps) {
    const int64_t row = first_row + r;
    const bool live = row < total_rows;
    const int64_t t = live ? row / a.group : 0;
    const int64_t head = int64_t{kv_head} * a.group + (live ? row % a.group : 0);
    const float* q = a.q + t * a.q_stride + head * HD;
    for (int d = lane; d < HD; d += 32) {
      q_tile[r * L::kLd + d] = __float2bfloat16(live ? q[d] : 0.0f);
    }
    if (lane == 0) row_position[r] = live ? a.positions[t] : -1;
  }
  __syncthreads();

  int32_t max_position = -1, min_position = INT_MAX;
  for (int r = 0; r < kRows; ++r) {
    const int32_t p = row_position[r];
    if (p >= 0) {
      max_position = max(max_position, p);
      min_position = min(min_position, p);
    }
  }
  const int32_t my_position[2] = {row_position[row_tile * kWarpRows + quad_row],
                                  row_position[row_tile * kWarpRows + quad_row + 8]};

  // This split's share of the tiles.
  const TileSpace space = tile_space<kKeys>(a, max_position);
  const int64_t tile_begin = space.tiles * split / a.splits;
  const int64_t tile_end = space.tiles * (split + 1) / a.splits;

  float o[kDimTiles][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 units
  float row_sum[2] = {0.0f, 0.0f};            // this lane's columns only

  for (int64_t chunk = tile_begin; chunk < tile_end; chunk += kThreads) {
    // The chunk's tiles that some row may see (a superset test; each row's own mask is
    // applied to the scores), compacted in order into tile_list, with the keys worth reading
    // (holding a position, one some row may see) as a bit mask in tile_loaded.
    uint32_t loaded = 0;
    const int64_t tile = chunk + threadIdx.x;
    if (tile < tile_end) {
      const TileSlots at = tile_slots<kKeys>(a, space, tile);
      // Independent loads (no early exit): one memory round trip per tile, not kKeys.
#pragma unroll
      for (int k = 0; k < kKeys; ++k) {
        const int64_t slot = at.first_slot + k;
        const int32_t p = slot < at.scanned ? __ldg(at.source.slot_positions + slot) : -1;
        const bool seen =
            p >= 0 && p <= max_position && (a.window == 0 || min_position - p < a.window);
        loaded |= static_cast<uint32_t>(seen) << k;
      }
    }
    const bool wanted = loaded != 0;
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, wanted);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int offset = __popc(ballot & ((1u << lane) - 1u)), count = 0;
    for (int w = 0; w < kWarps; ++w) {
      offset += w < warp ? warp_counts[w] : 0;
      count += warp_counts[w];
    }
    if (wanted) {
      tile_list[offset] = static_cast<int32_t>(tile);
      tile_loaded[offset] = loaded;
    }
    __syncthreads();
    if (count == 0) continue;

    load_tile<HD, Kv>(a, space, kv_head, tile_list[0], tile_loaded[0], 0, shared);
    commit_copies();
    for (int i = 0; i < count; ++i) {
      const int buffer = i % 2;
      if (i + 1 < count) {
        load_tile<HD, Kv>(a, space, kv_head, tile_list[i + 1], tile_loaded[i + 1], 1 - buffer,
                          shared);
        commit_copies();
        wait_copies<1>();
      } else {
        wait_copies<0>();
      }
      __syncthreads();  // tile i complete and visible to every warp
      const bf16* k_tile = reinterpret_cast<const bf16*>(shared + L::kK + buffer * L::kTileBytes);
      const bf16* v_tile = reinterpret_cast<const bf16*>(shared + L::kV + buffer * L::kTileBytes);
      const int32_t* key_position =
          reinterpret_cast<const int32_t*>(shared + L::kKeyPosition) + buffer * kKeys;

      // S = Q · Kᵀ over this warp's dims (K's rows [key][d] are Kᵀ column-major).
      float s[kKeyTiles][4] = {};
      const int dim0 = dim_part * kWarpDims;
#pragma unroll 4  // (fully unrolled, the prefetched fragments spill the accumulators)
      for (int kk = 0; kk < kWarpDims; kk += 16) {
        uint32_t q_fragment[4];
        load_matrices<false>(q_fragment, q_tile + (row_tile * kWarpRows + lane % 16) * L::kLd +
                                             dim0 + kk + lane / 16 * 8);
#pragma unroll
        for (int n = 0; n < kKeyTiles; n += 2) {
          uint32_t k_fragment[4];
          load_matrices<false>(k_fragment, k_tile + (n * 8 + lane % 8 + lane / 16 * 8) * L::kLd +
                                               dim0 + kk + lane / 8 % 2 * 8);
          mma_bf16(s[n], q_fragment, k_fragment[0], k_fragment[1]);
          mma_bf16(s[n + 1], q_fragment, k_fragment[2], k_fragment[3]);
        }
      }
      if constexpr (L::kDimParts > 1) {
        // Every part's partial scores, summed in part order by each warp of the row tile.
        float* mine = exchange + warp * L::kScoreRegs * 32;
#pragma unroll
        for (int i = 0; i < L::kScoreRegs; ++i) mine[i * 32 + lane] = s[i / 4][i % 4];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < L::kScoreRegs; ++i) {
          float sum = 0.0f;
#pragma unroll
          for (int part = 0; part < L::kDimParts; ++part) {
            sum += exchange[((part * L::kRowTiles + row_tile) * L::kScoreRegs + i) * 32 + lane];
          }
          s[i / 4][i % 4] = sum;
        }
      }

      // Online softmax; element e of n-tile n is row quad_row + 8 · (e / 2), key
      // n · 8 + 2 · quad_column + e % 2.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int32_t key = key_position[n * 8 + 2 * quad_column + e % 2];
          s[n][e] = visible(key, my_position[e / 2], a.window) ? s[n][e] * a.scale_log2 : -INFINITY;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
        }
      }
      float base[2], rescale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 2));
        const float new_max = fmaxf(row_max[h], tile_max[h]);
        // Nothing visible yet: every weight 0 (exp2(−∞ − 0)), O and the sum stay 0.
        base[h] = new_max == -INFINITY ? 0.0f : new_max;
        rescale[h] = exp2f(row_max[h] - base[h]);
        row_max[h] = new_max;
        row_sum[h] *= rescale[h];
      }
      // Once a row's max has settled most tiles leave it (rescale exactly 1): the warp skips the
      // multiplies of its whole accumulator then (x · 1 = x: the same result).
      if (!__all_sync(0xFFFFFFFFu, rescale[0] == 1.0f && rescale[1] == 1.0f)) {
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          o[n][0] *= rescale[0];
          o[n][1] *= rescale[0];
          o[n][2] *= rescale[1];
          o[n][3] *= rescale[1];
        }
      }

      // O += P · V: the score fragments of 16 keys are the A fragment of one mma k-step.
#pragma unroll
      for (int kk = 0; kk < kKeyTiles; kk += 2) {
        uint32_t p[4];
        p[0] = pack_bf16(exp2f(s[kk][0] - base[0]), exp2f(s[kk][1] - base[0]));
        p[1] = pack_bf16(exp2f(s[kk][2] - base[1]), exp2f(s[kk][3] - base[1]));
        p[2] = pack_bf16(exp2f(s[kk + 1][0] - base[0]), exp2f(s[kk + 1][1] - base[0]));
        p[3] = pack_bf16(exp2f(s[kk + 1][2] - base[1]), exp2f(s[kk + 1][3] - base[1]));
        row_sum[0] += unpacked_sum(p[0]) + unpacked_sum(p[2]);
        row_sum[1] += unpacked_sum(p[1]) + unpacked_sum(p[3]);
#pragma unroll
        for (int n = 0; n < kDimTiles; n += 2) {
          uint32_t v_fragment[4];
          load_matrices<true>(v_fragment, v_tile + (kk * 8 + lane % 8 + lane / 8 % 2 * 8) * L::kLd +
                                              dim0 + n * 8 + lane / 16 * 8);
          mma_bf16(o[n], p, v_fragment[0], v_fragment[1]);
          mma_bf16(o[n + 1], p, v_fragment[2], v_fragment[3]);
        }
      }
      __syncthreads();  // the buffers (and the exchange) are refilled next iteration
    }
  }

  // The row sums over the quad's columns; then the output (or this split's partial).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[h], 2);
  }
  const int q_heads = a.kv_heads * a.group;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = first_row + row_tile * kWarpRows + quad_row + 8 * h;
    if (row >= total_rows) continue;
    const int64_t t = row / a.group;
    const int64_t head = int64_t{kv_head} * a.group + row % a.group;
    float* out;
    float divisor = 1.0f;
    if (a.splits == 1) {
      out = a.out + t * a.out_stride + head * HD;
      divisor = row_sum[h];
    } else {
      const int64_t partial_row = (split * a.queries + t) * q_heads + head;
      out = a.partials + partial_row * HD;
      if (dim_part == 0 && quad_column == 0) {
        float* stats = a.partials + a.splits * a.queries * q_heads * HD + partial_row * 2;
        stats[0] = row_max[h];
        stats[1] = row_sum[h];
      }
    }
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      const int d = dim_part * kWarpDims + n * 8 + 2 * quad_column;
      out[d] = divisor > 0.0f ? o[n][2 * h] / divisor : 0.0f;
      out[d + 1] = divisor > 0.0f ? o[n][2 * h + 1] / divisor : 0.0f;
    }
  }
}

// out[t][head] = Σ_s 2^(m_s − M) · O_s / Σ_s 2^(m_s − M) · l_s over the splits' partials
// (M = max m_s; zeros where no split saw anything). One block per (query, q head).
__global__ void __launch_bounds__(kThreads)
    prefill_merge_kernel(const float* partials, int64_t queries, int q_heads, int head_dim,
                         int splits, float* out, int64_t out_stride) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t row = blockIdx.x;  // t · q_heads + head
  const int64_t rows = queries * q_heads;
  const float* stats = partials + splits * rows * head_dim;
  float max_log2 = -INFINITY;
  for (int s = 0; s < splits; ++s) max_log2 = fmaxf(max_log2, stats[(s * rows + row) * 2]);
  float* o = out + row / q_heads * out_stride + row % q_heads * head_dim;
  if (max_log2 == -INFINITY) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = 0.0f;
    return;
  }
  float total = 0.0f;
  for (int s = 0; s < splits; ++s) {
    total += exp2f(stats[(s * rows + row) * 2] - max_log2) * stats[(s * rows + row) * 2 + 1];
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) {
      sum +=
          exp2f(stats[(s * rows + row) * 2] - max_log2) * partials[(s * rows + row) * head_dim + d];
    }
    o[d] = total > 0.0f ? sum / total : 0.0f;
  }
}

// store_staged_kv: block b copies staged slots [b, b + 1) · kStoredSlotsPerBlock, each holding a
// position among the last cache.slots staged ones (p + cache.slots > the largest: what writing
// every staged row in position order would leave), to cache slot p % cache.slots, as raw 16-byte
// words (both are of one element type; `cache` is read for its pointers and slots only).
constexpr int kStoredSlotsPerBlock = 8;

__global__ void __launch_bounds__(kThreads)
    store_staged_kernel(KeySource staged, SequenceKv cache, int64_t row_words) {
  pdl_trigger_dependents();
  __shared__ int32_t warp_latest[kWarps];
  pdl_wait_for_predecessors();
  int32_t latest = -1;
  for (int64_t slot = threadIdx.x; slot < staged.slots; slot += kThreads) {
    latest = max(latest, staged.slot_positions[slot]);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    latest = max(latest, __shfl_xor_sync(0xFFFFFFFFu, latest, offset));
  }
  if (threadIdx.x % 32 == 0) warp_latest[threadIdx.x / 32] = latest;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) latest = max(latest, warp_latest[w]);

  const int64_t first = int64_t{blockIdx.x} * kStoredSlotsPerBlock;
  for (int64_t slot = first; slot < min(first + kStoredSlotsPerBlock, staged.slots); ++slot) {
    const int32_t position = staged.slot_positions[slot];
    if (position < 0 || position + cache.slots <= latest) continue;
    const int64_t target = position % cache.slots;
    const auto* staged_keys = static_cast<const uint4*>(staged.keys) + slot * row_words;
    const auto* staged_values = static_cast<const uint4*>(staged.values) + slot * row_words;
    auto* keys = static_cast<uint4*>(cache.keys) + target * row_words;
    auto* values = static_cast<uint4*>(cache.values) + target * row_words;
    for (int64_t i = threadIdx.x; i < row_words; i += kThreads) {
      keys[i] = staged_keys[i];
      values[i] = staged_values[i];
    }
    if (threadIdx.x == 0) cache.slot_positions[target] = position;
  }
}

template <int HD, typename Kv>
cudaError_t launch_prefill_attention(const PrefillArgs& args, const Launch& launch) {
  using L = Layout<HD>;
  const int64_t blocks = (args.queries * args.group + L::kRows - 1) / L::kRows;
  if (blocks > INT_MAX || args.kv_heads > 65535) return cudaErrorInvalidValue;
  // Above 48 KB a kernel must opt in (a function attribute, not a stream operation: allowed
  // while a graph is captured).
  const cudaError_t status = cudaFuncSetAttribute(
      prefill_attention_kernel<HD, Kv>, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (status != cudaSuccess) return status;
  return launch_kernel(prefill_attention_kernel<HD, Kv>,
                       dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(args.kv_heads),
                            static_cast<unsigned>(args.splits)),
                       dim3(kThreads), L::kBytes, launch, args);
}

template <typename Kv>
cudaError_t launch_for_head_dim(const PrefillArgs& args, int head_dim, const Launch& launch) {
  return head_dim == 256 ? launch_prefill_attention<256, Kv>(args, launch)
                         : launch_prefill_attention<512, Kv>(args, launch);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

int64_t rows_per_block(int head_dim) {
  return head_dim == 256 ? Layout<256>::kRows : Layout<512>::kRows;
}

int64_t keys_per_tile(int head_dim) {
  return head_dim == 256 ? Layout<256>::kKeys : Layout<512>::kKeys;
}

// A uniform view of one sequence's slots the kernels take (head_dim 256 or 512, 16-byte aligned).
bool valid_source(const KvCacheView& kv) {
  return kv.keys != nullptr && kv.values != nullptr && kv.slot_positions != nullptr &&
         kv.slots >= 1 && kv.kv_heads >= 1 && kv.sequences == nullptr &&
         (kv.head_dim == 256 || kv.head_dim == 512) && aligned16(kv.keys) && aligned16(kv.values);
}

KeySource source_of(const KvCacheView& kv) {
  return {kv.keys, kv.values, kv.slot_positions, kv.slots};
}

// prefill_attention over the keys of `kv` and, if `staged` is not null, those of *staged.
cudaError_t attend(const RowsView& q, const int32_t* positions, const KvCacheView& kv,
                   const KvCacheView* staged, int window, float scale, const RowsView& out,
                   float* partials, int splits, const Launch& launch) {
  const int head_dim = kv.head_dim;
  if (q.data == nullptr || out.data == nullptr || q.rows < 1 || out.rows != q.rows ||
      out.width != q.width || q.stride < q.width || out.stride < out.width ||
      positions == nullptr || !valid_source(kv) || q.width % head_dim != 0 ||
      (q.width / head_dim) % kv.kv_heads != 0 || q.width / head_dim > INT_MAX || splits < 1 ||
      splits > 65535 || (splits > 1 && partials == nullptr) ||
      q.rows * (q.width / head_dim) > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  PrefillArgs args = {};
  args.q = q.data;
  args.q_stride = q.stride;
  args.positions = positions;
  args.queries = q.rows;
  args.group = static_cast<int>(q.width / head_dim / kv.kv_heads);
  args.kv_heads = kv.kv_heads;
  args.cache = source_of(kv);
  if (staged != nullptr) args.staged = source_of(*staged);
  args.window = window;
  args.scale_log2 = scale * kLog2e;
  args.splits = splits;
  args.out = out.data;
  args.out_stride = out.stride;
  args.partials = partials;
  const cudaError_t status = with_kv_type(kv.type, [&](auto element) {
    return launch_for_head_dim<decltype(element)>(args, head_dim, launch);
  });
  if (status != cudaSuccess || splits == 1) return status;
  const int64_t rows = q.rows * (q.width / head_dim);
  return launch_kernel(prefill_merge_kernel, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0,
                       launch, static_cast<const float*>(partials), q.rows,
                       static_cast<int>(q.width / head_dim), head_dim, splits, out.data,
                       out.stride);
}

}  // namespace

size_t prefill_attention_partials_floats(int64_t queries, int q_heads, int head_dim, int splits) {
  return static_cast<size_t>(splits) * static_cast<size_t>(queries) * static_cast<size_t>(q_heads) *
         (static_cast<size_t>(head_dim) + 2);
}

int prefill_attention_splits(int64_t queries, int q_heads, const KvCacheView& kv) {
  if (kv.kv_heads < 1 || q_heads < kv.kv_heads || (kv.head_dim != 256 && kv.head_dim != 512)) {
    return 1;
  }
  int multiprocessors = 0, device = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  // Two waves of two blocks per SM: blocks differ in work (causal rows see different numbers
  // of keys), and more, smaller ones even that out. Each split keeps at least four tiles of the
  // whole cache, and the partials stay within kMaxPartialBytes (both mirrored in
  // engine/memory_plan.cpp, which plans this scratch).
  constexpr int kMaxSplits = 8;
  constexpr size_t kMaxPartialBytes = size_t{32} << 20;
  const int64_t row_blocks = (queries * (q_heads / kv.kv_heads) + rows_per_block(kv.head_dim) - 1) /
                             rows_per_block(kv.head_dim) * kv.kv_heads;
  const int64_t wanted = (4 * int64_t{multiprocessors} + row_blocks - 1) / row_blocks;
  const int64_t by_keys = std::max<int64_t>(1, kv.slots / (4 * keys_per_tile(kv.head_dim)));
  int splits = static_cast<int>(std::clamp<int64_t>(std::min(wanted, by_keys), 1, kMaxSplits));
  while (splits > 1 &&
         sizeof(float) * prefill_attention_partials_floats(queries, q_heads, kv.head_dim, splits) >
             kMaxPartialBytes) {
    --splits;
  }
  return splits;
}

cudaError_t prefill_attention(const RowsView& q, const int32_t* positions, const KvCacheView& kv,
                              int window, float scale, const RowsView& out, float* partials,
                              int splits, const Launch& launch) {
  return attend(q, positions, kv, nullptr, window, scale, out, partials, splits, launch);
}

cudaError_t prefill_chunk_attention(const RowsView& q, const int32_t* positions,
                                    const KvCacheView& kv, const KvCacheView& staged, int window,
                                    float scale, const RowsView& out, float* partials, int splits,
                                    const Launch& launch) {
  if (!valid_source(staged) || staged.kv_heads != kv.kv_heads || staged.head_dim != kv.head_dim ||
      staged.type != kv.type) {
    return cudaErrorInvalidValue;
  }
  return attend(q, positions, kv, &staged, window, scale, out, partials, splits, launch);
}

cudaError_t store_staged_kv(const KvCacheView& staged, const SequenceKv& kv, const Launch& launch) {
  if (!valid_source(staged) || kv.keys == nullptr || kv.values == nullptr ||
      kv.slot_positions == nullptr || kv.slots < 1 || !aligned16(kv.keys) ||
      !aligned16(kv.values) ||
      (staged.slots + kStoredSlotsPerBlock - 1) / kStoredSlotsPerBlock > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  // Every element type's row of 256 or 512 dims per kv head is a whole number of 16-byte words.
  const int64_t row_bytes =
      int64_t{staged.kv_heads} * staged.head_dim *
      static_cast<int64_t>(with_kv_type(staged.type, [](auto element) { return sizeof(element); }));
  const auto blocks =
      static_cast<unsigned>((staged.slots + kStoredSlotsPerBlock - 1) / kStoredSlotsPerBlock);
  return launch_kernel(store_staged_kernel, dim3(blocks), dim3(kThreads), 0, launch,
                       source_of(staged), kv, row_bytes / 16);
}

}  // namespace gemma4::cuda
