// The norm math of the row kernels (elementwise.cu), shared with the GEMV that folds the residual
// step into its last block (gemv_kernel.cuh: GemvResidualNorm): the same rounded operations in
// the same order, so a folded step equals the add_rms_norm kernel up to the order of the sums of
// squares (which follows the block's size).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/float_quads.cuh"
#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/q8.cuh"

namespace gemma4::cuda {

// Sum of `value` over the block (a multiple of 32 threads); every thread gets the result. One
// barrier: each warp reduces the per-warp sums itself. `scratch` holds 32 floats and serves one
// call only (a second sum in the same kernel takes its own).
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  value = warp_sum(value);
  const int lane = threadIdx.x & 31;
  if (lane == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  return warp_sum(lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : 0.0f);
}

// (mean(x²) + eps)^-1/2 as transformers evaluates it (eps inside; a correctly rounded sqrt and
// division rather than the approximate rsqrt), from each thread's share of Σx².
__device__ __forceinline__ float inverse_rms(float sum_of_squares, int64_t width, float eps,
                                             float* scratch) {
  return 1.0f / sqrtf(block_sum(sum_of_squares, scratch) / static_cast<float>(width) + eps);
}

// x · inv · scale, each product rounded (no fma), as the CPU reference rounds them.
__device__ __forceinline__ float normed_product(float x, float inv, float scale) {
  return __fmul_rn(__fmul_rn(x, inv), scale);
}

// The Gemma residual step of one element: (residual + normed) · scalar.
__device__ __forceinline__ float residual_update(float residual, float normed, float scalar) {
  return __fmul_rn(residual + normed, scalar);
}

// add_rms_norm (elementwise.h) of one row, row 0 of the companions, by the calling block (any
// multiple of 32 threads; every thread calls), streaming the row through L2 instead of holding
// it in registers: for a block that did not produce all of x itself (the GEMV's last block),
// so x is read past L1. x, residual and next (if any) 16-byte aligned, width a multiple of 4
// (of 32 with companions). `scratch`: 64 floats of shared memory. Thread t takes quads t,
// t + blockDim, ... as add_rms_norm_kernel does.
__device__ __forceinline__ void add_rms_norm_streamed(const float* x, int64_t width,
                                                      const GemvResidualNorm& s, float* scratch) {
  const int64_t quads = width / 4;
  auto x_quad = [&](int64_t q) {
    const float4 f = __ldcg(reinterpret_cast<const float4*>(x) + q);
    return FloatQuad{{f.x, f.y, f.z, f.w}};
  };
  float sum = 0.0f;
  for (int64_t q = threadIdx.x; q < quads; q += blockDim.x) {
    const FloatQuad v = x_quad(q);
#pragma unroll
    for (int e = 0; e < 4; ++e) sum += v.v[e] * v.v[e];
  }
  const float inv = inverse_rms(sum, width, s.eps, scratch);
  // Whole warps run every round: the companions' kQ8 chunks reduce across 8 lanes.
  const int64_t rounds = (quads + blockDim.x - 1) / blockDim.x;
  float residual_sum = 0.0f;
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t q = threadIdx.x + k * blockDim.x;
    const bool in_row = q < quads;
    FloatQuad r = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (in_row) {
      const FloatQuad v = x_quad(q);
      const FloatQuad scale = load_norm_scale<true>(s.weight, s.weight_offset, 4 * q, width);
      r = load_quad<true>(s.residual, 4 * q, width);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        r.v[e] = residual_update(r.v[e], normed_product(v.v[e], inv, scale.v[e]), s.scalar);
        residual_sum += r.v[e] * r.v[e];
      }
      store_quad<true>(s.residual, 4 * q, width, r);
    }
    store_companions<4>(s.residual_companions, 0, 4 * q, r.v, in_row);
  }
  if (s.next == nullptr) return;
  const float next_inv = inverse_rms(residual_sum, width, s.eps, scratch + 32);
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t q = threadIdx.x + k * blockDim.x;
    const bool in_row = q < quads;
    FloatQuad r = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (in_row) {
      // This thread's own residual stores above.
      r = load_quad<true>(s.residual, 4 * q, width);
      const FloatQuad scale = load_norm_scale<true>(s.next_weight, s.weight_offset, 4 * q, width);
#pragma unroll
      for (int e = 0; e < 4; ++e) r.v[e] = normed_product(r.v[e], next_inv, scale.v[e]);
      store_quad<true>(s.next, 4 * q, width, r);
    }
    store_companions<4>(s.next_companions, 0, 4 * q, r.v, in_row);
  }
}

}  // namespace gemma4::cuda
