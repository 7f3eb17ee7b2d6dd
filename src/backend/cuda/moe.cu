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
// Grouped path (run_experts: T >= kMoeGroupedMinTokens), four launches:
//   1. plan_kernel: a device-side stable counting sort of the pairs by expert (ascending id =
//      "slots", each slot's pairs in ascending order) and the list of (slot, 32-pair tile) work
//      items: the same plan on every run.
//   2. grouped_kernel<gate/up>: grid (inner-column tiles, work items); each block stages 128
//      weight rows (64 gate + the same 64 up rows) dequantized to bf16 and its 32 pairs' token
//      rows (bf16) in shared memory, kStepK elements of K at a time (the next step's global loads
//      in flight during this step's WMMA), accumulates in fp32 and stores gelu_tanh(gate) · up as
//      bf16 activations. Each weight is read once per 32 pairs of its expert.
//   3. grouped_kernel<down>: the same over hidden-row tiles, activations → expert_outputs (fp32).
//   4. combine_kernel: out[t] = Σ_k weights[t][k] · expert_outputs[p], summed in ascending expert
//      id (the CPU reference's order): deterministic, no atomics.
// The tensor cores take bf16 inputs (activations and dequantized weights rounded to bf16, NVFP4's
// global scale applied to the fp32 sums), so the grouped path agrees with the CPU reference to
// bf16 precision, the decode path to fp32 rounding. Both are deterministic: no atomics in any
// sum, every launch's work split fixed.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <climits>
#include <cmath>
#include <type_traits>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe_decode.cuh"
#include "backend/cuda/moe_kernels.h"

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

__global__ void __launch_bounds__(kRouterWarps * 32) router_kernel(RouterArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
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
// any product (one memory round trip per pass, not one per row).
constexpr int kRouterClusterBlocks = 8;
constexpr int kRouterGemvWarps = 16;
// 16-byte chunks (8 bf16) per lane per pass: 12 cover hidden 3072 in one pass.
constexpr int kRouterChunksPerLane = 12;
// Rows of one warp: kMaxRouterExperts over the cluster's warps.
constexpr int kRouterRowsPerWarp = kMaxRouterExperts / (kRouterClusterBlocks * kRouterGemvWarps);

__global__ void __cluster_dims__(kRouterClusterBlocks, 1, 1)
    __launch_bounds__(kRouterGemvWarps * 32) fused_router_kernel(FusedRouterArgs a) {
  namespace cg = cooperative_groups;
  __shared__ float cluster_logits[kMaxRouterExperts];
  pdl_trigger_dependents();
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
      waited = true;
    }
#pragma unroll
    for (int j = 0; j < kRouterChunksPerLane; ++j) {
      const int64_t chunk = base + 32 * j + lane;
      if (chunk >= chunks) continue;
      XChunk<8> xc;
      load_x_chunk<ActType::kF32>(a.x, chunk * 8, xc, a.round_x_to_bf16 != 0);
#pragma unroll
      for (int i = 0; i < kRouterRowsPerWarp; ++i) acc[i] += dot_bf16(q[i][j], xc);
    }
  }
  float row_logits[kRouterRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRouterRowsPerWarp; ++i) row_logits[i] = butterfly_sum<32>(acc[i]);
  if (!waited) pdl_wait_for_predecessors();
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
};

// Four blocks per SM (128 registers, no spills): one token's 704 blocks in 1.3 waves, not 1.8.
template <PackedFormat F>
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
              dot_chunk_unscaled<F>(weights[j][mat][r], scale_bits[j][mat][r], mats[mat], xc);
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
  const float* activations;  // [tokens · top_k, inner]
  int64_t inner;
  float* out;
  int64_t out_stride;
};

