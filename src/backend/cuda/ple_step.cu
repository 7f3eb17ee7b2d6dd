// ple_step (ple_step.h): one cluster of kClusterBlocks blocks (8, or 16 as a non-portable
// cluster), two gate rows per warp. Block c owns gate rows [c · P/C, (c + 1) · P/C) and projection
// rows (= hidden columns) [c · H/C, (c + 1) · H/C). The launch's cost is the chain of dependent
// steps after the PDL wait, so everything else happens before it, and the blocks exchange what
// they share by pushing it into their peers' shared memory (st.async, completing on the peer's
// mbarrier: one one-way trip per exchange, no cluster barrier on the way):
//  0. before the wait: every weight load, the norm weights, then the mbarriers and one cluster
//     barrier (every block has started and initialized its mbarriers before any peer sends);
//  1. every block builds v = acc + rms_norm(x) for the whole row (the gate's K) in shared memory:
//     fp32, and rounded to bf16 (kept as fp32, piece-major, with each 32-element chunk's offset
//     for dot_w4g32, so that the gate's lanes read ready operands);
//  2. its gate rows, a half warp per row (16 lanes x 3 chunks: no idle lane): gated =
//     gelu_tanh(dot) · multiplier; each warp pushes its two bf16-rounded values to every block;
//  3. once all 256 have arrived, its projection rows; each warp pushes its Σ projected² to every
//     block;
//  4. its hidden columns: acc = (v + norm(projected)) · scalar; with a next norm, each warp pushes
//     its Σ acc² to every block, and next = norm(acc) with the companions of its 32-column chunks;
//  5. ple_step_matmul only: each warp of step 4 pushes its chunk of next, rounded to bf16 and
//     staged as v is, to every block, and every block multiplies its rows of the GEMV that
//     follows (a half warp a row, as the gate's) by the whole of it. Each cluster of the grid
//     runs steps 1-5 on the same inputs (the same bits); cluster 0 alone stores the step's
//     outputs, acc once the other clusters' blocks have counted their read of it.
// A block exits once all it receives has arrived and its peers have received all it sent (a
// cluster barrier whose arrival comes right after the last receipt, long before the wait). Each
// product rounds as the unfused kernels round it (add_rms_norm_kernel, the GEMV's staging); the
// sums (of squares, of a chunk's offset) run in another order, so the last bits may differ from
// them.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <cuda/ptx>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/float_quads.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ple_step.h"
#include "backend/cuda/q8.cuh"

