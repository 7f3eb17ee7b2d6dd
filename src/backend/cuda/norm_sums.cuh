// Reduction helpers of the one-row norm kernels (elementwise.cu's add_rms_norm and rms_norm,
// ple_step.cu): the second level of a block sum, and the sum of squares of a residual step's new
// residual from sums over the old one (the next norm's, without a second reduction).
#pragma once

#include <cuda_runtime.h>

namespace gemma4::cuda {

// The second level of the block sums: Σ of the per-warp totals in groups of 4 warps (a float4 of
// 16-byte aligned shared memory each, zeros past the last warp), at most 8 groups, in one fixed
// order: each group pairwise, then the groups as an xor butterfly over 8 lanes would add them,
// ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), missing groups zeros. sum_of_groups adds
// them in one thread (its reads issue together); butterfly_of_groups in 8 lanes of a warp. Both
// give the same bits.
__device__ __forceinline__ float group_total(const float* values, int group) {
  const float4 q = reinterpret_cast<const float4*>(values)[group];
  return (q.x + q.y) + (q.z + q.w);
}

template <int kGroups>
__device__ __forceinline__ float sum_of_groups(const float* values) {
  static_assert(kGroups >= 1 && kGroups <= 8);
  float s[8];
#pragma unroll
  for (int g = 0; g < 8; ++g) s[g] = g < kGroups ? group_total(values, g) : 0.0f;
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// The same sum by 8 consecutive lanes (aligned to 8) of a warp that all call: lane g % 8 reads
// group g; every one of the 8 gets the total. Groups at or past `groups` count as zeros.
__device__ __forceinline__ float butterfly_of_groups(const float* values, int groups) {
  const int group = static_cast<int>(threadIdx.x & 7);
  float s = group < groups ? group_total(values, group) : 0.0f;
#pragma unroll
  for (int offset = 4; offset > 0; offset /= 2) s += __shfl_xor_sync(0xFFFFFFFFu, s, offset);
  return s;
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