template <PackedFormat F>
__global__ void __launch_bounds__(kDecodeWarps * 32) decode_down_kernel(DecodeDownArgs a) {
  constexpr int R = kDecodeRows;
  constexpr int G = kDownChunksPerLane;
  constexpr int kElems = kChunkElems<F>;
  // The token's picks (weights == nullptr: an invalid pick, skipped) and routing weights, NVFP4's
  // global scale of the pick's expert folded in (dot_chunk_unscaled's sums lack it).
  __shared__ MoeMatrix downs[kMaxTopK];
  __shared__ float pick_weights[kMaxTopK];
  pdl_trigger_dependents();
  const int token = blockIdx.x;
  // The router's output, read before the wait: this grid starts only once every gate/up block has
  // passed its own wait, i.e. after the router completed. The wait below is for the activations.
  for (int k = threadIdx.x; k < a.top_k; k += blockDim.x) {
    const int64_t pick = static_cast<int64_t>(token) * a.top_k + k;
    const int e = a.expert_ids[pick];
    const bool valid = e >= 0 && e < a.num_experts;
    downs[k] = valid ? a.experts[e].down : MoeMatrix{};
    pick_weights[k] = valid ? apply_global_scale<F>(downs[k], a.weights[pick]) : 0.0f;
  }
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
      // 32-bit division: a token's chunks number far below 2^31.
      pick[j] =
          chunk < total_chunks ? static_cast<int>(chunk) / static_cast<int>(a.chunks_per_row) : 0;
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
                  dot_chunk_unscaled<F>(weights[j][r], scale_bits[j][r], downs[pick[j]], xc);
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
// decode and one fp16 multiply by its block scale, and mma.sync m16n8k16 (fp16 inputs, fp32
// accumulation) does the products, 16 weight rows against the activations in column 0.
// Fragment order (PTX ISA, m16n8k16): lane (g = lane / 4, t = lane % 4) holds the A elements of
// rows g and g + 8 at k slots {2t, 2t + 1} and {2t + 8, 2t + 9}, and the B elements of column g
// at the same slots. The sum over k does not care which K element sits in which slot as long as
// A and B agree, so in round r lane t takes whole chunk 4r + t of its two rows (one 16-byte load
// each): step j of the chunk's eight feeds slots {2t, 2t + 1} with the nibble pair (s, s + 4) of
// word j / 2, s = 2 (j % 2), and slots {2t + 8, 2t + 9} with s + 1 (the pairs one mask of
// word >> 4s extracts, device_math.cuh's dot_nvfp4). Every pair lies in one 16-element block.
// Weights: e2m1 · 2^-14 (the fp16 bits dot_nvfp4 builds) times the e4m3 block scale · 2^7 (at
// most 448 · 2^7, in fp16 range), i.e. e2m1 · scale · 2^-7: exact in fp16 (at most 6 significant
// bits, a multiple of 2^-17) and a normal number unless the block scale is an e4m3 subnormal.
// Activations: the row scaled by 2^p, p from its largest magnitude so that it stays below 2^15,
// rounded to fp16 (2^-11 relative: finer than the bf16 the engine's default mode rounds to) and
// staged in shared memory in the same pair order; the fp32 sums are scaled back by 2^(7 − p) and
// NVFP4's global scale. Lanes of g != 0 feed B column g with zeros (one token per pair).

constexpr int kMmaGateUpWarps = 4;  // split one tile's K (rounds) between them
constexpr int kMmaDownWarps = 8;
constexpr int kMmaRoundsInFlight = 6;  // rounds whose loads a lane issues before any product
constexpr int kMmaGateUpRows = 8;      // gate rows (and as many up rows) per block: A rows g, g + 8
constexpr int kMmaDownRows = 16;       // down rows per block

// The staged activations: kStagedWordsPerChunk words per chunk, then one chunk of zeros (B for
// lanes of g != 0 and for chunks past the row).
size_t mma_staged_bytes(int64_t chunks) {
  return sizeof(uint32_t) * static_cast<size_t>(chunks + 1) * kStagedWordsPerChunk;
}

// Pieces of 8 activations a thread keeps in registers between the two staging passes (the rest is
// read again): 4 cover hidden 4096 over 128 threads and 8 · 704 over 256.
constexpr int kCachedPieces = 4;

// Stages `chunks` chunks of fp32 activations (chunk c at source + 32c, times factor(c) · 2^p) as
// fp16 pairs in mma order, and the zero chunk after them; p (block_staging_scale) to the caller.
// A chunk of factor 0 (an invalid pick: its activations were never written) stages zeros.
template <typename Factor>
__device__ __forceinline__ void stage_mma_activations(const float* source, int chunks,
                                                      Factor factor, uint32_t* staged,
                                                      float* scratch, int& p) {
  // Pieces of 8 elements: piece (c, i) = elements 32c + 8i .. + 7 → words 16c + 4i .. + 3.
  const int pieces = 4 * chunks;
  auto load_piece = [&](int piece, float4& lo, float4& hi) {
    const float f = factor(piece / 4);
    const float4* src = reinterpret_cast<const float4*>(source + 8 * static_cast<int64_t>(piece));
    lo = f != 0.0f ? __ldg(src) : make_float4(0, 0, 0, 0);
    hi = f != 0.0f ? __ldg(src + 1) : make_float4(0, 0, 0, 0);
    return f;
  };
  auto largest_of = [](float4 v, float f) {
    return fmaxf(fmaxf(fabsf(v.x * f), fabsf(v.y * f)), fmaxf(fabsf(v.z * f), fabsf(v.w * f)));
  };
  float4 cached[kCachedPieces][2];
  float largest = 0.0f;
#pragma unroll
  for (int j = 0; j < kCachedPieces; ++j) {
    const int piece = static_cast<int>(threadIdx.x + j * blockDim.x);
    if (piece < pieces) {
      const float f = load_piece(piece, cached[j][0], cached[j][1]);
      largest = fmaxf(largest, fmaxf(largest_of(cached[j][0], f), largest_of(cached[j][1], f)));
    }
  }
  for (int piece = static_cast<int>(threadIdx.x + kCachedPieces * blockDim.x); piece < pieces;
       piece += blockDim.x) {
    float4 lo, hi;
    const float f = load_piece(piece, lo, hi);
    largest = fmaxf(largest, fmaxf(largest_of(lo, f), largest_of(hi, f)));
  }
  const float scale = block_staging_scale(largest, scratch, p);
  // Pairs (v0, v4), (v1, v5), (v2, v6), (v3, v7): nibble pairs (s, s + 4) of the word.
  auto store_piece = [&](int piece, float4 lo, float4 hi) {
    const float f = factor(piece / 4) * scale;
    auto pair = [f](float a, float b) {
      const __half2 h = __floats2half2_rn(a * f, b * f);
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
__device__ __forceinline__ RoundRange warp_rounds(int64_t chunks, int warps) {
  const int rounds = static_cast<int>((chunks + 3) / 4);
  const int per_warp = (rounds + warps - 1) / warps;
  const int begin = min(static_cast<int>(threadIdx.x >> 5) * per_warp, rounds);
  return {begin, min(begin + per_warp, rounds)};
}

// Grid (pairs, ⌈inner / 8⌉): block (p, y) computes activations[p][8y .. 8y + 7] from gate rows
// (A rows g) and up rows (A rows g + 8), its warps splitting K; a fixed-order sum over the warps.
__global__ void __launch_bounds__(kMmaGateUpWarps * 32)
    decode_gate_up_mma_kernel(DecodeGateUpArgs a) {
  constexpr int R = kMmaRoundsInFlight;
  __shared__ float partial[kMmaGateUpWarps][kMmaGateUpRows][2];
  __shared__ float scratch[kMmaGateUpWarps];
  extern __shared__ uint4 staged_x_words[];
  uint32_t* staged_x = reinterpret_cast<uint32_t*>(staged_x_words);
  // As decode_gate_up_kernel: wait first, trigger after (decode_down_mma_kernel reads the router's
  // output before its own wait).
  pdl_wait_for_predecessors();
  pdl_trigger_dependents();
  const int pair = blockIdx.x;
  const int expert = a.expert_ids[pair];
  if (expert < 0 || expert >= a.num_experts) return;  // the whole block: skipped downstream
  const MoeMatrix mats[2] = {a.experts[expert].gate, a.experts[expert].up};
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kMmaGateUpRows + g;
  const bool row_live = row < a.inner;
  const int chunks = static_cast<int>(a.chunks_per_row);
  const RoundRange rounds = warp_rounds(chunks, kMmaGateUpWarps);

  uint4 weights[R][2];
  uint32_t scale_bits[R][2];
  auto load_rounds = [&](int first) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int chunk = 4 * (first + i) + t;
      const bool live = first + i < rounds.end && chunk < chunks && row_live;
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
  load_rounds(rounds.begin);
  int p = 0;
  stage_mma_activations(
      a.x + static_cast<int64_t>(pair / a.top_k) * a.x_stride, chunks, [](int) { return 1.0f; },
      staged_x, scratch, p);
  __syncthreads();
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int first = rounds.begin; first < rounds.end; first += R) {
    if (first != rounds.begin) load_rounds(first);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (first + i >= rounds.end) break;  // warp-uniform
      const int chunk = 4 * (first + i) + t;
      const uint32_t* staged =
          staged_x + kStagedWordsPerChunk * (g == 0 && chunk < chunks ? chunk : chunks);
      mma_round(acc, weights[i], scale_bits[i], staged);
    }
  }
  // Column 0 (lanes t == 0): acc[0] = gate row g, acc[2] = up row g.
  const int warp = threadIdx.x >> 5;
  if (t == 0) {
    partial[warp][g][0] = acc[0];
    partial[warp][g][1] = acc[2];
  }
  __syncthreads();
  if (threadIdx.x < kMmaGateUpRows) {
    const int64_t out_row = static_cast<int64_t>(blockIdx.y) * kMmaGateUpRows + threadIdx.x;
    float gate = 0.0f, up = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaGateUpWarps; ++w) {
      gate += partial[w][threadIdx.x][0];
      up += partial[w][threadIdx.x][1];
    }
    const float back = ldexpf(1.0f, kMmaWeightShift - p);
    gate = apply_global_scale<PackedFormat::kNVFP4>(mats[0], gate * back);
    up = apply_global_scale<PackedFormat::kNVFP4>(mats[1], up * back);
    if (out_row < a.inner) {
      a.activations[static_cast<int64_t>(pair) * a.inner + out_row] = gelu_tanh(gate) * up;
    }
  }
}

// Grid (tokens, ⌈hidden / 16⌉): block (t, y) computes out[t][16y .. 16y + 15], A rows g and g + 8
// of the picks' down matrices over K = the concatenation of the token's top_k activation rows,
// each staged times its pick's routing weight (NVFP4's global scale folded in); its warps split K.
__global__ void __launch_bounds__(kMmaDownWarps * 32) decode_down_mma_kernel(DecodeDownArgs a) {
  constexpr int R = kMmaRoundsInFlight;
  __shared__ MoeMatrix downs[kMaxTopK];
  __shared__ float pick_weights[kMaxTopK];
  __shared__ float partial[kMmaDownWarps][kMmaDownRows];
  __shared__ float scratch[kMmaDownWarps];
  extern __shared__ uint4 staged_words[];
  uint32_t* staged = reinterpret_cast<uint32_t*>(staged_words);
  pdl_trigger_dependents();
  const int token = blockIdx.x;
  // The router's output before the wait, as decode_down_kernel (see there).
  for (int k = threadIdx.x; k < a.top_k; k += blockDim.x) {
    const int64_t pick = static_cast<int64_t>(token) * a.top_k + k;
    const int e = a.expert_ids[pick];
    const bool valid = e >= 0 && e < a.num_experts;
    downs[k] = valid ? a.experts[e].down : MoeMatrix{};
    pick_weights[k] =
        valid ? apply_global_scale<PackedFormat::kNVFP4>(a.experts[e].down, a.weights[pick]) : 0.0f;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kMmaDownRows + g;
  const int per_pick = static_cast<int>(a.chunks_per_row);
  const int chunks = a.top_k * per_pick;
  const RoundRange rounds = warp_rounds(chunks, kMmaDownWarps);

  uint4 weights[R][2];
  uint32_t scale_bits[R][2];
  auto load_rounds = [&](int first) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int chunk = 4 * (first + i) + t;
      const bool in_k = first + i < rounds.end && chunk < chunks;
      const int pick = in_k ? chunk / per_pick : 0;
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
  load_rounds(rounds.begin);
  pdl_wait_for_predecessors();
  int p = 0;
  stage_mma_activations(
      a.activations + static_cast<int64_t>(token) * a.top_k * a.inner, chunks,
      [&](int chunk) { return pick_weights[chunk / per_pick]; }, staged, scratch, p);
  __syncthreads();
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int first = rounds.begin; first < rounds.end; first += R) {
    if (first != rounds.begin) load_rounds(first);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (first + i >= rounds.end) break;  // warp-uniform
      const int chunk = 4 * (first + i) + t;
      const uint32_t* x =
          staged + kStagedWordsPerChunk * (g == 0 && chunk < chunks ? chunk : chunks);
      mma_round(acc, weights[i], scale_bits[i], x);
    }
  }
  const int warp = threadIdx.x >> 5;
  if (t == 0) {
    partial[warp][g] = acc[0];
    partial[warp][g + 8] = acc[2];
  }
  __syncthreads();
  if (threadIdx.x < kMmaDownRows) {
    const int64_t row = static_cast<int64_t>(blockIdx.y) * kMmaDownRows + threadIdx.x;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaDownWarps; ++w) sum += partial[w][threadIdx.x];
    if (row < a.hidden) a.out[token * a.out_stride + row] = sum * ldexpf(1.0f, kMmaWeightShift - p);
  }
}

