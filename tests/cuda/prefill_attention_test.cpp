// The prefill attention kernel (prefill_kernels.h) on its own, against a double-precision
// reference computed here on fresh random inputs: float and bf16 K/V, head_dim 256 and 512,
// GQA groups of 1..8, full and sliding layers (a ring that wrapped, sliding windows), chunks of
// 1..512 queries deep into a prompt, forgotten slots holding NaN, one block per row tile or the
// cache split among several blocks and merged; and chunks of up to 1000 queries attended against a
// ring holding the positions before them plus their own staged K/V (prefill_chunk_attention),
// then stored into the ring (store_staged_kv). The output starts as NaN with padding between
// rows: every element must be written, finite, and the padding untouched.
//
// Bound (q, K and V are bf16-exact, so both K/V types hold the same values and every Q·K
// product is exact on the tensor cores):
//  * a score's fp32 sum of head_dim products is within ε = scale · 4 · head_dim · 2^-24 ·
//    Σ_d |q_d k_d| of exact (tensor-core accumulation may truncate), plus a few 2^-24 of the
//    score itself for the scaling by log2(e) and exp2;
//  * the weights are rounded to bf16 (u = 2^-9) and normalised by the sum of the rounded
//    weights, so each normalised weight is within a factor β = e^{2ε} (1 + u) / (1 − u) of the
//    exact one, and the output within (β − 1 + 8 · slots · 2^-24) · max|v| (the last term: the
//    fp32 sums, per-tile rescalings, the split merge and the division).
//  * q = 0: every score is 0 and every weight exactly 1, so the output is the mean of the
//    visible values up to fp32 sums; one key too many or too few (a mask, ring, head mapping or
//    split boundary error) moves it by ~max|v| / (visible keys).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/prefill_kernels.h"
#include "core/numeric.h"
#include "cuda_test_util.h"

namespace gemma4::cuda {
namespace {

using testing::DeviceArray;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kPadding = 7.25f;
constexpr double kBf16Roundoff = 1.0 / 512;
constexpr double kFp32Roundoff = 1.0 / 16777216;

struct FlashCase {
  const char* name;
  int head_dim, q_heads, kv_heads;
  int64_t slots;
  int window;
  int32_t first_position;  // of the chunk's first query
  int64_t chunk;           // queries at first_position, first_position + 1, ...
  KvType type;
  int splits;  // 0: prefill_attention_splits' choice
};

void PrintTo(const FlashCase& c, std::ostream* os) {
  *os << c.name;
}

// Slots of one layer of one sequence holding positions [first, last] at slot p % slots (the
// last `slots` of them where they wrap), with the positions in `forget` emptied (position -1,
// NaN contents) and never-written slots empty too.
struct Cache {
  Cache(const FlashCase& c, int64_t slots, int32_t first, int32_t last,
        std::initializer_list<int32_t> forget, uint32_t seed)
      : slots(slots),
        width(int64_t{c.kv_heads} * c.head_dim),
        keys(slots * width, kNaN),
        values(slots * width, kNaN),
        positions(slots, -1) {
    const auto k = testing::random_floats(slots * width, -1.0f, 1.0f, seed);
    const auto v = testing::random_floats(slots * width, -1.0f, 1.0f, seed + 1);
    for (int32_t p = std::max<int32_t>(first, last - static_cast<int32_t>(slots) + 1); p <= last;
         ++p) {
      const int64_t slot = p % slots;
      positions[slot] = p;
      for (int64_t j = slot * width; j < (slot + 1) * width; ++j) {
        // Values the cache type holds exactly (every e4m3 value is a bf16 value too).
        keys[j] = c.type == KvType::kFP8 ? e4m3_to_float(float_to_e4m3(k[j])) : round_bf16(k[j]);
        values[j] = c.type == KvType::kFP8 ? e4m3_to_float(float_to_e4m3(v[j])) : round_bf16(v[j]);
      }
    }
    for (int32_t p : forget) {
      if (p < first || p > last) continue;
      const int64_t slot = p % slots;
      positions[slot] = -1;
      std::fill(keys.begin() + slot * width, keys.begin() + (slot + 1) * width, kNaN);
      std::fill(values.begin() + slot * width, values.begin() + (slot + 1) * width, kNaN);
    }
    device_keys = device_copy(c.type, keys);
    device_values = device_copy(c.type, values);
    device_positions = std::make_unique<DeviceArray<int32_t>>(positions);
  }

