// One head of prepare_attention (fused_ops.h) by one warp: RMSNorm over the head (with a weight,
// or weightless) and the half-split RoPE, then a store to a float row or a KV cache row. Lane l
// owns the quads at 4c and half + 4c for c = l, l + 32, ...: the RoPE pairs (i, i + half) stay in
// one lane and the rotation needs no exchange. Shared by the prepare kernel
// (fused_prepare_attention.cu) and the decode attention's fused prologue (attention.cu), so both
// compute every bit alike.
#pragma once

#include <cstdint>

#include "backend/cuda/attention_kv.cuh"
#include "backend/cuda/float_quads.cuh"

namespace gemma4::cuda {

// The first element of lane `lane`'s k-th quad of a half head.
__device__ __forceinline__ int head_quad(int lane, int k) {
  return 4 * (lane + 32 * k);
}

// What a head's transform needs besides the head: the norm scales (weight_offset + w; ones
// without a weight) and RoPE frequencies of the lane's quads. None of it is written by a
// predecessor kernel, so it may be loaded before the PDL wait.
template <int kPairQuads>
struct HeadConstants {
  FloatQuad scale_first[kPairQuads], scale_second[kPairQuads], inv_freq[kPairQuads];
};

// inv_freq null: the head is not rotated (its frequencies are not read).
template <int kPairQuads, bool kAligned>
__device__ __forceinline__ HeadConstants<kPairQuads> load_head_constants(const float* weight,
                                                                         float weight_offset,
                                                                         const float* inv_freq,
                                                                         int half, int lane) {
  HeadConstants<kPairQuads> c;
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k) {
    if (head_quad(lane, k) >= half) continue;
    c.scale_first[k] = load_norm_scale<kAligned>(weight, weight_offset, head_quad(lane, k), half);
    c.scale_second[k] = load_norm_scale<kAligned>(weight ? weight + half : nullptr, weight_offset,
                                                  head_quad(lane, k), half);
    if (inv_freq != nullptr)
      c.inv_freq[k] = load_quad<kAligned>(inv_freq, head_quad(lane, k), half);
  }
  return c;
}

// A head as the lane's quads: first[k] at head_quad(lane, k), second[k] half further.
template <int kPairQuads>
struct HeadQuads {
  FloatQuad first[kPairQuads], second[kPairQuads];
};

// The RoPE rotation of the lane's quads at one position: cos and sin of the angle as the CPU
// reference rounds it, fp32(position) · inv_freq in fp32. It needs only the position and the
// frequencies, so the decode attention computes it before its PDL wait.
template <int kPairQuads>
struct HeadRotation {
  FloatQuad cos[kPairQuads], sin[kPairQuads];
};

template <int kPairQuads>
__device__ __forceinline__ HeadRotation<kPairQuads> head_rotation(
    const HeadConstants<kPairQuads>& c, int half, int32_t position, int lane) {
  HeadRotation<kPairQuads> r;
  const float angle_position = static_cast<float>(position);
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k) {
    if (head_quad(lane, k) >= half) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      sincosf(angle_position * c.inv_freq[k].v[e], &r.sin[k].v[e], &r.cos[k].v[e]);
  }
  return r;
}

// The lane's quads of the head at `src` (2 · half floats), as they are.
template <int kPairQuads, bool kAligned>
__device__ __forceinline__ HeadQuads<kPairQuads> load_head(const float* src, int half, int lane) {
  HeadQuads<kPairQuads> h;
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k) {
    h.first[k] = h.second[k] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (head_quad(lane, k) >= half) continue;
    h.first[k] = load_quad<kAligned>(src, head_quad(lane, k), half);
    h.second[k] = load_quad<kAligned>(src + half, head_quad(lane, k), half);
  }
  return h;
}

// A loaded head normed when `norm` (x · rsqrt(mean(x²) + eps) · scale) and rotated by `rotation`
// when `rotate` (pairs whose frequency is 0 stay as they are). Loading apart from the rest lets
// a warp with two heads issue both heads' loads before either's reduction.
template <int kPairQuads>
__device__ __forceinline__ HeadQuads<kPairQuads> finish_head(
    HeadQuads<kPairQuads> h, const HeadConstants<kPairQuads>& c, bool norm, bool rotate,
    const HeadRotation<kPairQuads>& rotation, float eps, int half, int lane) {
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      sum += h.first[k].v[e] * h.first[k].v[e] + h.second[k].v[e] * h.second[k].v[e];
  const float inv = norm ? 1.0f / sqrtf(warp_sum(sum) / static_cast<float>(2 * half) + eps) : 1.0f;
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k) {
    if (head_quad(lane, k) >= half) continue;
    if (norm) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        h.first[k].v[e] = h.first[k].v[e] * inv * c.scale_first[k].v[e];
        h.second[k].v[e] = h.second[k].v[e] * inv * c.scale_second[k].v[e];
      }
    }
    if (rotate) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (c.inv_freq[k].v[e] == 0.0f) continue;
        const float sin_angle = rotation.sin[k].v[e], cos_angle = rotation.cos[k].v[e];
        const float x = h.first[k].v[e], y = h.second[k].v[e];
        h.first[k].v[e] = x * cos_angle - y * sin_angle;
        h.second[k].v[e] = y * cos_angle + x * sin_angle;
      }
    }
  }
  return h;
}

// The head at `src` loaded and finished at `position` in one go. Every lane has read its
// elements before the warp's reduction completes, so a store of the result may overwrite src.
template <int kPairQuads, bool kAligned>
__device__ __forceinline__ HeadQuads<kPairQuads> transform_head(const float* src,
                                                                const HeadConstants<kPairQuads>& c,
                                                                bool norm, bool rotate, float eps,
                                                                int half, int32_t position,
                                                                int lane) {
  const HeadQuads<kPairQuads> h = load_head<kPairQuads, kAligned>(src, half, lane);
  HeadRotation<kPairQuads> rotation = {};
  if (rotate) rotation = head_rotation(c, half, position, lane);
  return finish_head(h, c, norm, rotate, rotation, eps, half, lane);
}

// Stores the lane's quads of a head to `dst` (a float row, or a KV cache row of T: rounded as
// attention_kv.cuh).
template <bool kAligned, typename T, int kPairQuads>
__device__ __forceinline__ void store_head(T* dst, const HeadQuads<kPairQuads>& h, int half,
                                           int lane) {
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k) {
    if (head_quad(lane, k) >= half) continue;
    store_kv_quad<kAligned>(dst, head_quad(lane, k), half, h.first[k]);
    store_kv_quad<kAligned>(dst + half, head_quad(lane, k), half, h.second[k]);
  }
}

}  // namespace gemma4::cuda
