// RoPE, row maps, the KV store and generic attention (backend_kernels.h). fp32 math throughout, as
// the CPU reference (K/V widened from the cache's element type).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/attention_kv.cuh"
#include "backend/cuda/backend_kernels.h"
#include "backend/cuda/launch.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kThreads = 256;

bool valid_rows(const RowsView& v) {
  return v.data != nullptr && v.rows >= 1 && v.width >= 1 && v.stride >= v.width;
}

bool same_shape(const RowsView& a, const RowsView& b) {
  return a.rows == b.rows && a.width == b.width;
}

// A grid that covers `rows` rows of `width` (both loops stride, so any size works).
dim3 row_grid(int64_t rows, int64_t width) {
  return dim3(static_cast<unsigned>(std::min<int64_t>((width + kThreads - 1) / kThreads, 1024)),
              static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
}

__global__ void __launch_bounds__(kThreads)
    rope_kernel(RowsView x, int head_dim, const int32_t* positions, const float* inv_freq) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int half = head_dim / 2;
  const int64_t heads = x.width / head_dim;
  for (int64_t t = blockIdx.y; t < x.rows; t += gridDim.y) {
    const float position = static_cast<float>(positions[t]);
    float* row = x.data + t * x.stride;
    // Each thread owns whole pairs (i, i + half) of one head.
    for (int64_t pair = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; pair < heads * half;
         pair += int64_t{gridDim.x} * blockDim.x) {
      const int i = static_cast<int>(pair % half);
      if (inv_freq[i] == 0.0f) continue;  // cos 0 = 1, sin 0 = 0: the pair passes through
      float sin_angle, cos_angle;
      sincosf(position * inv_freq[i], &sin_angle, &cos_angle);
      float* head = row + (pair / half) * head_dim;
      const float a = head[i], b = head[i + half];
      head[i] = a * cos_angle - b * sin_angle;
      head[i + half] = b * cos_angle + a * sin_angle;
    }
  }
}

// kLanes consecutive floats of p at word j (of kLanes floats each; 16-byte aligned for 4).
template <int kLanes>
__device__ __forceinline__ void load_word(const float* p, int64_t j, float (&v)[kLanes]) {
  if constexpr (kLanes == 4) {
    const float4 w = reinterpret_cast<const float4*>(p)[j];
    v[0] = w.x;
    v[1] = w.y;
    v[2] = w.z;
    v[3] = w.w;
  } else {
    v[0] = p[j];
  }
}

template <int kLanes>
__device__ __forceinline__ void store_word(float* p, int64_t j, const float (&v)[kLanes]) {
  if constexpr (kLanes == 4) {
    reinterpret_cast<float4*>(p)[j] = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    p[j] = v[0];
  }
}

// kLanes floats a thread: 4 (one 16-byte load and store each, row_grid over width / 4) where
// the rows are whole aligned float4s, else 1. At E2B's 64-row logits (16.8M floats) the 4-byte
// accesses of a thread each moved 134 MB at ~1.4 TB/s (softcap: 93 µs on the step's critical
// path, session 10's CUPTI timeline).
template <RowMap kMap, int kLanes>
__global__ void __launch_bounds__(kThreads)
    map_kernel(RowsView acc, RowsView x, const float* column_scale, float scalar) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t words = acc.width / kLanes;
  for (int64_t r = blockIdx.y; r < acc.rows; r += gridDim.y) {
    float* a = acc.data + r * acc.stride;
    const float* b = x.data + r * x.stride;
    for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < words;
         j += int64_t{gridDim.x} * blockDim.x) {
      float v[kLanes], other[kLanes];
      if constexpr (kMap != RowMap::kCopy) load_word(a, j, v);
      if constexpr (kMap == RowMap::kAdd || kMap == RowMap::kCopy) load_word(b, j, other);
      if constexpr (kMap == RowMap::kScale) {
        if (column_scale != nullptr) {
          load_word(column_scale, j, other);
          for (int e = 0; e < kLanes; ++e) v[e] *= other[e];
        }
      }
#pragma unroll
      for (int e = 0; e < kLanes; ++e) {
        if constexpr (kMap == RowMap::kAdd) {
          v[e] += other[e];
        } else if constexpr (kMap == RowMap::kScale) {
          v[e] *= scalar;
        } else if constexpr (kMap == RowMap::kSoftcap) {
          v[e] = scalar * tanhf(v[e] / scalar);
        } else {
          v[e] = other[e];
        }
      }
      store_word(a, j, v);
    }
  }
}

