// Mixture-of-experts kernels (see moe.h): the router (and for one token the router GEMV fused with
// it: fused_router_kernel), the decode path (few tokens: one GEMV-like launch per projection over
// every (token, expert) pair; for NVFP4 outside exact-fp32 mode on tensor cores, see "Decode path
// on tensor cores" below) and the grouped path (prefill: tokens grouped by expert, tensor-core
// tiles). Accumulation is fp32 throughout.
//
// Decode path (run_experts: T < kMoeGroupedMinTokens, but NVFP4 experts only below
// kMoeByExpertMinTokens: moe_by_expert.cu runs them from there with the same per-pair arithmetic,
// each selected expert read once) for T tokens with top_k experts each (pairs p = t · top_k + k),
// two launches after the router:
//   1. decode_gate_up_kernel: grid (pairs, inner-row tiles); a warp owns kDecodeRows rows of the
//      pair's expert in both gate and up, its 32 lanes split K (one 16-byte chunk each, all of a
//      lane's loads in flight at once; the token's x staged in shared memory meanwhile, see
//      stage_activations), a butterfly reduces, gelu_tanh(gate) · up is stored
//      (fp32) to activations[p]. Pairs vary fastest, so pairs that share an expert read its rows
//      at the same time (the second read hits L2).
//   2. decode_down_kernel: grid (tokens, hidden-row tiles); row n of a token is one GEMV over the
//      concatenation of its experts' down rows n (K = top_k · inner), each chunk's dot product
//      times its pick's routing weight: the weighted combine is fused, and the sum order is fixed
//      (lane order, then a butterfly), so the result is deterministic with no atomics. Its weights
//      depend only on the router, not on step 1: they are loaded before the PDL wait, overlapping
//      step 1 (safe because step 1 triggers its dependents only after its own wait, see there).
// Weights are dequantized in registers by device_math.cuh's chunk dot products, as the dense GEMV
// (NVFP4's global scale applied once per output, not per group: dot_chunk_unscaled).
//
// Grouped path (run_experts: T >= kMoeGroupedMinTokens): moe_grouped.cu. The decode path
// agrees with the CPU reference to fp32 rounding, deterministically: no atomics in any sum,
// every launch's work split fixed.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <type_traits>

#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe_decode.cuh"
#include "backend/cuda/moe_grouped.h"
#include "backend/cuda/moe_kernels.h"
#include "backend/cuda/moe_launch.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kRouterWarps = 4;
constexpr int kExpertsPerLane = kMaxRouterExperts / 32;

// One warp routes one token (`logits`: its num_experts logits, global or shared memory): softmax
// over the logits (fp32, as transformers), the top_k largest probabilities (ties: lower expert id
// first), renormalised, times per_expert_scale; picks and weights to expert_ids / weights (top_k
// each).
__device__ void route_token(const float* logits, int num_experts, int top_k,
                            const float* per_expert_scale, int32_t* expert_ids, float* weights) {
  const int lane = threadIdx.x & 31;

  // Lane l holds experts l, l + 32, ...: ascending id with the slot index i.
  float p[kExpertsPerLane];
  float max_logit = -INFINITY;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < num_experts ? logits[e] : -INFINITY;
    max_logit = fmaxf(max_logit, p[i]);
  }
  // Butterfly reductions: every lane ends with the same bits (a + b == b + a).
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    max_logit = fmaxf(max_logit, __shfl_xor_sync(0xFFFFFFFFu, max_logit, offset));
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    p[i] = lane + 32 * i < num_experts ? expf(p[i] - max_logit) : 0.0f;
    sum += p[i];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
  // Selection keys: a probability's bits + 1 (ordered as the probabilities, which are >= 0), 0
  // for absent or taken experts and NaN probabilities (never ranked). Equal keys are equal
  // probabilities, so the lowest id among the holders of the largest key is the CPU reference's
  // pick; each pick is two warp reductions (REDUX), not a shuffle butterfly.
  uint32_t key[kExpertsPerLane];
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const float probability = p[i] / sum;
    key[i] = lane + 32 * i < num_experts && probability >= 0.0f
                 ? __float_as_uint(fabsf(probability)) + 1u
                 : 0u;
  }

  float kept = 0.0f;
  int my_expert = -1;
  float my_probability = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    uint32_t lane_best = 0;
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) lane_best = max(lane_best, key[i]);
    const uint32_t best = __reduce_max_sync(0xFFFFFFFFu, lane_best);
    // The lane's lowest id holding it (slot i is expert lane + 32 i), then the warp's.
    uint32_t lane_expert = UINT_MAX;
#pragma unroll
    for (int i = kExpertsPerLane - 1; i >= 0; --i) {
      if (key[i] == best) lane_expert = lane + 32 * i;
    }
    // NaN logits leave no winner (best == 0): that pick is marked invalid (it then contributes
    // nothing).
    const bool valid = best != 0;
    const uint32_t winner = __reduce_min_sync(0xFFFFFFFFu, valid ? lane_expert : UINT_MAX);
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      if (lane + 32 * i == winner) key[i] = 0;
    }
    const float probability = __uint_as_float(best - 1u);
    kept += valid ? probability : 0.0f;
    if (lane == k) {
      my_expert = valid ? static_cast<int>(winner) : -1;
      my_probability = probability;
    }
  }
  if (lane < top_k) {
    expert_ids[lane] = my_expert;
    weights[lane] = my_expert >= 0 ? my_probability / kept * per_expert_scale[my_expert] : 0.0f;
  }
}

// Wait first, trigger after (both routers): the experts' gate/up kernel, launched next, stages x
// before its own wait, which is safe only because its grid starts after the routers' wait, i.e.
// after x's producer (launched before the router) completed.
__global__ void __launch_bounds__(kRouterWarps * 32) router_kernel(RouterArgs a) {
  pdl_wait_for_predecessors();
  pdl_trigger_dependents();
  const int token = blockIdx.x * kRouterWarps + static_cast<int>(threadIdx.x >> 5);
  if (token >= a.tokens) return;
  const int64_t pick = static_cast<int64_t>(token) * a.top_k;
  route_token(a.logits + token * a.logits_stride, a.num_experts, a.top_k, a.per_expert_scale,
              a.expert_ids + pick, a.weights + pick);
}

// ---- Fused decode router (one token): the bf16 router GEMV and route_token in one launch ----

// One cluster of blocks splits the experts' rows (a single block would read the 0.7 MB of
// 26B-A4B's router alone, bandwidth-bound on one SM); each block puts its logits into block 0's
// shared memory, and after the cluster barrier block 0 routes. No atomics, no host round-trip.
// 16 warps per block give 128 experts one row per warp; every row's loads of a pass go out before
// any product (one memory round trip per pass, not one per row). x is staged in shared memory
// (piece-major, as stage_activations) by all threads at once after the wait: loaded per chunk
// beside the products, its loads went out one chunk at a time (the weights hold the registers),
// 12 round trips to L2 per pass.
constexpr int kRouterClusterBlocks = 8;
constexpr int kRouterGemvWarps = 16;
// 16-byte chunks (8 bf16) per lane per pass: 12 cover hidden 3072 in one pass.
constexpr int kRouterChunksPerLane = 12;
// Rows of one warp: kMaxRouterExperts over the cluster's warps.
constexpr int kRouterRowsPerWarp = kMaxRouterExperts / (kRouterClusterBlocks * kRouterGemvWarps);

// Pieces of x (4 floats) a router thread loads at once, before storing any: 2 cover hidden 4096.
constexpr int kRouterPiecesPerThread = 2;

// x's `chunks` chunks of 8 floats (rounded to bf16 when the GEMV's mode asks) to `staged`, piece
// i of chunk c at staged[i · chunks + c] (stage_activations' layout: load_staged_chunk reads it).
// A thread's first pieces are all loaded before it stores any (one round trip to L2).
__device__ __forceinline__ void stage_router_x(const FusedRouterArgs& a, int chunks,
                                               float4* staged) {
  const float4* pieces = reinterpret_cast<const float4*>(a.x);
  const int count = 2 * chunks;
  auto store = [&](int i, float4 v) {
    if (a.round_x_to_bf16 != 0) {
      v = make_float4(bf16_rounded(v.x), bf16_rounded(v.y), bf16_rounded(v.z), bf16_rounded(v.w));
    }
    staged[(i % 2) * chunks + i / 2] = v;
  };
  float4 first[kRouterPiecesPerThread];
#pragma unroll
  for (int j = 0; j < kRouterPiecesPerThread; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < count) first[j] = __ldg(pieces + i);
  }
#pragma unroll
  for (int j = 0; j < kRouterPiecesPerThread; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < count) store(i, first[j]);
  }
  for (int i = threadIdx.x + kRouterPiecesPerThread * blockDim.x; i < count; i += blockDim.x) {
    store(i, __ldg(pieces + i));
  }
}

