// Decode attention (see attention.h). Two kernels share the key splits, the cp.async copies,
// the fused prologue and the split merge: the CUDA-core kernel described here (every cache type)
// and the tensor-core one further down (bf16 and e4m3 caches, up to 8 q heads per kv head; its
// comment says why it exists). The CUDA-core kernel: block (x, kv head, sequence) of 8 warps, two
// blocks per SM; x is a (key split, q-head part) pair chosen at run time from the query's depth
// (block_work): a deep cache splits its keys, a shallow one gives each block a few of the group's q
// heads, so the short chain of dependent loads of one head is the whole cost. The block streams its
// keys' K/V rows and slot positions through shared memory in tiles of kStageBytes with cp.async,
// kStages tiles deep: while one tile is computed the next kStages − 1 are in flight, so the DRAM
// latency is hidden instead of waited for per key (the earlier register-batched kernel reached ~10
// % of the read bandwidth). Computing a tile: warp w serves q heads [hg·HPW, hg·HPW + HPW) of the
// group (hg = w % HG) over the tile's keys ks, ks + KS, ... (ks = w / HG): with few heads per group
// more warps share the keys. A row is read in pieces of 16 (or 8) bytes, lane l taking pieces l, l
// + 32, ... so a warp's reads of a row are contiguous in shared memory (no bank conflicts); lane l
// therefore owns the dims of those pieces. K/V are fp32, bf16 or e4m3 (KvType), widened to fp32 as
// read. Each warp keeps an online softmax (max, sum, acc) per head; the warps of a block are merged
// in shared memory, and the splits by a small second kernel (which leaves at once when a shallow
// cache put every key in one split: that block wrote the output), or, where the records are few,
// by the last of the tensor-core kernel's split blocks to finish (merge_in_last_block). The
// sequences come from a table in the kernel parameters, so one launch serves a whole decode batch
// of separate caches. With AttentionQuery::prepare the launch also does prepare_attention's work
// for the decode rows (attention.h: DecodePrepare), saving that kernel and its launch gap per
// layer: each block prepares its own q heads, and every block of the last key split makes the new
// K/V in shared memory (the part-0 one also stores it), while its first tiles are in flight.
// Whichever kernel writes an output row (the attention kernel for one split, else the merge) also
// writes its bf16 / kQ8 companions for o_proj's GEMV.
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_kv.cuh"
#include "backend/cuda/attention_prepare.cuh"
#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/q8.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// The merge keeps one weight per split in shared memory.
constexpr int kMaxSplits = 4096;
// One pipeline stage: K and V rows of a tile of keys (4 keys of fp32 × 512 ... 32 keys of e4m3 ×
// 256). Six stages keep 80 KB per block of reads in flight while one tile is computed, enough to
// cover the DRAM latency even when a shallow cache gives fewer blocks than SMs; two blocks (192 KB)
// fit an SM.
constexpr int kStageBytes = 16384;
constexpr int kStages = 6;
constexpr int kChunkBytes = 16;
constexpr size_t kPipelineBytes = size_t{kStages} * kStageBytes;
// The fused prologue's q heads live in one stage.
static_assert(sizeof(float) * kMaxPreparedGroupFloats <= kStageBytes);

struct AttentionArgs {
  const float* q;
  int64_t q_stride;
  int q_heads;
  int group;  // q heads per kv head
  const int32_t* positions;
  SequenceKvTable sequences;
  int kv_heads;
  int window;
  float scale;
  int splits;
  float* out;  // splits == 1
  int64_t out_stride;
  ActivationCompanions out_companions;  // written with out
  float* partials;        // splits > 1: [batch][q_heads][splits][head_dim + 2] = (max, sum, acc)
  DecodePrepare prepare;  // the fused prologue's (kPrepare kernels)
  // Set (tensor-core kernel): [batch][kv_heads] arrival counters, and the last split block of a kv
  // head merges its splits (merge_in_last_block) instead of the merge kernel.
  int* merge_counters;
  // The kRotatedKeys tensor-core kernel's (reads_rotated_keys_only): K's rotated dims are read, V
  // scaled by the key scales in the others' stead (attention.h).
  KeysFromValues keys_from_values;
};

// The keys a query at `query_position` scans, n = P + 1 capped by the slots and the window: the
// slots of positions (P − n, P]. Key j is slot (first_slot + j) % slots, so key n − 1 holds P
// itself; the recorded positions still decide what is visible (a slot may be empty or stale). The
// keys are cut into split ranges of `per_split` (at least kMinKeysPerSplit, so a shallow cache uses
// few of the launch's splits); `splits` of them hold keys (at least one, which writes zeros when
// nothing is visible). Up to kOneSplitKeys keys take one split (attention.h).
struct ScannedKeys {
  int64_t count, first_slot, slots, per_split;
  int splits;

  __device__ __forceinline__ int64_t slot_of(int64_t j) const {
    const int64_t slot = first_slot + j;  // j < count <= slots
    return slot < slots ? slot : slot - slots;
  }
  __device__ __forceinline__ int64_t split_begin(int split) const { return split * per_split; }
  __device__ __forceinline__ int64_t split_end(int split) const {
    return min(count, split_begin(split) + per_split);
  }
};

__device__ __forceinline__ ScannedKeys scanned_keys(int64_t slots, int32_t query_position,
                                                    int window, int max_splits) {
  ScannedKeys k;
  k.slots = slots;
  const int64_t keys = min(slots, static_cast<int64_t>(query_position) + 1);
  k.count = max(int64_t{0}, window > 0 ? min(keys, static_cast<int64_t>(window)) : keys);
  // 32-bit divisions from here (count and the oldest position are below 2^31): a 64-bit one is a
  // slow subroutine, and this runs before the PDL wait, on the path to the first copies.
  const auto count = static_cast<uint32_t>(k.count);
  const auto oldest = static_cast<uint32_t>(query_position + 1 - k.count);
  k.first_slot = oldest < slots ? oldest : oldest % static_cast<uint32_t>(slots);
  if (count <= static_cast<uint32_t>(kOneSplitKeys)) {  // no division on a shallow cache's chain
    k.per_split = max(count, 1u);
    k.splits = 1;
    return k;
  }
  const uint32_t per_split =
      max(static_cast<uint32_t>(kMinKeysPerSplit), (count + max_splits - 1) / max_splits);
  k.per_split = per_split;
  k.splits = static_cast<int>((count + per_split - 1) / per_split);
  return k;
}

// The floats of N 32-bit words of K/V elements: 1, 2 or 4 per word (fp32, bf16, e4m3).
template <typename KvT, int N>
__device__ __forceinline__ void unpack_words(const uint32_t (&words)[N], float* v) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if constexpr (std::is_same_v<KvT, float>) {
      v[j] = __uint_as_float(words[j]);
    } else if constexpr (std::is_same_v<KvT, __nv_bfloat16>) {
      v[2 * j] = __uint_as_float(words[j] << 16);
      v[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
    } else {
      const float2 lo = fp8_pair_to_float2(static_cast<uint16_t>(words[j]));
      const float2 hi = fp8_pair_to_float2(static_cast<uint16_t>(words[j] >> 16));
      v[4 * j] = lo.x;
      v[4 * j + 1] = lo.y;
      v[4 * j + 2] = hi.x;
      v[4 * j + 3] = hi.y;
    }
  }
}

template <int HD, int HPW, typename KvT>
struct Tiling {
  static constexpr int kElementBytes = static_cast<int>(sizeof(KvT));
  // cp.async moves 16-byte chunks of a tile.
  static constexpr int kChunkElems = kChunkBytes / kElementBytes;
  static constexpr int kRowChunks = HD / kChunkElems;
  // A lane reads a row in pieces of 16 bytes, or 8 when a row is shorter than 32 of those (e4m3
  // rows of 256): lane l takes pieces l, l + 32, ..., so a warp's reads of a row are contiguous
  // in shared memory (no bank conflicts) and lane l owns the dims of those pieces.
  static constexpr int kPieceBytes = HD * kElementBytes / 32 >= 16 ? 16 : 8;
  static constexpr int kPieceElems = kPieceBytes / kElementBytes;
  static constexpr int kLanePieces = HD / kPieceElems / 32;
  static constexpr int kLaneDims = HD / 32;
  static constexpr int kTileKeys = kStageBytes / (2 * HD * kElementBytes);
  static constexpr int kTileChunks = 2 * kTileKeys * kRowChunks;  // K rows, then V rows
  static_assert(kLanePieces * kPieceElems == kLaneDims && kPieceElems % 4 == 0 &&
                kTileChunks % kThreads == 0);
  static_assert(kTileKeys <= kThreads && kTileKeys <= kMinKeysPerSplit);
  // The block merge reuses the pipeline's shared memory.
  static_assert(sizeof(float) * kWarps * HPW * (HD + 2) <= kPipelineBytes);

  // The head dim of element e of lane `lane`'s piece i.
  static __device__ __forceinline__ int dim(int lane, int i, int e) {
    return (lane + 32 * i) * kPieceElems + e;
  }

  // Lane `lane`'s dims of a row in shared memory.
  static __device__ __forceinline__ void load_lane(const KvT* row, int lane,
                                                   float (&v)[kLaneDims]) {
#pragma unroll
    for (int i = 0; i < kLanePieces; ++i) {
      if constexpr (kPieceBytes == 16) {
        const uint4 piece = reinterpret_cast<const uint4*>(row)[lane + 32 * i];
        const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
        unpack_words<KvT>(words, v + i * kPieceElems);
      } else {
        const uint2 piece = reinterpret_cast<const uint2*>(row)[lane + 32 * i];
        const uint32_t words[2] = {piece.x, piece.y};
        unpack_words<KvT>(words, v + i * kPieceElems);
      }
    }
  }
};

// How the blocks of one (sequence, kv head) share its work: `splits` key ranges (ScannedKeys) ×
// `parts` subsets of `heads_per_part` q heads of the group. A shallow cache uses few key ranges,
// so the launch's other blocks take q heads instead: every head's chain of loads then runs on its
// own SM rather than all of them one after another through one block.
// Block x serves split x / parts, part x % parts. A shallow cache with a block for each head
// (the common case at batch 1) needs no division: they lie on the chain before the PDL wait.
struct BlockWork {
  int splits, parts, heads_per_part;

  __device__ __forceinline__ int split_of(int block) const {
    return splits == 1 ? 0 : block / parts;
  }
  __device__ __forceinline__ int part_of(int block) const {
    return splits == 1 ? block : block % parts;
  }
};

__host__ __device__ __forceinline__ BlockWork block_work(int splits, int blocks, int group) {
  const int fitting = splits == 1 ? blocks : blocks / splits;
  if (fitting >= group) return {splits, group, 1};
  const int parts = fitting < 1 ? 1 : fitting;
  const int heads_per_part = (group + parts - 1) / parts;
  return {splits, (group + heads_per_part - 1) / heads_per_part, heads_per_part};
}