// ---- Grouped path ----

// Work items of the grouped GEMMs: kTileM pairs of one slot.
constexpr int kTileM = 32;

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
};

// A stable counting sort in one block: warp w owns a contiguous segment of the pairs and visits
// it 32 pairs at a time in order; lanes that picked the same expert find each other with
// __match_any_sync. Each slot lists its pairs in ascending order, so the plan (and every tile's
// content) is the same on every run.
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs a) {
  // counts[w][e]: pairs of warp w's segment that picked expert e; after the prefix over the
  // warps, where warp w's next pair of expert e goes, relative to the expert's first entry.
  __shared__ int counts[kPlanWarps][kMaxRouterExperts];
  __shared__ int totals[kMaxRouterExperts];
  __shared__ int first_entry[kMaxRouterExperts];
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
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

constexpr int kGroupedThreads = 128;  // 4 warps
constexpr int kTileN = 128;           // weight rows staged per block
constexpr int kStepK = 128;           // K elements staged per step
constexpr int kPitch = kStepK + 8;    // shared row pitch in bf16 (16-byte shift between rows)

struct GroupedArgs {
  const MoeExpert* experts;
  int num_experts;
  const int32_t* plan;
  int pairs;
  int top_k;
  int64_t rows;            // output columns: inner (gate/up) or hidden (down)
  int64_t chunks_per_row;  // of a weight row (K = hidden or inner)
  const void* a;  // gate/up: token rows (fp32, a_stride); down: activations (bf16, [pairs, K])
  int64_t a_stride;
  void* y;  // gate/up: activations (bf16, [pairs, inner]); down: expert outputs (fp32)
  int64_t y_stride;
};

// One chunk of weights as bf16, in element order. NVFP4 and bf16 values are exact (e2m1 · e4m3
// has at most 6 significant bits); w4g32's (u − 8) · scale is rounded.
template <PackedFormat F>
__device__ __forceinline__ void dequantize_chunk(const uint4& q, uint32_t scale_bits,
                                                 const MoeMatrix& m, uint4* out) {
  if constexpr (F == PackedFormat::kBF16) {
    out[0] = q;
  } else {
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    float v[32];
    if constexpr (F == PackedFormat::kNVFP4) {
      const float factor[2] = {nvfp4_factor(NoGlobalScale{}, scale_bits),
                               nvfp4_factor(NoGlobalScale{}, scale_bits >> 8)};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          // As dot_nvfp4: elements s and s + 4 of the word as one half2, value · 2^-14.
          const uint32_t t = words[i] >> (4 * s);
          const uint32_t h = ((t << 9) & 0x0E000E00u) | ((t << 12) & 0x80008000u);
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
          v[8 * i + s] = f.x * factor[i / 2];
          v[8 * i + s + 4] = f.y * factor[i / 2];
        }
      }
    } else {
      const float scale = scale_from_bits(m, scale_bits);
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        v[e] =
            static_cast<float>(static_cast<int>((words[e / 8] >> (4 * (e % 8))) & 0xF) - 8) * scale;
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t packed[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 b = __floats2bfloat162_rn(v[8 * i + 2 * j], v[8 * i + 2 * j + 1]);
        packed[j] = *reinterpret_cast<const uint32_t*>(&b);
      }
      out[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
}

// Grouped GEMM over the plan's work items: block (x, i) computes output columns
// x · kColumns ... of work item i's pairs. Gate/up: columns = inner rows of gate and up (64 of
// each), output gelu_tanh(gate) · up; down: 128 hidden rows.
// Four blocks per SM (128 registers; ptxas -v: NVFP4 spills nothing, w4g32's gate/up 20 bytes)
// hide the global latency of each step's loads better than the two that 180 registers allow;
// bf16's 16 loads per thread need the registers of two.
template <PackedFormat F>
constexpr int kGroupedBlocksPerSm = F == PackedFormat::kBF16 ? 2 : 4;

template <PackedFormat F, bool kGateUp>
__global__ void __launch_bounds__(kGroupedThreads, kGroupedBlocksPerSm<F>)
    grouped_kernel(GroupedArgs a) {
  using namespace nvcuda;
  constexpr int kElems = kChunkElems<F>;
  constexpr int kChunksPerRowStep = kStepK / kElems;
  constexpr int kChunksPerThread = kTileN * kChunksPerRowStep / kGroupedThreads;
  constexpr int kColumns = kGateUp ? kTileN / 2 : kTileN;
  constexpr int kAElemsPerThread = kTileM * kStepK / kGroupedThreads;  // 32: one A row quarter
  static_assert(kAElemsPerThread == 32 && kStepK / kAElemsPerThread == 4);
  // The output staging reuses b_tile once the last step is done.
  constexpr int kStagePitch = kColumns + 4;
  static_assert(sizeof(float) * kTileM * kStagePitch <= sizeof(__nv_bfloat16) * kTileN * kPitch);
  __shared__ __align__(32) __nv_bfloat16 a_tile[kTileM][kPitch];
  __shared__ __align__(32) __nv_bfloat16 b_tile[kTileN][kPitch];
  __shared__ int tile_pairs[kTileM];
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
    tile_pairs[threadIdx.x] =
        static_cast<int>(threadIdx.x) < count ? plan.pair(first + threadIdx.x) : -1;
  }
  __syncthreads();

  // What this thread stages per step: chunks of the weight rows, and a quarter of one A row.
  const int a_row = threadIdx.x / 4;
  const int64_t a_k = (threadIdx.x % 4) * kAElemsPerThread;
  const int a_pair = tile_pairs[a_row];
  // The A row's first element (a row past the tile's pairs stages zeros: offset 0, never read).
  const bool a_live = a_pair >= 0;
  const int64_t a_offset = a_live ? (kGateUp ? a_pair / a.top_k : a_pair) * a.a_stride : 0;
  const int64_t k_total = a.chunks_per_row * kElems;
  uint4 weights[kChunksPerThread];
  uint32_t scale_bits[kChunksPerThread];
  float4 a_f32[kGateUp ? 8 : 1];
  uint4 a_bf16[kGateUp ? 1 : 4];

  auto weight_slot = [&](int i, int& row_in_tile, int& chunk_in_step) {
    const int index = i * kGroupedThreads + threadIdx.x;
    row_in_tile = index / kChunksPerRowStep;
    chunk_in_step = index % kChunksPerRowStep;
  };
  auto load_step = [&](int step) {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      int row_in_tile, chunk_in_step;
      weight_slot(i, row_in_tile, chunk_in_step);
      const int mat = kGateUp && row_in_tile >= kColumns ? 1 : 0;
      const int64_t row = column0 + row_in_tile - mat * kColumns;
      const int64_t chunk = static_cast<int64_t>(step) * kChunksPerRowStep + chunk_in_step;
      if (row < a.rows && chunk < a.chunks_per_row) {
        weights[i] = load_weights_nc(static_cast<const uint4*>(mats[mat].weights) +
                                     row * a.chunks_per_row + chunk);
        scale_bits[i] = load_scale_bits<F>(mats[mat], row, chunk);
      } else {
        weights[i] = make_uint4(0, 0, 0, 0);
        scale_bits[i] = 0;
      }
    }
    const int64_t k = static_cast<int64_t>(step) * kStepK + a_k;
    const bool live = a_live && k < k_total;
    if constexpr (kGateUp) {
      const float4* src =
          reinterpret_cast<const float4*>(static_cast<const float*>(a.a) + a_offset + k);
#pragma unroll
      for (int i = 0; i < 8; ++i) a_f32[i] = live ? __ldg(src + i) : make_float4(0, 0, 0, 0);
    } else {
      const uint4* src =
          reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.a) + a_offset + k);
#pragma unroll
      for (int i = 0; i < 4; ++i) a_bf16[i] = live ? __ldg(src + i) : make_uint4(0, 0, 0, 0);
    }
  };
  auto store_step = [&]() {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      int row_in_tile, chunk_in_step;
      weight_slot(i, row_in_tile, chunk_in_step);
      const int mat = kGateUp && row_in_tile >= kColumns ? 1 : 0;
      dequantize_chunk<F>(weights[i], scale_bits[i], mats[mat],
                          reinterpret_cast<uint4*>(&b_tile[row_in_tile][chunk_in_step * kElems]));
    }
    uint4* a_out = reinterpret_cast<uint4*>(&a_tile[a_row][a_k]);
    if constexpr (kGateUp) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 p0 = __floats2bfloat162_rn(a_f32[2 * i].x, a_f32[2 * i].y);
        const __nv_bfloat162 p1 = __floats2bfloat162_rn(a_f32[2 * i].z, a_f32[2 * i].w);
        const __nv_bfloat162 p2 = __floats2bfloat162_rn(a_f32[2 * i + 1].x, a_f32[2 * i + 1].y);
        const __nv_bfloat162 p3 = __floats2bfloat162_rn(a_f32[2 * i + 1].z, a_f32[2 * i + 1].w);
        a_out[i] = make_uint4(
            *reinterpret_cast<const uint32_t*>(&p0), *reinterpret_cast<const uint32_t*>(&p1),
            *reinterpret_cast<const uint32_t*>(&p2), *reinterpret_cast<const uint32_t*>(&p3));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) a_out[i] = a_bf16[i];
    }
  };

  // Warp w: rows 0..31 of the tile (two 16-row fragments) times two 16-column fragments, the
  // gate and up columns 16w.. (gate/up) or columns 32w.. (down).
  const int warp = threadIdx.x >> 5;
  auto b_column = [&](int j) { return kGateUp ? j * kColumns + 16 * warp : 32 * warp + 16 * j; };
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[mi][j], 0.0f);
  }
  const int steps = static_cast<int>((k_total + kStepK - 1) / kStepK);
  load_step(0);
  for (int step = 0; step < steps; ++step) {
    store_step();
    __syncthreads();
    if (step + 1 < steps) load_step(step + 1);  // in flight during this step's products
#pragma unroll
    for (int kk = 0; kk < kStepK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) wmma::load_matrix_sync(fa[mi], &a_tile[16 * mi][kk], kPitch);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &b_tile[b_column(j)][kk], kPitch);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[mi][j], fa[mi], fb[j], acc[mi][j]);
      }
    }
    __syncthreads();
  }

  // Epilogue: the fp32 sums (global scale applied) through shared memory to the pairs' rows.
  float* stage = reinterpret_cast<float*>(&b_tile[0][0]);
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    if constexpr (kGateUp) {
      // Fragments of one type map elements to positions alike: element e of the gate and the up
      // fragment is the same (pair, column).
#pragma unroll
      for (int e = 0; e < acc[mi][0].num_elements; ++e) {
        const float gate = apply_global_scale<F>(mats[0], acc[mi][0].x[e]);
        const float up = apply_global_scale<F>(mats[1], acc[mi][1].x[e]);
        acc[mi][0].x[e] = gelu_tanh(gate) * up;
      }
      wmma::store_matrix_sync(stage + 16 * mi * kStagePitch + 16 * warp, acc[mi][0], kStagePitch,
                              wmma::mem_row_major);
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < acc[mi][j].num_elements; ++e) {
          acc[mi][j].x[e] = apply_global_scale<F>(mats[0], acc[mi][j].x[e]);
        }
        wmma::store_matrix_sync(stage + 16 * mi * kStagePitch + b_column(j), acc[mi][j],
                                kStagePitch, wmma::mem_row_major);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTileM * kColumns; i += kGroupedThreads) {
    const int m = i / kColumns;
    const int column = i % kColumns;
    if (m >= count || column0 + column >= a.rows) continue;
    const int64_t at = static_cast<int64_t>(tile_pairs[m]) * a.y_stride + column0 + column;
    const float value = stage[m * kStagePitch + column];
    if constexpr (kGateUp) {
      static_cast<__nv_bfloat16*>(a.y)[at] = __float2bfloat16_rn(value);
    } else {
      static_cast<float*>(a.y)[at] = value;
    }
  }
}

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

