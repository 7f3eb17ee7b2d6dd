// The prefill attention kernel (prefill_kernels.h) on its own, against a double-precision
// reference computed here on fresh random inputs: float and bf16 K/V, head_dim 256 and 512,
// GQA groups of 1..8, full and sliding layers (a ring that wrapped, sliding windows), chunks of
// 1..512 queries deep into a prompt, forgotten slots holding NaN, one block per row tile or the
// cache split among several blocks and merged. The output starts as NaN with padding between
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
#include <limits>
#include <string>
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

// The cache as the engine leaves it once the chunk's K/V are stored: the last `slots` positions
// up to the chunk's last at slot p % slots, three slots forgotten (position -1, NaN contents).
struct Cache {
  explicit Cache(const FlashCase& c, uint32_t seed)
      : width(int64_t{c.kv_heads} * c.head_dim),
        keys(c.slots * width, kNaN),
        values(c.slots * width, kNaN),
        positions(c.slots, -1) {
    const int32_t last = c.first_position + static_cast<int32_t>(c.chunk) - 1;
    const auto k = testing::random_floats(c.slots * width, -1.0f, 1.0f, seed);
    const auto v = testing::random_floats(c.slots * width, -1.0f, 1.0f, seed + 1);
    for (int32_t p = std::max<int32_t>(0, last - static_cast<int32_t>(c.slots) + 1); p <= last;
         ++p) {
      const int64_t slot = p % c.slots;
      positions[slot] = p;
      for (int64_t j = slot * width; j < (slot + 1) * width; ++j) {
        // Values the cache type holds exactly (every e4m3 value is a bf16 value too).
        keys[j] = c.type == KvType::kFP8 ? e4m3_to_float(float_to_e4m3(k[j])) : round_bf16(k[j]);
        values[j] = c.type == KvType::kFP8 ? e4m3_to_float(float_to_e4m3(v[j])) : round_bf16(v[j]);
      }
    }
    for (int32_t p : {last, last - 5, std::max(0, last - 40)}) {
      const int64_t slot = p % c.slots;
      positions[slot] = -1;
      std::fill(keys.begin() + slot * width, keys.begin() + (slot + 1) * width, kNaN);
      std::fill(values.begin() + slot * width, values.begin() + (slot + 1) * width, kNaN);
    }
  }
  // The device copy of keys or values in `type`.
  std::unique_ptr<DeviceArray<uint16_t>> bf16(const std::vector<float>& host) const {
    std::vector<uint16_t> bits(host.size());
    for (size_t i = 0; i < host.size(); ++i) {
      bits[i] = std::isnan(host[i]) ? uint16_t{0x7FC0} : float_to_bf16(host[i]);
    }
    return std::make_unique<DeviceArray<uint16_t>>(bits);
  }
  std::unique_ptr<DeviceArray<uint8_t>> e4m3(const std::vector<float>& host) const {
    std::vector<uint8_t> bits(host.size());
    for (size_t i = 0; i < host.size(); ++i) {
      bits[i] = std::isnan(host[i]) ? uint8_t{0x7F} : float_to_e4m3(host[i]);
    }
    return std::make_unique<DeviceArray<uint8_t>>(bits);
  }

  int64_t width;
  std::vector<float> keys, values;
  std::vector<int32_t> positions;
};

bool visible(int32_t key, int32_t query, int window) {
  return key >= 0 && key <= query && (window == 0 || query - key < window);
}