// The fused prologue (AttentionQuery::prepare): warps kKeyWarp and kValueWarp make the new K and
// V, every warp q heads.
constexpr int kKeyWarp = kWarps - 1, kValueWarp = kWarps - 2;

// The prologue's norm scales and RoPE frequencies (weights no kernel writes), loaded before the
// PDL wait: q's for every warp, k's and v's for the warps that transform them.
template <int HD>
struct PrologueConstants {
  HeadConstants<HD / 256> q, kv;  // attention_prepare.cuh: HD / 256 quads per half head per lane
};

template <int HD>
__device__ __forceinline__ PrologueConstants<HD> load_prologue_constants(
    const DecodePrepare& prepare, int warp, int lane) {
  PrologueConstants<HD> c;
  c.q = load_head_constants<HD / 256, true>(prepare.q_norm, prepare.weight_offset, prepare.inv_freq,
                                            HD / 2, lane);
  if ((warp == kKeyWarp || warp == kValueWarp) && prepare.k != nullptr) {
    const bool is_key = warp == kKeyWarp;
    c.kv = load_head_constants<HD / 256, true>(is_key ? prepare.k_norm : nullptr,
                                               prepare.weight_offset,
                                               is_key ? prepare.inv_freq : nullptr, HD / 2, lane);
  }
  return c;
}

// The prologue of a block serving q heads [first_head, first_head + heads) of its group: those
// heads normed and rotated (at the query position) into `prepared_q` (fp32, one head after the
// other); with `makes_new_key` the query position's K and V into `new_kv` as the cache holds them,
// and with `stores_new_key` also into the cache at `new_slot` with the slot's position. The K and V
// warps load their new row with their first q head (one round trip, not two), and the rotation's
// sines and cosines are computed while those loads are in flight: they wait for the frequencies,
// whose load (issued before the PDL wait) may still be on its way from DRAM when the block became
// resident late, next to the end of its predecessor. Ends with a block barrier.
template <int HD, typename KvT>
__device__ __forceinline__ void run_prologue(const AttentionArgs& a, const SequenceKv& sequence,
                                             const PrologueConstants<HD>& constants, int64_t row,
                                             int kv, int first_head, int heads,
                                             int32_t query_position, bool makes_new_key,
                                             bool stores_new_key, int64_t new_slot,
                                             float* prepared_q, KvT (*new_kv)[HD], int warp,
                                             int lane) {
  constexpr int kPairQuads = HD / 256;
  const DecodePrepare& prepare = a.prepare;
  const bool makes_kv = makes_new_key && (warp == kKeyWarp || warp == kValueWarp);
  const bool is_key = warp == kKeyWarp;
  HeadQuads<kPairQuads> raw_kv, raw_q;
  if (makes_kv) {
    const float* src =
        (is_key ? prepare.k + row * prepare.k_stride : prepare.v + row * prepare.v_stride) +
        int64_t{kv} * HD;
    raw_kv = load_head<kPairQuads, true>(src, HD / 2, lane);
  }
  const float* q_row =
      a.q + row * a.q_stride + static_cast<int64_t>(kv * a.group + first_head) * HD;
  if (warp < heads) raw_q = load_head<kPairQuads, true>(q_row + warp * HD, HD / 2, lane);
  const HeadRotation<kPairQuads> rotation =
      head_rotation(constants.q, HD / 2, query_position, lane);
  for (int g = warp; g < heads; g += kWarps) {
    if (g != warp) raw_q = load_head<kPairQuads, true>(q_row + g * HD, HD / 2, lane);
    const HeadQuads<kPairQuads> head =
        finish_head(raw_q, constants.q, true, true, rotation, prepare.eps, HD / 2, lane);
    store_head<true>(prepared_q + g * HD, head, HD / 2, lane);
  }
  if (makes_kv) {
    const HeadQuads<kPairQuads> head = finish_head(raw_kv, constants.kv, is_key || prepare.norm_v,
                                                   is_key, rotation, prepare.eps, HD / 2, lane);
    store_head<true>(new_kv[is_key ? 0 : 1], head, HD / 2, lane);
    if (stores_new_key) {
      store_head<true>(static_cast<KvT*>(is_key ? sequence.keys : sequence.values) +
                           (new_slot * a.kv_heads + kv) * HD,
                       head, HD / 2, lane);
      if (is_key && lane == 0) sequence.slot_positions[new_slot] = query_position;
    }
  }
  __syncthreads();
}

// Whether a slot holding position p is visible to a query at `query_position`.
__device__ __forceinline__ bool visible_position(int32_t p, int32_t query_position, int window) {
  return p >= 0 && p <= query_position && (window <= 0 || query_position - p < window);
}

// Dimension d of one head's unnormalised attention output `value` (softmax max `head_max`,
// sum `head_sum` over this block's keys): final (and its companions) when the query's keys fell
// in one split, else a partial record [max, sum, value per dim] for the merge kernel.
template <int HD>
__device__ __forceinline__ void write_head_output(const AttentionArgs& a, int64_t row, int head,
                                                  int d, int splits, int split, float value,
                                                  float head_max, float head_sum) {
  if (splits == 1) {
    const float result[1] = {head_sum > 0.0f ? value / head_sum : 0.0f};
    const int64_t column = static_cast<int64_t>(head) * HD + d;
    a.out[row * a.out_stride + column] = result[0];
    store_companions<1>(a.out_companions, row, column, result);
  } else {
    float* record =
        a.partials +
        ((static_cast<int64_t>(blockIdx.z) * a.q_heads + head) * a.splits + split) * (HD + 2);
    record[2 + d] = value;
    if (d == 0) {
      record[0] = head_max;
      record[1] = head_sum;
    }
  }
}

template <int HD, int HPW, typename KvT, bool kPrepare>
__global__ void __launch_bounds__(kThreads, 2) decode_attention_kernel(AttentionArgs a) {
  using T = Tiling<HD, HPW, KvT>;
  constexpr int D = T::kLaneDims;
  pdl_trigger_dependents();
  extern __shared__ __align__(16) unsigned char pipeline[];
  __shared__ int32_t tile_positions[kStages][T::kTileKeys];
  __shared__ float head_max[kWarps * HPW], head_sum[kWarps * HPW];  // the block merge's
  __shared__ __align__(16) KvT new_kv[2][HD];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const DecodePrepare& prepare = a.prepare;
  PrologueConstants<HD> constants;
  if constexpr (kPrepare) constants = load_prologue_constants<HD>(prepare, warp, lane);
  pdl_wait_for_predecessors();

  const int kv = blockIdx.y;
  const SequenceKv& sequence = a.sequences.entries[blockIdx.z];
  const int64_t row = sequence.first_row;
  const int32_t query_position = a.positions[row];
  const ScannedKeys scan = scanned_keys(sequence.slots, query_position, a.window, a.splits);
  const int64_t scanned = scan.count;
  const BlockWork work = block_work(scan.splits, gridDim.x, a.group);
  if (static_cast<int>(blockIdx.x) >= work.splits * work.parts) return;  // the merge skips it
  const int split = work.split_of(blockIdx.x);
  const int part = work.part_of(blockIdx.x);
  const int first_head = part * work.heads_per_part;  // of the group
  const int heads = min(work.heads_per_part, a.group - first_head);
  const int64_t begin = scan.split_begin(split);
  const int64_t end = scan.split_end(split);
  // The query position's K/V (key scanned − 1, the split's last) is made by the fused prologue:
  // every block of its split takes it from shared memory, never from the cache, which the part-0
  // block writes meanwhile. The tiles stop before it.
  const bool makes_new_key = kPrepare && prepare.k != nullptr && end == scanned;
  const int64_t loaded_end = makes_new_key ? end - 1 : end;
  // 32-bit tile counts (a split has fewer than 2^31 keys): the stage and phase of a tile are then
  // cheap divisions by a constant.
  const int tiles =
      static_cast<int>(max(int64_t{0}, (loaded_end - begin + T::kTileKeys - 1) / T::kTileKeys));

  const KvT* keys = static_cast<const KvT*>(sequence.keys);
  const KvT* values = static_cast<const KvT*>(sequence.values);
  const int32_t* slot_positions = sequence.slot_positions;
  // Tile `tile` into stage tile % kStages: its K rows, V rows and slot positions; keys past
  // loaded_end are not read and get position -1 (never visible). Every thread commits one group
  // per call, empty or not, so the group count tells which tiles have landed.
  auto load_tile = [&](int tile) {
    if (tile < tiles) {
      const int stage = tile % kStages;
      unsigned char* base = pipeline + stage * kStageBytes;
      const int64_t first_key = begin + int64_t{tile} * T::kTileKeys;
#pragma unroll
      for (int n = 0; n < T::kTileChunks / kThreads; ++n) {
        const int c = threadIdx.x + n * kThreads;
        const int is_value = c / (T::kTileChunks / 2);
        const int key = c / T::kRowChunks % T::kTileKeys;
        const int chunk = c % T::kRowChunks;
        const int64_t j = first_key + key;
        if (j < loaded_end) {
          const KvT* source = (is_value ? values : keys) +
                              (scan.slot_of(j) * a.kv_heads + kv) * HD + chunk * T::kChunkElems;
          copy_async16(base + c * kChunkBytes, source);
        }
      }
      if (threadIdx.x < T::kTileKeys) {
        const int64_t j = first_key + threadIdx.x;
        if (j < loaded_end) {
          copy_async4(&tile_positions[stage][threadIdx.x], slot_positions + scan.slot_of(j));
        } else {
          tile_positions[stage][threadIdx.x] = -1;
        }
      }
    }
    commit_copies();
  };
  for (int t = 0; t < kStages - 1; ++t) load_tile(t);

  // The prologue, while the first tiles are in flight, into the last stage, which no copy
  // touches before the first tile is computed (every thread has read its q by then).
  const float* prepared_q = reinterpret_cast<const float*>(pipeline + (kStages - 1) * kStageBytes);
  if constexpr (kPrepare) {
    run_prologue<HD>(a, sequence, constants, row, kv, first_head, heads, query_position,
                     makes_new_key, part == 0, scan.slot_of(scanned - 1),
                     const_cast<float*>(prepared_q), new_kv, warp, lane);
  }

  const int head_groups = (heads + HPW - 1) / HPW;
  const int key_slices = kWarps / head_groups;
  const int hg = warp % head_groups;
  const int ks = warp / head_groups;
  const bool active = ks < key_slices;

  float q[HPW][D];
  float acc[HPW][D];
  float running_max[HPW];
  float running_sum[HPW];
#pragma unroll
  for (int h = 0; h < HPW; ++h) {
    const int g = hg * HPW + h;
    const bool used = active && g < heads;
    const float* q_head = kPrepare ? prepared_q + g * HD
                                   : a.q + row * a.q_stride +
                                         static_cast<int64_t>(kv * a.group + first_head + g) * HD;
#pragma unroll
    for (int i = 0; i < T::kLanePieces; ++i) {
#pragma unroll
      for (int e = 0; e < T::kPieceElems; e += 4) {
        const float4 x = used ? *reinterpret_cast<const float4*>(q_head + T::dim(lane, i, e))
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float* dst = q[h] + i * T::kPieceElems + e;
        dst[0] = x.x * a.scale;
        dst[1] = x.y * a.scale;
        dst[2] = x.z * a.scale;
        dst[3] = x.w * a.scale;
      }
    }
#pragma unroll
    for (int d = 0; d < D; ++d) acc[h][d] = 0.0f;
    running_max[h] = -INFINITY;
    running_sum[h] = 0.0f;
  }

  // One visible key (its K and V rows in shared memory) into the warp's online softmax.
  auto attend = [&](const KvT* key_row, const KvT* value_row) {
    float k[D];
    T::load_lane(key_row, lane, k);
    float score[HPW];
#pragma unroll
    for (int h = 0; h < HPW; ++h) {
      float s = 0.0f;
#pragma unroll
      for (int d = 0; d < D; ++d) s = fmaf(q[h][d], k[d], s);
      score[h] = s;
    }
    // A butterfly: every lane ends with the same bits, so the branches below stay uniform.
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
      for (int h = 0; h < HPW; ++h) score[h] += __shfl_xor_sync(0xFFFFFFFFu, score[h], offset);
    }
    float v[D];
    T::load_lane(value_row, lane, v);
#pragma unroll
    for (int h = 0; h < HPW; ++h) {
      // Rescale only when the maximum grows (rarely after the first keys).
      if (score[h] > running_max[h]) {
        const float rescale = expf(running_max[h] - score[h]);
        running_sum[h] *= rescale;
#pragma unroll
        for (int d = 0; d < D; ++d) acc[h][d] *= rescale;
        running_max[h] = score[h];
      }
      const float weight = expf(score[h] - running_max[h]);
      running_sum[h] += weight;
#pragma unroll
      for (int d = 0; d < D; ++d) acc[h][d] = fmaf(weight, v[d], acc[h][d]);
    }
  };

  for (int tile = 0; tile < tiles; ++tile) {
    wait_copies<kStages - 2>();  // this thread's copies of `tile` have landed
    __syncthreads();             // everyone's have, and the stage loaded next is free again
    load_tile(tile + kStages - 1);
    const int stage = tile % kStages;
    const KvT* tile_keys = reinterpret_cast<const KvT*>(pipeline + stage * kStageBytes);
    const KvT* tile_values = tile_keys + T::kTileKeys * HD;
    for (int t = active ? ks : T::kTileKeys; t < T::kTileKeys; t += key_slices) {
      const int32_t p = tile_positions[stage][t];
      // The same for the whole warp, so the skip does not diverge.
      if (!visible_position(p, query_position, a.window)) continue;
      attend(tile_keys + t * HD, tile_values + t * HD);
    }
  }
  // The query's own position is always visible: one key slice takes it.
  if constexpr (kPrepare) {
    if (makes_new_key && active && ks == 0) attend(new_kv[0], new_kv[1]);
  }
  wait_copies<0>();  // only empty groups remain, but the stages are reused below
  __syncthreads();

  // Merge the key slices of this block, in the pipeline's shared memory.
  auto merge = reinterpret_cast<float(*)[HPW][HD + 2]>(pipeline);