__global__ void __cluster_dims__(kRouterClusterBlocks, 1, 1)
    __launch_bounds__(kRouterGemvWarps * 32) fused_router_kernel(FusedRouterArgs a) {
  namespace cg = cooperative_groups;
  __shared__ float cluster_logits[kMaxRouterExperts];
  extern __shared__ float4 staged_x[];  // hidden / 4 pieces
  const cg::cluster_group cluster = cg::this_cluster();
  // Every block of the cluster must have started before another writes its shared memory: the
  // arrival now, the wait only before those writes.
  cluster.barrier_arrive();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rows_per_block = (a.num_experts + kRouterClusterBlocks - 1) / kRouterClusterBlocks;
  const int first_row = static_cast<int>(cluster.block_rank()) * rows_per_block + warp;
  const int end_row = min(first_row - warp + rows_per_block, a.num_experts);
  const int64_t chunks = a.hidden / 8;
  float acc[kRouterRowsPerWarp] = {};
  bool waited = false;
  for (int64_t base = 0; base < chunks; base += 32 * kRouterChunksPerLane) {
    uint4 q[kRouterRowsPerWarp][kRouterChunksPerLane];
#pragma unroll
    for (int i = 0; i < kRouterRowsPerWarp; ++i) {
      const int row = first_row + i * kRouterGemvWarps;
      const uint4* w = static_cast<const uint4*>(a.w) + row * chunks;
#pragma unroll
      for (int j = 0; j < kRouterChunksPerLane; ++j) {
        const int64_t chunk = base + 32 * j + lane;
        q[i][j] =
            row < end_row && chunk < chunks ? load_weights_nc(w + chunk) : make_uint4(0, 0, 0, 0);
      }
    }
    // The weights are constant: their first loads go out before the wait for x.
    if (!waited) {
      pdl_wait_for_predecessors();
      pdl_trigger_dependents();  // after the wait: see router_kernel
      waited = true;
      stage_router_x(a, static_cast<int>(chunks), staged_x);
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < kRouterChunksPerLane; ++j) {
      const int64_t chunk = base + 32 * j + lane;
      if (chunk >= chunks) continue;
      XChunk<8> xc;
      load_staged_chunk<8>(staged_x, static_cast<int>(chunks), static_cast<int>(chunk), xc);
#pragma unroll
      for (int i = 0; i < kRouterRowsPerWarp; ++i) acc[i] += dot_bf16(q[i][j], xc);
    }
  }
  float row_logits[kRouterRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRouterRowsPerWarp; ++i) row_logits[i] = butterfly_sum<32>(acc[i]);
  if (!waited) {
    pdl_wait_for_predecessors();
    pdl_trigger_dependents();
  }
  cluster.barrier_wait();
  float* logits_of_block0 = cluster.map_shared_rank(cluster_logits, 0);
#pragma unroll
  for (int i = 0; i < kRouterRowsPerWarp; ++i) {
    const int row = first_row + i * kRouterGemvWarps;
    if (lane == 0 && row < end_row) {
      a.logits[row] = row_logits[i];
      logits_of_block0[row] = row_logits[i];
    }
  }
  cluster.sync();
  if (cluster.block_rank() == 0 && warp == 0) {
    route_token(cluster_logits, a.num_experts, a.top_k, a.per_expert_scale, a.expert_ids,
                a.weights);
  }
}

// ---- Decode path ----

constexpr int kDecodeWarps = 4;
constexpr int kDecodeRows = 2;  // output rows per warp (gate/up: that many rows of each)
constexpr int kDecodeRowsPerBlock = kDecodeWarps * kDecodeRows;
// Chunks per lane per pass: 96 covers hidden 2816 of 4-bit weights (88 chunks), 192 the 8 down
// rows of inner 704 (176 chunks) in one pass.
constexpr int kGateUpChunksPerLane = 3;
constexpr int kDownChunksPerLane = 6;

// Dynamic shared memory of the decode kernels: one token's staged activations.
size_t decode_gate_up_shared_bytes(const MoeShape& shape) {
  return sizeof(float) * static_cast<size_t>(shape.hidden);
}
size_t decode_down_shared_bytes(const MoeShape& shape, int top_k) {
  return sizeof(float) * static_cast<size_t>(shape.inner) * top_k;
}

struct DecodeGateUpArgs {
  const MoeExpert* experts;
  int num_experts;
  const int32_t* expert_ids;  // [pairs]
  int top_k;
  int64_t inner;
  int64_t chunks_per_row;  // of a gate/up row
  const float* x;
  int64_t x_stride;
  float* activations;  // [pairs, inner]
  // Rows of each pick's down matrix the CUDA-core gate/up blocks prefetch to L2
  // (prefetch_down_share_l2): hidden where the down matrices have the gate/up matrices' format,
  // else 0. Not on tensor cores: there both prefetches (the down share and the rest of the
  // block's own tile) measured slower (moe_bench T=1 NVFP4 20.2 -> 21.3 / 22.6 µs, session 9),
  // while the w4g32 CUDA-core kernels gained (29.5 -> 23.6-25.1 µs: their down blocks do not fit
  // beside gate/up's, so without it down's weights came from DRAM after gate/up).
  int64_t down_rows_to_prefetch;
  // The activations for the tensor-core down kernels (both projections on tensor cores), else
  // nullptr: see ActivationHandoff.
  const float* routing_weights;  // [pairs]
  uint32_t* handoff_words;
  float* handoff_scales;
};

// Four blocks per SM (128 registers, no spills): one token's 704 blocks in 1.3 waves, not 1.8.
// D: how w4g32 nibbles meet the (fp32) activations, NibbleDot::kCentered on the exact-fp32 path.
template <PackedFormat F, NibbleDot D = NibbleDot::kBiased>
__global__ void __launch_bounds__(kDecodeWarps * 32, 4) decode_gate_up_kernel(DecodeGateUpArgs a) {
  constexpr int R = kDecodeRows;
  constexpr int G = kGateUpChunksPerLane;
  constexpr int kElems = kChunkElems<F>;
  // Wait first, trigger after: decode_down_kernel reads the router's output before its own
  // wait, which is safe only because no block here lets it start before the router finished.
  pdl_wait_for_predecessors();
  pdl_trigger_dependents();
  const int pair = blockIdx.x;
  const int expert = a.expert_ids[pair];
  // An invalid pick contributes nothing: decode_down_kernel skips it.
  if (expert < 0 || expert >= a.num_experts) return;
  const MoeMatrix mats[2] = {a.experts[expert].gate, a.experts[expert].up};
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t first_row = (static_cast<int64_t>(blockIdx.y) * kDecodeWarps + warp) * R;
  const float* x = a.x + static_cast<int64_t>(pair / a.top_k) * a.x_stride;
  extern __shared__ float4 staged_x[];
  const int chunks = static_cast<int>(a.chunks_per_row);

  float acc[2][R] = {};
  for (int64_t base = 0; base < a.chunks_per_row; base += 32 * G) {
    uint4 weights[G][2][R];
    uint32_t scale_bits[G][2][R];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = base + 32 * j + lane;
#pragma unroll
      for (int mat = 0; mat < 2; ++mat) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int64_t row = first_row + r;
          if (chunk < a.chunks_per_row && row < a.inner) {
            weights[j][mat][r] = load_weights_nc(static_cast<const uint4*>(mats[mat].weights) +
                                                 row * a.chunks_per_row + chunk);
            scale_bits[j][mat][r] = load_scale_bits<F>(mats[mat], row, chunk);
          } else {
            weights[j][mat][r] = make_uint4(0, 0, 0, 0);
            scale_bits[j][mat][r] = 0;
          }
        }
      }
    }
    // Staged while the first pass's weight loads are in flight.
    if (base == 0) {
      prefetch_down_share_l2<F>(a.experts[expert].down, a.down_rows_to_prefetch);
      stage_activations<kElems>(x, chunks, staged_x);
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = base + 32 * j + lane;
      if (chunk >= a.chunks_per_row) continue;
      XChunk<kElems> xc;
      load_staged_chunk<kElems>(staged_x, chunks, static_cast<int>(chunk), xc);
#pragma unroll
      for (int mat = 0; mat < 2; ++mat) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          acc[mat][r] +=
              dot_chunk_unscaled<F, D>(weights[j][mat][r], scale_bits[j][mat][r], mats[mat], xc);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float gate = apply_global_scale<F>(mats[0], butterfly_sum<32>(acc[0][r]));
    const float up = apply_global_scale<F>(mats[1], butterfly_sum<32>(acc[1][r]));
    const int64_t row = first_row + r;
    if (lane == r && row < a.inner) {
      a.activations[static_cast<int64_t>(pair) * a.inner + row] = gelu_tanh(gate) * up;
    }
  }
}

