// Decode attention (see attention.h). Block (split, kv head, sequence) of 8 warps. Lane l owns
// dims [l·D, l·D + D) of a head (D = head_dim / 32), so a warp reads each K/V row with one
// coalesced sweep. Warp w serves q heads [hg·HPW, hg·HPW + HPW) of the group (hg = w % HG) over
// the keys ks, ks + KS, ... of the split (ks = w / HG): with few heads per group more warps share
// the keys. Each warp keeps an online softmax (max, sum, acc) per head; the warps of a block are
// merged in shared memory, and the splits by a small second kernel. The sequences come from a
// table in the kernel parameters, so one launch serves a whole decode batch of separate caches.
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
  SequenceKvTable sequences;
  int kv_heads;
  int window;
  float scale;
  int splits;
  float* out;  // splits == 1
  int64_t out_stride;
  float* partials;  // splits > 1: [batch][q_heads][splits][head_dim + 2] = (max, sum, acc)
};

// Slots [0, scanned) hold the positions a query at `query_position` may see.
__device__ __forceinline__ int64_t scanned_slots(int64_t slots, int32_t query_position) {
  return min(slots, static_cast<int64_t>(query_position) + 1);
}

// Keys per split block: at least kMinKeysPerSplit, so a shallow cache uses few of the splits.
__device__ __forceinline__ int64_t keys_per_split(int64_t scanned, int splits) {
  return max(kMinKeysPerSplit, (scanned + splits - 1) / splits);
}

// The split blocks that hold keys (at least one, which writes zeros when nothing is visible).
__device__ __forceinline__ int used_splits(int64_t scanned, int splits) {
  const int64_t per_split = keys_per_split(scanned, splits);
  return static_cast<int>(max(int64_t{1}, (scanned + per_split - 1) / per_split));
}

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
  const SequenceKv& sequence = a.sequences.entries[blockIdx.z];
  const int64_t row = sequence.first_row;
  const int32_t query_position = a.positions[row];
  const int64_t scanned = scanned_slots(sequence.slots, query_position);
  if (split >= used_splits(scanned, a.splits)) return;  // the merge skips this split
  const int64_t per_split = keys_per_split(scanned, a.splits);
  const int64_t begin = split * per_split;
  const int64_t end = min(scanned, begin + per_split);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int head_groups = (a.group + HPW - 1) / HPW;
  const int key_slices = kWarps / head_groups;
  const int hg = warp % head_groups;
  const int ks = warp / head_groups;
  const bool active = ks < key_slices;

  float q[HPW][D];
  float acc[HPW][D];
  float running_max[HPW];
  float running_sum[HPW];