#pragma unroll
  for (int h = 0; h < HPW; ++h) {
#pragma unroll
    for (int i = 0; i < T::kLanePieces; ++i) {
#pragma unroll
      for (int e = 0; e < T::kPieceElems; ++e) {
        merge[warp][h][2 + T::dim(lane, i, e)] = acc[h][i * T::kPieceElems + e];
      }
    }
    if (lane == 0) {
      merge[warp][h][0] = running_max[h];
      merge[warp][h][1] = running_sum[h];
    }
  }
  __syncthreads();
  // Per q head once (not per dim): the block's max and sum, and each key slice's weight
  // exp(max_s − max) in place of its max (0 for a slice that saw nothing).
  if (threadIdx.x < heads) {
    const int g = threadIdx.x;
    float block_max = -INFINITY;
    for (int s = 0; s < key_slices; ++s)
      block_max = fmaxf(block_max, merge[g / HPW + s * head_groups][g % HPW][0]);
    float sum = 0.0f;
    for (int s = 0; s < key_slices; ++s) {
      float* m = merge[g / HPW + s * head_groups][g % HPW];
      m[0] = block_max == -INFINITY ? 0.0f : expf(m[0] - block_max);
      sum += m[1] * m[0];
    }
    head_max[g] = block_max;
    head_sum[g] = sum;
  }
  __syncthreads();
  // heads · HD is a multiple of the block's threads: every warp runs every iteration (the q8
  // companion's chunk reductions are warp-wide) over 32 consecutive dims, one kQ8 chunk.
  static_assert(HD % kThreads == 0);
  for (int idx = threadIdx.x; idx < heads * HD; idx += kThreads) {
    const int g = idx / HD;
    const int d = idx % HD;
    const int group_warp = g / HPW;
    const int h = g % HPW;
    const float block_max = head_max[g];
    const float sum = head_sum[g];
    float value = 0.0f;
    for (int s = 0; s < key_slices; ++s) {
      const float* m = merge[group_warp + s * head_groups][h];
      value += m[2 + d] * m[0];
    }
    const int head = kv * a.group + first_head + g;
    // A query whose keys all fell in one split (a shallow cache) is final here: the merge
    // kernel leaves it alone.
    write_head_output<HD>(a, row, head, d, work.splits, split, value, block_max, sum);
  }
}

// ---- The tensor-core kernel: bf16 and e4m3 caches, up to 8 q heads per kv head ----
// The CUDA-core kernel above spends ~140 instructions per key and warp (bf16 unpacking, a 5-step
// shuffle reduction per head, a dependent FMA chain) and reaches ~1.2 TB/s at depth 32K: it is
// bound by issue and latency, not by the reads. Here the block's 8 warps split the head dims (warp
// w owns HD / 8 of them) and do q·kᵀ and p·v with mma.sync m16n8k16 (bf16 in, fp32 accumulate) over
// tiles of 16 keys: Sᵀ = K·Qᵀ (keys × heads, the group's heads in n = 8) over the warp's dims,
// summed over the warps in shared memory; every warp then runs the same online softmax on the sums
// and accumulates Oᵀ += Vᵀ·Pᵀ for its own dims, Pᵀ being the transposed (movmatrix) score fragment.
// q and p enter the products as bf16 pairs hi + lo (each a bf16, hi + lo within 2^-16 of the fp32
// value), so the only roundings are the cache's own, as in the CUDA-core kernel. K/V tiles stream
// through shared memory with cp.async as above, each row's 16-byte chunks XOR-swizzled by the row's
// low 3 bits so that ldmatrix's 8 rows hit distinct banks; or (kBulk) one bulk copy per row,
// landing on a per-stage mbarrier, bf16 rows padded by 16 bytes instead of swizzled. With 16-byte
// cp.async pieces from every thread an SM read ~19 GB/s at depth 32K (kernel_bench: 132 splits on
// one block per SM as fast as 264 on two), well below its 32 GB/s share of the DRAM bandwidth: the
// load path, not the bytes in flight, looked to be the limit. Blocks are (key split, q-head part)
// pairs as in the CUDA-core kernel (block_work): the mma takes up to 8 heads at once, but a block's
// prologue (a second q head's norm and RoPE on the K and V warps), epilogue (each head's outputs
// and companions) and split records grow with its heads, so at shallow depths, where the chain is
// the whole cost, every head gets its own block (each block of the query's key range makes the new
// K/V itself; the part-0 one stores it); and at depth the few records of a part's heads merge in
// the kernel's last block instead of a merge kernel (merges_in_kernel). What needs no predecessor
// runs before the PDL wait: the loads of the norm scales and RoPE frequencies, the query position,
// and the copies of the keys older than the query (attention.h says why that is safe); after it
// only q, k, v (loaded together; the RoPE angles computed meanwhile), the query's own key and the
// chain from the scores to the output remain. In the engine a block often becomes resident only
// about a microsecond before its predecessor (the QKV GEMV) ends, so whatever delays the PDL
// wait's issue (such as angles waiting on frequencies from DRAM) lies on the critical path.
constexpr int kMmaTileKeys = 16;
constexpr int kMmaMaxGroup = 8;

// The bulk-copy kernels' pipeline: their padded rows make a stage 3 % larger, and two blocks
// still fit an SM.
constexpr size_t kBulkPipelineBytes = 100 << 10;

// kBulk: each K/V row of a tile lands by one bulk copy (copy_bulk) instead of every thread's
// 16-byte cp.async pieces, so the SM's load path does not cap the bytes in flight.
// kRotatedKeys (bf16 k_eq_v caches whose rotated dims are two warps' own, AttentionArgs::
// keys_from_values): the kernel reads K's rotated dims only, and a tile's K rows hold only those,
// [0, kWarpDims) then [HD / 2, HD / 2 + kWarpDims): no room for dims never copied, so the pipeline
// is deeper (4 stages of 21 KB at 512 dims instead of 3 of 33 KB), about as many bytes in flight
// as a cache read whole (the rotated dims into whole-row tiles, 3 stages, were not kept).
template <int HD, typename KvT, bool kBulk, bool kRotatedKeys = false>
struct MmaTiling {
  // e4m3 rows are widened to bf16 (exactly) into a separate tile, each warp its own dims; bf16
  // rows are read where they land.
  static constexpr bool kWidens = !std::is_same_v<KvT, __nv_bfloat16>;
  static constexpr int kElementBytes = static_cast<int>(sizeof(KvT));
  static constexpr int kRowBytes = HD * kElementBytes;  // a row as cached
  static constexpr int kRowChunks = kRowBytes / kChunkBytes;
  static constexpr int kTileRowChunks = HD * 2 / kChunkBytes;  // a bf16 row
  // A bf16 tile row in shared memory: a bulk copy cannot swizzle, so the rows it writes for
  // ldmatrix are padded by one chunk instead (the 8 rows then start 4 banks apart). Widened tiles
  // are written by the threads, swizzled.
  static constexpr bool kPadded = kBulk && !kWidens;
  static constexpr int kTileRowBytes = HD * 2 + (kPadded ? kChunkBytes : 0);
  static constexpr int kWarpDims = HD / kWarps;  // the dims a warp owns
  static_assert(!kRotatedKeys || !kWidens);
  static constexpr int kKeyDims = kRotatedKeys ? 2 * kWarpDims : HD;  // of a tile's K row
  static constexpr int kTileKeyRowBytes = kKeyDims * 2 + (kPadded ? kChunkBytes : 0);
  // A stage: K rows, then (from kKeyTileBytes) V rows.
  static constexpr int kKeyTileBytes = kMmaTileKeys * (kWidens ? kRowBytes : kTileKeyRowBytes);
  static constexpr int kStageBytes =
      kKeyTileBytes + kMmaTileKeys * (kWidens ? kRowBytes : kTileRowBytes);
  static constexpr int kWidenedBytes = kWidens ? 2 * kMmaTileKeys * HD * 2 : 0;
  static constexpr size_t kBudgetBytes = kBulk ? kBulkPipelineBytes : kPipelineBytes;
  static constexpr int kStages = static_cast<int>((kBudgetBytes - kWidenedBytes) / kStageBytes);
  // The dynamic shared memory a block uses.
  static constexpr size_t kSharedBytes = size_t{kStages} * kStageBytes + kWidenedBytes;
  static constexpr int kTileChunks = 2 * kMmaTileKeys * kRowChunks;
  static constexpr int kSteps = kWarpDims / 16;  // k16 steps of q·kᵀ = m16 tiles of p·v
  static constexpr int kWarpRowChunks = kWarpDims * kElementBytes / kChunkBytes;  // as cached
  static_assert(kStages >= 3 && kTileChunks % kThreads == 0 && kWarpDims % 32 == 0);
  // The prepared q heads (fp32) fit the stage the prologue writes them to.
  static_assert(sizeof(float) * kMmaMaxGroup * HD <= kStageBytes);
  // The epilogue's staged outputs fit what of stage 0 is dead once every warp has passed the last
  // tile's score barrier: its K rows, or all of it where the rows read later are widened copies.
  // Compact K rows are too few: those kernels stage after a block barrier.
  static constexpr bool kStagesAfterBarrier = sizeof(float) * kWarps * kMmaMaxGroup * kWarpDims >
                                              (kWidens ? kStageBytes : kKeyTileBytes);
  static_assert(!kStagesAfterBarrier || kRotatedKeys);

