// Grouped path of the MoE kernels (launch_moe for passes of moe_grouped_min_tokens tokens or more:
// prefill), four launches for T tokens with top_k experts each (pairs p = t · top_k + k):
//   1. plan_kernel: block 0 sorts the pairs by expert on the device (a stable counting sort:
//      ascending expert id = "slots", each slot's pairs in ascending order) and lists the (slot,
//      kTileM-pair tile) work items: the same plan on every run. Blocks 1.. copy x to bf16 in
//      the staged order (below).
//   2. grouped_kernel<gate/up>: grid (64-column tiles of inner, work items); a block computes
//      gelu_tanh(gate) · up for 64 inner columns (128 weight rows: gate and up) of up to 64 pairs
//      of one expert and stores it as bf16 activations in the staged order.
//   3. grouped_kernel<down>: the same over 128 hidden columns, activations → expert_outputs
//      (fp32, [pairs, hidden]).
//   4. combine_kernel: out[t] = Σ_k weights[t][k] · expert_outputs[p], summed in ascending expert
//      id (the CPU reference's order): deterministic, no atomics.
//
// The grouped GEMM (why it is shaped so: 26B-A4B prefill has ~32 pairs per expert per 512-token
// pass, so every weight feeds few rows and the work is as much dequantization as products).
// K advances kSpan (128) elements per step through a two-stage cp.async ring that holds, per
// stage, the tile's activation rows (bf16, already in the staged order, gathered by pair) and the
// block's 128 weight rows exactly as stored (4-bit: 64 bytes a row). Warp w owns 32 weight rows
// (four 8-row mma fragments) against all live rows of the tile: lane (g = lane / 4, t = lane % 4)
// dequantizes, for each fragment, 32-element group t of row g straight into mma B registers, so
// each weight is dequantized once per block and never goes back to shared memory; the
// activations come by ldmatrix. 16-row fragments past the tile's pairs are skipped (a tile has 64
// rows; an expert's pairs fill about half of one at 26B-A4B prefill).
//
// Staged order. mma.sync m16n8k16 gives lane (g, t) the B elements of column g at k slots
// {2t, 2t + 1} (register b0) and {2t + 8, 2t + 9} (b1), and the A elements of rows g, g + 8 at
// the same slots. The sum over k does not care which K element sits in which slot as long as A
// and B agree, so lane t takes the 32-element group t of a span (elements 32t .. 32t + 31; one
// 16-byte chunk of 4-bit weights, one scale) for all 8 k16 steps of the span: word w of the
// group (elements 8w .. 8w + 7) gives the bf16 pairs Q[4w + s] = (8w + s, 8w + s + 4), s = 0..3
// (what one mask of (word >> 4s) extracts), and step j takes b0 = Q[2j], b1 = Q[2j + 1]. The
// activations are stored in that order: word W (a bf16 pair) of a span is pair Q[i] of group t
// with j = W / 8, b = W / 4 % 2, t = W % 4, i = 2j + b (staged_element). Rows are padded to
// whole spans with zeros.
//
// Numbers: activations and dequantized weights enter the tensor cores as bf16 (NVFP4 and bf16
// weights exactly, w4g32's (u − 8) · scale rounded), NVFP4's global scale and the 2^-7 of its
// decode (nvfp4_pairs) are applied to the fp32 sums: the results equal the CPU reference to bf16
// precision. Deterministic: no atomics, every launch's work split fixed.
//
// Measured (H200, 26B-A4B NVFP4, a 512-token pass = 4,096 pairs, session 6): per layer plan 12 µs,
// gate/up 302, down 168, combine 18 with the fp16 NVFP4 decode (before: 12 / 539 / 245 / 77, with
// 32-pair WMMA tiles, weights dequantized through shared memory, fp32 x gathered per column
// block); moe_bench T=512 grouped 518 → 471 µs/layer with the bf16 decode (nvfp4_pairs). The
// GEMMs issue ~1,100 instructions per warp and span against ~2,500 cycles measured: latency, not
// the tensor cores, bounds them (next: a deeper pipeline, or wgmma fed by dequantizing warps).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/gemv_mma_kernel.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/moe_grouped.h"
#include "backend/cuda/moe_launch.cuh"

