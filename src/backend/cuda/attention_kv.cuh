// Device side of the KV cache element types (attention.h KvType, engine::KvType): how every
// writer rounds a float into the cache and how every reader widens it back. One definition, so
// the writers (write_kv, prepare_attention) and the readers (decode, generic and prefill
// attention) agree bit for bit with the host rounding (core/numeric.h: round-to-nearest-even;
// e4m3 saturating at ±448, no scale: see engine::KvType).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/attention.h"
#include "backend/cuda/float_quads.cuh"

namespace gemma4::cuda {

template <typename KvT>
__device__ __forceinline__ KvT to_kv(float x) {
  if constexpr (std::is_same_v<KvT, float>) {
    return x;
  } else if constexpr (std::is_same_v<KvT, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    static_assert(std::is_same_v<KvT, __nv_fp8_e4m3>);
    return __nv_fp8_e4m3(x);  // round to nearest even, saturating (__NV_SATFINITE)
  }
}

template <typename KvT>
__device__ __forceinline__ float from_kv(KvT x) {
  if constexpr (std::is_same_v<KvT, float>) {
    return x;
  } else if constexpr (std::is_same_v<KvT, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    static_assert(std::is_same_v<KvT, __nv_fp8_e4m3>);
    return static_cast<float>(x);
  }
}

// Two e4m3 values (the low byte first) widened exactly (through fp16, which holds every e4m3).
__device__ __forceinline__ float2 fp8_pair_to_float2(uint16_t pair) {
  const __half2_raw halves = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&halves));
}

// The 4 · sizeof(KvT) bytes at `p` (aligned to them): 4 consecutive elements as floats.
template <typename KvT>
__device__ __forceinline__ float4 load_kv4(const KvT* p) {
  if constexpr (std::is_same_v<KvT, float>) {
    return *reinterpret_cast<const float4*>(p);
  } else if constexpr (std::is_same_v<KvT, __nv_bfloat16>) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xFFFF0000u),
                       __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xFFFF0000u));
  } else {
    static_assert(std::is_same_v<KvT, __nv_fp8_e4m3>);
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    const float2 lo = fp8_pair_to_float2(static_cast<uint16_t>(w));
    const float2 hi = fp8_pair_to_float2(static_cast<uint16_t>(w >> 16));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}

// store_quad for a cache row of KvT: the quad rounded to KvT (an aligned quad as one access of
// 4 · sizeof(KvT) bytes).
template <bool kAligned, typename KvT>
__device__ __forceinline__ void store_kv_quad(KvT* row, int64_t first, int64_t width,
                                              const FloatQuad& q) {
  if constexpr (std::is_same_v<KvT, float>) {
    store_quad<kAligned>(row, first, width, q);
  } else if constexpr (kAligned && std::is_same_v<KvT, __nv_bfloat16>) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(q.v[0], q.v[1]);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(q.v[2], q.v[3]);
    *reinterpret_cast<uint2*>(row + first) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                                        *reinterpret_cast<const uint32_t*>(&hi));
  } else if constexpr (kAligned) {
    static_assert(std::is_same_v<KvT, __nv_fp8_e4m3>);
    const uint32_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(q.v[0], q.v[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(q.v[2], q.v[3]), __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint32_t*>(row + first) = lo | hi << 16;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (first + e < width) row[first + e] = to_kv<KvT>(q.v[e]);
  }
}

// Calls f(KvT{}) with the element type of `type` (a kernel template's dispatch).
template <typename F>
decltype(auto) with_kv_type(KvType type, F&& f) {
  switch (type) {
    case KvType::kBF16:
      return f(__nv_bfloat16{});
    case KvType::kFP8:
      return f(__nv_fp8_e4m3{});
    case KvType::kF32:
      break;
  }
  return f(float{});
}

}  // namespace gemma4::cuda
