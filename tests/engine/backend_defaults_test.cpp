// Backend's default fused operations (engine/backend.cpp) on the CPU backend against their
// documented formulas, in double precision: what every overriding kernel is checked against.
#include <gtest/gtest.h>

#include "test_support.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/backend.h"

namespace gemma4::engine {
namespace {

// y = x · rsqrt(mean(x²) + eps) · (offset + w), w = nullptr: no weight factor.
std::vector<double> rms_normed(const float* x, int64_t n, const float* w, const NormParams& p) {
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += double{x[j]} * x[j];
  const double inv = 1.0 / std::sqrt(sum / n + p.eps);
  std::vector<double> y(n);
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] * inv * (w ? p.weight_offset + w[j] : 1.0);
  return y;
}

TEST(BackendDefaults, AddRmsNormAddsScalesAndNormsTheNextInput) {
  backend::cpu::CpuBackend backend(2);
  const int64_t rows = 3, width = 48;
  const NormParams params{1.0f, 1e-6f};
  const auto x0 = testing::random_normal(rows * width, 1),
             acc0 = testing::random_normal(rows * width, 2);
  const auto weight = testing::random_normal(width, 3),
             next_weight = testing::random_normal(width, 4);
  for (const bool with_next : {false, true}) {
    auto x = x0, acc = acc0;
    std::vector<float> next(rows * width, 0.0f);
    backend.add_rms_norm(Rows::dense(acc.data(), rows, width), Rows::dense(x.data(), rows, width),
                         weight.data(), 0.5f, next_weight.data(),
                         with_next ? Rows::dense(next.data(), rows, width) : Rows{}, params);
    for (int64_t r = 0; r < rows; ++r) {
      const auto normed = rms_normed(&x0[r * width], width, weight.data(), params);
      std::vector<float> expected_acc(width);
      for (int64_t j = 0; j < width; ++j) {
        const double expected = (acc0[r * width + j] + normed[j]) * 0.5;
        EXPECT_NEAR(acc[r * width + j], expected, 1e-5);
        expected_acc[j] = static_cast<float>(expected);
      }
      const auto expected_next = rms_normed(expected_acc.data(), width, next_weight.data(), params);
      for (int64_t j = 0; j < width; ++j) {
        EXPECT_NEAR(next[r * width + j], with_next ? expected_next[j] : 0.0, 1e-4);
      }
    }
  }
}

TEST(BackendDefaults, AddRmsNormBranchJoinsTheBranchFirst) {
  backend::cpu::CpuBackend backend(2);
  const int64_t rows = 2, width = 40;
  const NormParams params{0.0f, 1e-6f};
  const auto x0 = testing::random_normal(rows * width, 21),
             branch0 = testing::random_normal(rows * width, 22),
             acc0 = testing::random_normal(rows * width, 23);
  const auto branch_weight = testing::random_normal(width, 24),
             weight = testing::random_normal(width, 25),
             next_weight = testing::random_normal(width, 26);
  auto x = x0, branch = branch0, acc = acc0;
  std::vector<float> next(rows * width);
  backend.add_rms_norm_branch(
      Rows::dense(acc.data(), rows, width), Rows::dense(branch.data(), rows, width),
      Rows::dense(x.data(), rows, width), branch_weight.data(), weight.data(), 0.5f,
      next_weight.data(), Rows::dense(next.data(), rows, width), params);
  for (int64_t r = 0; r < rows; ++r) {
    const auto normed_x = rms_normed(&x0[r * width], width, branch_weight.data(), params);
    std::vector<float> joined(width);
    for (int64_t j = 0; j < width; ++j)
      joined[j] = static_cast<float>(branch0[r * width + j] + normed_x[j]);
    const auto normed = rms_normed(joined.data(), width, weight.data(), params);
    std::vector<float> expected_acc(width);
    for (int64_t j = 0; j < width; ++j) {
      expected_acc[j] = static_cast<float>((acc0[r * width + j] + normed[j]) * 0.5);
      EXPECT_NEAR(acc[r * width + j], expected_acc[j], 1e-5);
    }
    const auto expected_next = rms_normed(expected_acc.data(), width, next_weight.data(), params);
    for (int64_t j = 0; j < width; ++j) EXPECT_NEAR(next[r * width + j], expected_next[j], 1e-4);
  }
}

TEST(BackendDefaults, AddRmsNormMoeStepsThenNormsTheRouterAndExpertInputs) {
  backend::cpu::CpuBackend backend(2);
  const int64_t rows = 3, width = 40;
  const NormParams params{0.0f, 1e-6f};
  const auto x0 = testing::random_normal(rows * width, 11),
             acc0 = testing::random_normal(rows * width, 12);
  const auto weight = testing::random_normal(width, 13),
             next_weight = testing::random_normal(width, 14),
             router_scale = testing::random_normal(width, 15),
             expert_weight = testing::random_normal(width, 16);
  const float factor = 0.25f;
  auto x = x0, acc = acc0;
  std::vector<float> next(rows * width), expert_in(rows * width);
  // The router's input takes the place of x, as the engine places it.
  const MoeInputs moe = {router_scale.data(), factor, expert_weight.data(),
                         Rows::dense(x.data(), rows, width),
                         Rows::dense(expert_in.data(), rows, width)};
  backend.add_rms_norm_moe(Rows::dense(acc.data(), rows, width), Rows::dense(x.data(), rows, width),
                           weight.data(), 1.0f, next_weight.data(),
                           Rows::dense(next.data(), rows, width), moe, params);
  for (int64_t r = 0; r < rows; ++r) {
    const auto normed_x = rms_normed(&x0[r * width], width, weight.data(), params);
    std::vector<float> expected_acc(width);
    for (int64_t j = 0; j < width; ++j) {
      expected_acc[j] = static_cast<float>(acc0[r * width + j] + normed_x[j]);
      EXPECT_NEAR(acc[r * width + j], expected_acc[j], 1e-5);
    }
    const auto n = rms_normed(expected_acc.data(), width, next_weight.data(), params);
    const auto plain = rms_normed(expected_acc.data(), width, nullptr, params);
    const auto e = rms_normed(expected_acc.data(), width, expert_weight.data(), params);
    for (int64_t j = 0; j < width; ++j) {
      EXPECT_NEAR(next[r * width + j], n[j], 1e-4);
      EXPECT_NEAR(x[r * width + j], plain[j] * router_scale[j] * factor, 1e-5);
      EXPECT_NEAR(expert_in[r * width + j], e[j], 1e-4);
    }
  }
}

TEST(BackendDefaults, ConcurrentlyRunsTheFirstBranchThenTheSecond) {
  backend::cpu::CpuBackend backend(2);
  std::vector<int> order;
  backend.concurrently(
      1, [&] { order.push_back(1); }, [&] { order.push_back(2); });
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

// q/k/v as column views of one [rows, q + k + v] matrix (a stacked QKV projection): per-head
// norms, rotation and the K/V store reach exactly the same values as on dense matrices.
TEST(BackendDefaults, PrepareAttentionOnColumnViewsEqualsDenseMatrices) {
  backend::cpu::CpuBackend backend(2);
  const int head_dim = 16, q_heads = 4, kv_heads = 2, rows = 5;
  const int64_t q_width = q_heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t width = q_width + 2 * kv_width;
  const auto stacked0 = testing::random_normal(rows * width, 5);
  const auto q_norm = testing::random_normal(head_dim, 6),
             k_norm = testing::random_normal(head_dim, 7);
  const std::vector<int32_t> positions{0, 1, 2, 7, 8};
  const model::RopeParams rope{10000.0, head_dim / 2, head_dim};
  const NormParams params{0.0f, 1e-6f};

  struct Cache {
    std::vector<float> keys, values;
    std::vector<int32_t> slot_positions;
    KvView view(int64_t slots, int kv, int hd) {
      keys.assign(slots * kv * hd, 0.0f);
      values.assign(slots * kv * hd, 0.0f);
      slot_positions.assign(slots, -1);
      return {keys.data(), values.data(), slot_positions.data(), slots, kv, hd};
    }
  } strided_cache, dense_cache;
  // Rows 0-2 one sequence, 3-4 another: two caches each.
  auto stacked = stacked0;
  const Rows all = Rows::dense(stacked.data(), rows, width);
  const Rows q = all.columns(0, q_width), k = all.columns(q_width, kv_width),
             v = all.columns(q_width + kv_width, kv_width);
  const KvView strided_kv = strided_cache.view(16, kv_heads, head_dim);
  const SequenceRows strided_sequences[] = {{strided_kv, 0, 3}, {strided_kv, 3, 2}};
  backend.prepare_attention(q, k, v, q_norm.data(), k_norm.data(), true, head_dim, positions.data(),
                            rope, strided_sequences, params);

  std::vector<float> dq(rows * q_width), dk(rows * kv_width), dv(rows * kv_width);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(&stacked0[r * width], q_width, &dq[r * q_width]);
    std::copy_n(&stacked0[r * width + q_width], kv_width, &dk[r * kv_width]);
    std::copy_n(&stacked0[r * width + q_width + kv_width], kv_width, &dv[r * kv_width]);
  }
  const KvView dense_kv = dense_cache.view(16, kv_heads, head_dim);
  const SequenceRows dense_sequences[] = {{dense_kv, 0, 3}, {dense_kv, 3, 2}};
  backend.prepare_attention(Rows::dense(dq.data(), rows, q_width),
                            Rows::dense(dk.data(), rows, kv_width),
                            Rows::dense(dv.data(), rows, kv_width), q_norm.data(), k_norm.data(),
                            true, head_dim, positions.data(), rope, dense_sequences, params);

  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < q_width; ++j) EXPECT_EQ(q.row(r)[j], dq[r * q_width + j]);
  }
  EXPECT_EQ(strided_cache.keys, dense_cache.keys);
  EXPECT_EQ(strided_cache.values, dense_cache.values);
  EXPECT_EQ(strided_cache.slot_positions, dense_cache.slot_positions);
  // v normed without weight: each stored head has mean square 1 (up to eps).
  const int64_t slot = positions[3] % 16;
  double sum = 0;
  for (int j = 0; j < head_dim; ++j) {
    sum +=
        double{dense_cache.values[slot * kv_width + j]} * dense_cache.values[slot * kv_width + j];
  }
  EXPECT_NEAR(sum / head_dim, 1.0, 1e-4);
}

}  // namespace
}  // namespace gemma4::engine