namespace gemma4::cuda {
namespace {

namespace cg = cooperative_groups;
namespace ptx = ::cuda::ptx;

// E2B's widths: the only shape compiled (see the static_asserts for what another must satisfy).
constexpr int kHidden = 1536;
constexpr int kPle = 256;

constexpr int kGateChunks = kHidden / 32;  // 48 chunks of 32 in a gate row
constexpr int kGateChunksPerLane = 3;      // a half warp's 16 lanes take a row's 48
constexpr int kQuads = kHidden / 4;        // step 1: float4s of the row
// v rounded, piece-major: float4 i of chunk c at [i · kStagedPitch + c]. Lanes reading
// consecutive chunks read consecutive float4s; the pad spreads step 1's stores over the banks.
constexpr int kStagedPitch = kGateChunks + 1;
constexpr int kProjectionChunks = kPle / 32;  // 8: one per lane of a team
constexpr int kProjectionTeams = 32 / kProjectionChunks;
constexpr int kProjectionRowsPerThread = 3;  // the lanes of a team split K, each row's sum
                                             // ends in lane (its index) of the team
static_assert(16 * kGateChunksPerLane == kGateChunks);
static_assert(32 % kProjectionChunks == 0 && kProjectionRowsPerThread <= kProjectionChunks);

template <int kClusterBlocks>
struct Layout {
  static constexpr int kWarps = kPle / 2 / kClusterBlocks;  // two gate rows each
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kGateRowsPerBlock = kPle / kClusterBlocks;
  static constexpr int kColumns = kHidden / kClusterBlocks;  // projection rows of a block
  static constexpr int kColumnWarps = kColumns / 32;         // step 4: a thread per column
  static constexpr int kQuadsPerThread = (kQuads + kThreads - 1) / kThreads;
  static_assert(kProjectionRowsPerThread * kProjectionTeams * kWarps == kColumns);
  static_assert(kColumns % 32 == 0 && kQuads % 32 == 0 && kThreads % 8 == 0);
};

// The exchanges, each with its own mbarrier (used for one phase): three for the step, a fourth
// (next's bf16 rounding, staged) for the GEMV that follows it in ple_step_matmul.
enum Exchange { kGated, kProjectedSquares, kAccSquares, kNextValues, kExchanges };

// Σ of kSlots floats in shared memory (16-byte aligned, kSlots a multiple of 4, at most 128), the
// same in every lane of the warp and in every block holding the same values.
template <int kSlots>
__device__ __forceinline__ float slots_total(const float* slots) {
  static_assert(kSlots % 4 == 0 && kSlots <= 128);
  const int lane = threadIdx.x & 31;
  float sum = 0.0f;
  if (lane < kSlots / 4) {
    const float4 q = reinterpret_cast<const float4*>(slots)[lane];
    sum = (q.x + q.y) + (q.z + q.w);
  }
  return warp_sum(sum);
}

// Puts `value` at `slot` in block `peer`'s shared memory and completes it on the peer's
// `arrival`: st.async to another block (its bytes counted by the peer's expect_tx), a store and
// an arrival (release: the store first) to this one (`own`: peer is this block's rank).
template <typename T>
__device__ __forceinline__ void send(const cg::cluster_group& cluster, T* slot, const T& value,
                                     uint64_t* arrival, int peer, bool own) {
  if (own) {
    *slot = value;
    ptx::mbarrier_arrive(ptx::sem_release, ptx::scope_cta, ptx::space_shared, arrival);
  } else {
    ptx::st_async(cluster.map_shared_rank(slot, peer), value,
                  cluster.map_shared_rank(arrival, peer));
  }
}

// send() for a float4 (one 16-byte st.async).
__device__ __forceinline__ void send_quad(const cg::cluster_group& cluster, float4* slot,
                                          const float4& value, uint64_t* arrival, int peer,
                                          bool own) {
  if (own) {
    *slot = value;
    ptx::mbarrier_arrive(ptx::sem_release, ptx::scope_cta, ptx::space_shared, arrival);
  } else {
    const float values[4] = {value.x, value.y, value.z, value.w};
    ptx::st_async(cluster.map_shared_rank(reinterpret_cast<float*>(slot), peer), values,
                  cluster.map_shared_rank(arrival, peer));
  }
}

// Waits until everything sent to this block for an exchange has arrived (acquire at cluster
// scope: the peers' stores are visible after it).
__device__ __forceinline__ void wait_for(uint64_t* arrival) {
  while (!ptx::mbarrier_try_wait_parity(ptx::sem_acquire, ptx::scope_cluster, arrival, 0u)) {
  }
}

// 32 activations staged as fp32 float4 pieces (`pitch` float4s apart) as the dot's XChunk, its
// offset and sum left to the caller.
__device__ __forceinline__ XChunk<32> staged_chunk(const float4* pieces, int pitch) {
  XChunk<32> x;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 q = pieces[i * pitch];
    x.v[4 * i] = q.x, x.v[4 * i + 1] = q.y, x.v[4 * i + 2] = q.z, x.v[4 * i + 3] = q.w;
  }
  x.offset = x.sum = 0.0f;
  return x;
}

// Where gate row `row`'s value sits in the projection's staging: piece-major like v's (float4 i
// of chunk c at float4 [i · kProjectionChunks + c]).
__device__ __forceinline__ int gated_index(int row) {
  return ((row % 32) / 4 * kProjectionChunks + row / 32) * 4 + row % 4;
}

// A 16-byte weight word, loaded before the PDL wait. Not ld.global.nc (load_weights_nc): ptxas
// moves .nc loads (read-only memory: nothing orders them) past griddepcontrol.wait, down to their
// first use, which puts the weights' DRAM latency after the wait (the SASS of the .nc version
// issues them after ACQBULK); a plain load stays before it.
__device__ __forceinline__ uint4 load_weights_before_wait(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// The raw bits of a w4g32 group scale (bf16, fp16 or fp32: m.scale_type), loaded before the PDL
// wait (a plain load, as load_weights_before_wait).
__device__ __forceinline__ uint32_t load_scale_before_wait(const MatrixView& m, int64_t index) {
  uint32_t bits;
  if (m.scale_type == kScaleF32) {
    asm volatile("ld.global.u32 %0, [%1];"
                 : "=r"(bits)
                 : "l"(static_cast<const uint32_t*>(m.scales) + index));
  } else {
    uint16_t half_bits;
    asm volatile("ld.global.u16 %0, [%1];"
                 : "=h"(half_bits)
                 : "l"(static_cast<const uint16_t*>(m.scales) + index));
    bits = half_bits;
  }
  return bits;
}

// A half warp's share of row `row` of a [rows, kHidden] w4g32 matrix: lane l of the half its
// chunks (l & 15) + 16j, loaded before the PDL wait (zeros past the last row).
struct HalfWarpRow {
  uint4 words[kGateChunksPerLane];
  uint32_t scales[kGateChunksPerLane];
};

__device__ __forceinline__ HalfWarpRow load_half_warp_row(const MatrixView& m, int64_t row,
                                                          int lane) {
  HalfWarpRow r;
#pragma unroll
  for (int j = 0; j < kGateChunksPerLane; ++j) {
    r.words[j] = make_uint4(0, 0, 0, 0);
    r.scales[j] = 0;
    if (row < m.rows) {
      const int64_t index = row * kGateChunks + (lane & 15) + 16 * j;
      r.words[j] = load_weights_before_wait(static_cast<const uint4*>(m.data) + index);
      r.scales[j] = load_scale_before_wait(m, index);
    }
  }
  return r;
}

// The row's dot with a K-kHidden vector staged as v's bf16 rounding is (piece-major, with each
// chunk's offset), in every lane of the half warp.
__device__ __forceinline__ float half_warp_row_dot(const MatrixView& m, const HalfWarpRow& r,
                                                   const float* staged, const float* offsets,
                                                   int lane) {
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < kGateChunksPerLane; ++j) {
    const int chunk = (lane & 15) + 16 * j;
    XChunk<32> xc = staged_chunk(reinterpret_cast<const float4*>(staged) + chunk, kStagedPitch);
    xc.offset = offsets[chunk];  // dot_w4g32 reads no sum
    dot += dot_w4g32(r.words[j], scale_from_bits(m, r.scales[j]), xc);
  }
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, offset);
  return dot;
}

