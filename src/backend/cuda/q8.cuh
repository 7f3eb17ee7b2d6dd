// Device side of the activation companions (gemv_kernels.h): the kQ8 layout, where 32 / N
// consecutive lanes (aligned) hold one 32-element chunk, N values each, and the bf16 copy. Shared
// by the stand-alone converter (gemv.cu), the norms (elementwise.cu) and the GEMV epilogue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda {

// The lanes of `value`'s chunk are the aligned group of kLanes around this one: xor offsets below
// kLanes stay inside it. Every lane of the warp must call (full-mask shuffles).
template <int kLanes, typename T, typename Op>
__device__ __forceinline__ T chunk_reduce(T value, Op op) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  }
  return value;
}

// Lane `lane` holds elements (lane % (32 / N)) · N + i of chunk `chunk` of the kQ8 row at
// `row_base` (a row of `stride` elements: values, then stride/32 fp32 scales, then stride/32 int32
// sums). Writes q = round(value / (max|chunk| / 127)) (ties to even) at each value's permuted byte
// (element e of a group of 8 at byte e/2 for even e, 4 + e/2 for odd e: the nibble order of a
// packed word) and, from the group's first lane, the scale and Σq. Every lane of the warp calls;
// `store` false lanes (past the row) take part in the reductions with zeros and write nothing.
template <int N>
__device__ __forceinline__ void store_chunk_q8(const float (&values)[N], int lane,
                                               uint8_t* row_base, int64_t stride, int64_t chunk,
                                               bool store = true) {
  constexpr int kLanes = 32 / N;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(values[i]));
  amax = chunk_reduce<kLanes>(amax, [](float a, float b) { return fmaxf(a, b); });
  const float scale = amax / 127.0f;
  int q[N];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    q[i] = scale > 0.0f ? __float2int_rn(values[i] / scale) : 0;
    sum += q[i];
  }
  sum = chunk_reduce<kLanes>(sum, [](int a, int b) { return a + b; });
  if (!store) return;
  const int first = (lane % kLanes) * N;
  if constexpr (N == 4) {
    // Elements first .. first + 3 (half a group of 8) land at bytes b, b + 4 (the even ones) and
    // b + 1, b + 5 (the odd ones), b = first % 8 / 2 of their group: two 2-byte stores.
    uint8_t* group = row_base + chunk * 32 + (first / 8) * 8 + first % 8 / 2;
    const auto byte = [](int v) { return static_cast<uint32_t>(static_cast<uint8_t>(v)); };
    *reinterpret_cast<uint16_t*>(group) = static_cast<uint16_t>(byte(q[0]) | byte(q[2]) << 8);
    *reinterpret_cast<uint16_t*>(group + 4) = static_cast<uint16_t>(byte(q[1]) | byte(q[3]) << 8);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int element = first + i;
      const int e = element % 8;
      row_base[chunk * 32 + (element / 8) * 8 + (e % 2 ? 4 : 0) + e / 2] =
          static_cast<uint8_t>(static_cast<int8_t>(q[i]));
    }
  }
  if (lane % kLanes == 0) {
    reinterpret_cast<float*>(row_base + stride)[chunk] = scale;
    reinterpret_cast<int*>(row_base + stride + stride / 8)[chunk] = sum;
  }
}

// Row r of a companion's kQ8 array.
__device__ __forceinline__ uint8_t* q8_row(const ActivationCompanions& c, int64_t r) {
  return static_cast<uint8_t*>(c.q8) + r * (c.stride + c.stride / 4);
}

// The companions of elements first .. first + N − 1 (N consecutive lanes' worth, see
// store_chunk_q8; first a multiple of N) of row r: bf16 and/or kQ8. Every lane of the warp calls.
template <int N>
__device__ __forceinline__ void store_companions(const ActivationCompanions& c, int64_t r,
                                                 int64_t first, const float (&values)[N],
                                                 bool store = true) {
  if (c.bf16 != nullptr && store) {
    __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(c.bf16) + r * c.stride + first;
    if constexpr (N == 4) {
      // first is a multiple of 4 in a 64-byte aligned row (stride a multiple of 32): 8 bytes.
      const __nv_bfloat162 lo = __floats2bfloat162_rn(values[0], values[1]);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(values[2], values[3]);
      *reinterpret_cast<uint2*>(row) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                                  *reinterpret_cast<const uint32_t*>(&hi));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) row[i] = __float2bfloat16_rn(values[i]);
    }
  }
  if (c.q8 != nullptr) {
    store_chunk_q8<N>(values, static_cast<int>(threadIdx.x & 31), q8_row(c, r), c.stride,
                      first / 32, store);
  }
}

}  // namespace gemma4::cuda