namespace gemma4::cuda {
namespace {

using gemv_mma_detail::centered_nibble_pairs;
using gemv_mma_detail::e4m3_pair;

constexpr int kTileM = 64;      // pairs per work item (all of one expert)
constexpr int kTileRows = 128;  // weight rows per block: 4 warps x 4 fragments of 8
constexpr int kSpan = 128;      // K elements per pipeline step
constexpr int kStages = 2;
constexpr int kGroupedThreads = 128;
constexpr int kAPitch =
    kSpan + 8;  // bf16: rows 16 bytes apart mod 128 (ldmatrix without conflicts)

__host__ __device__ constexpr int64_t staged_width(int64_t k) {
  return (k + kSpan - 1) / kSpan * kSpan;
}

// Staged order (see the top): the element (within its span) whose pair is stored at word W.
__host__ __device__ constexpr int staged_element(int word) {
  const int j = word / 8, b = word / 4 % 2, t = word % 4;
  const int i = 2 * j + b;
  return 32 * t + 8 * (i / 4) + i % 4;
}

// The word of a span holding element e (e % 8 < 4) and e + 4.
__device__ __forceinline__ int staged_word(int e) {
  const int t = e / 32, i = 4 * (e % 32 / 8) + e % 4;
  return 8 * (i / 2) + 4 * (i % 2) + t;
}

// ---- Plan ----

// The grouping, int32 words in the workspace: [0] = number of slots S, [1 + s] = expert of slot
// s (ascending), [1 + E + s] = first entry of slot s in the pair list ([1 + E + S] = the end),
// [2 + 2E + i] = the pair list (pair indices grouped by slot), then the number of work items and
// the items, each slot << 16 | tile index within the slot.
struct Plan {
  const int32_t* words;
  int num_experts;
  int pairs;
  __device__ int expert(int slot) const { return words[1 + slot]; }
  __device__ int begin(int slot) const { return words[1 + num_experts + slot]; }
  __device__ int pair(int entry) const { return words[2 + 2 * num_experts + entry]; }
  __device__ int items() const { return words[2 + 2 * num_experts + pairs]; }
  __device__ int item(int i) const { return words[3 + 2 * num_experts + pairs + i]; }
};

// Bound on the work items: Σ_s ⌈c_s / kTileM⌉ <= slots + pairs / kTileM.
int max_items(int pairs, int num_experts) {
  return (pairs < num_experts ? pairs : num_experts) + (pairs + kTileM - 1) / kTileM;
}

size_t plan_words(int pairs, int num_experts) {
  return 3 + 2 * static_cast<size_t>(num_experts) + pairs + max_items(pairs, num_experts);
}

constexpr int kPlanThreads = 1024;
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kPlanExpertsPerLane = kMaxRouterExperts / 32;

struct PlanArgs {
  const int32_t* expert_ids;
  int pairs;
  int num_experts;
  int32_t* words;
  // x → staged bf16 rows (blocks 1..): 4 words (8 elements) per thread.
  const float* x;
  int64_t x_stride;
  int tokens;
  int64_t hidden;
  __nv_bfloat16* staged_x;  // [tokens, staged_width(hidden)]
};

__device__ void stage_x(const PlanArgs& a) {
  const int64_t quads_per_row = staged_width(a.hidden) / 8;
  const int64_t quad = static_cast<int64_t>(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  const int64_t token = quad / quads_per_row;
  if (token >= a.tokens) return;
  const int64_t first_word = quad % quads_per_row * 4;
  const float* row = a.x + token * a.x_stride;
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t word = first_word + i;
    // hidden is a multiple of 32: e and e + 4 are both in the row or both past it.
    const int64_t e = word / 64 * kSpan + staged_element(static_cast<int>(word % 64));
    words[i] = e < a.hidden ? pack_bf16x2(row[e], row[e + 4]) : 0u;
  }
  reinterpret_cast<uint4*>(a.staged_x + token * staged_width(a.hidden))[quad % quads_per_row] =
      make_uint4(words[0], words[1], words[2], words[3]);
}

// Block 0: a stable counting sort in one block: warp w owns a contiguous segment of the pairs and
// visits it 32 pairs at a time in order; lanes that picked the same expert find each other with
// __match_any_sync. Each slot lists its pairs in ascending order, so the plan (and every tile's
// content) is the same on every run. Blocks 1..: stage_x.
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs a) {
  // counts[w][e]: pairs of warp w's segment that picked expert e; after the prefix over the
  // warps, where warp w's next pair of expert e goes, relative to the expert's first entry.
  __shared__ int counts[kPlanWarps][kMaxRouterExperts];
  __shared__ int totals[kMaxRouterExperts];
  __shared__ int first_entry[kMaxRouterExperts];
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  if (blockIdx.x > 0) {
    stage_x(a);
    return;
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kPlanWarps * kMaxRouterExperts; i += blockDim.x) {
    counts[i / kMaxRouterExperts][i % kMaxRouterExperts] = 0;
  }
  __syncthreads();
  const int span = (a.pairs + kPlanWarps - 1) / kPlanWarps;
  const int segment_begin = min(warp * span, a.pairs);
  const int segment_end = min(segment_begin + span, a.pairs);
  const unsigned lanes_below = (1u << lane) - 1;
  // The expert of pair i, -1 when invalid or past the segment (those contribute nothing).
  auto expert_of = [&](int i) {
    const int e = i < segment_end ? a.expert_ids[i] : -1;
    return e >= 0 && e < a.num_experts ? e : -1;
  };
  for (int base = segment_begin; base < segment_end; base += 32) {
    const int e = expert_of(base + lane);
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
    if (e >= 0 && (peers & lanes_below) == 0) counts[warp][e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kMaxRouterExperts; e += blockDim.x) {
    int running = 0;
    for (int w = 0; w < kPlanWarps; ++w) {
      const int c = counts[w][e];
      counts[w][e] = running;
      running += c;
    }
    totals[e] = running;
  }
  __syncthreads();

  int32_t* slot_expert = a.words + 1;
  int32_t* slot_begin = a.words + 1 + a.num_experts;
  int32_t* items = a.words + 2 + 2 * a.num_experts + a.pairs;
  if (warp == 0) {
    // Lane l numbers experts 8l .. 8l+7: a warp scan of (experts in use, pairs, work items)
    // gives each expert its slot, its first list entry and its first work item.
    int used = 0, listed = 0, tiles = 0;
#pragma unroll
    for (int j = 0; j < kPlanExpertsPerLane; ++j) {
      const int c = totals[lane * kPlanExpertsPerLane + j];
      used += c > 0;
      listed += c;
      tiles += (c + kTileM - 1) / kTileM;
    }
    int used_before = used, listed_before = listed, tiles_before = tiles;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int u = __shfl_up_sync(0xFFFFFFFFu, used_before, offset);
      const int l = __shfl_up_sync(0xFFFFFFFFu, listed_before, offset);
      const int t = __shfl_up_sync(0xFFFFFFFFu, tiles_before, offset);
      if (lane >= offset) {
        used_before += u;
        listed_before += l;
        tiles_before += t;
      }
    }
    used_before -= used;
    listed_before -= listed;
    tiles_before -= tiles;
#pragma unroll
    for (int j = 0; j < kPlanExpertsPerLane; ++j) {
      const int e = lane * kPlanExpertsPerLane + j;
      const int c = totals[e];
      if (c > 0) {
        slot_expert[used_before] = e;
        slot_begin[used_before] = listed_before;
        first_entry[e] = listed_before;
        for (int tile = 0; tile * kTileM < c; ++tile) {
          items[1 + tiles_before++] = used_before << 16 | tile;
        }
        ++used_before;
        listed_before += c;
      }
    }
    if (lane == 31) {
      a.words[0] = used_before;
      slot_begin[used_before] = listed_before;
      items[0] = tiles_before;
    }
  }
  __syncthreads();
  int32_t* list = a.words + 2 + 2 * a.num_experts;
  for (int base = segment_begin; base < segment_end; base += 32) {
    const int i = base + lane;
    const int e = expert_of(i);
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
    if (e >= 0) list[first_entry[e] + counts[warp][e] + __popc(peers & lanes_below)] = i;
    __syncwarp();
    if (e >= 0 && (peers & lanes_below) == 0) counts[warp][e] += __popc(peers);
    __syncwarp();
  }
}

// ---- Grouped GEMM ----

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared, asynchronously; zeros when !valid (nothing is read then).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}

