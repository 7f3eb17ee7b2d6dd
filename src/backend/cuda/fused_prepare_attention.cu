// prepare_attention (fused_ops.h). One warp per head: block (row, g) of kWarps warps takes heads
// g · kWarps + w of the row's list (q heads, then k heads, then v heads), so a row's heads run on
// as many SMs as it has head groups. A head is normed with a shuffle reduction (no block barrier)
// and lane l owns the quads at 4c and half + 4c for c = l, l + 32, ...: the RoPE pairs
// (i, i + head_dim/2) stay in one lane and the rotation needs no exchange. Every load of a lane
// (norm weights and inv_freq before the PDL wait, the head after it) is issued before the sum.
#include <algorithm>

#include "backend/cuda/float_quads.cuh"
#include "backend/cuda/fused_ops.h"
#include "backend/cuda/launch.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kWarps = 4;
// Quads per half head per lane: head_dim <= 2 · 4 · 32 · kMaxPairQuads = 512.
constexpr int kMaxPairQuads = 2;

struct PrepareArgs {
  AttentionInputs in;
  SequenceKvTable sequences;
  int q_heads;
  int kv_heads;
  bool prepare_q;  // the first launch of a call prepares q; every launch stores its sequences
};

// What a head is: its source and destination and how it is transformed.
struct HeadJob {
  const float* src = nullptr;
  float* dst = nullptr;  // may be src
  const float* weight = nullptr;
  bool norm = false;
  bool rotate = false;
};

template <int kPairQuads, bool kAligned>
__global__ void __launch_bounds__(kWarps * 32) prepare_attention_kernel(PrepareArgs a) {
  pdl_trigger_dependents();
  const AttentionInputs& in = a.in;
  const int64_t row = blockIdx.x;
  const int head = static_cast<int>(blockIdx.y) * kWarps + static_cast<int>(threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int hd = in.head_dim;
  const int half = hd / 2;

  // The sequence whose rows include this one (a short scan of the parameter table).
  SequenceKv sequence = {};
  bool stores = false;
  for (int s = 0; s < a.sequences.count && !stores; ++s) {
    sequence = a.sequences.entries[s];
    stores = row >= sequence.first_row && row < sequence.first_row + sequence.rows;
  }
  const int q_heads = a.prepare_q ? a.q_heads : 0;
  const int kv_heads = stores ? a.kv_heads : 0;
  const bool has_head = head < q_heads + 2 * kv_heads;

  HeadJob job;
  int64_t cache_offset = 0;  // of the head within its slot (k and v)
  if (head < q_heads) {
    job.src = job.dst = in.q.data + row * in.q.stride + int64_t{head} * hd;
    job.weight = in.q_norm;
    job.norm = job.rotate = true;
  } else if (head < q_heads + kv_heads) {
    cache_offset = int64_t{head - q_heads} * hd;
    job.src = in.k.data + row * in.k.stride + cache_offset;
    job.weight = in.k_norm;
    job.norm = job.rotate = true;
  } else if (has_head) {
    cache_offset = int64_t{head - q_heads - kv_heads} * hd;
    job.src = in.v.data + row * in.v.stride + cache_offset;
    job.norm = in.norm_v;
  }

  // Norm weights and the RoPE frequencies are not written by a predecessor: loaded before the
  // wait, as every other load of the lane is issued before the first use.
  auto pair_quad = [&](int k) { return 4 * (lane + 32 * k); };
  auto in_head = [&](int k) { return pair_quad(k) < half; };
  FloatQuad scale_first[kPairQuads], scale_second[kPairQuads], inv_freq[kPairQuads];
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k) {
    if (!has_head || !in_head(k)) continue;
    scale_first[k] = load_norm_scale<kAligned>(job.weight, in.weight_offset, pair_quad(k), half);
    scale_second[k] = load_norm_scale<kAligned>(job.weight ? job.weight + half : nullptr,
                                                in.weight_offset, pair_quad(k), half);
    if (job.rotate) inv_freq[k] = load_quad<kAligned>(in.inv_freq, pair_quad(k), half);
  }
  pdl_wait_for_predecessors();
  if (!has_head) return;
  const int32_t position = in.positions[row];
  const int64_t slot = stores ? position % sequence.slots : 0;
  if (stores && head == 0 && lane == 0) sequence.slot_positions[slot] = position;
  if (job.dst == nullptr) {
    const int64_t slot_offset = slot * int64_t{a.kv_heads} * hd + cache_offset;
    const bool is_key = head < q_heads + kv_heads;
    job.dst = static_cast<float*>(is_key ? sequence.keys : sequence.values) + slot_offset;
  }

  FloatQuad first[kPairQuads], second[kPairQuads];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k) {
    first[k] = second[k] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (!in_head(k)) continue;
    first[k] = load_quad<kAligned>(job.src, pair_quad(k), half);
    second[k] = load_quad<kAligned>(job.src + half, pair_quad(k), half);
  }
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      sum += first[k].v[e] * first[k].v[e] + second[k].v[e] * second[k].v[e];
  // Every lane has read its elements before the shuffles complete: dst may alias src.
  const float inv = job.norm ? 1.0f / sqrtf(warp_sum(sum) / static_cast<float>(hd) + in.eps) : 1.0f;
  // The angle as the CPU reference rounds it: fp32(position) · inv_freq in fp32.
  const float angle_position = static_cast<float>(position);