// The GEMV that follows the step (kMatmulPasses > 0, ple_step_matmul): a block's rows, 32 a pass
// (a half warp each), rows block · 32 · kMatmulPasses + 32 · pass + the half warp's index.
constexpr int kMatmulRowsPerPass = 32;

// Releases / acquires the count of blocks past their read of acc (ple_step_matmul).
__device__ __forceinline__ void count_acc_read(unsigned* counter) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ unsigned acc_reads(const unsigned* counter) {
  unsigned count;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(count) : "l"(counter) : "memory");
  return count;
}

template <int kClusterBlocks, int kMatmulPasses>
__global__ void __cluster_dims__(kClusterBlocks, 1, 1)
    __launch_bounds__(Layout<kClusterBlocks>::kThreads)
        ple_step_kernel(PleStepArgs a, PleStepMatmul m) {
  using L = Layout<kClusterBlocks>;
  constexpr bool kMatmul = kMatmulPasses > 0;
  static_assert(!kMatmul || kClusterBlocks == 8, "the next-values exchange sends from 4 lanes");
  pdl_trigger_dependents();
  const cg::cluster_group cluster = cg::this_cluster();
  __shared__ __align__(16) float v[kHidden];                       // acc + norm(x), fp32
  __shared__ __align__(16) float v_rounded[8 * kStagedPitch * 4];  // the same as bf16, staged
  __shared__ float v_offsets[kGateChunks];                         // dot_w4g32's, per chunk
  __shared__ __align__(16) float gated_in[kPle];                   // every block's, bf16, staged
  __shared__ __align__(16) float projected_squares_in[kClusterBlocks * L::kWarps];
  __shared__ __align__(16) float acc_squares_in[kClusterBlocks * L::kColumnWarps];
  __shared__ float projected[L::kColumns];
  __shared__ float warp_sums[L::kWarps];
  // ple_step_matmul: next's bf16 rounding, staged as v_rounded is, from every block.
  __shared__ __align__(16) float next_rounded[kMatmul ? 8 * kStagedPitch * 4 : 4];
  __shared__ float next_offsets[kMatmul ? kGateChunks : 1];
  __shared__ uint64_t arrivals[kExchanges];
  const int t = threadIdx.x;
  const int lane = t & 31;
  const int warp = t >> 5;
  const int rank = static_cast<int>(cluster.block_rank());
  const bool has_next = a.next.data != nullptr;
  // ple_step_matmul runs the step in every cluster (each needs next whole) and cluster 0 alone
  // stores its outputs; a plain ple_step is one cluster.
  const int cluster_index = static_cast<int>(blockIdx.x) / kClusterBlocks;
  const bool stores = cluster_index == 0;

  // 0. Nothing here depends on a predecessor. First the weights (their DRAM latency is the
  // longest): a half warp's gate row, 3 chunks a lane; 3 projection rows a lane, one chunk each.
  const int gate_row = rank * L::kGateRowsPerBlock + 2 * warp + (lane >> 4);
  const HalfWarpRow gate_weights = load_half_warp_row(a.gate, gate_row, lane);
  const int team = lane / kProjectionChunks;
  const int chunk_in_row = lane % kProjectionChunks;
  const int first_local_row = (warp * kProjectionTeams + team) * kProjectionRowsPerThread;
  const int first_column = rank * L::kColumns;
  uint4 projection_words[kProjectionRowsPerThread];
  uint32_t projection_scales[kProjectionRowsPerThread];
#pragma unroll
  for (int r = 0; r < kProjectionRowsPerThread; ++r) {
    const int64_t index =
        int64_t{first_column + first_local_row + r} * kProjectionChunks + chunk_in_row;
    projection_words[r] =
        load_weights_before_wait(static_cast<const uint4*>(a.projection.data) + index);
    projection_scales[r] = load_scale_before_wait(a.projection, index);
  }
  // ple_step_matmul: this block's rows of the GEMV that follows.
  HalfWarpRow matmul_weights[kMatmul ? kMatmulPasses : 1];
  if constexpr (kMatmul) {
#pragma unroll
    for (int pass = 0; pass < kMatmulPasses; ++pass) {
      const int64_t row = int64_t{blockIdx.x} * kMatmulRowsPerPass * kMatmulPasses +
                          pass * kMatmulRowsPerPass + 2 * warp + (lane >> 4);
      matmul_weights[pass] = load_half_warp_row(m.weights, row, lane);
    }
  }
  // The norm weights: the residual step's (a float4 per quad) and, for this block's columns (a
  // thread each in the first warps), the projection's and the next norm's factors.
  const float weight_offset = a.spec.weight_offset;
  float4 s4[L::kQuadsPerThread];
#pragma unroll
  for (int k = 0; k < L::kQuadsPerThread; ++k) {
    const int quad = t + k * L::kThreads;
    s4[k] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    if (a.step_weight != nullptr && quad < kQuads) {
      const float4 w4 = reinterpret_cast<const float4*>(a.step_weight)[quad];
      s4[k] = make_float4(weight_offset + w4.x, weight_offset + w4.y, weight_offset + w4.z,
                          weight_offset + w4.w);
    }
  }
  const bool column_thread = t < L::kColumns;  // whole warps
  const int column = first_column + t;
  float projected_scale = 1.0f, next_scale = 1.0f;
  if (column_thread && a.spec.weight != nullptr) {
    projected_scale = weight_offset + a.spec.weight[column];
  }
  if (column_thread && has_next && a.spec.next_weight != nullptr) {
    next_scale = weight_offset + a.spec.next_weight[column];
  }
  // The mbarriers: one arrival per warp that sends to this block from here (its own), one for
  // the bytes the peers' st.async bring; then a cluster barrier, so that every block has started
  // and initialized them before any peer sends (relaxed: the mbarrier fence publishes the
  // initialization, nothing else needs a memory fence).
  if (t == 0) {
    constexpr uint32_t kPeers = kClusterBlocks - 1;
    ptx::mbarrier_init(&arrivals[kGated], L::kWarps + 1);
    ptx::mbarrier_init(&arrivals[kProjectedSquares], L::kWarps + 1);
    ptx::mbarrier_init(&arrivals[kAccSquares], L::kColumnWarps + 1);
    ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared,
                                   &arrivals[kGated], kPeers * L::kWarps * 2 * sizeof(float));
    ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared,
                                   &arrivals[kProjectedSquares],
                                   kPeers * L::kWarps * sizeof(float));
    ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared,
                                   &arrivals[kAccSquares],
                                   kPeers * L::kColumnWarps * sizeof(float));
    if constexpr (kMatmul) {
      // Each column warp sends every block its 8 staged float4s and its chunk's offset.
      ptx::mbarrier_init(&arrivals[kNextValues], L::kColumnWarps * 9 + 1);
      ptx::mbarrier_arrive_expect_tx(
          ptx::sem_release, ptx::scope_cta, ptx::space_shared, &arrivals[kNextValues],
          kPeers * L::kColumnWarps * (8 * sizeof(float4) + sizeof(float)));
    }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  ptx::barrier_cluster_arrive(ptx::sem_relaxed);
  ptx::barrier_cluster_wait();
  pdl_wait_for_predecessors();

  // 1. Everything a predecessor wrote that this block reads goes out at once: x, acc and the
  // multiplier of this half warp's gate row.
  float4 x4[L::kQuadsPerThread], r4[L::kQuadsPerThread];