// A 16-byte load at a shared-memory address, which the compiler may not merge with an earlier
// one (that would keep its registers live).
__device__ __forceinline__ uint4 load_shared(uint32_t address) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(address));
  return r;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// 16-byte chunks of one weight row per span, and the row pitch in shared memory (bf16 rows get
// 16 more bytes, so that the 8 rows a warp reads at once fall on different banks).
template <PackedFormat F>
constexpr int kSpanChunks = kSpan / kChunkElems<F>;
template <PackedFormat F>
constexpr int kRawPitch = kSpanChunks<F> + (F == PackedFormat::kBF16 ? 1 : 0);

template <PackedFormat F>
struct GroupedShared {
  __nv_bfloat16 a[kStages][kTileM][kAPitch];  // activation rows, staged order
  uint4 b[kStages][kTileRows][kRawPitch<F>];  // weight rows as stored
  int64_t a_rows[kTileM];  // offset of row m's staged activations, -1 past the tile's pairs
  int pairs[kTileM];
};

// Blocks per SM: ptxas wants ~170 registers a thread for the 4-bit formats (three blocks; at
// four, 128 registers, it spills ~200 bytes), ~240 for bf16 (whose weights are 4x the bytes).
template <PackedFormat F>
constexpr int kGroupedBlocksPerSm = F == PackedFormat::kBF16 ? 2 : 3;