  // Byte offset of 16-byte chunk `chunk` of row `key` within a bf16 tile's K (or V) rows.
  static __device__ __forceinline__ int offset(int key, int chunk) {
    if constexpr (kPadded) return key * kTileRowBytes + chunk * kChunkBytes;
    return (key * kTileRowChunks + (chunk ^ (key & 7))) * kChunkBytes;
  }
  // The same within a stage: the bf16 tile itself, or plain rows to be widened.
  static __device__ __forceinline__ int stage_offset(int key, int chunk) {
    return kWidens ? (key * kRowChunks + chunk) * kChunkBytes : offset(key, chunk);
  }
  // offset and stage_offset of K rows (chunk `chunk` of the whole row: a compact row holds the
  // chunks of the rotated dims only).
  static __device__ __forceinline__ int key_offset(int key, int chunk) {
    if constexpr (!kRotatedKeys) return offset(key, chunk);
    constexpr int kWarpChunks = kWarpDims * 2 / kChunkBytes, kKeyRowChunks = 2 * kWarpChunks;
    const int compact = chunk < kWarpChunks ? chunk : chunk - kTileRowChunks / 2 + kWarpChunks;
    if constexpr (kPadded) return key * kTileKeyRowBytes + compact * kChunkBytes;
    return (key * kKeyRowChunks + (compact ^ (key & 7))) * kChunkBytes;
  }
  static __device__ __forceinline__ int key_stage_offset(int key, int chunk) {
    return kWidens ? stage_offset(key, chunk) : key_offset(key, chunk);
  }
};

