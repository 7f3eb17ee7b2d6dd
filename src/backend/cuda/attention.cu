// Decode attention (see attention.h). Block (split, kv head, sequence) of 8 warps. Lane l owns
// dims [l·D, l·D + D) of a head (D = head_dim / 32), so a warp reads each K/V row with one
// coalesced sweep. Warp w serves q heads [hg·HPW, hg·HPW + HPW) of the group (hg = w % HG) over
// the keys ks, ks + KS, ... of the split (ks = w / HG): with few heads per group more warps share
// the keys. Each warp keeps an online softmax (max, sum, acc) per head; the warps of a block are
// merged in shared memory, and the splits by a small second kernel.
#include <cuda_bf16.h>

#include "backend/cuda/attention.h"
#include "backend/cuda/launch.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kWarps = 8;
// The merge keeps one weight per split in shared memory.
constexpr int kMaxSplits = 4096;

struct AttentionArgs {
  const float* q;
  int64_t q_stride;
  int q_heads;
  int group;  // q heads per kv head
  const int32_t* positions;
  const void* keys;
  const void* values;
  const int32_t* slot_positions;
  int64_t slots;
  int kv_heads;
  int64_t sequence_stride;
  int window;
  float scale;
  int splits;
  float* out;  // splits == 1
  int64_t out_stride;
  float* partials;  // splits > 1: [batch][q_heads][splits][head_dim + 2] = (max, sum, acc)
};

template <int D>
__device__ __forceinline__ void load_row(const float* p, float (&v)[D]) {
#pragma unroll
  for (int i = 0; i < D / 4; ++i) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p) + i);
    v[4 * i] = q.x;
    v[4 * i + 1] = q.y;
    v[4 * i + 2] = q.z;
    v[4 * i + 3] = q.w;
  }
}

template <int D>
__device__ __forceinline__ void load_row(const __nv_bfloat16* p, float (&v)[D]) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p) + i);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[8 * i + 2 * j] = __uint_as_float(words[j] << 16);
      v[8 * i + 2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
    }
  }
}