struct GroupedArgs {
  const MoeExpert* experts;
  int num_experts;
  const int32_t* plan;
  int pairs;
  int top_k;
  int64_t rows;  // output columns: inner (gate/up) or hidden (down)
  int64_t k;     // hidden (gate/up) or inner (down)
  const __nv_bfloat16*
      a;  // staged rows: gate/up x [tokens, a_stride], down activations [pairs, a_stride]
  int64_t a_stride;  // staged_width(k)
  void* y;  // gate/up: activations (bf16, staged order, [pairs, y_stride]); down: expert outputs
            // (fp32)
  int64_t y_stride;
};

// NVFP4 weights enter the tensor cores as e2m1 · block scale · 2^-kNvfp4Shift, exact in bf16
// (see nvfp4_pairs); the fp32 sums are scaled back.
constexpr int kNvfp4Shift = 7;

// The scale of a lane's 32-element group of one weight row, decoded once per span: NVFP4's two
// e4m3 block scales times 2^(126 − kNvfp4Shift) as bf16 pairs (words 0-1 are group 0, words 2-3
// group 1; exact: e4m3 has 4 significant bits, and 448 · 2^119 < 2^128), w4g32's scale.
struct GroupScale {
  __nv_bfloat162 nvfp4[2];
  float w4g32;
};

template <PackedFormat F>
__device__ __forceinline__ GroupScale decode_group_scale(uint32_t bits, const MoeMatrix& m) {
  GroupScale scale = {};
  if constexpr (F == PackedFormat::kNVFP4) {
#pragma unroll
    for (int group = 0; group < 2; ++group) {
      const float block = __low2float(e4m3_pair(bits >> (8 * group)));
      scale.nvfp4[group] = __float2bfloat162_rn(block * 0x1p119f);
    }
  } else if constexpr (F == PackedFormat::kW4G32) {
    scale.w4g32 = scale_from_bits(m, bits);
  }
  return scale;
}

// NVFP4 pairs (s, s + 4), s = 0..3, of a packed word: code c placed as bf16 bits
// (c & 8) << 12 | (c & 7) << 6 is e2m1(c) · 2^-126 (codes 0 and 1 as the subnormals 0 and 2^-127,
// the others normal with exponent field c >> 1), so one bf16 multiply by the group's
// block scale · 2^(126 − kNvfp4Shift) gives e2m1 · block scale · 2^-kNvfp4Shift exactly (at
// most 6 significant bits, at least 2^-17: normal).
__device__ __forceinline__ void nvfp4_pairs(uint32_t word, __nv_bfloat162 scale,
                                            uint32_t (&pairs)[4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t shifted = word >> (4 * s);
    const uint32_t bits = ((shifted << 6) & 0x01C001C0u) | ((shifted << 12) & 0x80008000u);
    const __nv_bfloat162 pair = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), scale);
    pairs[s] = *reinterpret_cast<const uint32_t*>(&pair);
  }
}

