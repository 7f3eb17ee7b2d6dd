// The GEMV's residual-step prologue (GemvResidualNorm, gemv_kernels.h): each block builds its
// staged bf16 activation rows as residual + rms_norm(x; weight) from the fp32 rows instead of
// converting x. Blocks recompute the row's norm (one reduction over K per row) rather than wait
// for a kernel of their own; nothing is written back, so no block can read a half-updated residual.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/float_quads.cuh"
#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda::gemv_detail {

__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// The norm weight is no predecessor's output: its lines go to L1 before the PDL wait.
__device__ __forceinline__ void prefetch_residual_norm_weight(const GemvResidualNorm& n,
                                                              int64_t cols) {
  if (n.residual == nullptr || n.weight == nullptr) return;
  for (int64_t j = 32 * int64_t{threadIdx.x}; j < cols; j += 32 * int64_t{blockDim.x}) {
    prefetch_l1(n.weight + j);  // one 128-byte line per thread and step
  }
}

// Elements 8·piece .. 8·piece + 7 of a 16-byte aligned fp32 row that nothing writes while the
// kernel runs (the non-coherent path).
__device__ __forceinline__ void load_piece(const float* row, int piece, float (&v)[8]) {
  const float4* p = reinterpret_cast<const float4*>(row) + 2 * piece;
  const float4 lo = __ldg(p), hi = __ldg(p + 1);
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
  v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

// One piece of residual + rms_norm(x; weight) (weight_offset + weight; no weight factor for a
// null weight), each product rounded (no fma) as add_rms_norm_kernel rounds it.
__device__ __forceinline__ void step_piece(const GemvResidualNorm& n, const float* x_row,
                                           const float* residual_row, int piece, float x_inv,
                                           float (&v)[8]) {
  float r[8];
  load_piece(x_row, piece, v);
  load_piece(residual_row, piece, r);
  if (n.weight == nullptr) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = r[e] + __fmul_rn(v[e], x_inv);
    return;
  }
  float w[8];
  load_piece(n.weight, piece, w);
#pragma unroll
  for (int e = 0; e < 8; ++e)
    v[e] = r[e] + __fmul_rn(__fmul_rn(v[e], x_inv), n.weight_offset + w[e]);
}

// Rows m0 .. m0 + rows_here − 1 of residual + rms_norm(x; weight), rounded to bf16, into `staged`
// in load_x_chunk_staged's piece-major layout (kPieces 8-element pieces per chunk), as the plain
// staging stores x. A block of kWarps > 1 warps sums across them in `warp_sums` (kWarps floats of
// shared memory that nothing else uses while the rows are staged: the kernel's split-K partials).
template <int kPieces, int kWarps>
__device__ __forceinline__ void stage_residual_norm_rows(const GemvArgs& a, int m0, int rows_here,
                                                         uint4* staged, float* warp_sums) {
  const GemvResidualNorm& n = a.residual_norm;
  const int row_words = static_cast<int>(a.chunks_per_row * kPieces);  // pieces of 8 per row
  const float cols = 8.0f * static_cast<float>(row_words);
  for (int row = 0; row < rows_here; ++row) {
    const float* x_row = static_cast<const float*>(a.x) + (m0 + row) * a.x_stride;
    const float* residual_row = n.residual + (m0 + row) * n.residual_stride;
    float sum = 0.0f;
    // Unrolled so that several L2 round trips for x (the previous kernel's output) overlap; the
    // later pass reads L1 (x, the prefetched residual and weight).
#pragma unroll 4
    for (int piece = threadIdx.x; piece < row_words; piece += blockDim.x) {
      float v[8];
      load_piece(x_row, piece, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += v[e] * v[e];
      prefetch_l1(residual_row + 8 * piece);  // read after the reduction
    }
    const float x_inv = 1.0f / sqrtf(block_total<kWarps>(sum, warp_sums) / cols + n.eps);
#pragma unroll 2
    for (int piece = threadIdx.x; piece < row_words; piece += blockDim.x) {
      float v[8];
      step_piece(n, x_row, residual_row, piece, x_inv, v);
      staged[row * row_words + (piece % kPieces) * a.chunks_per_row + piece / kPieces] =
          make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                     pack_bf16x2(v[6], v[7]));
    }
    if (kWarps > 1 && row + 1 < rows_here) __syncthreads();  // warp_sums serves the next row
  }
}

}  // namespace gemma4::cuda::gemv_detail
