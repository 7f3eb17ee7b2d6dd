// ple_step (ple_step.h): one cluster of kClusterBlocks blocks. Block c owns gate rows
// [c · P/C, (c + 1) · P/C) and projection rows (= hidden columns) [c · H/C, (c + 1) · H/C):
//  1. every block loads its weights (before the PDL wait), then builds v = acc + rms_norm(x) for
//     the whole row (the gate's K; cheap next to the weights) in shared memory, fp32 and bf16;
//  2. its gate rows: gated = gelu_tanh(dot) · multiplier, kept as bf16 in shared memory;
//  3. cluster barrier; every block gathers the whole bf16 gated vector from its peers (DSMEM);
//  4. its projection rows, their sum of squares; cluster barrier; the total from every peer;
//  5. its hidden columns: acc = (v + norm(projected)) · scalar, the sum of squares again across
//     the cluster, next = norm(acc), and the companions of its 32-column chunks.
// Each product rounds as the unfused kernels round it (add_rms_norm_kernel, the GEMV's staging);
// the sums of squares run in another order, so the last bits may differ from them.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ple_step.h"
#include "backend/cuda/q8.cuh"

namespace gemma4::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kClusterBlocks = 8;
constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
// E2B's widths: the only shape compiled (see the static_asserts for what another must satisfy).
constexpr int kHidden = 1536;
constexpr int kPle = 256;

constexpr int kGateChunks = kHidden / 32;                          // 16-byte chunks of a gate row
constexpr int kGateRowsPerBlock = kPle / kClusterBlocks;           // 32
constexpr int kGateRowsPerWarp = kGateRowsPerBlock / kWarps;       // 2: a warp's lanes split K
constexpr int kGateChunksPerLane = (kGateChunks + 31) / 32;        // 2
constexpr int kProjectionChunks = kPle / 32;                       // 8: one per lane of a team
constexpr int kProjectionRowsPerBlock = kHidden / kClusterBlocks;  // 192
constexpr int kProjectionTeams = 32 / kProjectionChunks;           // 4 rows at a time per warp
constexpr int kProjectionRowsPerThread =
    kProjectionRowsPerBlock / (kWarps * kProjectionTeams);  // 3
static_assert(kGateRowsPerWarp * kWarps == kGateRowsPerBlock);
static_assert(32 % kProjectionChunks == 0);
static_assert(kProjectionRowsPerThread * kWarps * kProjectionTeams == kProjectionRowsPerBlock);
// Step 5: one thread per column of the block, whole warps of whole kQ8 chunks.
static_assert(kProjectionRowsPerBlock % 32 == 0 && kProjectionRowsPerBlock <= kThreads);
static_assert(kHidden % 4 == 0 && kHidden / 4 <= kThreads);  // step 1: a float4 per thread
static_assert(kGateRowsPerBlock % 8 == 0);  // whole 16-byte words of bf16 gated values a block

constexpr int kColumnWarps = kProjectionRowsPerBlock / 32;

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  return value;
}