constexpr int kCombineThreads = 256;

// out[t][j] = Σ_k weights[t][k] · expert_outputs[t · top_k + k][j], in ascending (expert id, k).
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t t = blockIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x;
  if (j >= a.hidden) return;
  const int32_t* ids = a.expert_ids + t * a.top_k;
  float sum = 0.0f;
  // Selection order: the next (id, k) above the previous one; invalid ids never qualify.
  int previous_id = -1, previous_k = -1;
  for (int n = 0; n < a.top_k; ++n) {
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
    const int64_t p = t * a.top_k + next_k;
    sum += a.expert_outputs[p * a.hidden + j] * a.weights[p];
    previous_id = next_id;
    previous_k = next_k;
  }
  a.out[t * a.out_stride + j] = sum;
}

// launch_one(std::integral_constant<PackedFormat, F>) for the formats the MoE kernels read
// (check_experts admits no other).
template <typename LaunchOne>
cudaError_t for_format(PackedFormat format, LaunchOne launch_one) {
  switch (format) {
    case PackedFormat::kW4G32:
      return launch_one(std::integral_constant<PackedFormat, PackedFormat::kW4G32>{});
    case PackedFormat::kNVFP4:
      return launch_one(std::integral_constant<PackedFormat, PackedFormat::kNVFP4>{});
    case PackedFormat::kBF16:
      return launch_one(std::integral_constant<PackedFormat, PackedFormat::kBF16>{});
    default:
      return cudaErrorInvalidValue;
  }
}