// The transpose of an 8×8 b16 matrix held as one fragment (lane (g, t): row g, elements 2t, 2t+1).
__device__ __forceinline__ uint32_t transpose_fragment(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// x0, x1 as two bf16 pairs hi + lo (the first value in the low halves): hi rounds x, lo rounds
// the remainder, so hi + lo is within 2^-16 of x relatively.
struct SplitPair {
  uint32_t hi, lo;
};
__device__ __forceinline__ SplitPair split_pair(float x0, float x1) {
  const __nv_bfloat162 hi = __floats2bfloat162_rn(x0, x1);
  const float2 rounded = __bfloat1622float2(hi);
  const __nv_bfloat162 lo = __floats2bfloat162_rn(x0 - rounded.x, x1 - rounded.y);
  return {*reinterpret_cast<const uint32_t*>(&hi), *reinterpret_cast<const uint32_t*>(&lo)};
}

// The records that merge_in_last_block combines: head g's record of split s at
// records + (g · a.splits + s) · (HD + 2), read from L2, where the other blocks wrote them. Thread
// x combines outputs (head · HD + dim) x, x + kThreads, ... of the group's heads · HD, kDims of
// them and kSplits splits of each at a time: kDims · kSplits loads in flight (one SM reads the
// records at the L2's pace, not one round trip per split). heads · HD is a multiple of the block's
// threads, so each step is warp-uniform and a warp's 32 outputs are consecutive dims of one head
// (the q8 companion's chunk).
template <int HD, int kDims, int kSplits>
struct SplitRecords {
  const AttentionArgs& a;
  const float* records;
  int splits, outputs;

  // The values of batch (first_idx, first_split) (0 past the outputs or the splits).
  __device__ __forceinline__ void load(int first_idx, int first_split,
                                       float (&loaded)[kDims][kSplits]) const {
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
      const int idx = first_idx + i * kThreads;
      const float* values =
          records + (idx / HD * a.splits + first_split) * int64_t{HD + 2} + 2 + idx % HD;
#pragma unroll
      for (int u = 0; u < kSplits; ++u) {
        loaded[i][u] =
            idx < outputs && first_split + u < splits ? __ldcg(values + u * (HD + 2)) : 0.0f;
      }
    }
  }

  // Weighs and combines the splits (`weight`: [heads][splits], `total`: [heads] in shared
  // memory) into the outputs and their companions. The first batch is `first` (loaded before the
  // weights were known, so that its round trip overlaps theirs).
  __device__ __forceinline__ void combine(int64_t row, int first_q_head, const float* weight,
                                          const float* total,
                                          float (&first)[kDims][kSplits]) const {
    for (int first_idx = threadIdx.x; first_idx < outputs; first_idx += kDims * kThreads) {
      float value[kDims] = {};
      for (int first_split = 0; first_split < splits; first_split += kSplits) {
        if (first_idx != static_cast<int>(threadIdx.x) || first_split != 0) {
          load(first_idx, first_split, first);
        }
#pragma unroll
        for (int i = 0; i < kDims; ++i) {
          const int idx = first_idx + i * kThreads;
          const float* w = weight + (idx < outputs ? idx / HD : 0) * splits + first_split;
#pragma unroll
          for (int u = 0; u < kSplits; ++u) {
            if (first_split + u < splits) value[i] = fmaf(w[u], first[i][u], value[i]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kDims; ++i) {
        const int idx = first_idx + i * kThreads;
        if (idx >= outputs) break;  // warp-uniform
        const int g = idx / HD;
        const float result[1] = {total[g] > 0.0f ? value[i] / total[g] : 0.0f};
        const int64_t column = static_cast<int64_t>(first_q_head + g) * HD + idx % HD;
        a.out[row * a.out_stride + column] = result[0];
        store_companions<1>(a.out_companions, row, column, result);
      }
    }
  }
};

// The last block's merge (merge_in_last_block) with SplitRecords<HD, kDims, kSplits>: the first
// batch of values in flight while warp w weighs the splits of heads w, w + kWarps, ... (lane l
// taking splits l and l + 32: one round trip for the records' (max, sum), two warp reductions).
// `scratch`: shared memory for heads · (splits + 1) floats.
template <int HD, int kDims, int kSplits>
__device__ __forceinline__ void merge_records(const AttentionArgs& a, int64_t row, int first_q_head,
                                              int heads, int splits, const float* records,
                                              float* scratch) {
  const SplitRecords<HD, kDims, kSplits> merge = {a, records, splits, heads * HD};
  float first[kDims][kSplits];
  merge.load(threadIdx.x, 0, first);
  float* weight = scratch;                  // [heads][splits]: exp(max_s − max)
  float* total = scratch + heads * splits;  // [heads]: Σ_s weight_s · sum_s
  static_assert(kMaxMergedInKernelSplits <= 64);
  const int lane = threadIdx.x & 31;
  for (int g = threadIdx.x >> 5; g < heads; g += kWarps) {
    float split_max[2], split_sum[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int s = lane + 32 * i;
      const float* record = records + (g * a.splits + s) * int64_t{HD + 2};
      split_max[i] = s < splits ? __ldcg(record) : -INFINITY;
      split_sum[i] = s < splits ? __ldcg(record + 1) : 0.0f;
    }
    const float head_max = chunk_reduce<32>(fmaxf(split_max[0], split_max[1]),
                                            [](float x, float y) { return fmaxf(x, y); });
    float head_total = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int s = lane + 32 * i;
      const float w =
          head_max == -INFINITY || split_max[i] == -INFINITY ? 0.0f : expf(split_max[i] - head_max);
      if (s < splits) weight[g * splits + s] = w;
      head_total = fmaf(w, split_sum[i], head_total);
    }
    head_total = chunk_reduce<32>(head_total, [](float x, float y) { return x + y; });
    if (lane == 0) total[g] = head_total;
  }
  __syncthreads();
  merge.combine(row, first_q_head, weight, total, first);
}

// The split merge inside the attention kernel (AttentionArgs::merge_counters), after a block has
// written its partial records: each split block of a (sequence, kv head, q-head part) counts
// itself in; the last to arrive (all the others' records are then visible: each released them
// with its count) resets the counter for the next launch and combines the records of the part's
// q heads [first_head, first_head + heads) of the group as merge_splits_kernel does, into the
// outputs and their companions. `scratch`: shared memory for heads · (splits + 1) floats.
template <int HD>
__device__ __forceinline__ void merge_in_last_block(const AttentionArgs& a, int64_t row, int kv,
                                                    int part, int first_head, int heads, int splits,
                                                    float* scratch) {
  // The block's record stores, ordered before thread 0's count by the barrier, are released with
  // it (cumulatively); the count that finds every other block done acquires theirs, and the
  // barrier hands them to the block's threads. A release-acquire atomic rather than two
  // __threadfence (sequentially consistent fences, each waiting on the whole GPU's ordering).
  __syncthreads();
  bool counted_last = false;
  if (threadIdx.x == 0) {
    // One counter per (sequence, kv head, part): parts <= group, so [sequence][q head] holds them.
    int* counter =
        a.merge_counters + static_cast<int64_t>(blockIdx.z) * a.q_heads + kv * a.group + part;
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
                 : "=r"(before)
                 : "l"(counter)
                 : "memory");
    counted_last = before == splits - 1;
    if (counted_last) *counter = 0;  // every block of this launch has counted
  }
  if (!__syncthreads_or(counted_last)) return;
  const int first_q_head = kv * a.group + first_head;
  const float* records =
      a.partials +
      (static_cast<int64_t>(blockIdx.z) * a.q_heads + first_q_head) * a.splits * int64_t{HD + 2};
  // 16 values in flight per thread: one output of 16 splits where the part has at most one per
  // thread (E2B's sliding records at b1 in one batch), else more outputs of fewer splits (batched
  // decode's few splits of several heads). More values in flight spill the tile loop's registers
  // (ptxas -v).
  if constexpr (HD <= kThreads) {
    if (heads * HD <= kThreads) {
      merge_records<HD, 1, 16>(a, row, first_q_head, heads, splits, records, scratch);
      return;
    }
  }
  if (heads * HD <= 2 * kThreads) {
    merge_records<HD, 2, 8>(a, row, first_q_head, heads, splits, records, scratch);
  } else {
    merge_records<HD, 4, 4>(a, row, first_q_head, heads, splits, records, scratch);
  }
}

template <int HD, typename KvT, bool kPrepare, bool kBulk, bool kRotatedKeys>
__global__ void __launch_bounds__(kThreads, 2) decode_attention_mma_kernel(AttentionArgs a) {
  using T = MmaTiling<HD, KvT, kBulk, kRotatedKeys>;
  constexpr int kStages = T::kStages;
  constexpr int kSteps = T::kSteps;
  pdl_trigger_dependents();
  extern __shared__ __align__(16) unsigned char pipeline[];
  __shared__ int32_t tile_positions[kStages][kMmaTileKeys];
  // kBulk: a stage's rows have landed (phase parity (tile / kStages) & 1 for its tile).
  __shared__ uint64_t stage_landed[kBulk ? kStages : 1];
  // Each warp's partial Sᵀ fragment of a tile, double-buffered by tile parity.
  __shared__ float4 partial_scores[2][kWarps][32];
  // The query position's K/V rows (key scanned − 1) and the position its slot holds: made by the
  // fused prologue, or read from the cache after the PDL wait (a layer reading another layer's
  // cache, which wrote them in this step).
  __shared__ __align__(16) KvT new_kv[2][HD];
  __shared__ int32_t own_position;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // fragment row
  const int t = lane & 3;   // fragment column pair
  const DecodePrepare& prepare = a.prepare;

  // Before the PDL wait, everything that does not depend on the predecessors: the loads of the
  // norm scales and RoPE frequencies, the query position (uploaded before the step), the block's
  // key range, and the copies of the first tiles of keys older than the query (their rows and
  // slot positions were written by earlier steps; only the query's own slot is written in this
  // one, and it is read after the wait). Blocks without keys leave before the wait. The
  // constants' loads go out first (a layer's norm scales come from DRAM): without the warp
  // barrier after them, ptxas issued them only after the key range's divisions, which wait for
  // the position's load (SASS).
  PrologueConstants<HD> constants;
  if constexpr (kPrepare) constants = load_prologue_constants<HD>(prepare, warp, lane);
  __syncwarp();
  const int kv = blockIdx.y;
  const SequenceKv& sequence = a.sequences.entries[blockIdx.z];
  const int64_t row = sequence.first_row;
  const int32_t query_position = a.positions[row];
  const ScannedKeys scan = scanned_keys(sequence.slots, query_position, a.window, a.splits);
  const int64_t scanned = scan.count;
  const int splits = scan.splits;
  const BlockWork work = block_work(splits, gridDim.x, a.group);
  if (static_cast<int>(blockIdx.x) >= splits * work.parts) return;  // the merge skips it
  const int split = work.split_of(blockIdx.x);
  const int part = work.part_of(blockIdx.x);
  const int first_head = part * work.heads_per_part;  // of the group
  const int heads = min(work.heads_per_part, a.group - first_head);
  const int64_t begin = scan.split_begin(split);
  const int64_t end = scan.split_end(split);
  // The split holding the query's own key never copies it into the tiles: the block puts it
  // into its tile's rows from new_kv (never reading it from the cache while the prologue writes
  // it there, nor before the wait).
  const bool has_own_key = end == scanned;
  const bool makes_new_key = kPrepare && prepare.k != nullptr && has_own_key;
  const int64_t loaded_end = has_own_key ? end - 1 : end;
  const int tiles = static_cast<int>((end - begin + kMmaTileKeys - 1) / kMmaTileKeys);

  // This kv head's rows (row stride kv_heads · HD).
  const KvT* keys = static_cast<const KvT*>(sequence.keys) + kv * HD;
  const KvT* values = static_cast<const KvT*>(sequence.values) + kv * HD;
  const int64_t row_stride = int64_t{a.kv_heads} * HD;
  // As the CUDA-core kernel's load_tile, into T::stage_offset's rows; keys past loaded_end are
  // not read (position −1; the own key's is own_position). Thread x copies chunk
  // x % kRowChunks of the K and the V row of keys x / kRowChunks, + kKeysPerPass, ...: one slot
  // computed per pair of copies.
  // kBulk: one bulk copy per K or V row instead, kBulkRowsPerWarp rows from each warp (lane l <
  // kBulkRowsPerWarp of warp w copies row w · kBulkRowsPerWarp + l of the tile's K rows, then V
  // rows), thread 0 announcing the tile's bytes on the stage's barrier. A bulk copy takes uniform
  // operands, so a warp issues its lanes' copies one after another (~30 cycles each): all 32 rows
  // from one warp held the whole block ~1 µs per tile. A copy may land before the announcement
  // (the barrier's tx-count goes below zero), but the phase completes only after it, its one
  // arrival.
  constexpr int kKeysPerPass = kThreads / T::kRowChunks;
  static_assert(kThreads % T::kRowChunks == 0 && kMmaTileKeys % kKeysPerPass == 0);
  constexpr int kBulkRowsPerWarp = 2 * kMmaTileKeys / kWarps;
  static_assert(kBulkRowsPerWarp * kWarps == 2 * kMmaTileKeys);
  const int copy_chunk = threadIdx.x % T::kRowChunks;
  // kRotatedKeys: the K rows' 16-byte chunks of the rotated dims [0, kWarpDims) and [HD / 2,
  // HD / 2 + kWarpDims), `rotated_chunks` (kWarpRowChunks) of each, copied by the threads (one
  // each at 512 dims) while the bulk copies take the V rows. Counted at run time: with the count a
  // constant, ptxas kept the copies' addresses across the tile loop and spilled 24 bytes.
  const int rotated_chunks = a.keys_from_values.rotated_pairs * T::kElementBytes / kChunkBytes;
  auto load_tile = [&](int tile) {
    if (tile < tiles) {
      const int stage = tile % kStages;
      unsigned char* base = pipeline + stage * T::kStageBytes;
      const int64_t first_key = begin + int64_t{tile} * kMmaTileKeys;
      if constexpr (kBulk) {
        const int rows = static_cast<int>(
            min(static_cast<int64_t>(kMmaTileKeys), max(int64_t{0}, loaded_end - first_key)));
        if (threadIdx.x == 0) {
          arrive_expect_bytes(&stage_landed[stage], (kRotatedKeys ? 1 : 2) * rows * T::kRowBytes);
        }
        const int row = warp * kBulkRowsPerWarp + lane;
        const int key = row % kMmaTileKeys;
        const bool is_value = row >= kMmaTileKeys;
        if (lane < kBulkRowsPerWarp && key < rows && (is_value || !kRotatedKeys)) {
          copy_bulk(base + (is_value ? T::kKeyTileBytes + T::stage_offset(key, 0)
                                     : T::key_stage_offset(key, 0)),
                    (is_value ? values : keys) + scan.slot_of(first_key + key) * row_stride,
                    T::kRowBytes, &stage_landed[stage]);
        }
      } else {
#pragma unroll
        for (int key = threadIdx.x / T::kRowChunks; key < kMmaTileKeys; key += kKeysPerPass) {
          const int64_t j = first_key + key;
          if (j < loaded_end) {
            const int64_t element =
                scan.slot_of(j) * row_stride + copy_chunk * (kChunkBytes / T::kElementBytes);
            if constexpr (!kRotatedKeys) {
              copy_async16(base + T::key_stage_offset(key, copy_chunk), keys + element);
            }
            copy_async16(base + T::kKeyTileBytes + T::stage_offset(key, copy_chunk),
                         values + element);
          }
        }
      }
      if constexpr (kRotatedKeys) {
        for (int c = threadIdx.x; c < kMmaTileKeys * 2 * rotated_chunks; c += kThreads) {
          const int key = c / (2 * rotated_chunks);
          const int piece = c % (2 * rotated_chunks);
          const int chunk =
              piece < rotated_chunks ? piece : T::kRowChunks / 2 + piece - rotated_chunks;
          const int64_t j = first_key + key;
          if (j < loaded_end) {
            copy_async16(
                base + T::key_stage_offset(key, chunk),
                keys + scan.slot_of(j) * row_stride + chunk * (kChunkBytes / T::kElementBytes));
          }
        }
      }
      if (threadIdx.x < kMmaTileKeys) {
        const int64_t j = first_key + threadIdx.x;
        if (j < loaded_end) {
          copy_async4(&tile_positions[stage][threadIdx.x],
                      sequence.slot_positions + scan.slot_of(j));
        } else {
          tile_positions[stage][threadIdx.x] = -1;
        }
      }
    }
    commit_copies();
  };
  if constexpr (kBulk) {
    if (threadIdx.x == 0) {
      for (int stage = 0; stage < kStages; ++stage) init_barrier(&stage_landed[stage]);
      fence_barrier_init();
    }
    __syncthreads();
  }
  // kRotatedKeys: the warps whose dims lie outside K's rotated ones take their scores from the V
  // rows, q scaled by the key scales of its dims. Their k_norm (a weight) is copied before the PDL
  // wait (after the blocks without keys have left: none leaves copies in flight), each warp its own
  // dims, into `key_scales` past the pipeline (the launch's extra shared memory), in a copy group
  // of its own: held in registers through the prologue, the scales made the kernel spill.
  const KeysFromValues& keys_from_values = a.keys_from_values;
  float* const key_scales = reinterpret_cast<float*>(pipeline + T::kSharedBytes);
  if constexpr (kRotatedKeys) {
    const int warp_dim = warp * T::kWarpDims;
    if (warp_dim % (HD / 2) >= T::kWarpDims && lane < T::kWarpDims / 4) {
      copy_async16(key_scales + warp_dim + 4 * lane, keys_from_values.k_norm + warp_dim + 4 * lane);
    }
    commit_copies();
  }
  for (int tile = 0; tile < kStages - 1; ++tile) load_tile(tile);
  pdl_wait_for_predecessors();

  // The own key from the cache: loaded now, stored to shared memory after the prologue (its
  // loads in flight meanwhile), seen by the tile loop after its first barrier.
  constexpr int kOwnChunks = 2 * T::kRowChunks;  // K row, then V row
  static_assert(kOwnChunks <= kThreads);
  const bool loads_own_key = has_own_key && !makes_new_key;
  const int64_t own_slot = scan.slot_of(scanned - 1);
  uint4 own_chunk = {};
  int32_t cached_own_position = -1;
  if (loads_own_key) {
    if (threadIdx.x < kOwnChunks) {
      const int is_value = threadIdx.x / T::kRowChunks;
      own_chunk = reinterpret_cast<const uint4*>(
          (is_value ? values : keys) + own_slot * row_stride)[threadIdx.x % T::kRowChunks];
    }
    if (threadIdx.x == 0) cached_own_position = sequence.slot_positions[own_slot];
  }

  // The prologue while the first tiles are in flight, into the last stage (no copy touches it
  // before the first tile is computed; every thread has read its q by then).
  const float* prepared_q =
      reinterpret_cast<const float*>(pipeline + (kStages - 1) * T::kStageBytes);
  if constexpr (kPrepare) {
    run_prologue<HD>(a, sequence, constants, row, kv, first_head, heads, query_position,
                     makes_new_key, part == 0, own_slot, const_cast<float*>(prepared_q), new_kv,
                     warp, lane);
  }
  if (loads_own_key && threadIdx.x < kOwnChunks)
    reinterpret_cast<uint4*>(new_kv[threadIdx.x / T::kRowChunks])[threadIdx.x % T::kRowChunks] =
        own_chunk;
  if (threadIdx.x == 0) own_position = loads_own_key ? cached_own_position : query_position;

  // Qᵀ as the B operand of Sᵀ = K·Qᵀ over the warp's dims: step s covers dims
  // first_dim + 16s .. + 15; lane (g, t) holds head g's dims 2t, 2t + 1 (b0) and 2t + 8, 2t + 9
  // (b1), scaled, as hi + lo pairs. Heads past the group are zeros. kRotatedKeys: where the warp's
  // dims are not rotated, V stands in for K and q is scaled by the key scales.
  const int first_dim = warp * T::kWarpDims;
  const bool reads_keys = !kRotatedKeys || first_dim % (HD / 2) < T::kWarpDims;
  SplitPair q_b0[kSteps], q_b1[kSteps];
  {
    if (kRotatedKeys && !reads_keys) {
      wait_copies<kStages - 1>();  // the key scales' group (the tiles' are younger)
      __syncwarp();
    }
    // The key scale of dim d (1 where the warp reads K).
    auto key_scale = [&](int d) {
      return reads_keys ? make_float2(1.0f, 1.0f)
                        : make_float2(keys_from_values.weight_offset + key_scales[d],
                                      keys_from_values.weight_offset + key_scales[d + 1]);
    };
    const bool used = g < heads;
    const float* q_head = kPrepare ? prepared_q + g * HD
                                   : a.q + row * a.q_stride +
                                         static_cast<int64_t>(kv * a.group + first_head + g) * HD;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int d = first_dim + 16 * step + 2 * t;
      const float2 b0 = used ? *reinterpret_cast<const float2*>(q_head + d) : make_float2(0, 0);
      const float2 b1 = used ? *reinterpret_cast<const float2*>(q_head + d + 8) : make_float2(0, 0);
      const float2 s0 = key_scale(d), s1 = key_scale(d + 8);
      q_b0[step] = split_pair(b0.x * a.scale * s0.x, b0.y * a.scale * s0.y);
      q_b1[step] = split_pair(b1.x * a.scale * s1.x, b1.y * a.scale * s1.y);
    }
  }

  // Oᵀ fragments: acc[i] holds dims first_dim + 16i + g (0, 1) and + 8 (2, 3) of heads 2t (0, 2)
  // and 2t + 1 (1, 3); the running max and this lane's share of the sum of heads 2t, 2t + 1.
  float acc[kSteps][4] = {};
  float running_max[2] = {-INFINITY, -INFINITY};
  float running_sum[2] = {0.0f, 0.0f};
  // ldmatrix row addresses: lane l gives row l % 8 of matrix l / 8. K as A (keys × dims):
  // matrices (keys 0-7, dims 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15); V as Aᵀ (dims ×
  // keys): (keys 0-7, dims 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15), transposed.
  const int matrix = lane >> 3;
  const int key_row = (lane & 7) + (matrix & 1) * 8, key_chunk = matrix >> 1;
  const int value_row = (lane & 7) + (matrix >> 1) * 8, value_chunk = matrix & 1;

  // kBulk: whether this thread wrote to the stage loaded next (the prologue's q, then a tile's
  // own key or zeroed rows): those writes must come before that stage's bulk copies, if any (a
  // block of few tiles loads none after its first ones: no proxy fence on its short chain).
  [[maybe_unused]] bool wrote_stage = true;
  for (int tile = 0; tile < tiles; ++tile) {
    const int stage = tile % kStages;
    wait_copies<kStages - 2>();  // this thread's copies of `tile` have landed
    if constexpr (kBulk) {
      wait_barrier(&stage_landed[stage], static_cast<uint32_t>(tile / kStages) & 1);
      if (wrote_stage && tile + kStages - 1 < tiles) fence_proxy_async();
    }
    __syncthreads();  // everyone's have, and the stage loaded next is free again
    load_tile(tile + kStages - 1);
    unsigned char* stage_keys = pipeline + stage * T::kStageBytes;
    unsigned char* stage_values = stage_keys + T::kKeyTileBytes;
    // The own key, when this tile holds it (its index in the tile, else −1).
    const int64_t first_key = begin + int64_t{tile} * kMmaTileKeys;
    const int own_key = has_own_key && end - 1 < first_key + kMmaTileKeys
                            ? static_cast<int>(end - 1 - first_key)
                            : -1;
    const int32_t key_position =
        lane % kMmaTileKeys == own_key ? own_position : tile_positions[stage][lane % kMmaTileKeys];
    const uint32_t visible =
        __ballot_sync(0xFFFFFFFFu, visible_position(key_position, query_position, a.window)) &
        0xFFFFu;
    // Rows the warp reads but no copy filled this tile: the own key's (from new_kv; its K only
    // where the warp reads K) and the invisible keys' V (zeros: their weight is 0, and 0 · NaN of
    // a stale row would not be). Each warp touches only its own dims, so warp barriers order it.
    const int first_chunk = first_dim * T::kElementBytes / kChunkBytes;  // of a cached row
    if (own_key >= 0) {
      const int key = own_key;
      for (int c = lane + (reads_keys ? 0 : T::kWarpRowChunks); c < 2 * T::kWarpRowChunks;
           c += 32) {
        const int is_value = c / T::kWarpRowChunks;
        const int chunk = first_chunk + c % T::kWarpRowChunks;
        *reinterpret_cast<uint4*>(is_value ? stage_values + T::stage_offset(key, chunk)
                                           : stage_keys + T::key_stage_offset(key, chunk)) =
            reinterpret_cast<const uint4*>(new_kv[is_value])[chunk];
      }
    }
    wrote_stage = own_key >= 0 || visible != 0xFFFFu;
    if (visible != 0xFFFFu) {
      for (int c = lane; c < kMmaTileKeys * T::kWarpRowChunks; c += 32) {
        const int key = c / T::kWarpRowChunks;
        if (!(visible >> key & 1)) {
          const int chunk = first_chunk + c % T::kWarpRowChunks;
          *reinterpret_cast<uint4*>(stage_values + T::stage_offset(key, chunk)) =
              make_uint4(0, 0, 0, 0);
        }
      }
    }
    __syncwarp();
    unsigned char* tile_keys = stage_keys;
    unsigned char* tile_values = stage_values;
    if constexpr (T::kWidens) {
      // The warp's dims of every K and V row widened into the bf16 tile (16 e4m3 = 2 chunks).
      tile_keys = pipeline + kStages * T::kStageBytes;
      tile_values = tile_keys + kMmaTileKeys * HD * 2;
      for (int c = lane; c < 2 * kMmaTileKeys * T::kWarpRowChunks; c += 32) {
        const int is_value = c / (kMmaTileKeys * T::kWarpRowChunks);
        const int key = c / T::kWarpRowChunks % kMmaTileKeys;
        const int chunk = first_chunk + c % T::kWarpRowChunks;
        const uint4 raw = *reinterpret_cast<const uint4*>((is_value ? stage_values : stage_keys) +
                                                          T::stage_offset(key, chunk));
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t widened[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float2 pair = fp8_pair_to_float2(static_cast<uint16_t>(words[w] >> (16 * half)));
            const __nv_bfloat162 bf = __floats2bfloat162_rn(pair.x, pair.y);  // exact
            widened[2 * w + half] = *reinterpret_cast<const uint32_t*>(&bf);
          }
        }
        unsigned char* row = is_value ? tile_values : tile_keys;
        *reinterpret_cast<uint4*>(row + T::offset(key, 2 * chunk)) =
            make_uint4(widened[0], widened[1], widened[2], widened[3]);
        *reinterpret_cast<uint4*>(row + T::offset(key, 2 * chunk + 1)) =
            make_uint4(widened[4], widened[5], widened[6], widened[7]);
      }
      __syncwarp();
    }

    // Sᵀ over the warp's dims (the hi and lo products in separate accumulators: two short
    // dependency chains), then summed over the warps. From the V rows where they stand in for K
    // (q scaled by the key scales).
    float partial[2][4] = {};
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int chunk = first_dim * 2 / kChunkBytes + 2 * step + key_chunk;
      uint32_t k_a[4];
      load_matrices<false>(k_a, reads_keys ? tile_keys + T::key_offset(key_row, chunk)
                                           : tile_values + T::offset(key_row, chunk));
      mma_bf16(partial[0], k_a, q_b0[step].hi, q_b1[step].hi);
      mma_bf16(partial[1], k_a, q_b0[step].lo, q_b1[step].lo);
    }
    const int parity = tile & 1;
    partial_scores[parity][warp][lane] =
        make_float4(partial[0][0] + partial[1][0], partial[0][1] + partial[1][1],
                    partial[0][2] + partial[1][2], partial[0][3] + partial[1][3]);
    __syncthreads();
    // score[0], [1]: key g of heads 2t, 2t + 1; [2], [3]: key g + 8. Summed in one order by every
    // warp, so all warps see the same bits.
    float score[4] = {};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float4 s = partial_scores[parity][w][lane];
      score[0] += s.x;
      score[1] += s.y;
      score[2] += s.z;
      score[3] += s.w;
    }
    const bool low_visible = visible >> g & 1, high_visible = visible >> (g + 8) & 1;
    float p[4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float low = low_visible ? score[c] : -INFINITY;
      const float high = high_visible ? score[2 + c] : -INFINITY;
      // The tile's max of head 2t + c: over the 8 lanes of fragment column t.
      float tile_max = fmaxf(low, high);
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, offset));
      }
      const float new_max = fmaxf(running_max[c], tile_max);
      // Nothing visible yet: new_max is −∞, and exponents taken from 0 instead keep every weight
      // 0 (no NaN) without a branch, so the two heads' chains interleave.
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      const float rescale = expf(running_max[c] - base);
      running_max[c] = new_max;
      running_sum[c] *= rescale;
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        acc[i][c] *= rescale;
        acc[i][2 + c] *= rescale;
      }
      p[c] = expf(low - base);
      p[2 + c] = expf(high - base);
      running_sum[c] += p[c] + p[2 + c];
    }
    // Pᵀ as the B operand of Oᵀ += Vᵀ·Pᵀ: the score fragments of keys 0-7 and 8-15 transposed
    // (lane (g, t) then holds keys 2t, 2t + 1 of head g).
    const SplitPair low_keys = split_pair(p[0], p[1]), high_keys = split_pair(p[2], p[3]);
    const uint32_t p_b0_hi = transpose_fragment(low_keys.hi);
    const uint32_t p_b1_hi = transpose_fragment(high_keys.hi);
    const uint32_t p_b0_lo = transpose_fragment(low_keys.lo);
    const uint32_t p_b1_lo = transpose_fragment(high_keys.lo);
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      uint32_t v_a[4];
      load_matrices<true>(v_a, tile_values + T::offset(value_row, first_dim * 2 / kChunkBytes +
                                                                      2 * i + value_chunk));
      mma_bf16(acc[i], v_a, p_b0_hi, p_b1_hi);
      mma_bf16(acc[i], v_a, p_b0_lo, p_b1_lo);
    }
  }
  // Only empty copy groups remain. The outputs are staged below at the start of stage 0 without a
  // block barrier first: every warp has read the last tile's K rows (and widened its raw rows)
  // before that tile's score barrier, and the V rows a slower warp may still read lie past them
  // (MmaTiling's static_assert).
  wait_copies<0>();

  // The sums of heads 2t, 2t + 1 over the 8 lanes of column t.
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) {
      running_sum[c] += __shfl_xor_sync(0xFFFFFFFFu, running_sum[c], offset);
    }
  }
  // The warp's outputs through shared memory ([head][own dim]), to be written 32 consecutive dims
  // of one head per warp-wide step (the kQ8 companion's chunk).
  if constexpr (T::kStagesAfterBarrier) __syncthreads();
  float* staged = reinterpret_cast<float*>(pipeline) + warp * kMmaMaxGroup * T::kWarpDims;
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      staged[(2 * t + (c & 1)) * T::kWarpDims + 16 * i + g + (c >> 1) * 8] = acc[i][c];
    }
  }
  // Head h's max and sum live in the lanes of column h / 2: every head's fetched at once (the
  // shuffles pipeline) before the writes.
  float head_max[kMmaMaxGroup], head_sum[kMmaMaxGroup];