// The bf16 pairs Q[4w + s], s = 0..3, of a lane's 32-element group of one weight row (see the
// top), word w: 4-bit formats pass the group's chunk, bf16 its chunk w. NVFP4 values are
// e2m1 · block scale · 2^-kNvfp4Shift exactly (the sums are scaled back), w4g32's (u − 8) · scale
// rounded to bf16 as the CPU reference's bf16 path would.
template <PackedFormat F>
__device__ __forceinline__ void weight_pairs(const uint4& q, int w, const GroupScale& scale,
                                             uint32_t (&pairs)[4]) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  if constexpr (F == PackedFormat::kBF16) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      pairs[s] = __byte_perm(words[s / 2], words[2 + s / 2], s % 2 ? 0x7632 : 0x5410);
    }
  } else if constexpr (F == PackedFormat::kNVFP4) {
    nvfp4_pairs(words[w], scale.nvfp4[w / 2], pairs);
  } else {
    uint32_t centered[4];
    centered_nibble_pairs(words[w], centered);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&centered[s]));
      pairs[s] = pack_bf16x2(f.x * scale.w4g32, f.y * scale.w4g32);
    }
  }
}

// What the fp32 sums of one matrix are multiplied by: NVFP4's 2^kNvfp4Shift (nvfp4_pairs) and
// global scale (weight-formats.md 3.3).
template <PackedFormat F>
__device__ __forceinline__ float finish_sum(const MoeMatrix& m, float sum) {
  if constexpr (F == PackedFormat::kNVFP4) {
    const float unscaled = sum * static_cast<float>(1 << kNvfp4Shift);
    return m.nv_global_is_divisor ? unscaled / m.nv_global : unscaled * m.nv_global;
  } else {
    return sum;
  }
}

