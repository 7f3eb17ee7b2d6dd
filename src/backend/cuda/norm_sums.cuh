// Reduction helpers of the one-row norm kernels (elementwise.cu's add_rms_norm and rms_norm,
// ple_step.cu): the second level of a block sum, and the sum of squares of a residual step's new
// residual from sums over the old one (the next norm's, without a second reduction).
#pragma once

#include <cuda_runtime.h>

namespace gemma4::cuda {

// Σ of kGroups · 4 floats of shared memory (16-byte aligned: one float4 read per group) in one
// fixed order, each group pairwise, the groups in index order: every thread that reads the same
// values gets the same bits. The second level of the block sums (per-warp partials): the reads
// issue together, then a few dependent adds, instead of a second shuffle reduction.
template <int kGroups>
__device__ __forceinline__ float sum_of_groups(const float* values) {
  const float4* quads = reinterpret_cast<const float4*>(values);
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    const float4 q = quads[i];
    total += (q.x + q.y) + (q.z + q.w);
  }
  return total;
}

// Σ_j ((r_j + x_j·w_j·inv) · scalar)², the sum of squares of a residual step's new residual, from
// sums over the old one: r2 = Σ r², rxw = Σ r·(x·w), xw2 = Σ (x·w)², with the step's inverse rms
// `inv`. It replaces a second reduction after the step (the next norm's): the products it leaves
// unrounded move its value by the sums' own rounding, as long as the new residual does not cancel
// the old (a residual stream's steps add to it). Where it does, beyond 1/64 of Σ r² + inv² · Σ
// (x·w)² (the sums' rounding would show in the last 6 bits and up), it returns −1: the caller
// reduces the new residual's squares itself then.
__device__ __forceinline__ float expanded_sum_of_squares(float r2, float rxw, float xw2, float inv,
                                                         float scalar) {
  const float sum = __fmaf_rn(inv, __fmaf_rn(inv, xw2, 2.0f * rxw), r2);
  const float magnitude = __fmaf_rn(__fmul_rn(inv, inv), xw2, r2);
  if (sum < magnitude * (1.0f / 64.0f)) return -1.0f;
  return __fmul_rn(__fmul_rn(sum, scalar), scalar);
}

}  // namespace gemma4::cuda
