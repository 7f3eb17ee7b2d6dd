// prepare_attention (fused_ops.h). Block per row of 8 warps; warp w takes heads w, w + 8, ... of
// the row's list (q heads, then k heads, then v heads). A head is normed by one warp (a shuffle
// reduction, no block barrier), and lane l owns the RoPE pairs (i, i + head_dim/2) for i = l,
// l + 32, ..., so the rotation needs no exchange either.
#include <algorithm>

#include "backend/cuda/fused_ops.h"
#include "backend/cuda/launch.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kWarps = 8;

struct PrepareArgs {
  AttentionInputs in;
  SequenceKvTable sequences;
  int q_heads;
  int kv_heads;
  bool prepare_q;  // the first launch of a call prepares q; every launch stores its sequences
};

// One head: src normed ((weight_offset + weight) when weight is set), rotated by `position`
// (when inv_freq is set), written to dst (dst may be src).
__device__ void prepare_head(const float* src, float* dst, int head_dim, const float* weight,
                             float weight_offset, float eps, const float* inv_freq,
                             float position) {
  const int lane = threadIdx.x & 31;
  float sum = 0.0f;
  for (int j = lane; j < head_dim; j += 32) sum += src[j] * src[j];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
  // Every lane has read its elements before the shuffles complete: dst may alias src.
  const float inv = 1.0f / sqrtf(sum / static_cast<float>(head_dim) + eps);
  auto normed = [&](int j) {
    const float v = src[j] * inv;
    return weight ? v * (weight_offset + weight[j]) : v;
  };
  const int half = head_dim / 2;
  for (int i = lane; i < half; i += 32) {
    const float first = normed(i);
    const float second = normed(i + half);
    if (inv_freq != nullptr && inv_freq[i] != 0.0f) {
      // The angle as the CPU reference rounds it: fp32(position) · inv_freq in fp32.
      float sin_angle, cos_angle;
      sincosf(position * inv_freq[i], &sin_angle, &cos_angle);
      dst[i] = first * cos_angle - second * sin_angle;
      dst[i + half] = second * cos_angle + first * sin_angle;
    } else {
      dst[i] = first;
      dst[i + half] = second;
    }
  }
}

__global__ void __launch_bounds__(kWarps * 32) prepare_attention_kernel(PrepareArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t row = blockIdx.x;
  const AttentionInputs& in = a.in;
  const int warp = threadIdx.x >> 5;
  const int32_t position = in.positions[row];
  const float angle_position = static_cast<float>(position);
  const int hd = in.head_dim;

  // The sequence whose rows include this one (a short scan of the parameter table).
  SequenceKv sequence = {};
  bool stores = false;
  for (int s = 0; s < a.sequences.count && !stores; ++s) {
    sequence = a.sequences.entries[s];
    stores = row >= sequence.first_row && row < sequence.first_row + sequence.rows;
  }
  const int q_heads = a.prepare_q ? a.q_heads : 0;
  const int kv_heads = stores ? a.kv_heads : 0;
  if (q_heads + kv_heads == 0) return;

  const int64_t slot = stores ? position % sequence.slots : 0;
  const int64_t kv_width = int64_t{a.kv_heads} * hd;
  if (stores && threadIdx.x == 0) sequence.slot_positions[slot] = position;
  for (int head = warp; head < q_heads + 2 * kv_heads; head += kWarps) {
    if (head < q_heads) {
      float* q = in.q.data + row * in.q.stride + int64_t{head} * hd;
      prepare_head(q, q, hd, in.q_norm, in.weight_offset, in.eps, in.inv_freq, angle_position);
    } else if (head < q_heads + kv_heads) {
      const int kv_head = head - q_heads;
      const float* k = in.k.data + row * in.k.stride + int64_t{kv_head} * hd;
      float* cached = static_cast<float*>(sequence.keys) + slot * kv_width + int64_t{kv_head} * hd;
      prepare_head(k, cached, hd, in.k_norm, in.weight_offset, in.eps, in.inv_freq, angle_position);
    } else {
      const int kv_head = head - q_heads - kv_heads;
      const float* v = in.v.data + row * in.v.stride + int64_t{kv_head} * hd;
      float* cached =
          static_cast<float*>(sequence.values) + slot * kv_width + int64_t{kv_head} * hd;
      if (in.norm_v) {
        prepare_head(v, cached, hd, nullptr, 0.0f, in.eps, nullptr, 0.0f);
      } else {
        for (int j = threadIdx.x & 31; j < hd; j += 32) cached[j] = v[j];
      }
    }
  }
}

bool valid_rows(const RowsView& v, int64_t rows) {
  return v.data != nullptr && v.rows == rows && v.width >= 1 && v.stride >= v.width;
}

}  // namespace

int prepare_attention_launches(int sequences) {
  return std::max(1, (sequences + kMaxBatchedSequences - 1) / kMaxBatchedSequences);
}

cudaError_t prepare_attention(const AttentionInputs& inputs, std::span<const SequenceKv> sequences,
                              const Launch& launch) {
  const int64_t rows = inputs.q.rows;
  const int hd = inputs.head_dim;
  if (rows < 1 || rows > 0x7FFFFFFF || hd < 2 || hd % 2 != 0 || !valid_rows(inputs.q, rows) ||
      inputs.q.width % hd != 0 || inputs.positions == nullptr || inputs.inv_freq == nullptr) {
    return cudaErrorInvalidValue;
  }
  PrepareArgs args = {};
  args.in = inputs;
  args.q_heads = static_cast<int>(inputs.q.width / hd);
  if (inputs.k.data != nullptr) {
    if (!valid_rows(inputs.k, rows) || !valid_rows(inputs.v, rows) ||
        inputs.k.width != inputs.v.width || inputs.k.width % hd != 0) {
      return cudaErrorInvalidValue;
    }
    args.kv_heads = static_cast<int>(inputs.k.width / hd);
    for (const SequenceKv& s : sequences) {
      if (s.keys == nullptr || s.values == nullptr || s.slot_positions == nullptr || s.slots < 1 ||
          s.rows < 0 || s.rows > s.slots || s.first_row < 0 ||
          s.first_row + int64_t{s.rows} > rows) {
        return cudaErrorInvalidValue;
      }
    }
  }
  // Without k there is nothing to store: one launch for q.
  const std::span<const SequenceKv> stored =
      inputs.k.data != nullptr ? sequences : std::span<const SequenceKv>();
  const int launches = prepare_attention_launches(static_cast<int>(stored.size()));
  for (int c = 0; c < launches; ++c) {
    const auto chunk =
        stored.subspan(std::min(stored.size(), static_cast<size_t>(c) * kMaxBatchedSequences));
    args.sequences.count = static_cast<int>(std::min<size_t>(chunk.size(), kMaxBatchedSequences));
    std::copy_n(chunk.begin(), args.sequences.count, args.sequences.entries);
    args.prepare_q = c == 0;
    const cudaError_t status =
        launch_kernel(prepare_attention_kernel, dim3(static_cast<unsigned>(rows)),
                      dim3(kWarps * 32), 0, launch, args);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace gemma4::cuda