template <PackedFormat F, bool kGateUp>
__global__ void __launch_bounds__(kGroupedThreads, kGroupedBlocksPerSm<F>)
    grouped_kernel(GroupedArgs a) {
  constexpr int kColumns = kGateUp ? kTileRows / 2 : kTileRows;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  GroupedShared<F>& s = *reinterpret_cast<GroupedShared<F>*>(shared_bytes);
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();

  const Plan plan{a.plan, a.num_experts, a.pairs};
  if (static_cast<int>(blockIdx.y) >= plan.items()) return;
  const int item = plan.item(blockIdx.y);
  const int slot = item >> 16;
  const int first = plan.begin(slot) + (item & 0xFFFF) * kTileM;
  const int remaining = plan.begin(slot + 1) - first;
  const int count = remaining < kTileM ? remaining : kTileM;
  const MoeExpert& expert = a.experts[plan.expert(slot)];
  const MoeMatrix mats[2] = {kGateUp ? expert.gate : expert.down,
                             kGateUp ? expert.up : expert.down};
  const int64_t column0 = static_cast<int64_t>(blockIdx.x) * kColumns;
  if (threadIdx.x < kTileM) {
    const int m = threadIdx.x;
    const int pair = m < count ? plan.pair(first + m) : -1;
    s.pairs[m] = pair;
    s.a_rows[m] = pair < 0 ? -1 : (kGateUp ? pair / a.top_k : pair) * a.a_stride;
  }
  __syncthreads();

  const int live_fragments = (count + 15) / 16;  // 16-row fragments holding pairs
  const int64_t chunks_per_row = a.k / kChunkElems<F>;
  const int spans = static_cast<int>((a.k + kSpan - 1) / kSpan);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int warp = threadIdx.x >> 5;

  // Tile row r (warp r / 32's fragment r / 8 % 4, its row r % 8) is row tile_row(r) of
  // mats[tile_matrix(r)]:
  // gate/up fragments 0-1 are 16 gate rows, 2-3 the same 16 up rows (so that a lane holds the
  // gate and the up sum of the same output); down rows in order.
  auto tile_matrix = [&](int r) { return kGateUp ? r / 8 % 4 >> 1 : 0; };
  auto tile_row = [&](int r) -> int64_t {
    return kGateUp ? column0 + 16 * (r / 32) + 8 * (r / 8 % 2) + r % 8 : column0 + r;
  };
  auto load_span = [&](int span, int stage) {
    constexpr int kAPieces = kSpan / 8;  // 16-byte pieces of an activation row
#pragma unroll
    for (int pass = 0; pass < kTileM * kAPieces / kGroupedThreads; ++pass) {
      const int i = pass * kGroupedThreads + threadIdx.x;
      const int m = i / kAPieces, piece = i % kAPieces;
      if (m >= 16 * live_fragments) continue;  // never read
      const int64_t offset = s.a_rows[m];
      const __nv_bfloat16* src = a.a + (offset < 0 ? 0 : offset + span * kSpan + piece * 8);
      cp_async16(&s.a[stage][m][piece * 8], src, offset >= 0);
    }
#pragma unroll
    for (int pass = 0; pass < kTileRows * kSpanChunks<F> / kGroupedThreads; ++pass) {
      const int i = pass * kGroupedThreads + threadIdx.x;
      const int r = i / kSpanChunks<F>, piece = i % kSpanChunks<F>;
      const int64_t row = tile_row(r);
      const int64_t chunk = static_cast<int64_t>(span) * kSpanChunks<F> + piece;
      const bool valid = row < a.rows && chunk < chunks_per_row;
      const uint4* base =
          static_cast<const uint4*>(tile_matrix(r) ? mats[1].weights : mats[0].weights);
      cp_async16(&s.b[stage][r][piece], valid ? base + row * chunks_per_row + chunk : base, valid);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  // The scale bits of this lane's group of each fragment row (0 past the matrix: zero weights).
  auto load_scales = [&](int span, uint32_t(&bits)[4]) {
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      bits[f] = 0;
      if constexpr (F != PackedFormat::kBF16) {
        const int64_t row = tile_row(32 * warp + 8 * f + g);
        const int64_t chunk = static_cast<int64_t>(span) * kSpanChunks<F> + t;
        if (row < a.rows && chunk < chunks_per_row) {
          bits[f] = load_scale_bits<F>(mats[kGateUp ? f >> 1 : 0], row, chunk);
        }
      }
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int f = 0; f < 4; ++f) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][f][e] = 0.0f;
    }
  }
  uint32_t scales[4], next_scales[4];
  load_span(0, 0);
  load_scales(0, scales);
  for (int span = 0; span < spans; ++span) {
    const int stage = span % kStages;
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    // Span's stage visible to all; every warp is done with the other stage (span − 1).
    __syncthreads();
    if (span + 1 < spans) {
      load_span(span + 1, (span + 1) % kStages);
      load_scales(span + 1, next_scales);
    }
    // Shared addresses: this lane's group of fragment row 0 (4-bit formats: one chunk, read
    // again for each w rather than held across the span; bf16: chunk w of four), and its
    // ldmatrix row of fragment 0, step 0. The others are constant offsets from them.
    const uint32_t group_address =
        shared_address(&s.b[stage][32 * warp + g][F == PackedFormat::kBF16 ? 4 * t : t]);
    const uint32_t a_address = shared_address(&s.a[stage][lane & 15][(lane >> 4) * 8]);
    constexpr uint32_t kFragmentRowBytes = 8 * kRawPitch<F> * sizeof(uint4);
    constexpr uint32_t kAFragmentBytes = 16 * kAPitch * sizeof(__nv_bfloat16);
    GroupScale group_scales[4];
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      group_scales[f] = decode_group_scale<F>(scales[f], mats[kGateUp ? f >> 1 : 0]);
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t b[4][4];
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const uint4 q = load_shared(group_address + f * kFragmentRowBytes +
                                    (F == PackedFormat::kBF16 ? w * sizeof(uint4) : 0));
        weight_pairs<F>(q, w, group_scales[f], b[f]);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * w + half;  // k16 step of the span
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          if (mi >= live_fragments) break;
          uint32_t fragment[4];
          ldmatrix_x4(fragment, a_address + mi * kAFragmentBytes + j * 16 * sizeof(__nv_bfloat16));
#pragma unroll
          for (int f = 0; f < 4; ++f) {
            mma_bf16(acc[mi][f], fragment, b[f][2 * half], b[f][2 * half + 1]);
          }
        }
      }
    }