class FlashAttention : public ::testing::TestWithParam<FlashCase> {
 protected:
  void check(bool zero_query, uint32_t seed) {
    const FlashCase& c = GetParam();
    const Cache cache(c, seed);
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
    DeviceArray<int32_t> device_positions(query_positions), device_slots(cache.positions);
    std::unique_ptr<DeviceArray<float>> f32_keys, f32_values;
    std::unique_ptr<DeviceArray<uint16_t>> bf16_keys, bf16_values;
    std::unique_ptr<DeviceArray<uint8_t>> e4m3_keys, e4m3_values;
    KvCacheView kv;
    kv.type = c.type;
    kv.slot_positions = device_slots.get();
    kv.slots = c.slots;
    kv.kv_heads = c.kv_heads;
    kv.head_dim = c.head_dim;
    if (c.type == KvType::kBF16) {
      bf16_keys = cache.bf16(cache.keys);
      bf16_values = cache.bf16(cache.values);
      kv.keys = bf16_keys->get();
      kv.values = bf16_values->get();
    } else if (c.type == KvType::kFP8) {
      e4m3_keys = cache.e4m3(cache.keys);
      e4m3_values = cache.e4m3(cache.values);
      kv.keys = e4m3_keys->get();
      kv.values = e4m3_values->get();
    } else {
      f32_keys = std::make_unique<DeviceArray<float>>(cache.keys);
      f32_values = std::make_unique<DeviceArray<float>>(cache.values);
      kv.keys = f32_keys->get();
      kv.values = f32_values->get();
    }
    const int splits = c.splits > 0 ? c.splits : prefill_attention_splits(c.chunk, c.q_heads, kv);
    DeviceArray<float> partials(
        splits > 1 ? prefill_attention_partials_floats(c.chunk, c.q_heads, c.head_dim, splits) : 1);
    const float scale = 1.0f;  // Gemma 4's (q and k are normed)
    CUDA_ASSERT_OK(prefill_attention(
        {device_q.get(), c.chunk, q_width, q_stride}, device_positions.get(), kv, c.window, scale,
        {device_out.get(), c.chunk, q_width, out_stride}, partials.get(), splits, Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    const std::vector<float> got = device_out.download();

    // The reference and the bound per (query, head), in double.
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
      std::vector<double> scores(c.slots, -INFINITY);
      double max_score = -INFINITY, max_dot = 0.0, max_value = 0.0;
      for (int64_t slot = 0; slot < c.slots; ++slot) {
        if (!visible(cache.positions[slot], query_positions[t], c.window)) continue;
        const float* k = cache.keys.data() + slot * cache.width + kv_offset;
        const float* v = cache.values.data() + slot * cache.width + kv_offset;
        double dot = 0.0, abs_dot = 0.0;
        for (int d = 0; d < c.head_dim; ++d) {
          dot += double{qh[d]} * k[d];
          abs_dot += std::fabs(double{qh[d]} * k[d]);
          max_value = std::max(max_value, double{std::fabs(v[d])});
        }
        scores[slot] = scale * dot;
        max_score = std::max(max_score, scores[slot]);
        max_dot = std::max(max_dot, abs_dot);
      }
      std::vector<double> o(c.head_dim, 0.0);
      double sum = 0.0;
      for (int64_t slot = 0; slot < c.slots; ++slot) {
        if (scores[slot] == -INFINITY) continue;
        const double w = std::exp(scores[slot] - max_score);
        sum += w;
        const float* v = cache.values.data() + slot * cache.width + kv_offset;
        for (int d = 0; d < c.head_dim; ++d) o[d] += w * v[d];
      }
      const double epsilon = scale * 4.0 * c.head_dim * kFp32Roundoff * max_dot +
                             4.0 * kFp32Roundoff * (1.0 + 2.0 * scale * max_dot);
      const double beta =
          zero_query ? 1.0 : std::exp(2 * epsilon) * (1 + kBf16Roundoff) / (1 - kBf16Roundoff);
      const double element_bound =
          (beta - 1 + 8.0 * static_cast<double>(c.slots) * kFp32Roundoff) * max_value;
      for (int d = 0; d < c.head_dim; ++d) {
        const int64_t i = t * out_stride + int64_t{h} * c.head_dim + d;
        expected[i] = sum > 0.0 ? o[d] / sum : 0.0;
        bound[i] = element_bound;
      }
    });
    testing::expect_close(got, expected, bound, 1.0,
                          zero_query ? "uniform weights" : "random queries");
  }
};

TEST_P(FlashAttention, UniformWeightsAverageExactlyTheVisibleValues) {
  check(/*zero_query=*/true, 11);
}

TEST_P(FlashAttention, RandomQueriesWithinTheBf16Bound) {
  check(/*zero_query=*/false, 12);
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
  kv.keys = reinterpret_cast<const char*>(kv_data.get()) + 4;  // not 16-byte aligned
  EXPECT_EQ(prefill_attention(rows, positions.get(), kv, 0, 1.0f, out_rows, nullptr, 1, Launch{}),
            cudaErrorInvalidValue);
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace gemma4::cuda
