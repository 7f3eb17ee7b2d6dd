// prepare_attention (fused_ops.h). One warp per head: block (row, g) of kWarps warps takes heads
// g · kWarps + w of the row's list (q heads, then k heads, then v heads), so a row's heads run on
// as many SMs as it has head groups. A head is normed with a shuffle reduction (no block barrier)
// and rotated as attention_prepare.cuh does. Every load of a lane (norm weights and inv_freq
// before the PDL wait, the head after it) is issued before the sum.
#include <algorithm>

#include "backend/cuda/attention_prepare.cuh"
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
template <typename KvT>
struct HeadJob {
  const float* src = nullptr;
  float* dst = nullptr;  // a q head, in place (src)
  KvT* cache = nullptr;  // or a k / v head's row in its cache
  const float* weight = nullptr;
  bool norm = false;
  bool rotate = false;
};

template <int kPairQuads, bool kAligned, typename KvT>
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

  HeadJob<KvT> job;
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
  HeadConstants<kPairQuads> constants;
  if (has_head) {
    constants = load_head_constants<kPairQuads, kAligned>(
        job.weight, in.weight_offset, job.rotate ? in.inv_freq : nullptr, half, lane);
  }
  pdl_wait_for_predecessors();
  if (!has_head) return;
  const int32_t position = in.positions[row];
  const int64_t slot = stores ? position % sequence.slots : 0;
  if (stores && head == 0 && lane == 0) sequence.slot_positions[slot] = position;
  if (job.dst == nullptr) {
    const int64_t slot_offset = slot * int64_t{a.kv_heads} * hd + cache_offset;
    const bool is_key = head < q_heads + kv_heads;
    job.cache = static_cast<KvT*>(is_key ? sequence.keys : sequence.values) + slot_offset;
  }
  const HeadQuads<kPairQuads> quads = transform_head<kPairQuads, kAligned>(
      job.src, constants, job.norm, job.rotate, in.eps, half, position, lane);
  if (job.cache == nullptr) {
    store_head<kAligned>(job.dst, quads, half, lane);
  } else {
    store_head<kAligned>(job.cache, quads, half, lane);
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
  const auto kernel = with_kv_type(inputs.kv_type, [&](auto element) {
    using KvT = decltype(element);
    return half <= 128 ? (aligned ? prepare_attention_kernel<1, true, KvT>
                                  : prepare_attention_kernel<1, false, KvT>)
                       : (aligned ? prepare_attention_kernel<2, true, KvT>
                                  : prepare_attention_kernel<2, false, KvT>);
  });
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
