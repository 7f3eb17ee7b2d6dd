// Four consecutive fp32 values of a row held in registers: the unit in which the one-row kernels
// (elementwise.cu, fused_prepare_attention.cu) issue all their loads up front. An aligned row
// (width and stride multiples of 4, 16-byte base) moves as one 16-byte access per quad; any other
// row as four scalar accesses bounded by its width (zeros read past it, nothing written there).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/elementwise.h"

namespace gemma4::cuda {

struct FloatQuad {
  float v[4];
};

// The quad starting at row[first]; `fill` stands for the values past `width` (unaligned rows).
template <bool kAligned>
__device__ __forceinline__ FloatQuad load_quad(const float* row, int64_t first, int64_t width,
                                               float fill = 0.0f) {
  if constexpr (kAligned) {
    const float4 f = *reinterpret_cast<const float4*>(row + first);
    return {{f.x, f.y, f.z, f.w}};
  } else {
    FloatQuad q;
#pragma unroll
    for (int e = 0; e < 4; ++e) q.v[e] = first + e < width ? row[first + e] : fill;
    return q;
  }
}

template <bool kAligned>
__device__ __forceinline__ void store_quad(float* row, int64_t first, int64_t width,
                                           const FloatQuad& q) {
  if constexpr (kAligned) {
    *reinterpret_cast<float4*>(row + first) = make_float4(q.v[0], q.v[1], q.v[2], q.v[3]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (first + e < width) row[first + e] = q.v[e];
  }
}

// The norm scale (weight_offset + weight[j]) of the quad at `first`; all ones for a null weight
// (the exact identity for the rounded products the kernels form).
template <bool kAligned>
__device__ __forceinline__ FloatQuad load_norm_scale(const float* weight, float weight_offset,
                                                     int64_t first, int64_t width) {
  if (weight == nullptr) return {{1.0f, 1.0f, 1.0f, 1.0f}};
  FloatQuad q = load_quad<kAligned>(weight, first, width);
#pragma unroll
  for (int e = 0; e < 4; ++e) q.v[e] = weight_offset + q.v[e];
  return q;
}

// How the register-resident row kernels (elementwise.cu: add_rms_norm, rms_norm without RoPE)
// take rows of `width` (<= 4 · kMaxRowQuads · kMaxRowThreads): thread t of `threads` holds quads
// t, t + threads, ... (quads_per_thread of them), one quad per thread while the row fits
// kMaxRowThreads (E2B's 1536: 384 threads), else two.
inline constexpr int kMaxRowThreads = 1024;
inline constexpr int kMaxRowQuads = 2;

struct RowShape {
  int quads_per_thread;
  unsigned threads;
};

__host__ __device__ inline RowShape row_shape(int64_t width) {
  const int64_t quads = (width + 3) / 4;
  const int per_thread = quads <= kMaxRowThreads ? 1 : 2;
  return {per_thread,
          static_cast<unsigned>(((quads + per_thread - 1) / per_thread + 31) / 32 * 32)};
}

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  return value;
}

// The block's total of one value per thread (kWarps warps), in every thread: the warps' totals
// added in warp order. Several warps sum across them in warp_sums[0, kWarps) (shared memory): the
// caller separates a previous total's readers from these writes (a barrier).
template <int kWarps>
__device__ __forceinline__ float block_total(float value, float* warp_sums) {
  float total = warp_sum(value);
  if constexpr (kWarps > 1) {
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = total;
    __syncthreads();
    total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  }
  return total;
}

__host__ __device__ inline bool aligned_16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Whether every row of `v` (or no rows at all: data null) starts 16-byte aligned.
inline bool aligned_rows(const RowsView& v) {
  return v.data == nullptr || (aligned_16(v.data) && v.stride % 4 == 0);
}

}  // namespace gemma4::cuda