  // The bytes of `host` as a cache of `type` holds them (NaN stays NaN).
  static std::vector<uint8_t> encode(KvType type, const std::vector<float>& host) {
    std::vector<uint8_t> bytes;
    for (float x : host) {
      if (type == KvType::kFP8) {
        bytes.push_back(std::isnan(x) ? uint8_t{0x7F} : float_to_e4m3(x));
      } else if (type == KvType::kBF16) {
        const uint16_t bits = std::isnan(x) ? uint16_t{0x7FC0} : float_to_bf16(x);
        bytes.push_back(static_cast<uint8_t>(bits & 0xFF));
        bytes.push_back(static_cast<uint8_t>(bits >> 8));
      } else {
        uint8_t word[4];
        std::memcpy(word, &x, 4);
        bytes.insert(bytes.end(), word, word + 4);
      }
    }
    return bytes;
  }
  static std::unique_ptr<DeviceArray<uint8_t>> device_copy(KvType type,
                                                           const std::vector<float>& host) {
    return std::make_unique<DeviceArray<uint8_t>>(encode(type, host));
  }

  KvCacheView view(const FlashCase& c) const {
    KvCacheView kv;
    kv.type = c.type;
    kv.keys = device_keys->get();
    kv.values = device_values->get();
    kv.slot_positions = device_positions->get();
    kv.slots = slots;
    kv.kv_heads = c.kv_heads;
    kv.head_dim = c.head_dim;
    return kv;
  }
  SequenceKv target() const {
    return {device_keys->get(), device_values->get(), device_positions->get(), slots, 0, 0};
  }