template <RowMap kMap>
cudaError_t launch_map(bool vector, const RowsView& acc, const RowsView& x,
                       const float* column_scale, float scalar, const Launch& launch) {
  if (vector) {
    return launch_kernel(map_kernel<kMap, 4>, row_grid(acc.rows, acc.width / 4), dim3(kThreads), 0,
                         launch, acc, x, column_scale, scalar);
  }
  return launch_kernel(map_kernel<kMap, 1>, row_grid(acc.rows, acc.width), dim3(kThreads), 0,
                       launch, acc, x, column_scale, scalar);
}

template <typename KvT>
__global__ void __launch_bounds__(kThreads)
    write_kv_kernel(KvSlots kv, RowsView k, RowsView v, const int32_t* positions) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t width = int64_t{kv.kv_heads} * kv.head_dim;
  for (int64_t t = blockIdx.y; t < k.rows; t += gridDim.y) {
    const int32_t position = positions[t];
    const int64_t slot = position % kv.slots;
    for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < width;
         j += int64_t{gridDim.x} * blockDim.x) {
      static_cast<KvT*>(kv.keys)[slot * width + j] = to_kv<KvT>(k.data[t * k.stride + j]);
      static_cast<KvT*>(kv.values)[slot * width + j] = to_kv<KvT>(v.data[t * v.stride + j]);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) kv.slot_positions[slot] = position;
  }
}

__global__ void forget_kv_kernel(KvSlots kv, int64_t from_position) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  for (int64_t slot = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; slot < kv.slots;
       slot += int64_t{gridDim.x} * blockDim.x) {
    if (kv.slot_positions[slot] >= from_position) kv.slot_positions[slot] = -1;
  }
}

constexpr int kAttentionWarps = 4;
constexpr int kMaxDimsPerLane = 512 / 32;

// Block (q head h, query t). Warp w scans slots w, w + 4, ... with an online softmax; lane l
// holds dims l + 32·i of the head; the warps are merged through shared memory.
template <typename KvT>
__global__ void __launch_bounds__(kAttentionWarps * 32)
    attention_kernel(RowsView q, const int32_t* positions, KvSlots kv, int window, float scale,
                     RowsView out) {
  pdl_trigger_dependents();
  __shared__ float merge[kAttentionWarps][kMaxDimsPerLane * 32 + 2];
  pdl_wait_for_predecessors();
  const int head = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int head_dim = kv.head_dim;
  const int dims = head_dim / 32;
  const int q_heads = static_cast<int>(q.width / head_dim);
  const int kv_head = head / (q_heads / kv.kv_heads);
  const int64_t kv_width = int64_t{kv.kv_heads} * head_dim;
  const int32_t query_position = positions[t];

  float query[kMaxDimsPerLane], acc[kMaxDimsPerLane];
  const float* q_row = q.data + t * q.stride + int64_t{head} * head_dim;
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    query[i] = i < dims ? q_row[lane + 32 * i] : 0.0f;
    acc[i] = 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  // Position p lives in slot p % slots: with more slots than P + 1 the visible ones are below.
  const int64_t scanned = min(kv.slots, static_cast<int64_t>(query_position) + 1);
  for (int64_t slot = warp; slot < scanned; slot += kAttentionWarps) {
    const int32_t p = kv.slot_positions[slot];
    const bool visible =
        p >= 0 && p <= query_position && (window == 0 || query_position - p < window);
    if (!visible) continue;  // uniform across the warp
    const KvT* key =
        static_cast<const KvT*>(kv.keys) + slot * kv_width + int64_t{kv_head} * head_dim;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      if (i < dims) dot = fmaf(query[i], from_kv(key[lane + 32 * i]), dot);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, offset);
    const float score = dot * scale;
    const float new_max = fmaxf(running_max, score);
    const float rescale = expf(running_max - new_max);  // 0 for the first visible key
    const float weight = expf(score - new_max);
    const KvT* value =
        static_cast<const KvT*>(kv.values) + slot * kv_width + int64_t{kv_head} * head_dim;
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      if (i < dims) acc[i] = fmaf(weight, from_kv(value[lane + 32 * i]), acc[i] * rescale);
    }
    running_sum = running_sum * rescale + weight;
    running_max = new_max;
  }