struct DecodeDownArgs {
  const MoeExpert* experts;
  int num_experts;
  const int32_t* expert_ids;  // [tokens, top_k]
  const float* weights;       // [tokens, top_k]
  int top_k;
  int64_t hidden;
  int64_t chunks_per_row;    // of one expert's down row
  PickDivisor pick_divisor;  // of chunks_per_row
  const float* activations;  // [tokens · top_k, inner]
  int64_t inner;
  float* out;
  int64_t out_stride;
  // The tensor-core gate/up kernels' fp16 activations (ActivationHandoff), else nullptr.
  const uint32_t* handoff_words;
  const float* handoff_scales;
};

// Token `token`'s picks into downs (an invalid pick: MoeMatrix{}, weights == nullptr, skipped) and
// their routing weights, the global scale (F's) of the pick's expert folded in
// (dot_chunk_unscaled's sums lack it), 0 for an invalid pick. Read before the PDL wait: a down grid
// starts only once every gate/up block has passed its own wait, i.e. after the router completed.
template <PackedFormat F>
__device__ __forceinline__ void load_picks(const DecodeDownArgs& a, int token, MoeMatrix* downs,
                                           float* pick_weights) {
  for (int k = threadIdx.x; k < a.top_k; k += blockDim.x) {
    const int64_t pick = static_cast<int64_t>(token) * a.top_k + k;
    const int e = a.expert_ids[pick];
    const bool valid = e >= 0 && e < a.num_experts;
    downs[k] = valid ? a.experts[e].down : MoeMatrix{};
    pick_weights[k] = valid ? apply_global_scale<F>(a.experts[e].down, a.weights[pick]) : 0.0f;
  }
}

// D: as decode_gate_up_kernel's.
template <PackedFormat F, NibbleDot D = NibbleDot::kBiased>
__global__ void __launch_bounds__(kDecodeWarps * 32) decode_down_kernel(DecodeDownArgs a) {
  constexpr int R = kDecodeRows;
  constexpr int G = kDownChunksPerLane;
  constexpr int kElems = kChunkElems<F>;
  __shared__ MoeMatrix downs[kMaxTopK];
  __shared__ float pick_weights[kMaxTopK];
  pdl_trigger_dependents();
  const int token = blockIdx.x;
  // The router's output before the wait; the wait below is for the activations.
  load_picks<F>(a, token, downs, pick_weights);
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t first_row = (static_cast<int64_t>(blockIdx.y) * kDecodeWarps + warp) * R;
  const int64_t total_chunks = a.top_k * a.chunks_per_row;
  const float* activations = a.activations + static_cast<int64_t>(token) * a.top_k * a.inner;
  extern __shared__ float4 staged_activations[];

  float acc[R] = {};
  for (int64_t base = 0; base < total_chunks; base += 32 * G) {
    uint4 weights[G][R];
    uint32_t scale_bits[G][R];
    int pick[G];
    int64_t in_row[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = base + 32 * j + lane;
      pick[j] = chunk < total_chunks ? a.pick_divisor.divide(static_cast<int>(chunk)) : 0;
      in_row[j] = chunk - pick[j] * a.chunks_per_row;
      const bool live = chunk < total_chunks && downs[pick[j]].weights != nullptr;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = first_row + r;
        if (live && row < a.hidden) {
          weights[j][r] = load_weights_nc(static_cast<const uint4*>(downs[pick[j]].weights) +
                                          row * a.chunks_per_row + in_row[j]);
          scale_bits[j][r] = load_scale_bits<F>(downs[pick[j]], row, in_row[j]);
        } else {
          weights[j][r] = make_uint4(0, 0, 0, 0);
          scale_bits[j][r] = 0;
        }
      }
    }
    // Every thread passes here on the first pass (total_chunks > 0), before any activation read.
    if (base == 0) {
      pdl_wait_for_predecessors();
      stage_activations<kElems>(activations, static_cast<int>(total_chunks), staged_activations);
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = base + 32 * j + lane;
      if (chunk >= total_chunks || downs[pick[j]].weights == nullptr) continue;
      XChunk<kElems> xc;
      // Chunk `chunk` of the token's activations is chunk in_row of pick's row (inner is a
      // whole number of chunks).
      load_staged_chunk<kElems>(staged_activations, static_cast<int>(total_chunks),
                                static_cast<int>(chunk), xc);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[r] += pick_weights[pick[j]] *
                  dot_chunk_unscaled<F, D>(weights[j][r], scale_bits[j][r], downs[pick[j]], xc);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float sum = butterfly_sum<32>(acc[r]);
    const int64_t row = first_row + r;
    if (lane == r && row < a.hidden) a.out[token * a.out_stride + row] = sum;
  }
}

// ---- Decode path on tensor cores (NVFP4, MoePath::kDecodeTensorCores) ----
//
// The same two launches as above, for NVFP4 experts outside exact-fp32 mode: the CUDA-core
// kernels spend ~4 instructions per weight (decode, fp16 → fp32, FMA); here a weight costs its
// decode only, and mma.sync m16n8k16 (fp16 inputs, fp32 accumulation) does the products, 16 weight
// rows against the activations.
// Fragment order (PTX ISA, m16n8k16): lane (g = lane / 4, t = lane % 4) holds the A elements of
// rows g and g + 8 at k slots {2t, 2t + 1} and {2t + 8, 2t + 9}, the B elements of column g at
// the same slots, and the results of rows g and g + 8 in columns 2t and 2t + 1. The sum over k
// does not care which K element sits in which slot as long as A and B agree, so in round r lane
// t takes whole chunk 4r + t of its two rows (one 16-byte load each): step j of the chunk's eight
// feeds slots {2t, 2t + 1} with the nibble pair (s, s + 4) of word j / 2, s = 2 (j % 2), and
// slots {2t + 8, 2t + 9} with s + 1 (the pairs one mask of word >> 4s extracts, device_math.cuh's
// dot_nvfp4). Every pair lies in one 16-element block; "Block scales on the accumulators" below
// says which B column takes which block and where the e4m3 block scales enter.
// Weights: e2m1 · 2^-14 (nvfp4_decode.cuh's exact fp16 bits, code 1 an fp16 subnormal).
// Activations (gate/up): the row scaled by 2^p, p from its largest magnitude so that it stays below
// 2^15, rounded to fp16 (2^-11 relative: finer than the bf16 the engine's default mode rounds to)
// and staged in shared memory in the same pair order; the fp32 sums are scaled back by 2^(14 − p)
// and NVFP4's global scale. Down takes them from gate/up already in that form (ActivationHandoff).

// 8-row tiles per gate/up block, each on its own warps: the block stages x once for
// all of them (staging took ~20 % of a 2-warp block's instructions; ncu, session 9: the T=1 kernels
// are bound by their warps' instruction chains, 6.5 cycles an instruction at ~2.7 warps per
// scheduler, not by DRAM). moe_bench NVFP4 decode-tc PDL µs per layer, tiles 1 / 2 / 4: T=1 19.90 /
// 19.44 / 19.39, T=4 56.71 / 53.64 / 58.20, T=8 99.94 / 94.86 / 101.64 (session 9).
constexpr int kMmaGateUpTiles = 2;
// Gate/up warps split one tile's K (rounds) between them. 2, not 4 (11 rounds each): with 4, one
// token's tiles did not fit the SMs in one wave at ~124 registers (moe_bench T=1 experts 20.73 ->
// 20.10 µs per layer, session 8, blocks of one tile); 4 at 80 registers (3 blocks of 8 warps an
// SM, spilling) measured slower too (T=1 18.88 -> 19.58, T=8 85.11 -> 99.97, session 10).
constexpr int kMmaGateUpWarps = 2;
constexpr int kMmaGateUpBlockWarps = kMmaGateUpWarps * kMmaGateUpTiles;
// Down blocks of 4 warps (11 rounds each at 26B-A4B shapes), not 8: blocks of 128 threads fit
// beside the gate/up blocks, so more of them start and load their weights under PDL early
// (moe_bench NVFP4 decode-tc PDL µs per layer, 8 / 12 / 4 warps: T=1 18.88 / 18.72 / 18.82, T=8
// 85.11 / 84.55 / 82.36, session 10). The bulk-copy down kernel's 8 warps measured +0.4 % at
// depth 0 and equal at 32K (26B b1, session 11): 4 for both.
constexpr int kMmaDownWarps = 4;
// Bulk-copy down blocks an SM: their ~63 KB of shared memory.
constexpr int kBulkDownBlocksPerSm = 3;
// Rounds whose loads a lane has in flight, refilled by halves (mma_tile): gate/up T=1 18.88 ->
// 18.86, T=8 85.11 -> 83.45 µs against refilling all 6 after the pass (session 10).
constexpr int kMmaRoundsInFlight = 6;
constexpr int kMmaGateUpRows = 8;  // gate rows (and as many up rows) per tile: A rows g, g + 8
constexpr int kMmaDownRows = 16;   // down rows per block
// A gate/up block's outputs are one 16-element block of the down kernel's K (ActivationHandoff).
static_assert(kMmaGateUpTiles * kMmaGateUpRows == 16);