#pragma unroll
  for (int h = 0; h < kMmaMaxGroup; ++h) {
    head_max[h] = __shfl_sync(0xFFFFFFFFu, running_max[h & 1], h >> 1);
    head_sum[h] = __shfl_sync(0xFFFFFFFFu, running_sum[h & 1], h >> 1);
  }
  __syncwarp();
#pragma unroll
  for (int h = 0; h < kMmaMaxGroup; ++h) {
    if (h >= heads) break;  // warp-uniform
    const int head = kv * a.group + first_head + h;
#pragma unroll
    for (int part = 0; part < T::kWarpDims / 32; ++part) {
      const int d = first_dim + 32 * part + lane;
      const float value = staged[h * T::kWarpDims + 32 * part + lane];
      write_head_output<HD>(a, row, head, d, splits, split, value, head_max[h], head_sum[h]);
    }
  }
  if (splits > 1 && a.merge_counters != nullptr) {
    merge_in_last_block<HD>(a, row, kv, part, first_head, heads, splits,
                            reinterpret_cast<float*>(pipeline));
  }
}

struct MergeArgs {
  const float* partials;
  const int32_t* positions;
  int window;
  SequenceKvTable sequences;
  int q_heads;
  int head_dim;
  int splits;
  int block_dims;  // dims per block: a multiple of 32 dividing head_dim
  float* out;
  int64_t out_stride;
  ActivationCompanions out_companions;
};