#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    if (i < dims) merge[warp][2 + lane + 32 * i] = acc[i];
  }
  if (lane == 0) {
    merge[warp][0] = running_max;
    merge[warp][1] = running_sum;
  }
  __syncthreads();
  float block_max = -INFINITY;
  for (int w = 0; w < kAttentionWarps; ++w) block_max = fmaxf(block_max, merge[w][0]);
  float* o = out.data + t * out.stride + int64_t{head} * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float sum = 0.0f, value = 0.0f;
    if (block_max != -INFINITY) {
      for (int w = 0; w < kAttentionWarps; ++w) {
        if (merge[w][0] == -INFINITY) continue;
        const float scale_w = expf(merge[w][0] - block_max);
        sum += merge[w][1] * scale_w;
        value += merge[w][2 + d] * scale_w;
      }
    }
    o[d] = sum > 0.0f ? value / sum : 0.0f;  // nothing visible: zeros, as the CPU reference
  }
}

bool valid_kv(const KvSlots& kv) {
  return kv.keys != nullptr && kv.values != nullptr && kv.slot_positions != nullptr &&
         kv.slots >= 1 && kv.kv_heads >= 1 && kv.head_dim >= 1;
}

}  // namespace

cudaError_t rope_rows(const RowsView& x, int head_dim, const int32_t* positions,
                      const float* inv_freq, const Launch& launch) {
  if (!valid_rows(x) || head_dim < 2 || head_dim % 2 != 0 || x.width % head_dim != 0 ||
      positions == nullptr || inv_freq == nullptr) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel(rope_kernel, row_grid(x.rows, x.width / 2), dim3(kThreads), 0, launch, x,
                       head_dim, positions, inv_freq);
}

cudaError_t map_rows(RowMap map, const RowsView& acc, const RowsView& x, const float* column_scale,
                     float scalar, const Launch& launch) {
  const bool reads_x = map == RowMap::kAdd || map == RowMap::kCopy;
  if (!valid_rows(acc) || (reads_x && (!valid_rows(x) || !same_shape(acc, x)))) {
    return cudaErrorInvalidValue;
  }
  const auto whole_float4s = [](const float* p, int64_t stride) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0 && stride % 4 == 0;
  };
  const bool vector = acc.width % 4 == 0 && whole_float4s(acc.data, acc.stride) &&
                      (!reads_x || whole_float4s(x.data, x.stride)) &&
                      (column_scale == nullptr || whole_float4s(column_scale, 0));
  switch (map) {
    case RowMap::kAdd:
      return launch_map<RowMap::kAdd>(vector, acc, x, column_scale, scalar, launch);
    case RowMap::kScale:
      return launch_map<RowMap::kScale>(vector, acc, x, column_scale, scalar, launch);
    case RowMap::kSoftcap:
      return launch_map<RowMap::kSoftcap>(vector, acc, x, column_scale, scalar, launch);
    case RowMap::kCopy:
      return launch_map<RowMap::kCopy>(vector, acc, x, column_scale, scalar, launch);
  }
  return cudaErrorInvalidValue;
}

cudaError_t write_kv(const KvSlots& kv, const RowsView& k, const RowsView& v,
                     const int32_t* positions, const Launch& launch) {
  const int64_t width = int64_t{kv.kv_heads} * kv.head_dim;
  if (!valid_kv(kv) || !valid_rows(k) || !valid_rows(v) || !same_shape(k, v) || k.width != width ||
      positions == nullptr || k.rows > kv.slots) {
    return cudaErrorInvalidValue;
  }
  return with_kv_type(kv.type, [&](auto element) {
    return launch_kernel(write_kv_kernel<decltype(element)>, row_grid(k.rows, width),
                         dim3(kThreads), 0, launch, kv, k, v, positions);
  });
}

cudaError_t forget_kv(const KvSlots& kv, int64_t from_position, const Launch& launch) {
  if (!valid_kv(kv)) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>((kv.slots + kThreads - 1) / kThreads, 4096);
  return launch_kernel(forget_kv_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                       launch, kv, from_position);
}

cudaError_t attention_rows(const RowsView& q, const int32_t* positions, const KvSlots& kv,
                           int window, float scale, const RowsView& out, const Launch& launch) {
  if (!valid_rows(q) || !valid_rows(out) || !same_shape(q, out) || !valid_kv(kv) ||
      positions == nullptr || kv.head_dim % 32 != 0 || kv.head_dim > 512 ||
      q.width % kv.head_dim != 0 || (q.width / kv.head_dim) % kv.kv_heads != 0 ||
      q.width / kv.head_dim > 0x7FFFFFFF || q.rows > 65535) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(q.width / kv.head_dim), static_cast<unsigned>(q.rows));
  return with_kv_type(kv.type, [&](auto element) {
    return launch_kernel(attention_kernel<decltype(element)>, grid, dim3(kAttentionWarps * 32), 0,
                         launch, q, positions, kv, window, scale, out);
  });
}

}  // namespace gemma4::cuda
