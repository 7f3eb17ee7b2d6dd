// Decode attention: one query token per sequence against that sequence's KV cache, GQA (each
// cached K/V row is read once for all q heads of its group), split across the cache with an
// online-softmax merge (a second, small kernel when splits > 1, unless the tensor-core kernel
// merges few splits itself: decode_attention_launches). head_dim 256 or 512. bf16 and
// e4m3 caches with at most 8 q heads per kv head run on tensor cores (attention.cu), the rest on
// CUDA cores.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/launch.h"

namespace gemma4::cuda {

// The element type of a KV cache (engine::KvType's values, static_asserted in cuda_backend.cpp):
// fp32, bf16, or e4m3 without scales. Device conversions: attention_kv.cuh.
enum class KvType : uint8_t { kF32, kBF16, kFP8 };

// One sequence of a batched launch: its K/V arrays of the layer (engine::KvView layout, the
// element type of the launch's KvType) and its rows [first_row, first_row + rows) of the pass.
struct SequenceKv {
  void* keys = nullptr;
  void* values = nullptr;
  int32_t* slot_positions = nullptr;
  int64_t slots = 0;
  int32_t first_row = 0;
  int32_t rows = 0;
};

// Sequences travel inside the kernel parameters (no device table to upload or keep alive while
// graphs may read it), so one launch takes at most this many; callers split longer lists.
constexpr int kMaxBatchedSequences = 64;
struct SequenceKvTable {
  SequenceKv entries[kMaxBatchedSequences];
  int count = 0;
};

// A k_eq_v layer's cache (engine::KvView::k_eq_v): K and V were made from one raw row, V its
// weightless RMSNorm, K its RMSNorm with k_norm's weight, rotated in the RoPE pairs (i, i +
// head_dim / 2), i < rotated_pairs only. K's other dims are (weight_offset + k_norm) ⊙ V up to the
// cache's rounding, so the tensor-core kernel reads K's rotated dims only and takes V scaled in
// their stead: 1,280 instead of 2,048 bytes a key, for bf16 caches of 512 dims with 64 rotated
// pairs (26B's and 31B's full layers: the dims of two of its warps). Elsewhere K is read whole.
struct KeysFromValues {
  const float* k_norm = nullptr;  // [head_dim], 16-byte aligned; null: K is read whole
  float weight_offset = 0.0f;
  int rotated_pairs = 0;
};

// A layer's KV cache for `batch` sequences (engine::KvView layout): per sequence `slots` entries of
// [kv_heads, head_dim] for K and for V, and the absolute position each slot holds (-1 = empty).
// Either uniform (batch <= kMaxBatchedSequences): sequence b's arrays start at keys/values + b ·
// sequence_stride elements and slot_positions + b · slots, its query is row b; or, with `sequences`
// set (batch = sequences->count, each with rows == 1), sequence b is sequences->entries[b] (keys,
// values, slot_positions, slots of the uniform fields unused) and its query is row
// entries[b].first_row.
struct KvCacheView {
  const void* keys = nullptr;
  const void* values = nullptr;
  const int32_t* slot_positions = nullptr;
  KvType type = KvType::kBF16;
  int64_t slots = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int64_t sequence_stride = 0;
  const SequenceKvTable* sequences = nullptr;
  KeysFromValues keys_from_values;
};

// Device scratch for the split partials (needed when splits > 1): at least
// attention_partials_floats(batch, q_heads, head_dim, max_splits) floats. merge_counters
// (optional): merge_counter_count ints (batch · q_heads used: one per sequence, kv head and q-head
// part), all 0 before the first launch, which each launch leaves at 0 again; with them the
// tensor-core kernel merges few enough splits itself (decode_attention_launches).
struct AttentionWorkspace {
  float* partials = nullptr;
  int max_splits = 0;
  int* merge_counters = nullptr;
  int merge_counter_count = 0;
};

size_t attention_partials_floats(int batch, int q_heads, int head_dim, int max_splits);

// prepare_attention (fused_ops.h) of the decode rows as the attention launch's prologue: every
// block norms and rotates the q heads of its kv head (into shared memory: q in memory stays as it
// was), and the block whose keys include the slot of the query's position norms, rotates and
// stores that kv head's k and (normed) v there, with the slot's position, before it reads any key
// (no other block reads that slot). Rounded to the cache's type as attention_kv.cuh.
struct DecodePrepare {
  // Raw k and v rows (row r at k + r · k_stride), [kv_heads · head_dim] each; k == nullptr: the
  // layer reads another layer's KV (q only).
  const float* k = nullptr;
  int64_t k_stride = 0;
  const float* v = nullptr;
  int64_t v_stride = 0;
  const float* q_norm = nullptr;  // [head_dim]; null: weightless
  const float* k_norm = nullptr;
  bool norm_v = false;  // v normed without weight (else stored as it is)
  float weight_offset = 0.0f;
  float eps = 1e-6f;
  const float* inv_freq = nullptr;  // [head_dim / 2]: engine::rope_inverse_frequencies
};

struct AttentionQuery {
  const float* q = nullptr;  // [rows][q_heads · head_dim], row r at q + r · stride
  int64_t stride = 0;
  int q_heads = 0;
  const int32_t* positions = nullptr;  // per query row (device memory)
  int batch = 1;                       // sequences (uniform KvCacheView)
  // Set: q is raw and prepared in the launch (DecodePrepare); q_heads / kv_heads · head_dim
  // floats must fit one pipeline stage (kMaxPreparedGroupFloats).
  const DecodePrepare* prepare = nullptr;
  // The CUDA-core kernel even where the tensor-core one applies (bf16 and e4m3 caches, at most 8
  // q heads per kv head): benchmarks and tests compare the two.
  bool cuda_core_kernel = false;
  // The tensor-core kernel loads its K/V tiles by every thread's 16-byte cp.async pieces instead
  // of one bulk copy per row: benchmarks and tests compare the two.
  bool thread_copies = false;
};
constexpr int kMaxPreparedGroupFloats = 4096;

// out[r][h] = Σ_j softmax_j(scale · q[r][h] · k_j) · v_j for each sequence's query row r, over
// the slots j whose position p satisfies p <= P and (window == 0 or P − p < window),
// P = positions[r]; q head h reads kv head h / (q_heads / kv_heads). Only the slots of positions
// (P − n, P] are scanned, n = min(slots, P + 1, window or unbounded) (position p lives in slot
// p % slots): a sliding ring larger than its window costs no more than the window.
// Up to `splits` (1..4096) key ranges share each (sequence, kv head), each taking at least
// kMinKeysPerSplit of the scanned slots: a graph captured with the splits of the deepest cache
// replays cheaply at shallow depths (the unused split blocks exit after reading the position and
// the merge skips them). splits must not exceed workspace.max_splits. A cache using fewer key
// ranges than that spreads the q heads of a group over the idle blocks instead (within
// kDecodeAttentionBlocks per launch), so a short context costs about one head's work.
// out_companions (gemv_kernels.h; none by default): the output's bf16 and/or kQ8 rows for the
// GEMV that reads it, written with each output row (row r of the companions for row r of out).
// With PDL the split merge reads `positions`, and the tensor-core kernel also the K/V rows and
// slot positions of the keys older than each query, before they wait for their predecessors: no
// kernel of the launch's dependent chain may write those (the engine writes them in earlier
// passes, and each pass starts with an upload, which no kernel overlaps). The query's own slot
// is read after the wait.
constexpr int64_t kMinKeysPerSplit = 32;
// A query scanning up to this many keys uses one split whatever `splits` allows: the few tiles of
// its keys are in flight together (the tensor-core kernel keeps 5 tiles of 16 keys of 256 dims in
// flight, 2 of 512), so a second split would save less than merging the two costs (a merge
// kernel's place in the chain, ~0.8 us in kernel_bench, or the in-kernel merge's atomic and record
// round trips).
constexpr int64_t kOneSplitKeys = 64;
cudaError_t decode_attention(const AttentionQuery& query, const KvCacheView& kv, int window,
                             float scale, float* out, int64_t out_stride,
                             const AttentionWorkspace& workspace, int splits, const Launch& launch,
                             const ActivationCompanions& out_companions = {});

// The kernels decode_attention launches for these arguments: 1, or 2 when the splits need the merge
// kernel. The tensor-core kernel merges the splits itself when `workspace` has merge counters for
// every (sequence, q head) and the partials to merge are few (at most kMaxMergedInKernelSplits
// splits, kMaxMergedInKernelBytes of records per q-head part of a kv head at the deepest cache):
// the last of a part's split blocks to finish combines them, and the merge kernel's place in the
// chain of dependent kernels is saved (also at shallow depths, where a graph recorded for a deep
// cache would replay a merge kernel with nothing to merge). That one block reads all of its part's
// records, so the bound is low: measured on the H200 (kernel_bench, sliding windows full, s8 early
// batch, one part per kv head), 26B's sliding layer (32 splits x 2 heads x 256: 66 KB) took 10.5
// us merged in the kernel vs 9.1 with the merge kernel, E2B's (16 x 8 x 256: 132 KB) 11.1 vs 6.8.
// E2B's sliding layer now has a part per q head (16 x 1 x 256: 16.5 KB).
constexpr int kMaxMergedInKernelSplits = 64;
constexpr int64_t kMaxMergedInKernelBytes = 40 << 10;
int decode_attention_launches(const AttentionQuery& query, const KvCacheView& kv, int splits,
                              const AttentionWorkspace& workspace);

// The blocks of a decode attention launch that the GPU runs at once (two per SM of the H200's
// 132): callers size their splits to it and the kernel fills it with q heads at shallow depths.
constexpr int64_t kDecodeAttentionBlocks = 2 * 132;

}  // namespace gemma4::cuda