#pragma unroll
    for (int f = 0; f < 4; ++f) scales[f] = next_scales[f];
  }

  // Epilogue. Lane (g, t) holds, for fragment (mi, f), rows 16mi + g (elements 0, 1) and
  // 16mi + g + 8 (elements 2, 3) at columns 2t, 2t + 1 of the fragment's 8.
  if constexpr (kGateUp) {
    uint32_t* out = static_cast<uint32_t*>(a.y);
    const int64_t words_per_row = a.y_stride / 2;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      if (mi >= live_fragments) break;
#pragma unroll
      for (int f = 0; f < 2; ++f) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float v[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float gate = finish_sum<F>(mats[0], acc[mi][f][2 * half + e]);
            const float up = finish_sum<F>(mats[1], acc[mi][f + 2][2 * half + e]);
            v[e] = gelu_tanh(gate) * up;
          }
          // A staged word holds columns (c, c + 4), c % 8 < 4: lanes t and t ^ 2 trade one
          // value; lanes 0, 1 store columns (2t, 2t + 4), lanes 2, 3 (2t − 3, 2t + 1).
          const float sent = t < 2 ? v[1] : v[0];
          const float received = __shfl_xor_sync(0xFFFFFFFFu, sent, 2);
          const int m = 16 * mi + g + 8 * half;
          const int64_t column = column0 + 16 * warp + 8 * f + (t < 2 ? 2 * t : 2 * t - 3);
          if (m < count && column < a.rows) {
            const uint32_t word = t < 2 ? pack_bf16x2(v[0], received) : pack_bf16x2(received, v[1]);
            out[s.pairs[m] * words_per_row + column / kSpan * (kSpan / 2) +
                staged_word(static_cast<int>(column % kSpan))] = word;
          }
        }
      }
    }
    // The padding of each row to whole spans (the down kernel reads it): zeros, by the last
    // column block.
    const int64_t padding = a.y_stride - a.rows;
    if (blockIdx.x == gridDim.x - 1 && padding > 0) {
      const int64_t pad_words = padding / 2;
      for (int64_t i = threadIdx.x; i < count * pad_words; i += kGroupedThreads) {
        const int m = static_cast<int>(i / pad_words);
        const int64_t w = i % pad_words;
        const int64_t column = a.rows + 8 * (w / 4) + w % 4;
        out[s.pairs[m] * words_per_row + column / kSpan * (kSpan / 2) +
            staged_word(static_cast<int>(column % kSpan))] = 0u;
      }
    }
  } else {
    float* out = static_cast<float*>(a.y);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      if (mi >= live_fragments) break;
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const int64_t column = column0 + 32 * warp + 8 * f + 2 * t;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int m = 16 * mi + g + 8 * half;
          // rows is a multiple of 32: column + 1 is in the matrix when column is.
          if (m < count && column < a.rows) {
            *reinterpret_cast<float2*>(out + s.pairs[m] * a.y_stride + column) =
                make_float2(finish_sum<F>(mats[0], acc[mi][f][2 * half]),
                            finish_sum<F>(mats[0], acc[mi][f][2 * half + 1]));
          }
        }
      }
    }
  }
}

// ---- Combine ----

struct CombineArgs {
  const int32_t* expert_ids;
  const float* weights;
  int top_k;
  int num_experts;
  const float* expert_outputs;  // [pairs, hidden]
  int64_t hidden;
  float* out;
  int64_t out_stride;
};

constexpr int kCombineThreads = 128;  // 4 columns each

// out[t][j] = Σ_k weights[t][k] · expert_outputs[t · top_k + k][j], in ascending (expert id, k).
// The order is found once per block; the top_k rows' loads are then independent.
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineArgs a) {
  __shared__ int order[kMaxTopK];
  __shared__ int picks;
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t t = blockIdx.y;
  if (threadIdx.x == 0) {
    const int32_t* ids = a.expert_ids + t * a.top_k;
    // Selection order: the next (id, k) above the previous one; invalid ids never qualify.
    int previous_id = -1, previous_k = -1, n = 0;
    for (; n < a.top_k; ++n) {
      int next_id = INT_MAX, next_k = -1;
      for (int k = 0; k < a.top_k; ++k) {
        const int id = ids[k];
        const bool after = id > previous_id || (id == previous_id && k > previous_k);
        if (id >= 0 && id < a.num_experts && after && id < next_id) {
          next_id = id;
          next_k = k;
        }
      }
      if (next_k < 0) break;
      order[n] = static_cast<int>(t * a.top_k + next_k);
      previous_id = next_id;
      previous_k = next_k;
    }
    picks = n;
  }
  __syncthreads();
  const int64_t j = 4 * (static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x);
  if (j >= a.hidden) return;
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
  for (int n = 0; n < picks; ++n) {
    const int64_t p = order[n];
    const float4 v = *reinterpret_cast<const float4*>(a.expert_outputs + p * a.hidden + j);
    const float w = a.weights[p];
    sum[0] += v.x * w;
    sum[1] += v.y * w;
    sum[2] += v.z * w;
    sum[3] += v.w * w;
  }
  float* out = a.out + t * a.out_stride + j;
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = sum[i];
}

// ---- Launch ----