// Σ over the block of one value per thread of warps [0, warps): every thread gets the same total
// (summed in warp order). `scratch`: kWarps floats; the caller syncs before it is reused.
__device__ __forceinline__ float block_sum(float value, int warps, float* scratch) {
  const int warp = threadIdx.x >> 5;
  if (warp < warps) {
    value = warp_sum(value);
    if ((threadIdx.x & 31) == 0) scratch[warp] = value;
  }
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// 32 bf16 activations (four 16-byte words) as the dot's XChunk.
__device__ __forceinline__ XChunk<32> bf16_chunk(const uint4* words) {
  XChunk<32> x;
#pragma unroll
  for (int i = 0; i < 4; ++i) unpack_bf16x8(words[i], x.v + 8 * i);
  finish_x_chunk(x);
  return x;
}

// The cluster total of one float each block put at `slot` in its shared memory (read after a
// cluster barrier), summed in rank order: every block gets the same value.
__device__ __forceinline__ float cluster_total(const cg::cluster_group& cluster, float* slot) {
  float total = 0.0f;
#pragma unroll
  for (int rank = 0; rank < kClusterBlocks; ++rank) total += *cluster.map_shared_rank(slot, rank);
  return total;
}

__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kThreads)
    ple_step_kernel(PleStepArgs a) {
  pdl_trigger_dependents();
  const cg::cluster_group cluster = cg::this_cluster();
  __shared__ __align__(16) float v[kHidden];          // acc + norm(x), fp32 (read as float4)
  __shared__ uint4 v_bf16[kHidden / 8];               // the same rounded, 8 per word
  __shared__ uint4 own_gated[kGateRowsPerBlock / 8];  // this block's gated values, bf16
  __shared__ uint4 gated_bf16[kPle / 8];              // all of them
  __shared__ float projected[kProjectionRowsPerBlock];
  __shared__ float warp_sums[kWarps];
  __shared__ float block_totals[2];  // Σ projected², Σ acc² of this block's columns (peers read)
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rank = static_cast<int>(cluster.block_rank());

  // 1. The weights depend on no predecessor: every load goes out before the wait.
  const int first_gate_row = rank * kGateRowsPerBlock + warp * kGateRowsPerWarp;
  uint4 gate_words[kGateRowsPerWarp][kGateChunksPerLane];
  uint32_t gate_scales[kGateRowsPerWarp][kGateChunksPerLane];
#pragma unroll
  for (int r = 0; r < kGateRowsPerWarp; ++r) {
#pragma unroll
    for (int j = 0; j < kGateChunksPerLane; ++j) {
      const int chunk = lane + 32 * j;
      const int64_t index = int64_t{first_gate_row + r} * kGateChunks + chunk;
      const bool valid = chunk < kGateChunks;
      gate_words[r][j] = valid ? load_weights_nc(static_cast<const uint4*>(a.gate.data) + index)
                               : make_uint4(0, 0, 0, 0);
      gate_scales[r][j] = valid ? load_group_scale_bits(a.gate, index) : 0;
    }
  }
  const int team = lane / kProjectionChunks;
  const int chunk_in_row = lane % kProjectionChunks;
  const int first_local_row = (warp * kProjectionTeams + team) * kProjectionRowsPerThread;
  const int first_column = rank * kProjectionRowsPerBlock;
  uint4 projection_words[kProjectionRowsPerThread];
  uint32_t projection_scales[kProjectionRowsPerThread];
#pragma unroll
  for (int r = 0; r < kProjectionRowsPerThread; ++r) {
    const int64_t index =
        int64_t{first_column + first_local_row + r} * kProjectionChunks + chunk_in_row;
    projection_words[r] = load_weights_nc(static_cast<const uint4*>(a.projection.data) + index);
    projection_scales[r] = load_group_scale_bits(a.projection, index);
  }
  // The norm weights too: the residual step's (a float4 per thread) and, for this block's
  // columns (one per thread of the first warps), the projection's and the next norm's factors.
  const int t = threadIdx.x;
  constexpr int kQuads = kHidden / 4;
  const float weight_offset = a.spec.weight_offset;
  float4 s4 = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
  if (a.step_weight != nullptr && t < kQuads) {
    const float4 w4 = reinterpret_cast<const float4*>(a.step_weight)[t];
    s4 = make_float4(weight_offset + w4.x, weight_offset + w4.y, weight_offset + w4.z,
                     weight_offset + w4.w);
  }
  const bool column_thread = t < kProjectionRowsPerBlock;
  const int column = first_column + t;
  const bool has_next = a.next.data != nullptr;
  float projected_scale = 1.0f, next_scale = 1.0f;
  if (column_thread && a.spec.weight != nullptr)
    projected_scale = weight_offset + a.spec.weight[column];
  if (column_thread && has_next && a.spec.next_weight != nullptr) {
    next_scale = weight_offset + a.spec.next_weight[column];
  }
  pdl_wait_for_predecessors();

  // Everything a predecessor wrote that this block reads goes out at once: x, acc and the
  // multipliers of this warp's gate rows.
  float4 x4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), r4 = x4;
  if (t < kQuads) {
    x4 = reinterpret_cast<const float4*>(a.x.data)[t];
    r4 = reinterpret_cast<const float4*>(a.acc.data)[t];
  }
  float multipliers[kGateRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kGateRowsPerWarp; ++r) multipliers[r] = a.multiplier[first_gate_row + r];

  // v = acc + rms_norm(x; step_weight).
  const float x_total = block_sum(x4.x * x4.x + x4.y * x4.y + x4.z * x4.z + x4.w * x4.w,
                                  (kQuads + 31) / 32, warp_sums);
  const float x_inv = 1.0f / sqrtf(x_total / static_cast<float>(kHidden) + a.spec.eps);
  if (t < kQuads) {
    const float4 v4 = make_float4(r4.x + __fmul_rn(__fmul_rn(x4.x, x_inv), s4.x),
                                  r4.y + __fmul_rn(__fmul_rn(x4.y, x_inv), s4.y),
                                  r4.z + __fmul_rn(__fmul_rn(x4.z, x_inv), s4.z),
                                  r4.w + __fmul_rn(__fmul_rn(x4.w, x_inv), s4.w));
    reinterpret_cast<float4*>(v)[t] = v4;
    reinterpret_cast<uint2*>(v_bf16)[t] =
        make_uint2(pack_bf16x2(v4.x, v4.y), pack_bf16x2(v4.z, v4.w));
  }
  __syncthreads();

  // 2. This block's gate rows: a warp's lanes split K, each row summed across the warp.
  float gate_dots[kGateRowsPerWarp] = {};
#pragma unroll
  for (int j = 0; j < kGateChunksPerLane; ++j) {
    const int chunk = lane + 32 * j;
    if (chunk >= kGateChunks) continue;
    const XChunk<32> xc = bf16_chunk(v_bf16 + 4 * chunk);
#pragma unroll
    for (int r = 0; r < kGateRowsPerWarp; ++r) {
      gate_dots[r] += dot_w4g32(gate_words[r][j], scale_from_bits(a.gate, gate_scales[r][j]), xc);
    }
  }
  auto* own_gated_values = reinterpret_cast<__nv_bfloat16*>(own_gated);