int64_t chunk_elements(PackedFormat format) {
  return format == PackedFormat::kBF16 ? 8 : 32;
}

size_t align16(size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

cudaError_t launch_decode(const MoeRunArgs& args, float* activations, const Launch& launch) {
  const MoeShape& shape = args.shape;
  // kDecodeTensorCores: NVFP4 projections on the mma kernels, any other on the CUDA-core ones.
  const bool mma_gate_up =
      args.path == MoePath::kDecodeTensorCores && shape.gate_up_format == PackedFormat::kNVFP4;
  const bool mma_down =
      args.path == MoePath::kDecodeTensorCores && shape.down_format == PackedFormat::kNVFP4;
  const int pairs = args.tokens * args.top_k;
  const DecodeGateUpArgs gate_up = {
      args.experts, shape.num_experts, args.expert_ids,
      args.top_k,   shape.inner,       shape.hidden / chunk_elements(shape.gate_up_format),
      args.x,       args.x_stride,     activations};
  cudaError_t status;
  if (mma_gate_up) {
    const size_t shared = mma_staged_bytes(shape.hidden / 32);
    status = allow_shared_bytes(decode_gate_up_mma_kernel, shared);
    if (status == cudaSuccess) {
      status =
          launch_kernel(decode_gate_up_mma_kernel,
                        dim3(static_cast<unsigned>(pairs), blocks(shape.inner, kMmaGateUpRows)),
                        dim3(kMmaGateUpWarps * 32), shared, launch, gate_up);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(pairs), blocks(shape.inner, kDecodeRowsPerBlock));
    const size_t shared = decode_gate_up_shared_bytes(shape);
    status = for_format(shape.gate_up_format, [&](auto format) {
      const auto kernel = decode_gate_up_kernel<decltype(format)::value>;
      const cudaError_t allowed = allow_shared_bytes(kernel, shared);
      if (allowed != cudaSuccess) return allowed;
      return launch_kernel(kernel, grid, dim3(kDecodeWarps * 32), shared, launch, gate_up);
    });
  }
  if (status != cudaSuccess) return status;
  const DecodeDownArgs down = {args.experts,
                               shape.num_experts,
                               args.expert_ids,
                               args.weights,
                               args.top_k,
                               shape.hidden,
                               shape.inner / chunk_elements(shape.down_format),
                               activations,
                               shape.inner,
                               args.out,
                               args.out_stride};
  if (mma_down) {
    const size_t shared = mma_staged_bytes(args.top_k * (shape.inner / 32));
    const cudaError_t allowed = allow_shared_bytes(decode_down_mma_kernel, shared);
    if (allowed != cudaSuccess) return allowed;
    return launch_kernel(
        decode_down_mma_kernel,
        dim3(static_cast<unsigned>(args.tokens), blocks(shape.hidden, kMmaDownRows)),
        dim3(kMmaDownWarps * 32), shared, launch, down);
  }
  const dim3 down_grid(static_cast<unsigned>(args.tokens),
                       blocks(shape.hidden, kDecodeRowsPerBlock));
  const size_t down_shared = decode_down_shared_bytes(shape, args.top_k);
  return for_format(shape.down_format, [&](auto format) {
    const auto kernel = decode_down_kernel<decltype(format)::value>;
    const cudaError_t allowed = allow_shared_bytes(kernel, down_shared);
    if (allowed != cudaSuccess) return allowed;
    return launch_kernel(kernel, down_grid, dim3(kDecodeWarps * 32), down_shared, launch, down);
  });
}

cudaError_t launch_grouped(const MoeRunArgs& args, const MoeWorkspaceLayout& layout,
                           const Launch& launch) {
  const MoeShape& shape = args.shape;
  auto* workspace = static_cast<char*>(args.workspace);
  auto* activations = reinterpret_cast<__nv_bfloat16*>(workspace + layout.activations);
  auto* expert_outputs = reinterpret_cast<float*>(workspace + layout.expert_outputs);
  auto* plan = reinterpret_cast<int32_t*>(workspace + layout.plan);
  const int pairs = args.tokens * args.top_k;
  const PlanArgs plan_args = {args.expert_ids, pairs, shape.num_experts, plan};
  cudaError_t status =
      launch_kernel(plan_kernel, dim3(1), dim3(kPlanThreads), 0, launch, plan_args);
  if (status != cudaSuccess) return status;

  const unsigned items = static_cast<unsigned>(max_items(pairs, shape.num_experts));
  GroupedArgs gate_up = {args.experts,
                         shape.num_experts,
                         plan,
                         pairs,
                         args.top_k,
                         shape.inner,
                         shape.hidden / chunk_elements(shape.gate_up_format),
                         args.x,
                         args.x_stride,
                         activations,
                         shape.inner};
  const dim3 block(kGroupedThreads);
  const dim3 gate_up_grid(blocks(shape.inner, kTileN / 2), items);
  status = for_format(shape.gate_up_format, [&](auto format) {
    return launch_kernel(grouped_kernel<decltype(format)::value, true>, gate_up_grid, block, 0,
                         launch, gate_up);
  });
  if (status != cudaSuccess) return status;
  GroupedArgs down = gate_up;
  down.rows = shape.hidden;
  down.chunks_per_row = shape.inner / chunk_elements(shape.down_format);
  down.a = activations;
  down.a_stride = shape.inner;
  down.y = expert_outputs;
  down.y_stride = shape.hidden;
  const dim3 down_grid(blocks(shape.hidden, kTileN), items);
  status = for_format(shape.down_format, [&](auto format) {
    return launch_kernel(grouped_kernel<decltype(format)::value, false>, down_grid, block, 0,
                         launch, down);
  });
  if (status != cudaSuccess) return status;

  const CombineArgs combine = {args.expert_ids, args.weights, args.top_k, shape.num_experts,
                               expert_outputs,  shape.hidden, args.out,   args.out_stride};
  return launch_kernel(
      combine_kernel,
      dim3(blocks(shape.hidden, kCombineThreads), static_cast<unsigned>(args.tokens)),
      dim3(kCombineThreads), 0, launch, combine);
}

}  // namespace