#pragma unroll
  for (int k = 0; k < L::kQuadsPerThread; ++k) {
    const int quad = t + k * L::kThreads;
    x4[k] = r4[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (quad < kQuads) {
      x4[k] = reinterpret_cast<const float4*>(a.x.data)[quad];
      r4[k] = reinterpret_cast<const float4*>(a.acc.data)[quad];
    }
  }
  const float multiplier = a.multiplier[gate_row];

  // v = acc + rms_norm(x; step_weight); its bf16 rounding staged with each chunk's offset
  // (264·Σeven + 24·Σodd, finish_x_chunk's), a chunk's 8 float4s in 8 aligned lanes.
  float x_squares = 0.0f;
#pragma unroll
  for (int k = 0; k < L::kQuadsPerThread; ++k) {
    x_squares += x4[k].x * x4[k].x + x4[k].y * x4[k].y + x4[k].z * x4[k].z + x4[k].w * x4[k].w;
  }
  const float x_total = block_total<L::kWarps>(x_squares, warp_sums);
  const float x_inv = 1.0f / sqrtf(x_total / static_cast<float>(kHidden) + a.spec.eps);
#pragma unroll
  for (int k = 0; k < L::kQuadsPerThread; ++k) {
    const int quad = t + k * L::kThreads;
    if (quad >= kQuads) continue;  // whole warps: kQuads and kThreads are multiples of 32
    const float4 v4 = make_float4(r4[k].x + __fmul_rn(__fmul_rn(x4[k].x, x_inv), s4[k].x),
                                  r4[k].y + __fmul_rn(__fmul_rn(x4[k].y, x_inv), s4[k].y),
                                  r4[k].z + __fmul_rn(__fmul_rn(x4[k].z, x_inv), s4[k].z),
                                  r4[k].w + __fmul_rn(__fmul_rn(x4[k].w, x_inv), s4[k].w));
    reinterpret_cast<float4*>(v)[quad] = v4;
    const float4 rounded =
        make_float4(bf16_rounded(v4.x), bf16_rounded(v4.y), bf16_rounded(v4.z), bf16_rounded(v4.w));
    reinterpret_cast<float4*>(v_rounded)[(quad % 8) * kStagedPitch + quad / 8] = rounded;
    float even = rounded.x + rounded.z, odd = rounded.y + rounded.w;
#pragma unroll
    for (int offset = 4; offset > 0; offset /= 2) {
      even += __shfl_xor_sync(0xFFFFFFFFu, even, offset);
      odd += __shfl_xor_sync(0xFFFFFFFFu, odd, offset);
    }
    if (quad % 8 == 0) v_offsets[quad / 8] = 264.0f * even + 24.0f * odd;
  }
  __syncthreads();
  // acc is in v: cluster 0 may store the new acc once every other cluster's blocks got here.
  if (kMatmul && !stores && t == 0) count_acc_read(m.acc_readers);

  // 2. The half warp's gate row: its 16 lanes split K, 3 chunks each.
  const float dot = half_warp_row_dot(a.gate, gate_weights, v_rounded, v_offsets, lane);
  const float gated = gelu_tanh(dot) * multiplier;
  if (stores && (lane & 15) == 0) a.gated[gate_row] = gated;
  // The warp's two rows (2·warp, 2·warp + 1 of the block: adjacent in one float4 of the
  // staging) to every block, lane p sending to block p.
  const float rounded = bf16_rounded(gated);
  const float2 pair =
      make_float2(__shfl_sync(0xFFFFFFFFu, rounded, 0), __shfl_sync(0xFFFFFFFFu, rounded, 16));
  if (lane < kClusterBlocks) {
    const int first_row = rank * L::kGateRowsPerBlock + 2 * warp;
    send(cluster, reinterpret_cast<float2*>(&gated_in[gated_index(first_row)]), pair,
         &arrivals[kGated], lane, lane == rank);
  }

  // 3. This block's projection rows: a team of lanes per row, one chunk (32 of K) each; the
  // row's sum lands in every lane of the team and lane r of the team keeps row r.
  wait_for(&arrivals[kGated]);
  XChunk<32> gated_chunk =
      staged_chunk(reinterpret_cast<const float4*>(gated_in) + chunk_in_row, kProjectionChunks);
  finish_x_chunk(gated_chunk);
  float p = 0.0f;
#pragma unroll
  for (int r = 0; r < kProjectionRowsPerThread; ++r) {
    float row_dot = dot_w4g32(projection_words[r],
                              scale_from_bits(a.projection, projection_scales[r]), gated_chunk);
#pragma unroll
    for (int offset = kProjectionChunks / 2; offset > 0; offset /= 2)
      row_dot += __shfl_xor_sync(0xFFFFFFFFu, row_dot, offset);
    if (chunk_in_row == r) p = row_dot;
  }
  const bool owns_row = chunk_in_row < kProjectionRowsPerThread;
  if (owns_row) {
    projected[first_local_row + chunk_in_row] = p;
    if (stores) a.projected[first_column + first_local_row + chunk_in_row] = p;
  }
  const float p_squares = warp_sum(owns_row ? p * p : 0.0f);
  if (lane < kClusterBlocks) {
    send(cluster, &projected_squares_in[rank * L::kWarps + warp], p_squares,
         &arrivals[kProjectedSquares], lane, lane == rank);
  }
  __syncthreads();  // projected[] whole
  // The other warps are done with the step: the column warps keep the block (its shared memory)
  // until all its peers send it has arrived, and until every peer has received all it sent (the
  // closing cluster barrier, which counts only threads that have not exited). ple_step_matmul's
  // other warps wait for next (step 5).
  if (!column_thread) {
    if constexpr (!kMatmul) return;
  } else {
    // 4. This block's columns of acc, then next.
    wait_for(&arrivals[kProjectedSquares]);
    const float p_inv = 1.0f / sqrtf(slots_total<kClusterBlocks * L::kWarps>(projected_squares_in) /
                                         static_cast<float>(kHidden) +
                                     a.spec.eps);
    const float updated = __fmul_rn(
        v[column] + __fmul_rn(__fmul_rn(projected[t], p_inv), projected_scale), a.spec.scalar);
    if (!kMatmul) a.acc.data[column] = updated;
    if (!has_next) {
      ptx::barrier_cluster_arrive(ptx::sem_relaxed);  // all this block receives is in
      const float values[1] = {updated};
      store_companions<1>(a.spec.residual_companions, 0, column, values);
      ptx::barrier_cluster_wait();  // and what it sent: no st.async of its own still in flight
      return;
    }
    const float acc_squares = warp_sum(updated * updated);
    if (lane < kClusterBlocks) {
      send(cluster, &acc_squares_in[rank * L::kColumnWarps + warp], acc_squares,
           &arrivals[kAccSquares], lane, lane == rank);
    }
    wait_for(&arrivals[kAccSquares]);
    if constexpr (!kMatmul) ptx::barrier_cluster_arrive(ptx::sem_relaxed);  // as above
    const float next_inv =
        1.0f / sqrtf(slots_total<kClusterBlocks * L::kColumnWarps>(acc_squares_in) /
                         static_cast<float>(kHidden) +
                     a.spec.eps);
    const float values[1] = {__fmul_rn(__fmul_rn(updated, next_inv), next_scale)};
    if (stores) {
      a.next.data[column] = values[0];
      store_companions<1>(a.spec.next_companions, 0, column, values);
    }
    if constexpr (!kMatmul) {
      ptx::barrier_cluster_wait();
      return;
    }
    // The warp's 32 columns (one chunk) of next, rounded to bf16, to every block: float4 i
    // (columns 4i .. 4i + 3, from lanes 4i ..) by lanes i, i + 8, .. to blocks lane / 8 and
    // lane / 8 + 4, the chunk's offset (264·Σeven + 24·Σodd) by lane p to block p.
    const float rounded_next = bf16_rounded(values[0]);
    const float even = warp_sum(lane % 2 == 0 ? rounded_next : 0.0f);
    const float odd = warp_sum(lane % 2 == 1 ? rounded_next : 0.0f);
    const int piece = lane % 8;
    const float4 quad = make_float4(__shfl_sync(0xFFFFFFFFu, rounded_next, 4 * piece),
                                    __shfl_sync(0xFFFFFFFFu, rounded_next, 4 * piece + 1),
                                    __shfl_sync(0xFFFFFFFFu, rounded_next, 4 * piece + 2),
                                    __shfl_sync(0xFFFFFFFFu, rounded_next, 4 * piece + 3));
    const int chunk = column / 32;
    float4* slot = reinterpret_cast<float4*>(next_rounded) + piece * kStagedPitch + chunk;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int peer = lane / 8 + 4 * half;
      send_quad(cluster, slot, quad, &arrivals[kNextValues], peer, peer == rank);
    }
    if (lane < kClusterBlocks) {
      send(cluster, &next_offsets[chunk], 264.0f * even + 24.0f * odd, &arrivals[kNextValues], lane,
           lane == rank);
    }
    // The new acc, off the chain to the GEMV, once every other cluster's blocks have read the
    // old one.
    if (stores) {
      const unsigned readers = gridDim.x - kClusterBlocks;
      while (acc_reads(m.acc_readers) < readers) {
      }
      a.acc.data[column] = updated;
    }
  }
  if constexpr (kMatmul) {
    // 5. The GEMV's rows from next (every block's chunks).
    wait_for(&arrivals[kNextValues]);
    ptx::barrier_cluster_arrive();  // all this block receives is in (release: the polls of acc)
#pragma unroll
    for (int pass = 0; pass < kMatmulPasses; ++pass) {
      const float row_dot =
          half_warp_row_dot(m.weights, matmul_weights[pass], next_rounded, next_offsets, lane);
      const int64_t row = int64_t{blockIdx.x} * kMatmulRowsPerPass * kMatmulPasses +
                          pass * kMatmulRowsPerPass + 2 * warp + (lane >> 4);
      if ((lane & 15) == 0 && row < m.weights.rows) m.y[row] = row_dot;
    }
    ptx::barrier_cluster_wait();  // what it sent has arrived; cluster 0's polls are done
    // Zero for the next launch, whose blocks count only after its PDL wait (this grid's end).
    if (stores && rank == 0 && t == 0) *m.acc_readers = 0;
  }
}