  int64_t slots, width;
  std::vector<float> keys, values;
  std::vector<int32_t> positions;
  std::unique_ptr<DeviceArray<uint8_t>> device_keys, device_values;
  std::unique_ptr<DeviceArray<int32_t>> device_positions;
};

bool visible(int32_t key, int32_t query, int window) {
  return key >= 0 && key <= query && (window == 0 || query - key < window);
}

// Runs the kernel on the case's queries against `sources` (one: prefill_attention over the
// cache; two: prefill_chunk_attention over a cache and the staged chunk) and checks every output
// element against the double-precision reference over all their slots.
void check_attention(const FlashCase& c, const std::vector<const Cache*>& sources, bool zero_query,
                     uint32_t seed) {
  const int64_t q_width = int64_t{c.q_heads} * c.head_dim;
  const int64_t q_stride = q_width + 3, out_stride = q_width + 5;  // rows not 16-byte aligned
  std::vector<float> q(c.chunk * q_stride, kPadding);
  const auto random_q = testing::random_floats(c.chunk * q_width, -0.5f, 0.5f, seed + 2);
  for (int64_t t = 0; t < c.chunk; ++t) {
    for (int64_t i = 0; i < q_width; ++i) {
      q[t * q_stride + i] = zero_query ? 0.0f : round_bf16(random_q[t * q_width + i]);
    }
  }
  std::vector<int32_t> query_positions(c.chunk);
  for (int64_t t = 0; t < c.chunk; ++t) {
    query_positions[t] = c.first_position + static_cast<int32_t>(t);
  }
  std::vector<float> out(c.chunk * out_stride);
  for (int64_t i = 0; i < c.chunk * out_stride; ++i) {
    out[i] = i % out_stride < q_width ? kNaN : kPadding;
  }

  DeviceArray<float> device_q(q), device_out(out);
  DeviceArray<int32_t> device_positions(query_positions);
  const KvCacheView kv = sources[0]->view(c);
  const int splits = c.splits > 0 ? c.splits : prefill_attention_splits(c.chunk, c.q_heads, kv);
  DeviceArray<float> partials(
      splits > 1 ? prefill_attention_partials_floats(c.chunk, c.q_heads, c.head_dim, splits) : 1);
  const float scale = 1.0f;  // Gemma 4's (q and k are normed)
  const RowsView q_rows{device_q.get(), c.chunk, q_width, q_stride};
  const RowsView out_rows{device_out.get(), c.chunk, q_width, out_stride};
  if (sources.size() == 1) {
    CUDA_ASSERT_OK(prefill_attention(q_rows, device_positions.get(), kv, c.window, scale, out_rows,
                                     partials.get(), splits, Launch{}));
  } else {
    CUDA_ASSERT_OK(prefill_chunk_attention(q_rows, device_positions.get(), kv, sources[1]->view(c),
                                           c.window, scale, out_rows, partials.get(), splits,
                                           Launch{}));
  }
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<float> got = device_out.download();

  // The reference and the bound per (query, head), in double.
  int64_t slots = 0;
  for (const Cache* source : sources) slots += source->slots;
  std::vector<double> expected(got.size()), bound(got.size(), 0.0);
  for (int64_t i = 0; i < c.chunk * out_stride; ++i) {
    if (i % out_stride >= q_width) expected[i] = kPadding;  // compared exactly
  }
  const int group = c.q_heads / c.kv_heads;
  testing::parallel_for(c.chunk * c.q_heads, [&](int64_t task) {
    const int64_t t = task / c.q_heads;
    const int h = static_cast<int>(task % c.q_heads);
    const int64_t kv_offset = int64_t{h / group} * c.head_dim;
    const float* qh = q.data() + t * q_stride + int64_t{h} * c.head_dim;
    // (source, slot) pairs with their scores.
    std::vector<std::pair<const float*, double>> seen;
    double max_score = -INFINITY, max_dot = 0.0, max_value = 0.0;
    for (const Cache* source : sources) {
      for (int64_t slot = 0; slot < source->slots; ++slot) {
        if (!visible(source->positions[slot], query_positions[t], c.window)) continue;
        const float* k = source->keys.data() + slot * source->width + kv_offset;
        const float* v = source->values.data() + slot * source->width + kv_offset;
        double dot = 0.0, abs_dot = 0.0;
        for (int d = 0; d < c.head_dim; ++d) {
          dot += double{qh[d]} * k[d];
          abs_dot += std::fabs(double{qh[d]} * k[d]);
          max_value = std::max(max_value, double{std::fabs(v[d])});
        }
        seen.emplace_back(v, scale * dot);
        max_score = std::max(max_score, scale * dot);
        max_dot = std::max(max_dot, abs_dot);
      }
    }
    std::vector<double> o(c.head_dim, 0.0);
    double sum = 0.0;
    for (const auto& [v, score] : seen) {
      const double w = std::exp(score - max_score);
      sum += w;
      for (int d = 0; d < c.head_dim; ++d) o[d] += w * v[d];
    }
    const double epsilon = scale * 4.0 * c.head_dim * kFp32Roundoff * max_dot +
                           4.0 * kFp32Roundoff * (1.0 + 2.0 * scale * max_dot);
    const double beta =
        zero_query ? 1.0 : std::exp(2 * epsilon) * (1 + kBf16Roundoff) / (1 - kBf16Roundoff);
    const double element_bound =
        (beta - 1 + 8.0 * static_cast<double>(slots) * kFp32Roundoff) * max_value;
    for (int d = 0; d < c.head_dim; ++d) {
      const int64_t i = t * out_stride + int64_t{h} * c.head_dim + d;
      expected[i] = sum > 0.0 ? o[d] / sum : 0.0;
      bound[i] = element_bound;
    }
  });
  testing::expect_close(got, expected, bound, 1.0,
                        zero_query ? "uniform weights" : "random queries");
}

// The cache as the engine leaves it once the chunk's K/V are stored: the last `slots` positions
// up to the chunk's last, three slots forgotten.
class FlashAttention : public ::testing::TestWithParam<FlashCase> {
 protected:
  void check(bool zero_query, uint32_t seed) {
    const FlashCase& c = GetParam();
    const int32_t last = c.first_position + static_cast<int32_t>(c.chunk) - 1;
    const Cache cache(c, c.slots, 0, last, {last, last - 5, std::max(0, last - 40)}, seed);
    check_attention(c, {&cache}, zero_query, seed);
  }
};

TEST_P(FlashAttention, UniformWeightsAverageExactlyTheVisibleValues) {
  check(/*zero_query=*/true, 11);
}

TEST_P(FlashAttention, RandomQueriesWithinTheBf16Bound) {
  check(/*zero_query=*/false, 12);
}

// A chunk longer than its ring lets the engine write it first (prefill_chunk_attention): the ring
// holds the positions before the chunk (three forgotten), the staged slots the chunk's own K/V at
// slot p % chunk. Then store_staged_kv must leave the ring exactly as writing the chunk's
// positions in order would.
class StagedFlashAttention : public ::testing::TestWithParam<FlashCase> {
 protected:
  void check(bool zero_query, uint32_t seed) {
    const FlashCase& c = GetParam();
    const int32_t first = c.first_position, last = first + static_cast<int32_t>(c.chunk) - 1;
    const Cache ring(c, c.slots, 0, first - 1, {first - 1, first - 6, first - 300}, seed);
    const Cache staged(c, c.chunk, first, last, {}, seed + 7);
    check_attention(c, {&ring, &staged}, zero_query, seed);
  }
};

TEST_P(StagedFlashAttention, UniformWeightsAverageExactlyTheVisibleValues) {
  check(/*zero_query=*/true, 21);
}

TEST_P(StagedFlashAttention, RandomQueriesWithinTheBf16Bound) {
  check(/*zero_query=*/false, 22);
}

TEST_P(StagedFlashAttention, StoringTheChunkLeavesTheRingAsInOrderWrites) {
  const FlashCase& c = GetParam();
  const int32_t first = c.first_position, last = first + static_cast<int32_t>(c.chunk) - 1;
  Cache ring(c, c.slots, 0, first - 1, {first - 1, first - 6}, 31);
  const Cache staged(c, c.chunk, first, last, {}, 32);
  CUDA_ASSERT_OK(store_staged_kv(staged.view(c), ring.target(), Launch{}));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  for (int32_t p = first; p <= last; ++p) {
    const int64_t from = p % staged.slots, to = p % ring.slots;
    ring.positions[to] = p;
    std::copy_n(staged.keys.begin() + from * staged.width, staged.width,
                ring.keys.begin() + to * ring.width);
    std::copy_n(staged.values.begin() + from * staged.width, staged.width,
                ring.values.begin() + to * ring.width);
  }
  EXPECT_EQ(ring.device_positions->download(), ring.positions);
  EXPECT_EQ(ring.device_keys->download(), Cache::encode(c.type, ring.keys));
  EXPECT_EQ(ring.device_values->download(), Cache::encode(c.type, ring.values));
}

constexpr KvType kF32 = KvType::kF32;
constexpr KvType kBF16 = KvType::kBF16;
constexpr KvType kFP8 = KvType::kFP8;

INSTANTIATE_TEST_SUITE_P(
    Chunks, FlashAttention,
    ::testing::Values(
        // name, head_dim, q heads, kv heads, slots, window, first position, chunk, K/V, splits
        FlashCase{"hd256_one_query_deep_ring_bf16", 256, 8, 1, 1023, 512, 3000, 1, kBF16, 0},
        FlashCase{"hd256_e2b_sliding_33_bf16", 256, 8, 1, 1023, 512, 700, 33, kBF16, 0},
        FlashCase{"hd256_e2b_sliding_65_f32_one_split", 256, 8, 1, 1023, 512, 2000, 65, kF32, 1},
        FlashCase{"hd256_26b_sliding_97_bf16_3_splits", 256, 16, 8, 1056, 1024, 1500, 97, kBF16, 3},
        FlashCase{"hd256_e2b_sliding_97_fp8", 256, 8, 1, 1023, 512, 700, 97, kFP8, 0},
        FlashCase{"hd512_e2b_full_33_fp8_3_splits", 512, 8, 1, 4096, 0, 900, 33, kFP8, 3},
        FlashCase{"hd256_mha_first_chunk_512_bf16", 256, 4, 4, 600, 0, 0, 512, kBF16, 0},
        FlashCase{"hd256_e2b_sliding_512_deep_f32", 256, 8, 1, 1023, 512, 3584, 512, kF32, 0},
        FlashCase{"hd512_one_query_full_f32", 512, 8, 1, 2048, 0, 1200, 1, kF32, 0},
        FlashCase{"hd512_e2b_full_33_bf16_one_split", 512, 8, 1, 4096, 0, 900, 33, kBF16, 1},
        FlashCase{"hd512_26b_full_65_f32_5_splits", 512, 16, 2, 2048, 0, 1000, 65, kF32, 5},
        FlashCase{"hd512_window_97_bf16", 512, 8, 2, 300, 50, 200, 97, kBF16, 0},
        FlashCase{"hd512_e2b_full_512_deep_bf16", 512, 8, 1, 2048, 0, 1024, 512, kBF16, 0}),
    [](const auto& info) { return std::string(info.param.name); });

// Chunks of a 26B-like sliding layer (16 q / 8 kv heads, window 1024, a ring of 1056 slots), at
// depth 0 and past the window, and of other shapes (head_dim 512, E2B's one kv head).
INSTANTIATE_TEST_SUITE_P(
    Chunks, StagedFlashAttention,
    ::testing::Values(
        // name, head_dim, q heads, kv heads, ring slots, window, first position, chunk, K/V, splits
        FlashCase{"hd256_26b_one_query_deep_bf16", 256, 16, 8, 1056, 1024, 3000, 1, kBF16, 0},
        FlashCase{"hd256_26b_33_deep_bf16", 256, 16, 8, 1056, 1024, 2500, 33, kBF16, 0},
        FlashCase{"hd256_26b_65_first_fp8", 256, 16, 8, 1056, 1024, 0, 65, kFP8, 0},
        FlashCase{"hd256_26b_97_deep_f32_3_splits", 256, 16, 8, 1056, 1024, 1500, 97, kF32, 3},
        FlashCase{"hd256_26b_512_first_bf16", 256, 16, 8, 1056, 1024, 0, 512, kBF16, 0},
        FlashCase{"hd256_26b_1000_deep_bf16", 256, 16, 8, 1056, 1024, 4000, 1000, kBF16, 0},
        FlashCase{"hd256_26b_1000_deep_fp8", 256, 16, 8, 1056, 1024, 1100, 1000, kFP8, 0},
        FlashCase{"hd256_e2b_1000_deep_bf16_2_splits", 256, 8, 1, 544, 512, 2000, 1000, kBF16, 2},
        FlashCase{"hd512_window_97_deep_bf16", 512, 8, 2, 300, 50, 700, 97, kBF16, 0},
        FlashCase{"hd512_full_ring_512_deep_fp8", 512, 16, 2, 600, 0, 900, 512, kFP8, 0}),
    [](const auto& info) { return std::string(info.param.name); });

// Shapes the kernel does not take are refused before anything is launched.
TEST(FlashAttentionArguments, RejectsWhatItCannotRun) {
  DeviceArray<float> q(512 * 4), out(512 * 4), kv_data(512 * 4);
  DeviceArray<int32_t> positions(4), slots(4);
  KvCacheView kv;
  kv.keys = kv_data.get();
  kv.values = kv_data.get();
  kv.slot_positions = slots.get();
  kv.type = KvType::kF32;
  kv.slots = 4;
  kv.kv_heads = 1;
  kv.head_dim = 512;
  const RowsView rows{q.get(), 4, 512, 512}, out_rows{out.get(), 4, 512, 512};
  EXPECT_EQ(prefill_attention(rows, positions.get(), kv, 0, 1.0f, out_rows, nullptr, 1, Launch{}),
            cudaSuccess);
  EXPECT_EQ(prefill_attention(rows, positions.get(), kv, 0, 1.0f, out_rows, nullptr, 2, Launch{}),
            cudaErrorInvalidValue);  // splits without partials
  EXPECT_EQ(prefill_attention(rows, positions.get(), kv, 0, 1.0f, out_rows, nullptr, 0, Launch{}),
            cudaErrorInvalidValue);
  kv.head_dim = 128;
  EXPECT_EQ(prefill_attention({q.get(), 4, 512, 512}, positions.get(), kv, 0, 1.0f, out_rows,
                              nullptr, 1, Launch{}),
            cudaErrorInvalidValue);
  kv.head_dim = 512;
  // A staged chunk must match the cache's shape and element type.
  KvCacheView staged = kv;
  EXPECT_EQ(prefill_chunk_attention(rows, positions.get(), kv, staged, 0, 1.0f, out_rows, nullptr,
                                    1, Launch{}),
            cudaSuccess);
  staged.type = KvType::kBF16;
  EXPECT_EQ(prefill_chunk_attention(rows, positions.get(), kv, staged, 0, 1.0f, out_rows, nullptr,
                                    1, Launch{}),
            cudaErrorInvalidValue);
  staged.type = KvType::kF32;
  staged.slot_positions = nullptr;
  EXPECT_EQ(prefill_chunk_attention(rows, positions.get(), kv, staged, 0, 1.0f, out_rows, nullptr,
                                    1, Launch{}),
            cudaErrorInvalidValue);
  EXPECT_EQ(store_staged_kv(staged, {kv_data.get(), kv_data.get(), slots.get(), 4, 0, 0}, Launch{}),
            cudaErrorInvalidValue);
  kv.keys = reinterpret_cast<const char*>(kv_data.get()) + 4;  // not 16-byte aligned
  EXPECT_EQ(prefill_attention(rows, positions.get(), kv, 0, 1.0f, out_rows, nullptr, 1, Launch{}),
            cudaErrorInvalidValue);
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace gemma4::cuda
