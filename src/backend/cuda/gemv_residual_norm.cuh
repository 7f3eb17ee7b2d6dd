// The GEMV's residual-step prologue (GemvResidualNorm, gemv_kernels.h): each block builds its
// staged bf16 activation rows from the fp32 rows as the step's result, (residual + rms_norm(x;
// weight)) · scalar, normed once more with next_norm, instead of converting x. Blocks recompute
// the row's norms (one or two reductions over K per row) rather than wait for a kernel of their
// own. Without a done counter nothing is written back; with one, the block that finishes staging
// last (the others have read the residual by then) stores the step's results.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda::gemv_detail {

__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// The norm weights are no predecessor's output: their lines go to L1 before the PDL wait.
__device__ __forceinline__ void prefetch_residual_norm_weight(const GemvResidualNorm& n,
                                                              int64_t cols) {
  if (n.residual == nullptr) return;
  const float* weights[2] = {n.weight, n.next_norm ? n.next_weight : nullptr};
  for (const float* weight : weights) {
    if (weight == nullptr) continue;
    for (int64_t j = 32 * int64_t{threadIdx.x}; j < cols; j += 32 * int64_t{blockDim.x}) {
      prefetch_l1(weight + j);  // one 128-byte line per thread and step
    }
  }
}

__device__ __forceinline__ float warp_total(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  return value;
}

// The block's total of one value per thread (kWarps warps), in every thread. Several warps sum
// across them in warp_sums[0, kWarps) (shared memory): the caller separates a previous total's
// readers from these writes (a barrier, or other slots).
template <int kWarps>
__device__ __forceinline__ float block_total(float value, float* warp_sums) {
  float total = warp_total(value);
  if constexpr (kWarps > 1) {
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = total;
    __syncthreads();
    total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  }
  return total;
}