// The staged activations: kStagedWordsPerChunk words per chunk, then one chunk of zeros (B for
// the columns a lane does not feed and for chunks past the row).
__host__ __device__ constexpr size_t mma_staged_bytes(int64_t chunks) {
  return sizeof(uint32_t) * static_cast<size_t>(chunks + 1) * kStagedWordsPerChunk;
}

// Pieces of 8 activations a thread keeps in registers between the two staging passes (the rest is
// read again): 4 cover hidden 4096 over 128 threads.
constexpr int kCachedPieces = 4;

// Stages `chunks` chunks of fp32 activations (chunk c at source + 32c, times 2^p) as fp16 pairs in
// mma order, and the zero chunk after them; p (block_staging_scale) to the caller.
__device__ __forceinline__ void stage_mma_activations(const float* source, int chunks,
                                                      uint32_t* staged, float* scratch, int& p) {
  // Pieces of 8 elements: piece (c, i) = elements 32c + 8i .. + 7 → words 16c + 4i .. + 3.
  const int pieces = 4 * chunks;
  auto load_piece = [&](int piece, float4& lo, float4& hi) {
    const float4* src = reinterpret_cast<const float4*>(source + 8 * static_cast<int64_t>(piece));
    lo = __ldg(src);
    hi = __ldg(src + 1);
  };
  auto largest_of = [](float4 v) {
    return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
  };
  float4 cached[kCachedPieces][2];
  float largest = 0.0f;
#pragma unroll
  for (int j = 0; j < kCachedPieces; ++j) {
    const int piece = static_cast<int>(threadIdx.x + j * blockDim.x);
    if (piece < pieces) {
      load_piece(piece, cached[j][0], cached[j][1]);
      largest = fmaxf(largest, fmaxf(largest_of(cached[j][0]), largest_of(cached[j][1])));
    }
  }
  for (int piece = static_cast<int>(threadIdx.x + kCachedPieces * blockDim.x); piece < pieces;
       piece += blockDim.x) {
    float4 lo, hi;
    load_piece(piece, lo, hi);
    largest = fmaxf(largest, fmaxf(largest_of(lo), largest_of(hi)));
  }
  const float scale = block_staging_scale(largest, scratch, p);
  // Pairs (v0, v4), (v1, v5), (v2, v6), (v3, v7): nibble pairs (s, s + 4) of the word.
  auto store_piece = [&](int piece, float4 lo, float4 hi) {
    auto pair = [scale](float a, float b) {
      const __half2 h = __floats2half2_rn(a * scale, b * scale);
      return *reinterpret_cast<const uint32_t*>(&h);
    };
    reinterpret_cast<uint4*>(staged)[piece] =
        make_uint4(pair(lo.x, hi.x), pair(lo.y, hi.y), pair(lo.z, hi.z), pair(lo.w, hi.w));
  };
#pragma unroll
  for (int j = 0; j < kCachedPieces; ++j) {
    const int piece = static_cast<int>(threadIdx.x + j * blockDim.x);
    if (piece < pieces) store_piece(piece, cached[j][0], cached[j][1]);
  }
  for (int piece = static_cast<int>(threadIdx.x + kCachedPieces * blockDim.x); piece < pieces;
       piece += blockDim.x) {
    float4 lo, hi;
    load_piece(piece, lo, hi);
    store_piece(piece, lo, hi);
  }
  if (threadIdx.x < kStagedWordsPerChunk) staged[kStagedWordsPerChunk * chunks + threadIdx.x] = 0;
}

// A lane's share of one tile's K: rounds [begin, end) of ⌈chunks / 4⌉, split evenly by warp.
struct RoundRange {
  int begin;
  int end;
};
__device__ __forceinline__ RoundRange warp_rounds(int64_t chunks, int warps, int warp) {
  const int rounds = static_cast<int>((chunks + 3) / 4);
  const int per_warp = (rounds + warps - 1) / warps;
  const int begin = min(warp * per_warp, rounds);
  return {begin, min(begin + per_warp, rounds)};
}

// Block scales on the accumulators (both kernels below): moe_decode.cuh's mma_round multiplies
// every weight pair by its block scale (4 HMUL2 per 8 weights, ~20 % of a round's instructions).
// Here the 8 columns of B tell a round's blocks apart instead: column 2t + b holds the staged
// activations of block b of lane t's chunk (zeros elsewhere), so after a round's 8 products the
// accumulators c[0], c[1] (c[2], c[3]) of lane (g, t) are row g's (g + 8's) unscaled sums over
// blocks 0 and 1 of the lane's own chunk: each is multiplied by its e4m3 scale in fp32 and added
// to the lane's running sums. Products stay exact; only the fp32 summation order differs from
// mma_round's. The sums come back by 2^(kBlockColumnShift − p) (p: the staging exponent).
constexpr int kBlockColumnShift = 14;

// sums[0] (row g) and sums[1] (row g + 8) += one round of lane (g, t): `rows` = its chunk of A rows
// g and g + 8 (their block scale bits alongside), x_blocks[b] = the staged words of its chunk
// when g == 2t + b, else a staged chunk of zeros.
// x_scale: the activations' own block scales (ActivationHandoff), multiplied into the weights'.
template <bool kXScales>
__device__ __forceinline__ void mma_round_block_columns(float (&sums)[2], const uint4 (&rows)[2],
                                                        const uint32_t (&scale_bits)[2],
                                                        const uint32_t* const (&x_blocks)[2],
                                                        float2 x_scale) {
  // c[b]: the products of block b's words (B is zero outside columns 2t' + b for them, so only
  // c[b][b] and c[b][2 + b] are nonzero). Two chains of 4 mma, not one of 8: half the latency.
  float c[2][4] = {};
  const uint32_t words[2][4] = {{rows[0].x, rows[0].y, rows[0].z, rows[0].w},
                                {rows[1].x, rows[1].y, rows[1].z, rows[1].w}};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // words 0, 1: block 0; words 2, 3: block 1
    const uint4 x = *reinterpret_cast<const uint4*>(x_blocks[i / 2] + 4 * i);
    const uint32_t b[4] = {x.x, x.y, x.z, x.w};
    uint32_t a[2][4];  // pairs (s, s + 4) of word i of A rows g and g + 8
    e2m1_half2_bits(words[0][i], a[0]);
    e2m1_half2_bits(words[1][i], a[1]);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int s = 2 * half;
      mma_f16(c[i / 2], a[0][s], a[1][s], a[0][s + 1], a[1][s + 1], b[s], b[s + 1]);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const __half2 scales = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(scale_bits[r] & 0xFFFF), __NV_E4M3);
    float2 scale = __half22float2(scales);
    if constexpr (kXScales) scale = make_float2(scale.x * x_scale.x, scale.y * x_scale.y);
    sums[r] = fmaf(c[1][2 * r + 1], scale.y, fmaf(c[0][2 * r], scale.x, sums[r]));
  }
}

// The sum of `v` over the 4 lanes of a quad (the t of one g), the same bits in each.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  return v + __shfl_xor_sync(0xFFFFFFFFu, v, 2);
}

// sums += the lane's rounds of one tile (mma_round_block_columns) against the staged activations
// (`chunks` of them, then the zero chunk; kXScales: with their block scales x_scales, as the
// ActivationHandoff brings them), R rounds of weights in flight: load_rounds(first, slot, count)
// puts rounds first .. first + count − 1 into weights and scale_bits from `slot` on, which hold
// rounds.begin's R on entry. Each half of the slots is refilled with the rounds one pass ahead as
// soon as its products are done: the other half's products then cover the loads' latency.
template <bool kXScales, int R, typename LoadRounds>
__device__ __forceinline__ void mma_tile(float (&sums)[2], const uint4 (&weights)[R][2],
                                         const uint32_t (&scale_bits)[R][2],
                                         const LoadRounds& load_rounds, RoundRange rounds,
                                         const uint32_t* staged, int chunks,
                                         const float2* x_scales = nullptr) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const uint32_t* zeros = staged + kStagedWordsPerChunk * chunks;
  auto product = [&](int slot, int round) {
    const int chunk = 4 * round + t;
    const uint32_t* mine = chunk < chunks ? staged + kStagedWordsPerChunk * chunk : zeros;
    const uint32_t* const x_blocks[2] = {g == 2 * t ? mine : zeros, g == 2 * t + 1 ? mine : zeros};
    mma_round_block_columns<kXScales>(sums, weights[slot], scale_bits[slot], x_blocks,
                                      kXScales ? x_scales[min(chunk, chunks)] : float2{});
  };
  constexpr int kHalves = 2;
  constexpr int H = R / kHalves;
  static_assert(H * kHalves == R);
  for (int first = rounds.begin; first < rounds.end; first += R) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
#pragma unroll
      for (int i = 0; i < H; ++i) {
        if (first + h * H + i >= rounds.end) break;  // warp-uniform
        product(h * H + i, first + h * H + i);
      }
      const int next = first + R + h * H;
      if (next < rounds.end) load_rounds(next, h * H, H);
    }
  }
}