#pragma unroll
  for (int k = 0; k < kPairQuads; ++k) {
    if (!in_head(k)) continue;
    if (job.norm) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        first[k].v[e] = first[k].v[e] * inv * scale_first[k].v[e];
        second[k].v[e] = second[k].v[e] * inv * scale_second[k].v[e];
      }
    }
    if (job.rotate) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (inv_freq[k].v[e] == 0.0f) continue;
        float sin_angle, cos_angle;
        sincosf(angle_position * inv_freq[k].v[e], &sin_angle, &cos_angle);
        const float x = first[k].v[e], y = second[k].v[e];
        first[k].v[e] = x * cos_angle - y * sin_angle;
        second[k].v[e] = y * cos_angle + x * sin_angle;
      }
    }
    store_quad<kAligned>(job.dst, pair_quad(k), half, first[k]);
    store_quad<kAligned>(job.dst + half, pair_quad(k), half, second[k]);
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
  if (rows < 1 || rows > 0x7FFFFFFF || hd < 2 || hd % 2 != 0 || hd > 8 * 32 * kMaxPairQuads ||
      !valid_rows(inputs.q, rows) || inputs.q.width % hd != 0 || inputs.positions == nullptr ||
      inputs.inv_freq == nullptr) {
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
  // 16-byte accesses when every row, weight and cache allows them.
  const int half = hd / 2;
  const bool aligned =
      half % 4 == 0 && aligned_rows(inputs.q) && aligned_rows(inputs.k) && aligned_rows(inputs.v) &&
      aligned_16(inputs.q_norm) && aligned_16(inputs.k_norm) && aligned_16(inputs.inv_freq) &&
      std::all_of(stored.begin(), stored.end(),
                  [](const SequenceKv& s) { return aligned_16(s.keys) && aligned_16(s.values); });
  const auto kernel =
      half <= 128
          ? (aligned ? prepare_attention_kernel<1, true> : prepare_attention_kernel<1, false>)
          : (aligned ? prepare_attention_kernel<2, true> : prepare_attention_kernel<2, false>);
  const int launches = prepare_attention_launches(static_cast<int>(stored.size()));
  for (int c = 0; c < launches; ++c) {
    const auto chunk =
        stored.subspan(std::min(stored.size(), static_cast<size_t>(c) * kMaxBatchedSequences));
    args.sequences.count = static_cast<int>(std::min<size_t>(chunk.size(), kMaxBatchedSequences));
    std::copy_n(chunk.begin(), args.sequences.count, args.sequences.entries);
    args.prepare_q = c == 0;
    const int heads = (args.prepare_q ? args.q_heads : 0) + 2 * args.kv_heads;
    const cudaError_t status =
        launch_kernel(kernel, dim3(static_cast<unsigned>(rows), (heads + kWarps - 1) / kWarps),
                      dim3(kWarps * 32), 0, launch, args);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace gemma4::cuda
