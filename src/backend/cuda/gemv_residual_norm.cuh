// The GEMV's residual-step prologue (GemvResidualNorm, gemv_kernels.h): each block builds its
// staged bf16 activation rows as residual + rms_norm(x; weight) from the fp32 rows instead of
// converting x. Blocks recompute the row's norm (one reduction over K per row) rather than wait
// for a kernel of its own; nothing is written back, so no block can read a half-updated residual.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_math.cuh"
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

__device__ __forceinline__ float warp_total(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  return value;
}

// Rows m0 .. m0 + rows_here − 1 of residual + rms_norm(x; weight), rounded to bf16, into `staged`
// in load_x_chunk_staged's piece-major layout (kPieces 8-element pieces per chunk), as the plain
// staging stores x. Each product rounded as add_rms_norm_kernel rounds it (scalar 1). A block of
// kWarps > 1 warps sums across them in `warp_sums` (kWarps floats of shared memory that nothing
// else uses while the rows are staged: the kernel's split-K partials).
template <int kPieces, int kWarps>
__device__ __forceinline__ void stage_residual_norm_rows(const GemvArgs& a, int m0, int rows_here,
                                                         uint4* staged, float* warp_sums) {
  const GemvResidualNorm& n = a.residual_norm;
  const int row_words = static_cast<int>(a.chunks_per_row * kPieces);  // pieces of 8 per row
  const float cols = 8.0f * static_cast<float>(row_words);
  for (int row = 0; row < rows_here; ++row) {
    const auto* x =
        reinterpret_cast<const float4*>(static_cast<const float*>(a.x) + (m0 + row) * a.x_stride);
    const auto* residual =
        reinterpret_cast<const float4*>(n.residual + (m0 + row) * n.residual_stride);
    const auto* weight = reinterpret_cast<const float4*>(n.weight);
    float sum = 0.0f;
    for (int piece = threadIdx.x; piece < row_words; piece += blockDim.x) {
      const float4 lo = __ldg(x + 2 * piece), hi = __ldg(x + 2 * piece + 1);
      sum += lo.x * lo.x + lo.y * lo.y + lo.z * lo.z + lo.w * lo.w;
      sum += hi.x * hi.x + hi.y * hi.y + hi.z * hi.z + hi.w * hi.w;
      prefetch_l1(residual + 2 * piece);  // read after the reduction
    }
    float total = warp_total(sum);
    if constexpr (kWarps > 1) {
      if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = total;
      __syncthreads();
      total = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
    }
    const float inv = 1.0f / sqrtf(total / cols + n.eps);
    for (int piece = threadIdx.x; piece < row_words; piece += blockDim.x) {
      float v[8], r[8], s[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
      const float4 parts[4] = {__ldg(x + 2 * piece), __ldg(x + 2 * piece + 1),
                               __ldg(residual + 2 * piece), __ldg(residual + 2 * piece + 1)};
      const float* p = reinterpret_cast<const float*>(parts);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = p[e], r[e] = p[8 + e];
      if (weight != nullptr) {
        const float4 w[2] = {__ldg(weight + 2 * piece), __ldg(weight + 2 * piece + 1)};
        const float* wf = reinterpret_cast<const float*>(w);
#pragma unroll
        for (int e = 0; e < 8; ++e) s[e] = n.weight_offset + wf[e];
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = r[e] + __fmul_rn(__fmul_rn(v[e], inv), s[e]);
      staged[row * row_words + (piece % kPieces) * a.chunks_per_row + piece / kPieces] =
          make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                     pack_bf16x2(v[6], v[7]));
    }
    if (kWarps > 1 && row + 1 < rows_here) __syncthreads();  // warp_sums serves the next row
  }
}

}  // namespace gemma4::cuda::gemv_detail