// ActivationHandoff: with both projections on tensor cores, the gate/up kernel writes the
// activations the way the down kernel stages them, so that the down kernel only copies them after
// its PDL wait (stage_mma_activations read a token's fp32 rows, found their largest magnitude
// across the block and converted them: ~150 instructions a thread and two block barriers on the
// critical path). Words: fp16 pairs in stage_mma_activations' order, chunk c of a token's
// concatenated picks at words 16c .. 16c + 15 (its picks are consecutive pairs); each 16-element
// block times its pick's routing weight and down global scale (load_picks' factor) and its own
// 2^q (staging_exponent of the block's largest magnitude: finer than one exponent per token);
// scales[2c + b] = 2^-q (moe_kernels.h's MoeWorkspaceLayout: pairs · inner / 2 words and
// pairs · inner / 16 scales fit the fp32 activations' region, 2.25 bytes an element of its 4).

// One gate/up block's 16 activations (rows `row`, one per thread of lanes 0-15: one block of a
// chunk) into the handoff.
// factor: the pick's routing weight times its down matrix's global scale.
__device__ __forceinline__ void hand_off_activations(const DecodeGateUpArgs& a, int pair,
                                                     float factor, int64_t row, float value) {
  value *= factor;
  float largest = fabsf(value);
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0x0000FFFFu, largest, offset));
  }
  const int q = staging_exponent(largest);
  const int64_t chunk = pair * (a.inner / 32) + row / 32;
  const int e = static_cast<int>(row % 32);
  const int64_t word = kStagedWordsPerChunk * chunk + 4 * (e / 8) + e % 4;
  reinterpret_cast<__half*>(a.handoff_words)[2 * word + (e % 8) / 4] =
      __float2half_rn(value * ldexpf(1.0f, q));
  if (e % 16 == 0) a.handoff_scales[2 * chunk + e / 16] = ldexpf(1.0f, -q);
}

// The end of a gate/up block (both tensor-core gate/up kernels): the lanes' sums (gate row g, up
// row g of the warp's tile) over the tile's warps, gelu_tanh(gate) · up of the block's 16 rows
// handed off (handoff_factor: hand_off_activations') or stored.
__device__ __forceinline__ void finish_gate_up_block(
    const DecodeGateUpArgs& a, int pair, const MoeMatrix (&mats)[2], const float (&sums)[2], int p,
    float handoff_factor, float (&partial)[kMmaGateUpBlockWarps][kMmaGateUpRows][2]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int warp = threadIdx.x >> 5;
  const float gate_sum = quad_sum(sums[0]);
  const float up_sum = quad_sum(sums[1]);
  if (t == 0) {
    partial[warp][g][0] = gate_sum;
    partial[warp][g][1] = up_sum;
  }
  __syncthreads();
  if (threadIdx.x < kMmaGateUpTiles * kMmaGateUpRows) {
    // Thread i: row i % 8 of the block's tile i / 8, summed over that tile's warps.
    const int first_warp = static_cast<int>(threadIdx.x) / kMmaGateUpRows * kMmaGateUpWarps;
    const int r = static_cast<int>(threadIdx.x) % kMmaGateUpRows;
    const int64_t out_row =
        static_cast<int64_t>(blockIdx.y) * kMmaGateUpTiles * kMmaGateUpRows + threadIdx.x;
    float gate = 0.0f, up = 0.0f;
#pragma unroll
    for (int w = first_warp; w < first_warp + kMmaGateUpWarps; ++w) {
      gate += partial[w][r][0];
      up += partial[w][r][1];
    }
    const float back = ldexpf(1.0f, kBlockColumnShift - p);
    gate = apply_global_scale<PackedFormat::kNVFP4>(mats[0], gate * back);
    up = apply_global_scale<PackedFormat::kNVFP4>(mats[1], up * back);
    const float value = gelu_tanh(gate) * up;
    if (a.handoff_words != nullptr) {  // inner is a whole number of chunks: every row is live
      hand_off_activations(a, pair, handoff_factor, out_row, value);
    } else if (out_row < a.inner) {
      a.activations[static_cast<int64_t>(pair) * a.inner + out_row] = value;
    }
  }
}

// Grid (pairs, ⌈inner / (8 · kMmaGateUpTiles)⌉): tile i of block (p, y) computes
// activations[p][8j .. 8j + 7], j = kMmaGateUpTiles · y + i, from gate rows (A rows g) and up rows
// (A rows g + 8), its warps splitting K; a fixed-order sum over the tile's warps.
// 4 blocks per SM: at most 128 registers (no spills; the block-column rounds took 164 unbounded).
__global__ void __launch_bounds__(kMmaGateUpBlockWarps * 32, 4)
    decode_gate_up_mma_kernel(DecodeGateUpArgs a) {
  constexpr int R = kMmaRoundsInFlight;
  __shared__ float partial[kMmaGateUpBlockWarps][kMmaGateUpRows][2];
  __shared__ float scratch[kMmaGateUpBlockWarps];
  extern __shared__ uint4 staged_x_words[];
  uint32_t* staged_x = reinterpret_cast<uint32_t*>(staged_x_words);
  const int pair = blockIdx.x;
  const int chunks = static_cast<int>(a.chunks_per_row);
  const float* x = a.x + static_cast<int64_t>(pair / a.top_k) * a.x_stride;
  // x was made before the router (moe.h's run_experts): staged before the wait, off the critical
  // path (router_kernel says why that is safe).
  int p = 0;
  stage_mma_activations(x, chunks, staged_x, scratch, p);
  __syncthreads();
  // As decode_gate_up_kernel: wait first, trigger after (decode_down_mma_kernel reads the router's
  // output before its own wait).
  pdl_wait_for_predecessors();
  pdl_trigger_dependents();
  const int expert = a.expert_ids[pair];
  if (expert < 0 || expert >= a.num_experts) return;  // the whole block: skipped downstream
  const MoeMatrix mats[2] = {a.experts[expert].gate, a.experts[expert].up};
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int warp = threadIdx.x >> 5;
  const int64_t tile = static_cast<int64_t>(blockIdx.y) * kMmaGateUpTiles + warp / kMmaGateUpWarps;
  const int64_t row = tile * kMmaGateUpRows + g;
  const bool row_live = row < a.inner;
  const RoundRange rounds = warp_rounds(chunks, kMmaGateUpWarps, warp % kMmaGateUpWarps);

  uint4 weights[R][2];
  uint32_t scale_bits[R][2];
  auto load_rounds = [&](int first, int slot, int count) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (i < slot || i >= slot + count) continue;
      const int round = first + i - slot;
      const int chunk = 4 * round + t;
      const bool live = round < rounds.end && chunk < chunks && row_live;
#pragma unroll
      for (int mat = 0; mat < 2; ++mat) {
        weights[i][mat] = live ? load_weights_nc(static_cast<const uint4*>(mats[mat].weights) +
                                                 row * a.chunks_per_row + chunk)
                               : make_uint4(0, 0, 0, 0);
        scale_bits[i][mat] =
            live ? load_scale_bits<PackedFormat::kNVFP4>(mats[mat], row, chunk) : 0u;
      }
    }
  };
  load_rounds(rounds.begin, 0, R);
  float sums[2] = {0.0f, 0.0f};  // gate row g, up row g: this lane's chunks
  mma_tile<false>(sums, weights, scale_bits, load_rounds, rounds, staged_x, chunks);
  const float handoff_factor = a.handoff_words != nullptr
                                   ? apply_global_scale<PackedFormat::kNVFP4>(
                                         a.experts[expert].down, a.routing_weights[pair])
                                   : 0.0f;
  finish_gate_up_block(a, pair, mats, sums, p, handoff_factor, partial);
}

// Grid (pairs, ⌈inner / (8 · kMmaGateUpTiles)⌉): tile i of block (p, y) computes
// activations[p][8j .. 8j + 7], j = kMmaGateUpTiles · y + i, from gate rows (A rows g) and up rows
// (A rows g + 8), its warps splitting K; a fixed-order sum over the tile's warps. The block's 32
// weight rows (16 gate, 16 up) and their scales come to shared memory by bulk copies, all in
// flight as soon as the expert is known: one DRAM round trip, where loads into registers (6 rounds
// in flight, at 128 registers) took two or three (26B b1, with the bulk down kernel: 470.3 ->
// 494.4 tok/s at depth 0, 398.3 -> 412.0 at 32K, session 11; moe_bench alone, without the dense
// branch beside it, does not show it: T=1 18.48 -> 18.99 µs). For inner a multiple of 16 and
// chunks_per_row of 8 (launch_decode checks). Rows at bulk_row_pitch bytes: 16 words past a
// multiple of 32 banks, so the two rows g, g + 1 of a quarter warp's LDS.128 take different banks.
constexpr int kBulkRows = kMmaGateUpTiles * kMmaGateUpRows;  // per matrix
__host__ __device__ constexpr int64_t bulk_row_pitch(int64_t chunks) {
  return (16 * chunks + 127) / 128 * 128 + 64;
}
size_t bulk_gate_up_shared_bytes(int64_t chunks) {
  return mma_staged_bytes(chunks) +
         static_cast<size_t>(2 * kBulkRows) * (bulk_row_pitch(chunks) + 2 * chunks);
}