bool e2b_w4g32(const MatrixView& m, int64_t rows, int64_t cols) {
  return m.format == MatrixFormat::kW4G32 && m.rows == rows && m.cols == cols &&
         m.data != nullptr && m.scales != nullptr && aligned_16(m.data);
}

bool one_row(const RowsView& r) {
  return r.data != nullptr && r.rows == 1 && r.width == kHidden && aligned_16(r.data);
}

bool e2b_w4g32_rows(const MatrixView& m, int64_t cols) {
  return m.format == MatrixFormat::kW4G32 && m.rows > 0 && m.cols == cols && m.data != nullptr &&
         m.scales != nullptr && aligned_16(m.data);
}

// Runs `query` in the relaxed capture mode: the calls that set or query a kernel's attributes,
// maybe while this thread captures a graph (CudaBackend records decode steps); they enqueue
// nothing.
template <typename Query>
cudaError_t outside_capture(const Query& query) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  const cudaError_t status = query();
  cudaThreadExchangeStreamCaptureMode(&mode);
  return status;
}

template <int kClusterBlocks, int kMatmulPasses>
cudaError_t launch_ple_step(const PleStepArgs& a, const PleStepMatmul& m, int clusters,
                            const Launch& launch) {
  using L = Layout<kClusterBlocks>;
  constexpr auto kernel = ple_step_kernel<kClusterBlocks, kMatmulPasses>;
  if constexpr (kClusterBlocks > 8) {
    // Clusters past 8 blocks are non-portable: allowed once per process.
    static const cudaError_t allowed = outside_capture([&] {
      return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    });
    if (allowed != cudaSuccess) return allowed;
  }
  if constexpr (kMatmulPasses > 0) {
    // Cluster 0 waits for the others' reads of acc: all of them must fit on the GPU at once.
    static const int fitting = [&] {
      int count = 0;
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(kClusterBlocks * kMaxPleMatmulClusters);
      config.blockDim = dim3(L::kThreads);
      if (outside_capture([&] {
            return cudaOccupancyMaxActiveClusters(&count, kernel, &config);
          }) != cudaSuccess) {
        return 0;
      }
      return count;
    }();
    if (fitting < clusters) return cudaErrorInvalidValue;
  }
  return launch_kernel(kernel, dim3(kClusterBlocks * clusters), dim3(L::kThreads), 0, launch, a, m);
}