#pragma unroll
  for (int r = 0; r < kGateRowsPerWarp; ++r) {
    const float dot = warp_sum(gate_dots[r]);
    if (lane == 0) {
      const int row = first_gate_row + r;
      const float gated = gelu_tanh(dot) * multipliers[r];
      a.gated[row] = gated;
      own_gated_values[warp * kGateRowsPerWarp + r] = __float2bfloat16_rn(gated);
    }
  }

  // 3. Every block's gated values, once every block has written them.
  cluster.sync();
  constexpr int kWordsPerBlock = kGateRowsPerBlock / 8;
  if (t < kPle / 8) {
    gated_bf16[t] = *cluster.map_shared_rank(own_gated + t % kWordsPerBlock, t / kWordsPerBlock);
  }
  __syncthreads();

  // 4. This block's projection rows: a team of lanes per row, one chunk (32 of K) each.
  const XChunk<32> gated_chunk = bf16_chunk(gated_bf16 + 4 * chunk_in_row);
#pragma unroll
  for (int r = 0; r < kProjectionRowsPerThread; ++r) {
    float dot = dot_w4g32(projection_words[r], scale_from_bits(a.projection, projection_scales[r]),
                          gated_chunk);
#pragma unroll
    for (int offset = kProjectionChunks / 2; offset > 0; offset /= 2)
      dot += __shfl_xor_sync(0xFFFFFFFFu, dot, offset);
    if (chunk_in_row == 0) {
      projected[first_local_row + r] = dot;
      a.projected[first_column + first_local_row + r] = dot;
    }
  }
  __syncthreads();
  const float p = column_thread ? projected[t] : 0.0f;
  const float p_squares = block_sum(p * p, kColumnWarps, warp_sums);
  if (t == 0) block_totals[0] = p_squares;
  cluster.sync();
  const float p_inv =
      1.0f /
      sqrtf(cluster_total(cluster, &block_totals[0]) / static_cast<float>(kHidden) + a.spec.eps);
  // No block may leave while a peer still reads its shared memory: each arrives at the exit
  // barrier after its last read of a peer's (here without a next norm) and waits at the end.
  if (!has_next) cluster.barrier_arrive();

  // 5. This block's columns of acc, then next.
  float updated = 0.0f;
  if (column_thread) {
    updated = __fmul_rn(v[column] + __fmul_rn(__fmul_rn(p, p_inv), projected_scale), a.spec.scalar);
    a.acc.data[column] = updated;
  }
  if (warp < kColumnWarps && !has_next) {
    const float values[1] = {updated};
    store_companions<1>(a.spec.residual_companions, 0, column, values);
  }
  if (has_next) {     // the same in every block: all of them take part in the cluster barrier
    __syncthreads();  // warp_sums reused
    const float acc_squares = block_sum(updated * updated, kColumnWarps, warp_sums);
    if (t == 0) block_totals[1] = acc_squares;
    cluster.sync();
    const float next_inv =
        1.0f /
        sqrtf(cluster_total(cluster, &block_totals[1]) / static_cast<float>(kHidden) + a.spec.eps);
    cluster.barrier_arrive();
    if (warp < kColumnWarps) {
      const float values[1] = {__fmul_rn(__fmul_rn(updated, next_inv), next_scale)};
      a.next.data[column] = values[0];
      store_companions<1>(a.spec.next_companions, 0, column, values);
    }
  }
  cluster.barrier_wait();
}

bool aligned_16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

bool e2b_w4g32(const MatrixView& m, int64_t rows, int64_t cols) {
  return m.format == MatrixFormat::kW4G32 && m.rows == rows && m.cols == cols &&
         m.data != nullptr && m.scales != nullptr && aligned_16(m.data);
}

bool one_row(const RowsView& r) {
  return r.data != nullptr && r.rows == 1 && r.width == kHidden && aligned_16(r.data);
}

}  // namespace

cudaError_t ple_step(const PleStepArgs& a, const Launch& launch) {
  const bool has_next = a.next.data != nullptr;
  if (!one_row(a.acc) || !one_row(a.x) || (has_next && !one_row(a.next)) ||
      !e2b_w4g32(a.gate, kPle, kHidden) || !e2b_w4g32(a.projection, kHidden, kPle) ||
      a.multiplier == nullptr || a.gated == nullptr || a.projected == nullptr ||
      !aligned_16(a.step_weight) || !companions_fit(a.spec.residual_companions, kHidden) ||
      !companions_fit(a.spec.next_companions, kHidden) ||
      (!has_next && has_companions(a.spec.next_companions))) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel(ple_step_kernel, dim3(kClusterBlocks), dim3(kThreads), 0, launch, a);
}

}  // namespace gemma4::cuda
