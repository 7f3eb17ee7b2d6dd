// Decode attention against a double-precision softmax over the visible slots
// (gemma4-architecture.md 2.4 step 4 and 2.6: scale 1.0, GQA by consecutive grouping, sliding
// window of exactly W keys including the current token).
#include "backend/cuda/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "cuda_test_util.h"

namespace gemma4::cuda {
namespace {

using testing::DeviceArray;

struct Case {
  const char* name;
  int q_heads, kv_heads, head_dim;
  int64_t slots;
  int window;
  std::vector<int32_t> positions;  // one query per sequence
  int splits;
  KvType type;
};

// The kernel a case runs on: the default (tensor cores and bulk copies for bf16 and e4m3 caches),
// AttentionQuery::cuda_core_kernel, or AttentionQuery::thread_copies.
enum class Kernel { kDefault, kCudaCores, kThreadCopies };

// A k_eq_v cache (KvCacheView::keys_from_values): each slot's K and V of a kv head made from one
// random raw row x as prepare_attention makes them, V = x · r and K = x · r · s (r = 1 / rms(x),
// s = weight_offset + k_norm) rotated in its first `rotated_pairs` pairs (i, i + hd / 2) only (by
// arbitrary angles), both rounded to the cache's type. `rotated_keys_only`: the kernel reads K's
// rotated dims and s ⊙ V in the others' stead (the tensor-core kernel on bf16 caches of 512 dims
// with 64 pairs), else K whole.
struct KEqV {
  int rotated_pairs;
  float weight_offset;
  bool rotated_keys_only;
};

// own_slot_unwritten: the slot of each query's own position holds -1 (never written), so that
// key is invisible as any empty slot. k_eq_v: the cache is one (KEqV).
void run_case(const Case& c, Kernel kernel = Kernel::kDefault, bool own_slot_unwritten = false,
              const KEqV* k_eq_v = nullptr) {
  const char* type_name = c.type == KvType::kBF16  ? " bf16"
                          : c.type == KvType::kFP8 ? " fp8"
                                                   : " f32";
  SCOPED_TRACE(std::string(c.name) + type_name + " splits=" + std::to_string(c.splits) +
               (kernel == Kernel::kCudaCores      ? " cuda cores"
                : kernel == Kernel::kThreadCopies ? " thread copies"
                                                  : "") +
               (own_slot_unwritten ? " own slot unwritten" : "") +
               (k_eq_v != nullptr ? " k_eq_v pairs=" + std::to_string(k_eq_v->rotated_pairs) : ""));
  const int batch = static_cast<int>(c.positions.size());
  const int64_t hd = c.head_dim;
  const int64_t kv_width = c.kv_heads * hd;
  const int64_t per_sequence = c.slots * kv_width;
  // Small magnitudes keep the softmax spread over many keys (scale is 1.0, no 1/sqrt(hd)).
  auto q = testing::random_floats(batch * c.q_heads * hd, -0.15f, 0.15f, 51);
  auto keys = testing::random_floats(batch * per_sequence, -0.15f, 0.15f, 52);
  auto values = testing::random_floats(batch * per_sequence, -1.0f, 1.0f, 53);
  const auto k_norm = testing::random_floats(hd, -0.5f, 0.5f, 56);
  std::vector<float> key_scale(hd);
  if (k_eq_v != nullptr) {
    // Normed keys are ~1 in size, not 0.15: a smaller q keeps the scores as spread.
    for (float& x : q) x *= 0.25f;
    for (int64_t d = 0; d < hd; ++d) key_scale[d] = k_eq_v->weight_offset + k_norm[d];
    const int64_t half = hd / 2;
    for (int64_t row = 0; row < batch * c.slots * c.kv_heads; ++row) {
      float* x = &values[row * hd];
      float* k = &keys[row * hd];
      double squares = 0.0;
      for (int64_t d = 0; d < hd; ++d) squares += double{x[d]} * x[d];
      const auto r = static_cast<float>(1.0 / std::sqrt(squares / hd + 1e-6));
      for (int64_t d = 0; d < hd; ++d) {
        x[d] *= r;
        k[d] = x[d] * key_scale[d];
      }
      for (int64_t i = 0; i < k_eq_v->rotated_pairs; ++i) {
        const double angle = 0.37 * static_cast<double>(row) + 0.11 * static_cast<double>(i);
        const double first = k[i], second = k[i + half];
        k[i] = static_cast<float>(first * std::cos(angle) - second * std::sin(angle));
        k[i + half] = static_cast<float>(second * std::cos(angle) + first * std::sin(angle));
      }
    }
  }
  // The cache as stored, and the reference below reads the stored values: bf16 rounded from the
  // floats, e4m3 drawn as codes (keys below 0.25, values below 1: testing::random_e4m3) or, for
  // a k_eq_v cache, rounded from the floats.
  std::vector<uint16_t> keys_bf16, values_bf16;
  std::vector<uint8_t> keys_fp8, values_fp8;
  if (c.type == KvType::kBF16) {
    keys_bf16.resize(keys.size());
    values_bf16.resize(values.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      keys_bf16[i] = float_to_bf16(keys[i]);
      values_bf16[i] = float_to_bf16(values[i]);
      keys[i] = bf16_to_float(keys_bf16[i]);
      values[i] = bf16_to_float(values_bf16[i]);
    }
  } else if (c.type == KvType::kFP8) {
    keys_fp8 = testing::random_e4m3(keys.size(), 4, 54);
    values_fp8 = testing::random_e4m3(values.size(), 6, 55);
    if (k_eq_v != nullptr) {
      for (size_t i = 0; i < keys.size(); ++i) {
        keys_fp8[i] = float_to_e4m3(keys[i]);
        values_fp8[i] = float_to_e4m3(values[i]);
      }
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      keys[i] = e4m3_to_float(keys_fp8[i]);
      values[i] = e4m3_to_float(values_fp8[i]);
    }
  }
  // Slot s holds the latest position p <= P with p % slots == s (a ring for sliding layers, the
  // identity for full layers); slots never written hold -1.
  std::vector<int32_t> slot_positions(batch * c.slots, -1);
  for (int b = 0; b < batch; ++b) {
    const int32_t p_query = c.positions[b];
    for (int64_t s = 0; s < c.slots; ++s) {
      if (s > p_query) continue;
      slot_positions[b * c.slots + s] = static_cast<int32_t>(p_query - (p_query - s) % c.slots);
    }
    if (own_slot_unwritten) slot_positions[b * c.slots + p_query % c.slots] = -1;
  }

  DeviceArray<float> dq(q), dk(keys), dv(values), out(batch * c.q_heads * hd), dk_norm(k_norm);
  DeviceArray<uint16_t> dk16(keys_bf16), dv16(values_bf16);
  DeviceArray<uint8_t> dk8(keys_fp8), dv8(values_fp8);
  DeviceArray<int32_t> dslots(slot_positions), dpos(c.positions);
  DeviceArray<float> partials(attention_partials_floats(batch, c.q_heads, c.head_dim, c.splits));
  // The engine's merge counters (few enough splits merge in the tensor-core kernel: attention.h).
  const int counter_count = batch * c.q_heads;
  DeviceArray<int> merge_counters(std::vector<int>(counter_count, 0));
  KvCacheView kv;
  kv.keys = c.type == KvType::kBF16  ? static_cast<const void*>(dk16.get())
            : c.type == KvType::kFP8 ? static_cast<const void*>(dk8.get())
                                     : dk.get();
  kv.values = c.type == KvType::kBF16  ? static_cast<const void*>(dv16.get())
              : c.type == KvType::kFP8 ? static_cast<const void*>(dv8.get())
                                       : dv.get();
  kv.slot_positions = dslots.get();
  kv.type = c.type;
  kv.slots = c.slots;
  kv.kv_heads = c.kv_heads;
  kv.head_dim = c.head_dim;
  kv.sequence_stride = per_sequence;
  if (k_eq_v != nullptr) {
    kv.keys_from_values = {dk_norm.get(), k_eq_v->weight_offset, k_eq_v->rotated_pairs};
  }
  AttentionQuery query = {dq.get(), c.q_heads * hd, c.q_heads, dpos.get(), batch};
  query.cuda_core_kernel = kernel == Kernel::kCudaCores;
  query.thread_copies = kernel == Kernel::kThreadCopies;
  const AttentionWorkspace workspace = {partials.get(), c.splits, merge_counters.get(),
                                        counter_count};
  CUDA_ASSERT_OK(decode_attention(query, kv, c.window, 1.0f, out.get(), c.q_heads * hd, workspace,
                                  c.splits, Launch{}));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  // Left at zero for the next launch (a replayed graph reuses them).
  EXPECT_EQ(merge_counters.download(), std::vector<int>(counter_count, 0));

  // The reference over the stored keys, or with stand_in over the keys the kernel reads: s ⊙ V
  // outside the rotated dims.
  auto reference = [&](bool stand_in) {
    std::vector<double> expected(out.download().size());
    const int group = c.q_heads / c.kv_heads;
    const int64_t half = hd / 2;
    for (int b = 0; b < batch; ++b) {
      const int32_t p_query = c.positions[b];
      for (int h = 0; h < c.q_heads; ++h) {
        const int g = h / group;
        std::vector<double> score;
        std::vector<int64_t> visible;
        for (int64_t s = 0; s < c.slots; ++s) {
          const int32_t p = slot_positions[b * c.slots + s];
          if (p < 0 || p > p_query || (c.window > 0 && p_query - p >= c.window)) continue;
          double dot = 0.0;
          for (int64_t d = 0; d < hd; ++d) {
            const int64_t element = b * per_sequence + s * kv_width + g * hd + d;
            const double key = stand_in && d % half >= k_eq_v->rotated_pairs
                                   ? double{key_scale[d]} * values[element]
                                   : keys[element];
            dot += static_cast<double>(q[(b * c.q_heads + h) * hd + d]) * key;
          }
          score.push_back(dot);
          visible.push_back(s);
        }
        double max_score = -INFINITY;
        for (double s : score) max_score = std::max(max_score, s);
        double total = 0.0;
        for (double& s : score) total += (s = std::exp(s - max_score));
        for (int64_t d = 0; d < hd; ++d) {
          double acc = 0.0;
          for (size_t j = 0; j < visible.size(); ++j) {
            acc += score[j] * values[b * per_sequence + visible[j] * kv_width + g * hd + d];
          }
          expected[(b * c.q_heads + h) * hd + d] = acc / total;
        }
      }
    }
    return expected;
  };
  const std::vector<double> magnitude(out.download().size(), 1.0);
  const bool stand_in = k_eq_v != nullptr && k_eq_v->rotated_keys_only;
  testing::expect_close(out.download(), reference(stand_in), magnitude, 2e-5, "attention");
  // Against the stored keys: within what the cache's rounding of K and V allows (bf16: 2^-9 of
  // each, e4m3: 2^-4, over ~1.7-sized normed values).
  if (stand_in) {
    testing::expect_close(out.download(), reference(false), magnitude,
                          c.type == KvType::kBF16 ? 1e-2 : 1e-1, "attention (stored keys)");
  }
}

TEST(DecodeAttention, GroupsHeadDimsWindowsSplits) {
  const Case cases[] = {
      // E2B full layer: 8 q heads on 1 kv head of 512, causal over a deep cache.
      {"e2b-full", 8, 1, 512, 4096, 0, {3000}, 1, KvType::kBF16},
      {"e2b-full", 8, 1, 512, 4096, 0, {3000}, 37, KvType::kBF16},
      // E2B sliding layer: window 512 over a ring of 600 slots that wrapped several times.
      {"e2b-sliding", 8, 1, 256, 600, 512, {5000}, 1, KvType::kBF16},
      {"e2b-sliding", 8, 1, 256, 600, 512, {5000}, 9, KvType::kBF16},
      // 26B-A4B sliding (16 q / 8 kv × 256, window 1024) and full (16 q / 2 kv × 512), two
      // sequences at different depths (one shorter than the window), fp32 and bf16 caches.
      {"26b-sliding", 16, 8, 256, 1100, 1024, {2000, 300}, 16, KvType::kBF16},
      {"26b-full", 16, 2, 512, 2048, 0, {1500, 10}, 64, KvType::kF32},
      // First token of a sequence: one visible key, most splits empty.
      {"first-token", 8, 1, 512, 256, 0, {0}, 8, KvType::kBF16},
      // The engine's fp32 cache through the tiled pipeline: one split streaming hundreds of tiles
      // (4 keys of 512 or 8 of 256 per tile), splits ending mid-tile, a wrapped sliding ring.
      {"fp32-full-deep", 8, 1, 512, 4096, 0, {3001}, 1, KvType::kF32},
      {"fp32-full-splits", 8, 1, 512, 4096, 0, {3001}, 23, KvType::kF32},
      {"fp32-sliding", 8, 1, 256, 1023, 512, {4000, 511}, 16, KvType::kF32},
      // Groups that leave warps idle (5 q heads per kv head: 3 head groups of 2 on 8 warps) or
      // use one q head per kv head.
      {"group-of-5", 10, 2, 512, 700, 0, {650, 77}, 5, KvType::kF32},
      {"group-of-1", 4, 4, 256, 300, 0, {299}, 1, KvType::kBF16},
      // Few enough records per kv head that the tensor-core kernel merges the splits itself, for
      // heads of 512 (few outputs per thread, many splits at a time, and the other way round).
      {"group-of-1-merged", 4, 4, 512, 600, 0, {599}, 8, KvType::kBF16},
      {"e2b-full-merged", 8, 1, 512, 4096, 0, {3000}, 2, KvType::kBF16},
      // e4m3 caches (8-byte lane pieces for rows of 256, 16 for 512; 32 / 16 keys per tile).
      {"fp8-e2b-full", 8, 1, 512, 4096, 0, {3000}, 37, KvType::kFP8},
      {"fp8-e2b-full-one-split", 8, 1, 512, 4096, 0, {3000}, 1, KvType::kFP8},
      {"fp8-e2b-sliding", 8, 1, 256, 600, 512, {5000}, 9, KvType::kFP8},
      {"fp8-26b-sliding", 16, 8, 256, 1100, 1024, {2000, 300}, 16, KvType::kFP8},
      {"fp8-26b-full", 16, 2, 512, 2048, 0, {1500, 10}, 64, KvType::kFP8},
      {"fp8-first-token", 8, 1, 256, 256, 0, {0}, 8, KvType::kFP8},
  };
  for (const Case& c : cases) {
    run_case(c);
    if (c.type != KvType::kF32) {
      run_case(c, Kernel::kCudaCores);
      run_case(c, Kernel::kThreadCopies);
    }
  }
}

// One launch over sequences at depths 1, 7, 33, 64, 65, 1025 and 5000: the shallow ones use fewer
// key ranges than the launch has blocks and spread their q heads over the idle blocks (one head
// per block at depth 1; up to 64 keys in one range, 65 in three of 32 where the launch has the
// splits), the deep ones split their keys; every head dim, cache type and window, a group that
// does not divide evenly into the blocks, and splits sized for the deepest cache or a single one.
// Full layers hold 1100 positions (deeper queries wrap the ring) except one that holds all 5000
// (kept to one split count: its reference is the costly part).
TEST(DecodeAttention, ShallowAndDeepSequencesInOneLaunch) {
  const std::vector<int32_t> depths = {0, 6, 32, 63, 64, 1024, 4999};  // query positions
  for (const KvType type : {KvType::kF32, KvType::kBF16, KvType::kFP8}) {
    for (const int splits : {1, 32, 160}) {
      const Case cases[] = {
          {"e2b-full-ring", 8, 1, 512, 1100, 0, depths, splits, type},
          {"e2b-sliding", 8, 1, 256, 600, 512, depths, splits, type},
          {"26b-sliding", 16, 8, 256, 1100, 1024, depths, splits, type},
          {"31b-full-ring", 16, 2, 512, 1100, 0, depths, splits, type},
          {"group-of-3", 6, 2, 256, 1100, 0, depths, splits, type},
      };
      for (const Case& c : cases) {
        run_case(c);
        if (type != KvType::kF32) {
          run_case(c, Kernel::kCudaCores);
          run_case(c, Kernel::kThreadCopies);
        }
      }
    }
    run_case({"e2b-full", 8, 1, 512, 5000, 0, depths, 160, type});
  }
}

// Deep contexts with the splits the engine picks at batch 1 (one per 32 keys up to
// kDecodeAttentionBlocks / kv heads): a 33000-position full cache (E2B's 8 q heads on 1 kv head,
// 26B's 16 on 2), sliding rings wrapped 64 times, and 8 sequences of one row each at depths 1 to
// 5000 in one launch; bf16 and fp8 on both kernels, the tensor-core one by bulk and by thread
// copies.
TEST(DecodeAttention, DeepContextsOnEveryKernel) {
  const std::vector<int32_t> eight_rows = {0, 699, 1024, 4999, 1, 33, 2047, 4500};
  for (const KvType type : {KvType::kBF16, KvType::kFP8}) {
    for (const Kernel kernel : {Kernel::kDefault, Kernel::kCudaCores, Kernel::kThreadCopies}) {
      const Case cases[] = {
          {"e2b-full-33000", 8, 1, 512, 33000, 0, {32999}, 264, type},
          {"26b-full-33000", 16, 2, 512, 33000, 0, {32999}, 132, type},
          {"e2b-sliding-ring", 8, 1, 256, 512, 512, {32999}, 16, type},
          {"26b-sliding-ring", 16, 8, 256, 1024, 1024, {32999}, 32, type},
          {"e2b-full-8-rows", 8, 1, 512, 5000, 0, eight_rows, 33, type},
          {"e2b-sliding-8-rows", 8, 1, 256, 600, 512, eight_rows, 4, type},
      };
      for (const Case& c : cases) run_case(c, kernel);
    }
  }
}

// The tensor-core kernel reads the query's own slot (K, V and position) apart from the other
// keys, after the PDL wait (attention.cu): an unwritten own slot must stay invisible there too,
// at depths whose own key falls in the first tile, a later one, or a split of its own.
TEST(DecodeAttention, UnwrittenOwnSlotIsInvisible) {
  const std::vector<int32_t> depths = {1, 6, 40, 1024};  // query positions (each sees a key)
  for (const KvType type : {KvType::kBF16, KvType::kFP8}) {
    for (const int splits : {1, 32}) {
      const Case cases[] = {
          {"e2b-full", 8, 1, 512, 1100, 0, depths, splits, type},
          {"e2b-sliding", 8, 1, 256, 600, 512, depths, splits, type},
          {"26b-sliding", 16, 8, 256, 1100, 1024, depths, splits, type},
      };
      for (const Case& c : cases) {
        run_case(c, Kernel::kDefault, true);
        run_case(c, Kernel::kCudaCores, true);
        run_case(c, Kernel::kThreadCopies, true);
      }
    }
  }
}

// 32 sequences of one launch: 8 blocks per (sequence, kv head) (kDecodeAttentionBlocks / 32), so
// a query using all 4 splits gets 2 parts of 4 q heads, whose records (4 splits x 4 heads: 16.5 KB
// of 256 dims, 33 KB of 512) the last block of each part merges with several outputs per thread;
// shallower queries get more parts of fewer heads. Positions 0 to 1147: 1 to 4 splits used.
TEST(DecodeAttention, ManySequencesMergeSeveralHeadsPerPart) {
  std::vector<int32_t> positions(32);
  for (int b = 0; b < 32; ++b) positions[b] = 37 * b;
  for (const KvType type : {KvType::kBF16, KvType::kFP8}) {
    const Case cases[] = {
        {"e2b-sliding-32-rows", 8, 1, 256, 600, 512, positions, 4, type},
        {"e2b-full-32-rows", 8, 1, 512, 1200, 0, positions, 4, type},
    };
    for (const Case& c : cases) {
      run_case(c);
      run_case(c, Kernel::kThreadCopies);
    }
  }
}

// Which launches merge their splits in the tensor-core kernel: few records per q-head part of a kv
// head at the deepest cache (at most kMaxMergedInKernelBytes). E2B's sliding layer at the splits
// the engine picks (16 splits, one part per q head: 16 x 256 dims, 16.5 KB) and 31B's (16 splits of
// 16 kv heads: no spare blocks, parts of 2 heads, 33 KB); not 26B's sliding layer (32 splits of 8
// kv heads: parts of 2 heads, 66 KB), a deep full layer's 264 splits, 8 sequences of E2B's sliding
// layer (16 splits: 2 blocks per (sequence, split), parts of 4 heads, 66 KB), the CUDA-core
// kernel, a workspace without counters, nor more (sequence, q head) pairs than counters.
TEST(DecodeAttention, SplitMergeInTheKernelWhereTheRecordsAreFew) {
  int counters[64] = {};
  const AttentionWorkspace with_counters = {nullptr, 264, counters, 64};
  const AttentionWorkspace without_counters = {nullptr, 264};
  KvCacheView kv;
  kv.type = KvType::kBF16;
  kv.kv_heads = 1;
  kv.head_dim = 256;
  AttentionQuery query = {nullptr, 0, 8, nullptr, 1};
  EXPECT_EQ(decode_attention_launches(query, kv, 1, with_counters), 1);
  EXPECT_EQ(decode_attention_launches(query, kv, 4, with_counters), 1);
  EXPECT_EQ(decode_attention_launches(query, kv, 4, without_counters), 2);
  EXPECT_EQ(decode_attention_launches(query, kv, 16, with_counters), 1);
  query.batch = 8;
  EXPECT_EQ(decode_attention_launches(query, kv, 16, with_counters), 2);
  query.batch = 1;
  query.q_heads = 16;
  kv.kv_heads = 8;
  EXPECT_EQ(decode_attention_launches(query, kv, 32, with_counters), 2);
  query.q_heads = 32;
  kv.kv_heads = 16;
  EXPECT_EQ(decode_attention_launches(query, kv, 16, with_counters), 1);
  query.q_heads = 8;
  kv.kv_heads = 1;
  kv.head_dim = 512;
  EXPECT_EQ(decode_attention_launches(query, kv, 2, with_counters), 1);
  EXPECT_EQ(decode_attention_launches(query, kv, 264, with_counters), 2);
  query.cuda_core_kernel = true;
  EXPECT_EQ(decode_attention_launches(query, kv, 2, with_counters), 2);
  query.cuda_core_kernel = false;
  query.batch = 9;  // more (sequence, q head) pairs than counters
  EXPECT_EQ(decode_attention_launches(query, kv, 2, with_counters), 2);
}

// k_eq_v caches (KvCacheView::keys_from_values) as 26B's full layers (16 q / 2 kv heads of 512,
// 64 rotated pairs: warps 0 and 4 read K) and 31B's (32 / 4) hold them, bf16: deep with the
// engine's splits and shallow, several sequences in one launch, weight offsets 0 and 1, bulk and
// thread copies; and where K is read whole: e4m3, heads of 256, pairs that are not two warps'
// dims, the CUDA-core kernel.
TEST(DecodeAttention, KEqVCachesReadTheRotatedKeyDimsOnly) {
  const std::vector<int32_t> depths = {999, 0, 40, 700};
  const KEqV rotated = {64, 0.0f, true}, rotated_offset = {64, 1.0f, true};
  run_case({"26b-full-33000", 16, 2, 512, 33000, 0, {32999}, 132, KvType::kBF16}, Kernel::kDefault,
           false, &rotated_offset);
  const Case cases[] = {
      {"26b-full", 16, 2, 512, 1000, 0, depths, 33, KvType::kBF16},
      {"31b-full", 32, 4, 512, 1000, 0, depths, 16, KvType::kBF16},
      {"26b-full-one-split", 16, 2, 512, 600, 0, {599}, 1, KvType::kBF16},
  };
  for (const Case& c : cases) {
    run_case(c, Kernel::kDefault, false, &rotated);
    run_case(c, Kernel::kDefault, false, &rotated_offset);
    run_case(c, Kernel::kThreadCopies, false, &rotated_offset);
  }
  const KEqV read_whole = {64, 1.0f, false}, part_of_a_warp = {48, 1.0f, false};
  run_case(cases[0], Kernel::kCudaCores, false, &read_whole);
  run_case({"26b-full-fp8", 16, 2, 512, 1000, 0, depths, 33, KvType::kFP8}, Kernel::kDefault, false,
           &read_whole);
  run_case({"head-256", 8, 1, 256, 1000, 0, depths, 16, KvType::kBF16}, Kernel::kDefault, false,
           &read_whole);
  run_case({"26b-full-48-pairs", 16, 2, 512, 1000, 0, depths, 33, KvType::kBF16}, Kernel::kDefault,
           false, &part_of_a_warp);
}

TEST(DecodeAttention, RejectsUnsupportedHeadDim) {
  KvCacheView kv;
  kv.head_dim = 128;
  kv.kv_heads = 1;
  kv.slots = 1;
  const AttentionQuery query = {nullptr, 0, 8, nullptr, 1};
  EXPECT_EQ(decode_attention(query, kv, 0, 1.0f, nullptr, 0, {}, 1, Launch{}),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace gemma4::cuda