// Elements 8·piece .. 8·piece + 7 of a 16-byte aligned fp32 row. kReadOnly: through the
// non-coherent path (rows nothing writes while the kernel runs); else plain loads (the residual,
// which the last block writes).
template <bool kReadOnly>
__device__ __forceinline__ void load_piece(const float* row, int piece, float (&v)[8]) {
  const float4* p = reinterpret_cast<const float4*>(row) + 2 * piece;
  const float4 lo = kReadOnly ? __ldg(p) : p[0], hi = kReadOnly ? __ldg(p + 1) : p[1];
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
  v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

__device__ __forceinline__ void store_piece(float* row, int piece, const float (&v)[8]) {
  float4* p = reinterpret_cast<float4*>(row) + 2 * piece;
  p[0] = make_float4(v[0], v[1], v[2], v[3]);
  p[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// v · inv · (weight_offset + weight) over one piece, each product rounded (no fma) as the
// elementwise norm kernels round it; no weight factor for a null weight.
__device__ __forceinline__ void norm_piece(const float* weight, float weight_offset, int piece,
                                           float inv, float (&v)[8]) {
  if (weight == nullptr) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(v[e], inv);
    return;
  }
  float w[8];
  load_piece<true>(weight, piece, w);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(__fmul_rn(v[e], inv), weight_offset + w[e]);
}

// One piece of the step's result v = (residual + rms_norm(x; weight)) · scalar, rounded as
// add_rms_norm_kernel rounds it (the final product is exact for scalar 1).
__device__ __forceinline__ void step_piece(const GemvResidualNorm& n, const float* x_row,
                                           const float* residual_row, int piece, float x_inv,
                                           float (&v)[8]) {
  float r[8];
  load_piece<true>(x_row, piece, v);
  load_piece<false>(residual_row, piece, r);
  norm_piece(n.weight, n.weight_offset, piece, x_inv, v);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(r[e] + v[e], n.scalar);
}

// A row's inverse RMS of x and, with next_norm, of the step's result v (1 without).
struct StepNorms {
  float x_inv;
  float v_inv;
};

// Uses warp_sums[0, 2 · kWarps): the two totals of a row need no barrier between them.
template <int kWarps>
__device__ __forceinline__ StepNorms step_norms(const GemvResidualNorm& n, const float* x_row,
                                                const float* residual_row, int row_words,
                                                float* warp_sums) {
  const float cols = 8.0f * static_cast<float>(row_words);
  float sum = 0.0f;
  // Unrolled so that several L2 round trips for x (the previous kernel's output) overlap; the
  // later passes read L1 (x, the prefetched residual and weights).
#pragma unroll 4
  for (int piece = threadIdx.x; piece < row_words; piece += blockDim.x) {
    float v[8];
    load_piece<true>(x_row, piece, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += v[e] * v[e];
    prefetch_l1(residual_row + 8 * piece);  // read after the reduction
  }
  StepNorms norms = {1.0f / sqrtf(block_total<kWarps>(sum, warp_sums) / cols + n.eps), 1.0f};
  if (!n.next_norm) return norms;
  float v_sum = 0.0f;
#pragma unroll 2
  for (int piece = threadIdx.x; piece < row_words; piece += blockDim.x) {
    float v[8];
    step_piece(n, x_row, residual_row, piece, norms.x_inv, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) v_sum += v[e] * v[e];
  }
  norms.v_inv = 1.0f / sqrtf(block_total<kWarps>(v_sum, warp_sums + kWarps) / cols + n.eps);
  return norms;
}

// The done-counter protocol (GemvResidualNorm::done_counter): the block that counts last stores,
// for rows m0 .. m0 + rows_here − 1, v into the residual and, with next_norm, its norm into next.
// Every block calls it once, after staging.
template <int kWarps>
__device__ __forceinline__ void write_back_if_last(const GemvArgs& a, int m0, int rows_here,
                                                   int row_words, float* warp_sums) {
  const GemvResidualNorm& n = a.residual_norm;
  __syncthreads();  // every thread of the block is done reading the residual rows
  bool counted_last = false;
  if (threadIdx.x == 0) counted_last = atomicAdd(n.done_counter, 1u) == gridDim.x - 1;
  if (!__syncthreads_or(counted_last)) return;
  for (int row = 0; row < rows_here; ++row) {
    const float* x_row = static_cast<const float*>(a.x) + (m0 + row) * a.x_stride;
    float* residual_row = n.residual + (m0 + row) * n.residual_stride;
    const StepNorms norms = step_norms<kWarps>(n, x_row, residual_row, row_words, warp_sums);
    // Each thread rewrites only the pieces it read: no other thread reads them after.
    for (int piece = threadIdx.x; piece < row_words; piece += blockDim.x) {
      float v[8];
      step_piece(n, x_row, residual_row, piece, norms.x_inv, v);
      store_piece(residual_row, piece, v);
      if (n.next_norm) {
        norm_piece(n.next_weight, n.weight_offset, piece, norms.v_inv, v);
        store_piece(n.next + (m0 + row) * n.next_stride, piece, v);
      }
    }
    if (kWarps > 1) __syncthreads();  // warp_sums serves the next row
  }
  if (threadIdx.x == 0) *n.done_counter = 0u;  // the next launch finds it at zero
}

// Rows m0 .. m0 + rows_here − 1 of the step's staged value (GemvResidualNorm), rounded to bf16,
// into `staged` in load_x_chunk_staged's piece-major layout (kPieces 8-element pieces per chunk),
// as the plain staging stores x. A block of kWarps > 1 warps sums across them in `warp_sums`
// (2 · kWarps floats of shared memory that nothing else uses while the rows are staged: the
// kernel's split-K partials).
template <int kPieces, int kWarps>
__device__ __forceinline__ void stage_residual_norm_rows(const GemvArgs& a, int m0, int rows_here,
                                                         uint4* staged, float* warp_sums) {
  const GemvResidualNorm& n = a.residual_norm;
  const int row_words = static_cast<int>(a.chunks_per_row * kPieces);  // pieces of 8 per row
  for (int row = 0; row < rows_here; ++row) {
    const float* x_row = static_cast<const float*>(a.x) + (m0 + row) * a.x_stride;
    const float* residual_row = n.residual + (m0 + row) * n.residual_stride;
    const StepNorms norms = step_norms<kWarps>(n, x_row, residual_row, row_words, warp_sums);
#pragma unroll 2
    for (int piece = threadIdx.x; piece < row_words; piece += blockDim.x) {
      float v[8];
      step_piece(n, x_row, residual_row, piece, norms.x_inv, v);
      if (n.next_norm) norm_piece(n.next_weight, n.weight_offset, piece, norms.v_inv, v);
      staged[row * row_words + (piece % kPieces) * a.chunks_per_row + piece / kPieces] =
          make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                     pack_bf16x2(v[6], v[7]));
    }
    if (kWarps > 1 && row + 1 < rows_here) __syncthreads();  // warp_sums serves the next row
  }
  if (n.done_counter != nullptr) write_back_if_last<kWarps>(a, m0, rows_here, row_words, warp_sums);
}

}  // namespace gemma4::cuda::gemv_detail