bool valid_step(const PleStepArgs& a) {
  const bool has_next = a.next.data != nullptr;
  return one_row(a.acc) && one_row(a.x) && (!has_next || one_row(a.next)) &&
         e2b_w4g32(a.gate, kPle, kHidden) && e2b_w4g32(a.projection, kHidden, kPle) &&
         a.multiplier != nullptr && a.gated != nullptr && a.projected != nullptr &&
         aligned_16(a.step_weight) && companions_fit(a.spec.residual_companions, kHidden) &&
         companions_fit(a.spec.next_companions, kHidden) &&
         (has_next || !has_companions(a.spec.next_companions));
}

}  // namespace

cudaError_t ple_step(const PleStepArgs& a, const Launch& launch, int cluster_blocks) {
  if (!valid_step(a) || (cluster_blocks != 8 && cluster_blocks != 16)) {
    return cudaErrorInvalidValue;
  }
  return cluster_blocks == 16 ? launch_ple_step<16, 0>(a, {}, 1, launch)
                              : launch_ple_step<8, 0>(a, {}, 1, launch);
}

cudaError_t ple_step_matmul(const PleStepArgs& a, const PleStepMatmul& m, const Launch& launch) {
  constexpr int kBlockRows = 8 * kMatmulRowsPerPass;  // a cluster's rows per pass
  if (!valid_step(a) || a.next.data == nullptr || !e2b_w4g32_rows(m.weights, kHidden) ||
      m.y == nullptr || m.acc_readers == nullptr ||
      m.weights.rows > int64_t{2} * kBlockRows * kMaxPleMatmulClusters) {
    return cudaErrorInvalidValue;
  }
  // One pass while the clusters that takes fit kMaxPleMatmulClusters (E2B's q 2048, q+k+v 2560),
  // else two (the full layers' q 4096 and q+k+v).
  const int passes = m.weights.rows <= int64_t{kBlockRows} * kMaxPleMatmulClusters ? 1 : 2;
  const auto clusters =
      static_cast<int>((m.weights.rows + kBlockRows * passes - 1) / (kBlockRows * passes));
  return passes == 1 ? launch_ple_step<8, 1>(a, m, clusters, launch)
                     : launch_ple_step<8, 2>(a, m, clusters, launch);
}

}  // namespace gemma4::cuda