template <int HD, int HPW, typename KvT>
__global__ void __launch_bounds__(kWarps * 32) decode_attention_kernel(AttentionArgs a) {
  constexpr int D = HD / 32;
  pdl_trigger_dependents();
  __shared__ float merge[kWarps][HPW][HD + 2];
  pdl_wait_for_predecessors();

  const int split = blockIdx.x;
  const int kv = blockIdx.y;
  const int b = blockIdx.z;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int head_groups = (a.group + HPW - 1) / HPW;
  const int key_slices = kWarps / head_groups;
  const int hg = warp % head_groups;
  const int ks = warp / head_groups;
  const bool active = ks < key_slices;

  const int32_t query_position = a.positions[b];
  const int64_t scanned = min(a.slots, static_cast<int64_t>(query_position) + 1);
  const int64_t per_split = (scanned + a.splits - 1) / a.splits;
  const int64_t begin = split * per_split;
  const int64_t end = min(scanned, begin + per_split);

  float q[HPW][D];
  float acc[HPW][D];
  float running_max[HPW];
  float running_sum[HPW];
#pragma unroll
  for (int i = 0; i < HPW; ++i) {
    const int g = hg * HPW + i;
    if (active && g < a.group) {
      load_row(a.q + b * a.q_stride + static_cast<int64_t>(kv * a.group + g) * HD + lane * D, q[i]);
    } else {
#pragma unroll
      for (int d = 0; d < D; ++d) q[i][d] = 0.0f;
    }
#pragma unroll
    for (int d = 0; d < D; ++d) {
      q[i][d] *= a.scale;
      acc[i][d] = 0.0f;
    }
    running_max[i] = -INFINITY;
    running_sum[i] = 0.0f;
  }

  const KvT* keys = static_cast<const KvT*>(a.keys) + b * a.sequence_stride;
  const KvT* values = static_cast<const KvT*>(a.values) + b * a.sequence_stride;
  const int32_t* slot_positions = a.slot_positions + b * a.slots;
  // kBatch keys per step: their positions, K and V rows are all loaded before any is used (one
  // memory round trip per step, not two per key). Slots in [0, scanned) are always readable, so
  // the loads need no visibility test; invisible keys get weight 0.
  constexpr int kBatch = HD == 256 ? 4 : 2;
  if (active) {
    for (int64_t j0 = begin + ks; j0 < end; j0 += kBatch * key_slices) {
      int32_t p[kBatch];
      float k[kBatch][D], v[kBatch][D];
#pragma unroll
      for (int t = 0; t < kBatch; ++t) {
        const int64_t j = j0 + t * key_slices;
        if (j < end) {
          p[t] = slot_positions[j];
          const int64_t row = (j * a.kv_heads + kv) * HD + lane * D;
          load_row(keys + row, k[t]);
          load_row(values + row, v[t]);
        } else {
          // Past the split's end: nothing loaded, and no stale register may reach the sums.
          p[t] = -1;
#pragma unroll
          for (int d = 0; d < D; ++d) k[t][d] = v[t][d] = 0.0f;
        }
      }
      float score[kBatch][HPW];
#pragma unroll
      for (int t = 0; t < kBatch; ++t) {
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
          float s = 0.0f;
          if (p[t] >= 0) {
#pragma unroll
            for (int d = 0; d < D; ++d) s = fmaf(q[i][d], k[t][d], s);
          }
          score[t][i] = s;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
        for (int t = 0; t < kBatch; ++t) {
#pragma unroll
          for (int i = 0; i < HPW; ++i) {
            score[t][i] += __shfl_xor_sync(0xFFFFFFFFu, score[t][i], offset);
          }
        }
      }
      bool visible[kBatch];
#pragma unroll
      for (int t = 0; t < kBatch; ++t) {
        visible[t] = p[t] >= 0 && p[t] <= query_position &&
                     (a.window <= 0 || query_position - p[t] < a.window);
      }
#pragma unroll
      for (int i = 0; i < HPW; ++i) {
        float new_max = running_max[i];
#pragma unroll
        for (int t = 0; t < kBatch; ++t) {
          if (visible[t]) new_max = fmaxf(new_max, score[t][i]);
        }
        if (new_max == -INFINITY) continue;  // nothing visible yet
        const float rescale = expf(running_max[i] - new_max);
        float sum = running_sum[i] * rescale;
#pragma unroll
        for (int d = 0; d < D; ++d) acc[i][d] *= rescale;
#pragma unroll
        for (int t = 0; t < kBatch; ++t) {
          if (!visible[t]) continue;
          const float weight = expf(score[t][i] - new_max);
          sum += weight;
#pragma unroll
          for (int d = 0; d < D; ++d) acc[i][d] = fmaf(weight, v[t][d], acc[i][d]);
        }
        running_sum[i] = sum;
        running_max[i] = new_max;
      }
    }
  }

  // Merge the key slices of this block.
#pragma unroll
  for (int i = 0; i < HPW; ++i) {
#pragma unroll
    for (int d = 0; d < D; ++d) merge[warp][i][2 + lane * D + d] = acc[i][d];
    if (lane == 0) {
      merge[warp][i][0] = running_max[i];
      merge[warp][i][1] = running_sum[i];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < a.group * HD; idx += blockDim.x) {
    const int g = idx / HD;
    const int d = idx % HD;
    const int group_warp = g / HPW;
    const int i = g % HPW;
    float block_max = -INFINITY;
    for (int s = 0; s < key_slices; ++s)
      block_max = fmaxf(block_max, merge[group_warp + s * head_groups][i][0]);
    float sum = 0.0f, value = 0.0f;
    if (block_max != -INFINITY) {
      for (int s = 0; s < key_slices; ++s) {
        const float* m = merge[group_warp + s * head_groups][i];
        const float w = expf(m[0] - block_max);
        sum += m[1] * w;
        value += m[2 + d] * w;
      }
    }
    const int head = kv * a.group + g;
    if (a.splits == 1) {
      a.out[b * a.out_stride + static_cast<int64_t>(head) * HD + d] =
          sum > 0.0f ? value / sum : 0.0f;
    } else {
      float* record =
          a.partials + ((static_cast<int64_t>(b) * a.q_heads + head) * a.splits + split) * (HD + 2);
      record[2 + d] = value;
      if (d == 0) {
        record[0] = block_max;
        record[1] = sum;
      }
    }
  }
}

struct MergeArgs {
  const float* partials;
  int q_heads;
  int head_dim;
  int splits;
  float* out;
  int64_t out_stride;
};

constexpr int kMergeWarps = 8;

// Block (head, sequence) of 8 warps. The splits' weights exp(max_s − max) go to shared memory
// once; warp w then accumulates the splits w, w + 8, ... for every dim (lane l owns dims l + 32i,
// independent loads per split), and the 8 partial vectors are summed in shared memory.
__global__ void __launch_bounds__(kMergeWarps * 32) merge_splits_kernel(MergeArgs a) {
  pdl_trigger_dependents();
  __shared__ float split_weight[kMaxSplits];
  __shared__ float warp_partial[kMergeWarps][512];
  __shared__ float scratch[kMergeWarps];
  pdl_wait_for_predecessors();
  const int head = blockIdx.x;
  const int b = blockIdx.y;
  const int64_t record = a.head_dim + 2;
  const float* base = a.partials + (static_cast<int64_t>(b) * a.q_heads + head) * a.splits * record;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  float local_max = -INFINITY;
  for (int s = threadIdx.x; s < a.splits; s += blockDim.x) {
    local_max = fmaxf(local_max, base[s * record]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local_max = fmaxf(local_max, __shfl_xor_sync(0xFFFFFFFFu, local_max, offset));
  }
  if (lane == 0) scratch[warp] = local_max;
  __syncthreads();
  float global_max = -INFINITY;
  for (int w = 0; w < kMergeWarps; ++w) global_max = fmaxf(global_max, scratch[w]);
  __syncthreads();

  float local_sum = 0.0f;
  for (int s = threadIdx.x; s < a.splits; s += blockDim.x) {
    const float m = base[s * record];
    const float w = global_max == -INFINITY || m == -INFINITY ? 0.0f : expf(m - global_max);
    split_weight[s] = w;
    local_sum += w * base[s * record + 1];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local_sum += __shfl_xor_sync(0xFFFFFFFFu, local_sum, offset);
  }
  if (lane == 0) scratch[warp] = local_sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kMergeWarps; ++w) total += scratch[w];

  constexpr int kMaxDimsPerLane = 512 / 32;
  const int dims_per_lane = a.head_dim / 32;
  float acc[kMaxDimsPerLane] = {};
  for (int s = warp; s < a.splits; s += kMergeWarps) {
    const float w = split_weight[s];
    const float* values = base + s * record + 2;
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      if (i < dims_per_lane) acc[i] = fmaf(w, values[lane + 32 * i], acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    if (i < dims_per_lane) warp_partial[warp][lane + 32 * i] = acc[i];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    float value = 0.0f;
    for (int w = 0; w < kMergeWarps; ++w) value += warp_partial[w][d];
    a.out[b * a.out_stride + static_cast<int64_t>(head) * a.head_dim + d] =
        total > 0.0f ? value / total : 0.0f;
  }
}

using AttentionKernel = void (*)(AttentionArgs);

template <typename KvT>
AttentionKernel select_kernel(int head_dim) {
  if (head_dim == 256) return decode_attention_kernel<256, 4, KvT>;
  if (head_dim == 512) return decode_attention_kernel<512, 2, KvT>;
  return nullptr;
}

constexpr int heads_per_warp(int head_dim) {
  return head_dim == 256 ? 4 : 2;
}

}  // namespace

size_t attention_partials_floats(int batch, int q_heads, int head_dim, int max_splits) {
  return static_cast<size_t>(batch) * q_heads * max_splits * (head_dim + 2);
}

cudaError_t decode_attention(const AttentionQuery& query, const KvCacheView& kv, int window,
                             float scale, float* out, int64_t out_stride,
                             const AttentionWorkspace& workspace, int splits,
                             const Launch& launch) {
  AttentionKernel kernel = kv.type == KvType::kBF16 ? select_kernel<__nv_bfloat16>(kv.head_dim)
                                                    : select_kernel<float>(kv.head_dim);
  if (kernel == nullptr || kv.kv_heads < 1 || query.q_heads % kv.kv_heads != 0 || query.batch < 1 ||
      query.batch > 65535 || kv.kv_heads > 65535 || splits < 1 || splits > kMaxSplits ||
      kv.slots < 1 || query.q == nullptr || query.positions == nullptr || kv.keys == nullptr ||
      kv.values == nullptr || kv.slot_positions == nullptr || out == nullptr ||
      (splits > 1 && (workspace.partials == nullptr || splits > workspace.max_splits))) {
    return cudaErrorInvalidValue;
  }
  const int group = query.q_heads / kv.kv_heads;
  const int head_groups = (group + heads_per_warp(kv.head_dim) - 1) / heads_per_warp(kv.head_dim);
  if (head_groups > kWarps) return cudaErrorInvalidValue;
  AttentionArgs args = {};
  args.q = query.q;
  args.q_stride = query.stride;
  args.q_heads = query.q_heads;
  args.group = group;
  args.positions = query.positions;
  args.keys = kv.keys;
  args.values = kv.values;
  args.slot_positions = kv.slot_positions;
  args.slots = kv.slots;
  args.kv_heads = kv.kv_heads;
  args.sequence_stride = kv.sequence_stride;
  args.window = window;
  args.scale = scale;
  args.splits = splits;
  args.out = out;
  args.out_stride = out_stride;
  args.partials = workspace.partials;
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(kv.kv_heads),
                  static_cast<unsigned>(query.batch));
  cudaError_t status = launch_kernel(kernel, grid, dim3(kWarps * 32), 0, launch, args);
  if (status != cudaSuccess || splits == 1) return status;
  const MergeArgs merge = {workspace.partials, query.q_heads, kv.head_dim, splits, out, out_stride};
  return launch_kernel(
      merge_splits_kernel,
      dim3(static_cast<unsigned>(query.q_heads), static_cast<unsigned>(query.batch)),
      dim3(kMergeWarps * 32), 0, launch, merge);
}

}  // namespace gemma4::cuda