cudaError_t launch_router(const RouterArgs& args, const Launch& launch) {
  const dim3 grid(blocks(args.tokens, kRouterWarps));
  return launch_kernel(router_kernel, grid, dim3(kRouterWarps * 32), 0, launch, args);
}

cudaError_t launch_fused_router(const FusedRouterArgs& args, const Launch& launch) {
  return launch_kernel(fused_router_kernel, dim3(kRouterClusterBlocks), dim3(kRouterGemvWarps * 32),
                       0, launch, args);
}

MoeWorkspaceLayout moe_workspace_layout(const MoeShape& shape, int tokens, int top_k,
                                        MoePath path) {
  const int pairs = tokens * top_k;
  const bool grouped = path == MoePath::kGrouped;
  const bool pair_outputs = grouped || path == MoePath::kDecodeByExpert;
  MoeWorkspaceLayout layout;
  layout.activations = 0;
  // fp32 activations (decode) or bf16 ones (grouped).
  layout.expert_outputs = align16(sizeof(float) * pairs * shape.inner);
  layout.plan =
      layout.expert_outputs + (pair_outputs ? align16(sizeof(float) * pairs * shape.hidden) : 0);
  layout.bytes =
      layout.plan + (grouped ? align16(sizeof(int32_t) * plan_words(pairs, shape.num_experts)) : 0);
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
    return launch_decode(args, reinterpret_cast<float*>(workspace + layout.activations), launch);
  }
  return launch_grouped(args, layout, launch);
}

}  // namespace gemma4::cuda