__global__ void __launch_bounds__(kMmaGateUpBlockWarps * 32, 3)
    decode_gate_up_bulk_kernel(DecodeGateUpArgs a) {
  __shared__ float partial[kMmaGateUpBlockWarps][kMmaGateUpRows][2];
  __shared__ float scratch[kMmaGateUpBlockWarps];
  __shared__ uint64_t barrier;
  extern __shared__ uint4 shared_words[];
  const int pair = blockIdx.x;
  const int chunks = static_cast<int>(a.chunks_per_row);
  const int64_t pitch = bulk_row_pitch(chunks);
  uint32_t* staged_x = reinterpret_cast<uint32_t*>(shared_words);
  uint8_t* rows_smem = reinterpret_cast<uint8_t*>(shared_words) + mma_staged_bytes(chunks);
  uint16_t* scales_smem = reinterpret_cast<uint16_t*>(rows_smem + 2 * kBulkRows * pitch);
  const float* x = a.x + static_cast<int64_t>(pair / a.top_k) * a.x_stride;
  if (threadIdx.x == 0) {
    init_barrier(&barrier);
    fence_barrier_init();
  }
  int p = 0;
  // x was made before the router (moe.h's run_experts): staged before the wait, off the critical
  // path (router_kernel says why that is safe).
  stage_mma_activations(x, chunks, staged_x, scratch, p);
  __syncthreads();
  pdl_wait_for_predecessors();
  pdl_trigger_dependents();
  const int expert = a.expert_ids[pair];
  if (expert < 0 || expert >= a.num_experts) return;  // the whole block: skipped downstream
  const MoeMatrix mats[2] = {a.experts[expert].gate, a.experts[expert].up};
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * kBulkRows;
  const uint32_t row_bytes = 16u * static_cast<uint32_t>(chunks);
  const uint32_t scale_row_bytes = 2u * static_cast<uint32_t>(chunks);
  // Scales by bulk copies when both matrices' lie 16-byte aligned, else loaded by the threads.
  const bool bulk_scales =
      ((reinterpret_cast<uintptr_t>(mats[0].scales) | reinterpret_cast<uintptr_t>(mats[1].scales)) &
       15) == 0;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    // Lane i: row i % 16 of matrix i / 16.
    if (lane == 0) {
      arrive_expect_bytes(&barrier,
                          2 * kBulkRows * (row_bytes + (bulk_scales ? scale_row_bytes : 0u)));
    }
    __syncwarp();
    // Selected, not indexed: an indexed mats[] would live in local memory.
    const bool gate = lane < kBulkRows;
    const auto* weights = static_cast<const uint8_t*>(gate ? mats[0].weights : mats[1].weights);
    const auto* scales = static_cast<const uint8_t*>(gate ? mats[0].scales : mats[1].scales);
    const int64_t row = first_row + lane % kBulkRows;
    copy_bulk(rows_smem + lane * pitch, weights + row * static_cast<int64_t>(row_bytes), row_bytes,
              &barrier);
    if (bulk_scales) {
      copy_bulk(scales_smem + lane * chunks, scales + row * static_cast<int64_t>(scale_row_bytes),
                scale_row_bytes, &barrier);
    }
  }
  if (!bulk_scales) {
    for (int i = threadIdx.x; i < 2 * kBulkRows * chunks; i += blockDim.x) {
      const int r = i / chunks;
      const auto* scales =
          static_cast<const uint16_t*>(r < kBulkRows ? mats[0].scales : mats[1].scales);
      scales_smem[i] = __ldg(scales + (first_row + r % kBulkRows) * chunks + i % chunks);
    }
  }
  float handoff_factor = 0.0f;
  if (a.handoff_words != nullptr) {
    handoff_factor =
        apply_global_scale<PackedFormat::kNVFP4>(a.experts[expert].down, a.routing_weights[pair]);
  }
  wait_barrier(&barrier, 0);
  __syncthreads();

  const int g = lane >> 2;
  const int t = lane & 3;
  const int warp = threadIdx.x >> 5;
  const int local_row = (warp / kMmaGateUpWarps) * kMmaGateUpRows + g;
  const RoundRange rounds = warp_rounds(chunks, kMmaGateUpWarps, warp % kMmaGateUpWarps);
  const uint8_t* gate_row = rows_smem + local_row * pitch;
  const uint8_t* up_row = rows_smem + (kBulkRows + local_row) * pitch;
  const uint16_t* gate_scales = scales_smem + local_row * chunks;
  const uint16_t* up_scales = scales_smem + (kBulkRows + local_row) * chunks;
  const uint32_t* zeros = staged_x + kStagedWordsPerChunk * chunks;
  float sums[2] = {0.0f, 0.0f};
#pragma unroll 2
  for (int round = rounds.begin; round < rounds.end; ++round) {
    const int chunk = 4 * round + t;
    const bool live = chunk < chunks;
    const uint4 rows[2] = {
        live ? *reinterpret_cast<const uint4*>(gate_row + 16 * chunk) : make_uint4(0, 0, 0, 0),
        live ? *reinterpret_cast<const uint4*>(up_row + 16 * chunk) : make_uint4(0, 0, 0, 0)};
    const uint32_t scale_bits[2] = {live ? uint32_t{gate_scales[chunk]} : 0u,
                                    live ? uint32_t{up_scales[chunk]} : 0u};
    const uint32_t* mine = live ? staged_x + kStagedWordsPerChunk * chunk : zeros;
    const uint32_t* const x_blocks[2] = {g == 2 * t ? mine : zeros, g == 2 * t + 1 ? mine : zeros};
    mma_round_block_columns<false>(sums, rows, scale_bits, x_blocks, float2{});
  }
  finish_gate_up_block(a, pair, mats, sums, p, handoff_factor, partial);
}

// The token's handoff (ActivationHandoff: `chunks` chunks) into the staged words and x_scales, by
// cp.async, zeros for invalid picks (their gate/up blocks wrote nothing); then the zero chunk.
__device__ __forceinline__ void copy_handoff(const DecodeDownArgs& a, int token, int chunks,
                                             const MoeMatrix* downs, uint32_t* staged,
                                             float2* x_scales) {
  const int64_t first = static_cast<int64_t>(token) * chunks;
  const uint4* words = reinterpret_cast<const uint4*>(a.handoff_words) + 4 * first;
  const float2* scales = reinterpret_cast<const float2*>(a.handoff_scales) + first;
  for (int i = threadIdx.x; i < 4 * chunks; i += blockDim.x) {
    const bool valid = downs[a.pick_divisor.divide(i / 4)].weights != nullptr;
    copy_async16_or_zeros(reinterpret_cast<uint4*>(staged) + i, words + i, valid);
  }
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    if (downs[a.pick_divisor.divide(c)].weights != nullptr) {
      copy_async8(x_scales + c, scales + c);
    } else {
      x_scales[c] = make_float2(0.0f, 0.0f);
    }
  }
  commit_copies();
  if (threadIdx.x < kStagedWordsPerChunk) staged[kStagedWordsPerChunk * chunks + threadIdx.x] = 0;
  if (threadIdx.x == 0) x_scales[chunks] = make_float2(0.0f, 0.0f);
  wait_copies<0>();
}

// The end of a down block (both tensor-core down kernels): the lanes' sums (rows g, g + 8) over the
// block's warps, in fixed order, to out.
__device__ __forceinline__ void finish_down_block(const DecodeDownArgs& a, int token,
                                                  const float (&sums)[2],
                                                  float (&partial)[kMmaDownWarps][kMmaDownRows]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const float row_sum = quad_sum(sums[0]);
  const float row8_sum = quad_sum(sums[1]);
  const int warp = threadIdx.x >> 5;
  if (t == 0) {
    partial[warp][g] = row_sum;
    partial[warp][g + 8] = row8_sum;
  }
  __syncthreads();
  if (threadIdx.x < kMmaDownRows) {
    const int64_t row = static_cast<int64_t>(blockIdx.y) * kMmaDownRows + threadIdx.x;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaDownWarps; ++w) sum += partial[w][threadIdx.x];
    if (row < a.hidden) a.out[token * a.out_stride + row] = sum * ldexpf(1.0f, kBlockColumnShift);
  }
}