constexpr int kMergeWarps = 8;
// The loads a merge lane keeps in flight: kDimsPerLane dims of 16 / kDimsPerLane splits.
constexpr int kMergeLoadsInFlight = 16;

// Block (head, sequence, slice of block_dims dims) of 8 warps, over the splits the attention
// kernel used (none when it used one: it then wrote the output itself). The splits' weights
// exp(max_s − max) go to shared memory once; warp w then accumulates the splits w, w + 8, ...
// (kMergeLoadsInFlight / kDimsPerLane at a time) for the slice's dims (lane l owns dims l + 32i,
// kDimsPerLane = block_dims / 32 of them), and the 8 partial
// vectors are summed in shared memory. Slicing the dims gives a single deep sequence enough
// blocks to read its partials at the L2's pace rather than one round trip after another.
template <int kDimsPerLane>
__global__ void __launch_bounds__(kMergeWarps * 32) merge_splits_kernel(MergeArgs a) {
  pdl_trigger_dependents();
  __shared__ float split_weight[kMaxSplits];
  __shared__ float warp_partial[kMergeWarps][512];
  __shared__ float scratch[kMergeWarps];
  // The query position before the PDL wait (uploaded before the step, as the attention kernel
  // reads it): a shallow cache's merge then leaves as soon as the wait releases it.
  const int head = blockIdx.x;
  const SequenceKv& sequence = a.sequences.entries[blockIdx.y];
  const int64_t row = sequence.first_row;
  const int splits = scanned_keys(sequence.slots, a.positions[row], a.window, a.splits).splits;
  // Even with nothing to merge, the wait: the kernels after this one count on its completion
  // meaning the attention kernel's too.
  pdl_wait_for_predecessors();
  if (splits == 1) return;  // the attention kernel wrote the output
  const int64_t record = a.head_dim + 2;
  const float* base =
      a.partials + (static_cast<int64_t>(blockIdx.y) * a.q_heads + head) * a.splits * record;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  float local_max = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    local_max = fmaxf(local_max, base[s * record]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local_max = fmaxf(local_max, __shfl_xor_sync(0xFFFFFFFFu, local_max, offset));
  }
  if (lane == 0) scratch[warp] = local_max;
  __syncthreads();
  float global_max = -INFINITY;
  for (int w = 0; w < kMergeWarps; ++w) global_max = fmaxf(global_max, scratch[w]);
  __syncthreads();

  float local_sum = 0.0f;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    const float m = base[s * record];
    const float w = global_max == -INFINITY || m == -INFINITY ? 0.0f : expf(m - global_max);
    split_weight[s] = w;
    local_sum += w * base[s * record + 1];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local_sum += __shfl_xor_sync(0xFFFFFFFFu, local_sum, offset);
  }
  if (lane == 0) scratch[warp] = local_sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kMergeWarps; ++w) total += scratch[w];

  constexpr int kUnroll = kMergeLoadsInFlight / kDimsPerLane;
  const int first_dim = blockIdx.z * a.block_dims;
  float acc[kDimsPerLane] = {};
  for (int first = warp; first < splits; first += kMergeWarps * kUnroll) {
    float values[kUnroll][kDimsPerLane];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = first + u * kMergeWarps;
      const float* split_values = base + s * record + 2 + first_dim;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        values[u][i] = s < splits ? split_values[lane + 32 * i] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = first + u * kMergeWarps;
      const float w = s < splits ? split_weight[s] : 0.0f;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) acc[i] = fmaf(w, values[u][i], acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) warp_partial[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  // block_dims is a multiple of 32: every warp that enters runs every iteration (the q8
  // companion's chunk reductions are warp-wide) over 32 consecutive dims, one kQ8 chunk.
  for (int d = threadIdx.x; d < a.block_dims; d += blockDim.x) {
    float value = 0.0f;
    for (int w = 0; w < kMergeWarps; ++w) value += warp_partial[w][d];
    const float result[1] = {total > 0.0f ? value / total : 0.0f};
    const int64_t column = static_cast<int64_t>(head) * a.head_dim + first_dim + d;
    a.out[row * a.out_stride + column] = result[0];
    store_companions<1>(a.out_companions, row, column, result);
  }
}

using AttentionKernel = void (*)(AttentionArgs);

template <typename KvT, bool kPrepare>
AttentionKernel select_kernel(int head_dim) {
  if (head_dim == 256) return decode_attention_kernel<256, 4, KvT, kPrepare>;
  if (head_dim == 512) return decode_attention_kernel<512, 2, KvT, kPrepare>;
  return nullptr;
}

// A tensor-core kernel and the dynamic shared memory it launches with.
struct MmaKernel {
  AttentionKernel kernel = nullptr;
  size_t shared_bytes = 0;
};

template <int HD, typename KvT, bool kBulk, bool kRotatedKeys = false>
MmaKernel mma_kernel_for(bool prepare) {
  return {prepare ? decode_attention_mma_kernel<HD, KvT, true, kBulk, kRotatedKeys>
                  : decode_attention_mma_kernel<HD, KvT, false, kBulk, kRotatedKeys>,
          MmaTiling<HD, KvT, kBulk, kRotatedKeys>::kSharedBytes};
}

template <typename KvT, bool kBulk>
MmaKernel select_mma_kernel(int head_dim, bool prepare) {
  if (head_dim == 256) return mma_kernel_for<256, KvT, kBulk>(prepare);
  if (head_dim == 512) return mma_kernel_for<512, KvT, kBulk>(prepare);
  return {};
}

template <typename KvT>
MmaKernel select_mma_kernel(int head_dim, bool prepare, bool thread_copies) {
  return thread_copies ? select_mma_kernel<KvT, false>(head_dim, prepare)
                       : select_mma_kernel<KvT, true>(head_dim, prepare);
}

// The tensor-core kernel where it applies: bf16 or e4m3 caches, at most kMmaMaxGroup q heads per
// kv head; rows by bulk copies unless `thread_copies` (AttentionQuery::thread_copies).
MmaKernel select_mma_kernel(KvType type, int head_dim, int group, bool prepare,
                            bool thread_copies) {
  if (group > kMmaMaxGroup) return {};
  if (type == KvType::kBF16) {
    return select_mma_kernel<__nv_bfloat16>(head_dim, prepare, thread_copies);
  }
  if (type == KvType::kFP8) {
    return select_mma_kernel<__nv_fp8_e4m3>(head_dim, prepare, thread_copies);
  }
  return {};
}