// x in bf16 (staged order, [tokens, staged_width(hidden)]) follows the plan.
size_t staged_x_offset(const MoeWorkspaceLayout& layout, const MoeShape& shape, int tokens,
                       int top_k) {
  return layout.plan + align16(sizeof(int32_t) * plan_words(tokens * top_k, shape.num_experts));
}

template <bool kGateUp>
cudaError_t launch_gemm(PackedFormat format, dim3 grid, const GroupedArgs& args,
                        const Launch& launch) {
  return for_format(format, [&](auto f) {
    constexpr PackedFormat F = decltype(f)::value;
    const auto kernel = grouped_kernel<F, kGateUp>;
    constexpr size_t kShared = sizeof(GroupedShared<F>);
    // Not a stream operation: allowed during graph capture.
    const cudaError_t allowed = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kShared));
    if (allowed != cudaSuccess) return allowed;
    return launch_kernel(kernel, grid, dim3(kGroupedThreads), kShared, launch, args);
  });
}

}  // namespace

MoeWorkspaceLayout grouped_workspace_layout(const MoeShape& shape, int tokens, int top_k) {
  const size_t pairs = static_cast<size_t>(tokens) * top_k;
  MoeWorkspaceLayout layout;
  layout.activations = 0;
  layout.expert_outputs = align16(sizeof(__nv_bfloat16) * pairs * staged_width(shape.inner));
  layout.plan = layout.expert_outputs + align16(sizeof(float) * pairs * shape.hidden);
  layout.bytes = staged_x_offset(layout, shape, tokens, top_k) +
                 align16(sizeof(__nv_bfloat16) * tokens * staged_width(shape.hidden));
  return layout;
}

cudaError_t launch_grouped(const MoeRunArgs& args, const MoeWorkspaceLayout& layout,
                           const Launch& launch) {
  const MoeShape& shape = args.shape;
  auto* workspace = static_cast<char*>(args.workspace);
  auto* activations = reinterpret_cast<__nv_bfloat16*>(workspace + layout.activations);
  auto* expert_outputs = reinterpret_cast<float*>(workspace + layout.expert_outputs);
  auto* plan = reinterpret_cast<int32_t*>(workspace + layout.plan);
  auto* staged_x = reinterpret_cast<__nv_bfloat16*>(
      workspace + staged_x_offset(layout, shape, args.tokens, args.top_k));
  const int pairs = args.tokens * args.top_k;
  const PlanArgs plan_args = {args.expert_ids, pairs,       shape.num_experts, plan,    args.x,
                              args.x_stride,   args.tokens, shape.hidden,      staged_x};
  const unsigned staging_blocks =
      blocks(static_cast<int64_t>(args.tokens) * staged_width(shape.hidden) / 8, kPlanThreads);
  cudaError_t status = launch_kernel(plan_kernel, dim3(1 + staging_blocks), dim3(kPlanThreads), 0,
                                     launch, plan_args);
  if (status != cudaSuccess) return status;

  const unsigned items = static_cast<unsigned>(max_items(pairs, shape.num_experts));
  const GroupedArgs gate_up = {args.experts,
                               shape.num_experts,
                               plan,
                               pairs,
                               args.top_k,
                               shape.inner,
                               shape.hidden,
                               staged_x,
                               staged_width(shape.hidden),
                               activations,
                               staged_width(shape.inner)};
  status = launch_gemm<true>(shape.gate_up_format, dim3(blocks(shape.inner, kTileRows / 2), items),
                             gate_up, launch);
  if (status != cudaSuccess) return status;
  const GroupedArgs down = {args.experts,   shape.num_experts, plan,
                            pairs,          args.top_k,        shape.hidden,
                            shape.inner,    activations,       staged_width(shape.inner),
                            expert_outputs, shape.hidden};
  status = launch_gemm<false>(shape.down_format, dim3(blocks(shape.hidden, kTileRows), items), down,
                              launch);
  if (status != cudaSuccess) return status;

  const CombineArgs combine = {args.expert_ids, args.weights, args.top_k, shape.num_experts,
                               expert_outputs,  shape.hidden, args.out,   args.out_stride};
  return launch_kernel(
      combine_kernel,
      dim3(blocks(shape.hidden, 4 * kCombineThreads), static_cast<unsigned>(args.tokens)),
      dim3(kCombineThreads), 0, launch, combine);
}

}  // namespace gemma4::cuda