// Grid (tokens, ⌈hidden / 16⌉): block (t, y) computes out[t][16y .. 16y + 15], A rows g and g + 8
// of the picks' down matrices over K = the concatenation of the token's top_k activation rows
// (ActivationHandoff: each times its pick's routing weight and NVFP4 global scale); its warps
// split K. 4 blocks per SM: at most 128 registers.
__global__ void __launch_bounds__(kMmaDownWarps * 32, 4) decode_down_mma_kernel(DecodeDownArgs a) {
  constexpr int R = kMmaRoundsInFlight;
  __shared__ MoeMatrix downs[kMaxTopK];
  __shared__ float pick_weights[kMaxTopK];
  __shared__ float partial[kMmaDownWarps][kMmaDownRows];
  extern __shared__ uint4 staged_words[];
  uint32_t* staged = reinterpret_cast<uint32_t*>(staged_words);
  pdl_trigger_dependents();
  const int token = blockIdx.x;
  load_picks<PackedFormat::kNVFP4>(a, token, downs, pick_weights);  // before the wait
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kMmaDownRows + g;
  const int per_pick = static_cast<int>(a.chunks_per_row);
  const int chunks = a.top_k * per_pick;
  const RoundRange rounds = warp_rounds(chunks, kMmaDownWarps, static_cast<int>(threadIdx.x >> 5));

  uint4 weights[R][2];
  uint32_t scale_bits[R][2];
  auto load_rounds = [&](int first, int slot, int count) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (i < slot || i >= slot + count) continue;
      const int round = first + i - slot;
      const int chunk = 4 * round + t;
      const bool in_k = round < rounds.end && chunk < chunks;
      const int pick = in_k ? a.pick_divisor.divide(chunk) : 0;
      const int in_row = chunk - pick * per_pick;
      const bool live = in_k && downs[pick].weights != nullptr;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = row0 + 8 * half;
        const bool load = live && row < a.hidden;
        weights[i][half] = load ? load_weights_nc(static_cast<const uint4*>(downs[pick].weights) +
                                                  row * a.chunks_per_row + in_row)
                                : make_uint4(0, 0, 0, 0);
        scale_bits[i][half] =
            load ? load_scale_bits<PackedFormat::kNVFP4>(downs[pick], row, in_row) : 0u;
      }
    }
  };
  // The weights depend on the router only: in flight before the wait for the activations.
  load_rounds(rounds.begin, 0, R);
  pdl_wait_for_predecessors();
  float2* x_scales = reinterpret_cast<float2*>(staged + kStagedWordsPerChunk * (chunks + 1));
  copy_handoff(a, token, chunks, downs, staged, x_scales);
  __syncthreads();
  float sums[2] = {0.0f, 0.0f};  // rows g, g + 8: this lane's chunks
  mma_tile<true>(sums, weights, scale_bits, load_rounds, rounds, staged, chunks, x_scales);
  finish_down_block(a, token, sums, partial);
}

// Grid (tokens, ⌈hidden / 16⌉): block (t, y) computes out[t][16y .. 16y + 15], A rows g and g + 8
// of the picks' down matrices over K = the concatenation of the token's top_k activation rows
// (ActivationHandoff: each times its pick's routing weight and NVFP4 global scale); its warps
// split K. The block's 16 rows of each pick's down matrix are contiguous: one bulk copy per pick
// (and one for its scales) into shared memory, all issued before the PDL wait (they depend on the
// router only), the rounds then reading shared memory. For hidden a multiple of 16.
__host__ __device__ constexpr size_t bulk_down_x_bytes(int64_t chunks) {
  return (mma_staged_bytes(chunks) + sizeof(float2) * (chunks + 1) + 15) / 16 * 16;
}
size_t bulk_down_shared_bytes(int64_t chunks) {
  return bulk_down_x_bytes(chunks) + static_cast<size_t>(kMmaDownRows) * chunks * (16 + 2);
}

__global__ void __launch_bounds__(kMmaDownWarps * 32, kBulkDownBlocksPerSm)
    decode_down_bulk_kernel(DecodeDownArgs a) {
  __shared__ MoeMatrix downs[kMaxTopK];
  __shared__ float pick_weights[kMaxTopK];
  __shared__ float partial[kMmaDownWarps][kMmaDownRows];
  __shared__ uint64_t barrier;
  extern __shared__ uint4 shared_words[];
  pdl_trigger_dependents();
  const int token = blockIdx.x;
  const int per_pick = static_cast<int>(a.chunks_per_row);
  const int chunks = a.top_k * per_pick;
  uint32_t* staged = reinterpret_cast<uint32_t*>(shared_words);
  float2* x_scales = reinterpret_cast<float2*>(staged + kStagedWordsPerChunk * (chunks + 1));
  uint8_t* rows_smem = reinterpret_cast<uint8_t*>(shared_words) + bulk_down_x_bytes(chunks);
  uint16_t* scales_smem = reinterpret_cast<uint16_t*>(rows_smem + kMmaDownRows * 16 * chunks);
  load_picks<PackedFormat::kNVFP4>(a, token, downs, pick_weights);  // before the wait
  if (threadIdx.x == 0) {
    init_barrier(&barrier);
    fence_barrier_init();
  }
  __syncthreads();
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * kMmaDownRows;
  const uint32_t pick_bytes = kMmaDownRows * 16u * static_cast<uint32_t>(per_pick);
  const uint32_t pick_scale_bytes = kMmaDownRows * 2u * static_cast<uint32_t>(per_pick);
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    // Lane k: pick k's rows (weights, and its scales where they lie 16-byte aligned).
    const bool valid = lane < a.top_k && downs[lane].weights != nullptr;
    const bool bulk_scales = valid && (reinterpret_cast<uintptr_t>(downs[lane].scales) & 15) == 0;
    const uint32_t bytes = valid ? pick_bytes + (bulk_scales ? pick_scale_bytes : 0u) : 0u;
    const uint32_t total = __reduce_add_sync(0xFFFFFFFFu, bytes);
    if (lane == 0) arrive_expect_bytes(&barrier, total);
    __syncwarp();
    if (valid) {
      copy_bulk(rows_smem + lane * pick_bytes,
                static_cast<const uint8_t*>(downs[lane].weights) +
                    first_row * 16 * static_cast<int64_t>(per_pick),
                pick_bytes, &barrier);
    }
    if (bulk_scales) {
      copy_bulk(scales_smem + lane * kMmaDownRows * per_pick,
                static_cast<const uint8_t*>(downs[lane].scales) +
                    first_row * 2 * static_cast<int64_t>(per_pick),
                pick_scale_bytes, &barrier);
    }
  }
  // Scales the copies do not bring: loaded (misaligned), or zeros (invalid picks: their zero
  // activations must not meet NaN scale bits).
  for (int i = threadIdx.x; i < kMmaDownRows * chunks; i += blockDim.x) {
    const int pick = i / (kMmaDownRows * per_pick);
    const MoeMatrix& m = downs[pick];
    if (m.weights == nullptr) {
      scales_smem[i] = 0;
    } else if ((reinterpret_cast<uintptr_t>(m.scales) & 15) != 0) {
      const int in_pick = i - pick * kMmaDownRows * per_pick;
      scales_smem[i] =
          __ldg(static_cast<const uint16_t*>(m.scales) + first_row * per_pick + in_pick);
    }
  }
  pdl_wait_for_predecessors();
  copy_handoff(a, token, chunks, downs, staged, x_scales);
  wait_barrier(&barrier, 0);
  __syncthreads();

  const int g = lane >> 2;
  const int t = lane & 3;
  const RoundRange rounds = warp_rounds(chunks, kMmaDownWarps, static_cast<int>(threadIdx.x >> 5));
  const uint32_t* zeros = staged + kStagedWordsPerChunk * chunks;
  float sums[2] = {0.0f, 0.0f};  // rows g, g + 8: this lane's chunks
#pragma unroll 2
  for (int round = rounds.begin; round < rounds.end; ++round) {
    const int chunk = 4 * round + t;
    const bool in_k = chunk < chunks;
    const int pick = in_k ? a.pick_divisor.divide(chunk) : 0;
    const int in_row = chunk - pick * per_pick;
    // Row g of pick `pick` in shared memory: [pick][row][chunk].
    const int row_g = (pick * kMmaDownRows + g) * per_pick + in_row;
    const int row_g8 = row_g + 8 * per_pick;
    const uint4* words = reinterpret_cast<const uint4*>(rows_smem);
    const uint4 rows[2] = {in_k ? words[row_g] : make_uint4(0, 0, 0, 0),
                           in_k ? words[row_g8] : make_uint4(0, 0, 0, 0)};
    const uint32_t scale_bits[2] = {in_k ? uint32_t{scales_smem[row_g]} : 0u,
                                    in_k ? uint32_t{scales_smem[row_g8]} : 0u};
    const uint32_t* mine = in_k ? staged + kStagedWordsPerChunk * chunk : zeros;
    const uint32_t* const x_blocks[2] = {g == 2 * t ? mine : zeros, g == 2 * t + 1 ? mine : zeros};
    mma_round_block_columns<true>(sums, rows, scale_bits, x_blocks, x_scales[min(chunk, chunks)]);
  }
  finish_down_block(a, token, sums, partial);
}