#pragma unroll
  for (int i = 0; i < HPW; ++i) {
    const int g = hg * HPW + i;
    if (active && g < a.group) {
      load_row(a.q + row * a.q_stride + static_cast<int64_t>(kv * a.group + g) * HD + lane * D,
               q[i]);
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

  const KvT* keys = static_cast<const KvT*>(sequence.keys);
  const KvT* values = static_cast<const KvT*>(sequence.values);
  const int32_t* slot_positions = sequence.slot_positions;
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
      a.out[row * a.out_stride + static_cast<int64_t>(head) * HD + d] =
          sum > 0.0f ? value / sum : 0.0f;
    } else {
      float* record =
          a.partials +
          ((static_cast<int64_t>(blockIdx.z) * a.q_heads + head) * a.splits + split) * (HD + 2);
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
  const int32_t* positions;
  SequenceKvTable sequences;
  int q_heads;
  int head_dim;
  int splits;
  float* out;
  int64_t out_stride;
};

constexpr int kMergeWarps = 8;

// Block (head, sequence) of 8 warps, over the splits the attention kernel used. The splits' weights
// exp(max_s − max) go to shared memory once; warp w then accumulates the splits w, w + 8, ... for
// every dim (lane l owns dims l + 32i, independent loads per split), and the 8 partial vectors are
// summed in shared memory.
__global__ void __launch_bounds__(kMergeWarps * 32) merge_splits_kernel(MergeArgs a) {
  pdl_trigger_dependents();
  __shared__ float split_weight[kMaxSplits];
  __shared__ float warp_partial[kMergeWarps][512];
  __shared__ float scratch[kMergeWarps];
  pdl_wait_for_predecessors();
  const int head = blockIdx.x;
  const SequenceKv& sequence = a.sequences.entries[blockIdx.y];
  const int64_t row = sequence.first_row;
  const int splits = used_splits(scanned_slots(sequence.slots, a.positions[row]), a.splits);
  const int64_t record = a.head_dim + 2;
  const float* base =
      a.partials + (static_cast<int64_t>(blockIdx.y) * a.q_heads + head) * a.splits * record;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  float local_max = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
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
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
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
  for (int s = warp; s < splits; s += kMergeWarps) {
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
    a.out[row * a.out_stride + static_cast<int64_t>(head) * a.head_dim + d] =
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

namespace {

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// The uniform KvCacheView as a table: sequence b's arrays at b · sequence_stride, its query row b.
bool uniform_table(const KvCacheView& kv, int batch, SequenceKvTable& table) {
  if (batch > kMaxBatchedSequences || kv.keys == nullptr || kv.values == nullptr ||
      kv.slot_positions == nullptr) {
    return false;
  }
  const int64_t element_bytes = kv.type == KvType::kBF16 ? 2 : 4;
  // The table's pointers are writable because prepare_attention stores through them; the
  // attention kernel only reads.
  auto* keys = static_cast<char*>(const_cast<void*>(kv.keys));
  auto* values = static_cast<char*>(const_cast<void*>(kv.values));
  auto* slot_positions = const_cast<int32_t*>(kv.slot_positions);
  table.count = batch;
  for (int b = 0; b < batch; ++b) {
    table.entries[b] = {keys + b * kv.sequence_stride * element_bytes,
                        values + b * kv.sequence_stride * element_bytes,
                        slot_positions + b * kv.slots,
                        kv.slots,
                        b,
                        1};
  }
  return true;
}

}  // namespace

cudaError_t decode_attention(const AttentionQuery& query, const KvCacheView& kv, int window,
                             float scale, float* out, int64_t out_stride,
                             const AttentionWorkspace& workspace, int splits,
                             const Launch& launch) {
  AttentionKernel kernel = kv.type == KvType::kBF16 ? select_kernel<__nv_bfloat16>(kv.head_dim)
                                                    : select_kernel<float>(kv.head_dim);
  if (kernel == nullptr || kv.kv_heads < 1 || query.q_heads % kv.kv_heads != 0 ||
      kv.kv_heads > 65535 || splits < 1 || splits > kMaxSplits || query.q == nullptr ||
      query.positions == nullptr || out == nullptr || !aligned16(query.q) ||
      query.stride % 4 != 0 ||
      (splits > 1 && (workspace.partials == nullptr || splits > workspace.max_splits))) {
    return cudaErrorInvalidValue;
  }
  const int group = query.q_heads / kv.kv_heads;
  const int head_groups = (group + heads_per_warp(kv.head_dim) - 1) / heads_per_warp(kv.head_dim);
  if (head_groups > kWarps) return cudaErrorInvalidValue;
  AttentionArgs args = {};
  if (kv.sequences != nullptr) {
    args.sequences = *kv.sequences;
  } else if (kv.slots < 1 || query.batch < 1 || !uniform_table(kv, query.batch, args.sequences)) {
    return cudaErrorInvalidValue;
  }
  const int batch = args.sequences.count;
  if (batch < 1 || batch > kMaxBatchedSequences) return cudaErrorInvalidValue;
  for (int b = 0; b < batch; ++b) {
    const SequenceKv& sequence = args.sequences.entries[b];
    // The kernel reads K/V rows with 16-byte loads and one query row per sequence.
    if (sequence.slots < 1 || sequence.rows != 1 || sequence.first_row < 0 ||
        sequence.slot_positions == nullptr || !aligned16(sequence.keys) ||
        !aligned16(sequence.values)) {
      return cudaErrorInvalidValue;
    }
  }
  args.q = query.q;
  args.q_stride = query.stride;
  args.q_heads = query.q_heads;
  args.group = group;
  args.positions = query.positions;
  args.kv_heads = kv.kv_heads;
  args.window = window;
  args.scale = scale;
  args.splits = splits;
  args.out = out;
  args.out_stride = out_stride;
  args.partials = workspace.partials;
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(kv.kv_heads),
                  static_cast<unsigned>(batch));
  cudaError_t status = launch_kernel(kernel, grid, dim3(kWarps * 32), 0, launch, args);
  if (status != cudaSuccess || splits == 1) return status;
  const MergeArgs merge = {
      workspace.partials, query.positions, args.sequences, query.q_heads, kv.head_dim, splits, out,
      out_stride};
  return launch_kernel(merge_splits_kernel,
                       dim3(static_cast<unsigned>(query.q_heads), static_cast<unsigned>(batch)),
                       dim3(kMergeWarps * 32), 0, launch, merge);
}

}  // namespace gemma4::cuda