// The tensor-core kernel reading K's rotated dims only (MmaTiling's kRotatedKeys): bf16 caches of
// 512 dims whose rotated dims are two warps' own (reads_rotated_keys_only).
MmaKernel select_rotated_keys_mma_kernel(bool prepare, bool thread_copies) {
  return thread_copies ? mma_kernel_for<512, __nv_bfloat16, false, true>(prepare)
                       : mma_kernel_for<512, __nv_bfloat16, true, true>(prepare);
}

constexpr int heads_per_warp(int head_dim) {
  return head_dim == 256 ? 4 : 2;
}

}  // namespace

size_t attention_partials_floats(int batch, int q_heads, int head_dim, int max_splits) {
  return static_cast<size_t>(batch) * q_heads * max_splits * (head_dim + 2);
}

namespace {

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Whether the tensor-core kernel (`mma`) reads only K's rotated dims of a k_eq_v cache
// (attention.h): a bf16 cache of 512 dims whose rotated dims are two warps' own (64 pairs: 26B's
// and 31B's full layers), the key scales loaded as 16-byte pieces.
bool reads_rotated_keys_only(const MmaKernel& mma, const KvCacheView& kv) {
  const KeysFromValues& keys_from_values = kv.keys_from_values;
  return mma.kernel != nullptr && kv.type == KvType::kBF16 && kv.head_dim == 512 &&
         keys_from_values.k_norm != nullptr && aligned16(keys_from_values.k_norm) &&
         keys_from_values.rotated_pairs == kv.head_dim / kWarps;
}

// The uniform KvCacheView as a table: sequence b's arrays at b · sequence_stride, its query row b.
bool uniform_table(const KvCacheView& kv, int batch, SequenceKvTable& table) {
  if (batch > kMaxBatchedSequences || kv.keys == nullptr || kv.values == nullptr ||
      kv.slot_positions == nullptr) {
    return false;
  }
  const int64_t element_bytes =
      with_kv_type(kv.type, [](auto element) { return int64_t{sizeof(element)}; });
  // The table's pointers are writable because prepare_attention stores through them; the
  // attention kernel only reads.
  auto* keys = static_cast<char*>(const_cast<void*>(kv.keys));
  auto* values = static_cast<char*>(const_cast<void*>(kv.values));
  auto* slot_positions = const_cast<int32_t*>(kv.slot_positions);
  table.count = batch;
  for (int b = 0; b < batch; ++b) {
    table.entries[b] = {keys + b * kv.sequence_stride * element_bytes,
                        values + b * kv.sequence_stride * element_bytes,
                        slot_positions + b * kv.slots,
                        kv.slots,
                        b,
                        1};
  }
  return true;
}

// Blocks per (sequence, kv head): the splits, and where the GPU runs more blocks at once, up to
// one per (split, q head) of the group (block_work gives the blocks a shallow cache leaves idle q
// heads, and a deep one's split blocks fewer heads each).
int blocks_per_kv_head(int splits, int group, int kv_heads, int batch) {
  return static_cast<int>(std::max<int64_t>(
      splits, std::min<int64_t>(int64_t{splits} * group,
                                kDecodeAttentionBlocks / (int64_t{kv_heads} * batch))));
}

// Whether the tensor-core kernel (`mma`) merges `splits` itself (decode_attention_launches): the
// records one block merges are those of its q-head part, most at the deepest cache (every split
// used, the fewest parts).
bool merges_in_kernel(bool mma, const AttentionWorkspace& workspace, int splits, int batch,
                      int kv_heads, int group, int head_dim) {
  const int heads_per_part =
      block_work(splits, blocks_per_kv_head(splits, group, kv_heads, batch), group).heads_per_part;
  return mma && splits > 1 && splits <= kMaxMergedInKernelSplits &&
         workspace.merge_counters != nullptr &&
         int64_t{batch} * kv_heads * group <= workspace.merge_counter_count &&
         int64_t{splits} * heads_per_part * (head_dim + 2) * int64_t{sizeof(float)} <=
             kMaxMergedInKernelBytes;
}

}  // namespace

int decode_attention_launches(const AttentionQuery& query, const KvCacheView& kv, int splits,
                              const AttentionWorkspace& workspace) {
  if (splits <= 1) return 1;
  if (kv.kv_heads < 1) return 2;
  const int group = query.q_heads / kv.kv_heads;
  const bool mma =
      !query.cuda_core_kernel &&
      select_mma_kernel(kv.type, kv.head_dim, group, query.prepare != nullptr, query.thread_copies)
              .kernel != nullptr;
  const int batch = kv.sequences != nullptr ? kv.sequences->count : query.batch;
  return merges_in_kernel(mma, workspace, splits, batch, kv.kv_heads, group, kv.head_dim) ? 1 : 2;
}

cudaError_t decode_attention(const AttentionQuery& query, const KvCacheView& kv, int window,
                             float scale, float* out, int64_t out_stride,
                             const AttentionWorkspace& workspace, int splits, const Launch& launch,
                             const ActivationCompanions& out_companions) {
  const DecodePrepare* prepare = query.prepare;
  AttentionKernel kernel = with_kv_type(kv.type, [&](auto element) {
    return prepare != nullptr ? select_kernel<decltype(element), true>(kv.head_dim)
                              : select_kernel<decltype(element), false>(kv.head_dim);
  });
  if (kernel == nullptr || kv.kv_heads < 1 || query.q_heads % kv.kv_heads != 0 ||
      kv.kv_heads > 65535 || splits < 1 || splits > kMaxSplits || query.q == nullptr ||
      query.positions == nullptr || out == nullptr || !aligned16(query.q) ||
      query.stride % 4 != 0 ||
      (splits > 1 && (workspace.partials == nullptr || splits > workspace.max_splits)) ||
      !companions_fit(out_companions, int64_t{query.q_heads} * kv.head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int group = query.q_heads / kv.kv_heads;
  // The prologue reads 16-byte quads of q, k, v and the norm tables (attention_prepare.cuh).
  if (prepare != nullptr &&
      (prepare->inv_freq == nullptr || !aligned16(prepare->inv_freq) ||
       !aligned16(prepare->q_norm) || !aligned16(prepare->k_norm) ||
       int64_t{group} * kv.head_dim > kMaxPreparedGroupFloats ||
       (prepare->k != nullptr &&
        (prepare->v == nullptr || !aligned16(prepare->k) || !aligned16(prepare->v) ||
         prepare->k_stride % 4 != 0 || prepare->v_stride % 4 != 0)))) {
    return cudaErrorInvalidValue;
  }
  const int head_groups = (group + heads_per_warp(kv.head_dim) - 1) / heads_per_warp(kv.head_dim);
  if (head_groups > kWarps) return cudaErrorInvalidValue;
  AttentionArgs args = {};
  if (kv.sequences != nullptr) {
    args.sequences = *kv.sequences;
  } else if (kv.slots < 1 || query.batch < 1 || !uniform_table(kv, query.batch, args.sequences)) {
    return cudaErrorInvalidValue;
  }
  const int batch = args.sequences.count;
  if (batch < 1 || batch > kMaxBatchedSequences) return cudaErrorInvalidValue;
  for (int b = 0; b < batch; ++b) {
    const SequenceKv& sequence = args.sequences.entries[b];
    // The kernel reads K/V rows with 16-byte loads and one query row per sequence.
    if (sequence.slots < 1 || sequence.rows != 1 || sequence.first_row < 0 ||
        sequence.slot_positions == nullptr || !aligned16(sequence.keys) ||
        !aligned16(sequence.values)) {
      return cudaErrorInvalidValue;
    }
  }
  args.q = query.q;
  args.q_stride = query.stride;
  args.q_heads = query.q_heads;
  args.group = group;
  args.positions = query.positions;
  args.kv_heads = kv.kv_heads;
  args.window = window;
  args.scale = scale;
  args.splits = splits;
  args.out = out;
  args.out_stride = out_stride;
  args.out_companions = out_companions;
  args.partials = workspace.partials;
  if (prepare != nullptr) args.prepare = *prepare;
  const MmaKernel mma =
      query.cuda_core_kernel
          ? MmaKernel{}
          : select_mma_kernel(kv.type, kv.head_dim, group, prepare != nullptr, query.thread_copies);
  const AttentionKernel mma_kernel = mma.kernel;
  const dim3 grid(static_cast<unsigned>(blocks_per_kv_head(splits, group, kv.kv_heads, batch)),
                  static_cast<unsigned>(kv.kv_heads), static_cast<unsigned>(batch));
  size_t shared_bytes = kPipelineBytes;
  if (mma_kernel != nullptr) {
    kernel = mma_kernel;
    shared_bytes = mma.shared_bytes;
    if (reads_rotated_keys_only(mma, kv)) {
      args.keys_from_values = kv.keys_from_values;
      const MmaKernel rotated =
          select_rotated_keys_mma_kernel(prepare != nullptr, query.thread_copies);
      kernel = rotated.kernel;
      // The key scales past the pipeline.
      shared_bytes = rotated.shared_bytes + sizeof(float) * static_cast<size_t>(kv.head_dim);
    }
  }
  const bool merged_in_kernel = merges_in_kernel(mma_kernel != nullptr, workspace, splits, batch,
                                                 kv.kv_heads, group, kv.head_dim);
  if (merged_in_kernel) args.merge_counters = workspace.merge_counters;
  // Above 48 KB of shared memory a kernel must opt in (a function attribute, not a stream
  // operation: allowed while a graph is captured).
  cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  if (status != cudaSuccess) return status;
  status = launch_kernel(kernel, grid, dim3(kThreads), shared_bytes, launch, args);
  if (status != cudaSuccess || splits == 1 || merged_in_kernel) return status;
  // Dim slices (a power of two, at most one per 32 dims) so that the merge fills about the
  // blocks the GPU runs at once.
  int slices = 1;
  while (slices * 2 <= kv.head_dim / 32 &&
         int64_t{slices} * 2 * query.q_heads * batch <= kDecodeAttentionBlocks) {
    slices *= 2;
  }
  const MergeArgs merge = {workspace.partials,
                           query.positions,
                           window,
                           args.sequences,
                           query.q_heads,
                           kv.head_dim,
                           splits,
                           kv.head_dim / slices,
                           out,
                           out_stride,
                           out_companions};
  using MergeKernel = void (*)(MergeArgs);
  MergeKernel merge_kernel = merge_splits_kernel<16>;
  switch (merge.block_dims / 32) {
    case 1:
      merge_kernel = merge_splits_kernel<1>;
      break;
    case 2:
      merge_kernel = merge_splits_kernel<2>;
      break;
    case 4:
      merge_kernel = merge_splits_kernel<4>;
      break;
    case 8:
      merge_kernel = merge_splits_kernel<8>;
      break;
  }
  return launch_kernel(merge_kernel,
                       dim3(static_cast<unsigned>(query.q_heads), static_cast<unsigned>(batch),
                            static_cast<unsigned>(slices)),
                       dim3(kMergeWarps * 32), 0, launch, merge);
}

}  // namespace gemma4::cuda