int64_t chunk_elements(PackedFormat format) {
  return format == PackedFormat::kBF16 ? 8 : 32;
}

cudaError_t launch_decode(const MoeRunArgs& args, float* activations, float* handoff_scales_region,
                          const Launch& launch) {
  const MoeShape& shape = args.shape;
  // kDecodeTensorCores: NVFP4 projections on the mma kernels, any other on the CUDA-core ones;
  // down on them only after the mma gate/up kernel (it takes the ActivationHandoff). One token
  // takes the bulk-copy kernels where the shape suits them (whole 16-row blocks, gate/up rows of a
  // multiple of 8 chunks, the rows fitting in shared memory: 26B-A4B's); more take the
  // register-loading ones (26B, 8 streams: 1,637.1 tok/s, 1,423.0 on the bulk kernels, session 11:
  // their blocks wait for all of their copies, and 3, not 4, fit an SM).
  const bool mma_gate_up =
      args.path == MoePath::kDecodeTensorCores && shape.gate_up_format == PackedFormat::kNVFP4;
  const bool mma_down = mma_gate_up && shape.down_format == PackedFormat::kNVFP4;
  const bool bulk_gate_up =
      mma_gate_up && args.tokens == 1 && shape.inner % kBulkRows == 0 &&
      (shape.hidden / 32) % 8 == 0 &&
      shared_bytes_fit(decode_gate_up_bulk_kernel, bulk_gate_up_shared_bytes(shape.hidden / 32));
  const bool bulk_down =
      mma_down && args.tokens == 1 && shape.hidden % kMmaDownRows == 0 &&
      shared_bytes_fit(
          decode_down_bulk_kernel,
          bulk_down_shared_bytes(args.top_k * (shape.inner / chunk_elements(shape.down_format))));
  // MoePrecision::kExactF32's path multiplies w4g32 weights by the fp32 activations exactly
  // (NibbleDot::kCentered); the per-pair kernels of kDecodeTensorCores keep the biased products.
  const bool centered_nibbles = args.path == MoePath::kDecode;
  const int pairs = args.tokens * args.top_k;
  uint32_t* handoff_words = mma_down ? reinterpret_cast<uint32_t*>(activations) : nullptr;
  float* handoff_scales = mma_down ? handoff_scales_region : nullptr;
  const DecodeGateUpArgs gate_up = {
      args.experts,    shape.num_experts,
      args.expert_ids, args.top_k,
      shape.inner,     shape.hidden / chunk_elements(shape.gate_up_format),
      args.x,          args.x_stride,
      activations,     !mma_gate_up && shape.down_format == shape.gate_up_format ? shape.hidden : 0,
      args.weights,    handoff_words,
      handoff_scales};
  cudaError_t status;
  if (mma_gate_up) {
    // The bulk and register-loading kernels share the grid: blocks of kBulkRows rows a matrix.
    const auto kernel = bulk_gate_up ? decode_gate_up_bulk_kernel : decode_gate_up_mma_kernel;
    const size_t shared = bulk_gate_up ? bulk_gate_up_shared_bytes(shape.hidden / 32)
                                       : mma_staged_bytes(shape.hidden / 32);
    status = allow_shared_bytes(kernel, shared);
    if (status == cudaSuccess) {
      status =
          launch_kernel(kernel, dim3(static_cast<unsigned>(pairs), blocks(shape.inner, kBulkRows)),
                        dim3(kMmaGateUpBlockWarps * 32), shared, launch, gate_up);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(pairs), blocks(shape.inner, kDecodeRowsPerBlock));
    const size_t shared = decode_gate_up_shared_bytes(shape);
    status = for_format(shape.gate_up_format, [&](auto format) {
      constexpr PackedFormat F = decltype(format)::value;
      auto kernel = decode_gate_up_kernel<F>;
      if constexpr (F == PackedFormat::kW4G32) {
        if (centered_nibbles) kernel = decode_gate_up_kernel<F, NibbleDot::kCentered>;
      }
      const cudaError_t allowed = allow_shared_bytes(kernel, shared);
      if (allowed != cudaSuccess) return allowed;
      return launch_kernel(kernel, grid, dim3(kDecodeWarps * 32), shared, launch, gate_up);
    });
  }
  if (status != cudaSuccess) return status;
  const int64_t down_chunks_per_row = shape.inner / chunk_elements(shape.down_format);
  // PickDivisor's bound: a token's chunks times the chunks of a row below 2^32.
  if (args.top_k * down_chunks_per_row * down_chunks_per_row >= (int64_t{1} << 32)) {
    return cudaErrorInvalidValue;
  }
  const DecodeDownArgs down = {args.experts,
                               shape.num_experts,
                               args.expert_ids,
                               args.weights,
                               args.top_k,
                               shape.hidden,
                               down_chunks_per_row,
                               PickDivisor::of(down_chunks_per_row),
                               activations,
                               shape.inner,
                               args.out,
                               args.out_stride,
                               handoff_words,
                               handoff_scales};
  if (mma_down) {
    const int64_t chunks = args.top_k * down_chunks_per_row;
    const auto kernel = bulk_down ? decode_down_bulk_kernel : decode_down_mma_kernel;
    const size_t shared =
        bulk_down ? bulk_down_shared_bytes(chunks)
                  : mma_staged_bytes(chunks) + sizeof(float2) * (chunks + 1);  // x_scales
    const cudaError_t allowed = allow_shared_bytes(kernel, shared);
    if (allowed != cudaSuccess) return allowed;
    return launch_kernel(
        kernel, dim3(static_cast<unsigned>(args.tokens), blocks(shape.hidden, kMmaDownRows)),
        dim3(kMmaDownWarps * 32), shared, launch, down);
  }
  const dim3 down_grid(static_cast<unsigned>(args.tokens),
                       blocks(shape.hidden, kDecodeRowsPerBlock));
  const size_t down_shared = decode_down_shared_bytes(shape, args.top_k);
  return for_format(shape.down_format, [&](auto format) {
    constexpr PackedFormat F = decltype(format)::value;
    auto kernel = decode_down_kernel<F>;
    if constexpr (F == PackedFormat::kW4G32) {
      if (centered_nibbles) kernel = decode_down_kernel<F, NibbleDot::kCentered>;
    }
    const cudaError_t allowed = allow_shared_bytes(kernel, down_shared);
    if (allowed != cudaSuccess) return allowed;
    return launch_kernel(kernel, down_grid, dim3(kDecodeWarps * 32), down_shared, launch, down);
  });
}

}  // namespace

cudaError_t launch_router(const RouterArgs& args, const Launch& launch) {
  const dim3 grid(blocks(args.tokens, kRouterWarps));
  return launch_kernel(router_kernel, grid, dim3(kRouterWarps * 32), 0, launch, args);
}

cudaError_t launch_fused_router(const FusedRouterArgs& args, const Launch& launch) {
  const size_t shared = sizeof(float) * static_cast<size_t>(args.hidden);  // staged x
  const cudaError_t allowed = allow_shared_bytes(fused_router_kernel, shared);
  if (allowed != cudaSuccess) return allowed;
  return launch_kernel(fused_router_kernel, dim3(kRouterClusterBlocks), dim3(kRouterGemvWarps * 32),
                       shared, launch, args);
}

MoeWorkspaceLayout moe_workspace_layout(const MoeShape& shape, int tokens, int top_k,
                                        MoePath path) {
  if (path == MoePath::kGrouped) return grouped_workspace_layout(shape, tokens, top_k);
  const int pairs = tokens * top_k;
  MoeWorkspaceLayout layout;  // fp32 activations; by expert also fp32 per-pair expert outputs
  layout.activations = 0;
  layout.handoff_scales = align16(sizeof(uint16_t) * pairs * shape.inner);
  layout.expert_outputs = align16(sizeof(float) * pairs * shape.inner);
  layout.bytes =
      layout.expert_outputs +
      (path == MoePath::kDecodeByExpert ? align16(sizeof(float) * pairs * shape.hidden) : 0);
  layout.plan = layout.bytes;
  return layout;
}

cudaError_t launch_moe(const MoeRunArgs& args, const Launch& launch) {
  const MoeWorkspaceLayout layout =
      moe_workspace_layout(args.shape, args.tokens, args.top_k, args.path);
  char* workspace = static_cast<char*>(args.workspace);
  if (args.path == MoePath::kDecodeByExpert) {
    return launch_decode_by_expert(args, reinterpret_cast<float*>(workspace + layout.activations),
                                   reinterpret_cast<float*>(workspace + layout.expert_outputs),
                                   launch);
  }
  if (args.path != MoePath::kGrouped) {
    return launch_decode(args, reinterpret_cast<float*>(workspace + layout.activations),
                         reinterpret_cast<float*>(workspace + layout.handoff_scales), launch);
  }
  return launch_grouped(args, layout, launch);
}

}  // namespace gemma4::cuda
