// CPU reference kernels against the formulas of gemma4-architecture.md, evaluated here in double
// precision with naive loops.
#include "backend/cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include "test_support.h"

#include <atomic>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/numeric.h"

namespace gemma4::backend::cpu {
namespace {

using engine::KvView;
using engine::Rows;

quant::QMatrix f32_matrix(const std::vector<float>& data, int64_t rows, int64_t cols) {
  quant::QMatrix m;
  m.format = quant::WeightFormat::kF32;
  m.rows = rows;
  m.cols = cols;
  m.data = data.data();
  return m;
}

TEST(ThreadPool, CoversEveryIndexOnce) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ++hits[i];
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

TEST(CpuBackend, MatmulF32AndBf16) {
  CpuBackend backend(2);
  const int64_t n = 37, k = 64, t = 3;
  auto w = testing::random_normal(n * k, 1);
  auto x = testing::random_normal(t * k, 2);
  std::vector<uint16_t> w_bf16(w.size());
  for (size_t i = 0; i < w.size(); ++i) w_bf16[i] = float_to_bf16(w[i]);

  for (bool bf16 : {false, true}) {
    quant::QMatrix m = f32_matrix(w, n, k);
    if (bf16) {
      m.format = quant::WeightFormat::kBF16;
      m.data = w_bf16.data();
    }
    std::vector<float> y(t * n);
    backend.matmul(m, Rows::dense(x.data(), t, k), Rows::dense(y.data(), t, n));
    for (int64_t r = 0; r < t; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        double expected = 0;
        for (int64_t j = 0; j < k; ++j) {
          const double wj = bf16 ? bf16_to_float(w_bf16[c * k + j]) : w[c * k + j];
          expected += wj * x[r * k + j];
        }
        EXPECT_NEAR(y[r * n + c], expected, 1e-4) << r << "," << c;
      }
    }
  }
}

TEST(CpuBackend, EmbedScalesTheRows) {
  CpuBackend backend(1);
  auto table = testing::random_normal(10 * 4, 3);
  const std::vector<int32_t> ids{7, 2};
  std::vector<float> out(2 * 4);
  backend.embed(f32_matrix(table, 10, 4), ids.data(), 8.0f, Rows::dense(out.data(), 2, 4));
  for (int j = 0; j < 4; ++j) {
    EXPECT_FLOAT_EQ(out[j], table[7 * 4 + j] * 8.0f);
    EXPECT_FLOAT_EQ(out[4 + j], table[2 * 4 + j] * 8.0f);
  }
}

TEST(CpuBackend, RmsNormUsesWeightDirectlyWithEpsInside) {
  CpuBackend backend(1);
  std::vector<float> x{1.0f, -2.0f, 3.0f, 0.5f};
  const std::vector<float> w{0.5f, 2.0f, -1.0f, 0.0f};
  const double ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0 + 1e-6;
  std::vector<float> y(4), y_offset(4), y_plain(4);
  backend.rms_norm(Rows::dense(x.data(), 1, 4), w.data(), 0.0f, 1e-6f, Rows::dense(y.data(), 1, 4));
  backend.rms_norm(Rows::dense(x.data(), 1, 4), w.data(), 1.0f, 1e-6f,
                   Rows::dense(y_offset.data(), 1, 4));
  backend.rms_norm(Rows::dense(x.data(), 1, 4), nullptr, 0.0f, 1e-6f,
                   Rows::dense(y_plain.data(), 1, 4));
  for (int j = 0; j < 4; ++j) {
    EXPECT_NEAR(y[j], x[j] / std::sqrt(ms) * w[j], 1e-6);
    EXPECT_NEAR(y_offset[j], x[j] / std::sqrt(ms) * (1.0 + w[j]), 1e-6);
    EXPECT_NEAR(y_plain[j], x[j] / std::sqrt(ms), 1e-6);
  }
}

TEST(CpuBackend, RopeHalfSplitDefaultAndProportional) {
  CpuBackend backend(1);
  const int hd = 8, heads = 2;
  auto x = testing::random_normal(heads * hd, 4);
  const std::vector<int32_t> positions{5};

  // Default: all 4 pairs rotate, inv_freq[i] = theta^(-2i/8); pairing (i, i + 4).
  model::RopeParams rope{10000.0, 4, 8};
  auto y = x;
  backend.rope(Rows::dense(y.data(), 1, heads * hd), hd, positions.data(), rope);
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < 4; ++i) {
      const double angle = 5.0 * std::pow(10000.0, -2.0 * i / 8.0);
      const double a = x[h * hd + i], b = x[h * hd + i + 4];
      EXPECT_NEAR(y[h * hd + i], a * std::cos(angle) - b * std::sin(angle), 1e-5);
      EXPECT_NEAR(y[h * hd + i + 4], b * std::cos(angle) + a * std::sin(angle), 1e-5);
    }
  }

  // Proportional: 1 of 4 pairs rotates with denominator = head dim; the others pass through.
  model::RopeParams proportional{1e6, 1, 8};
  y = x;
  backend.rope(Rows::dense(y.data(), 1, heads * hd), hd, positions.data(), proportional);
  for (int h = 0; h < heads; ++h) {
    const double a = x[h * hd], b = x[h * hd + 4];
    EXPECT_NEAR(y[h * hd], a * std::cos(5.0) - b * std::sin(5.0), 1e-5);
    EXPECT_NEAR(y[h * hd + 4], b * std::cos(5.0) + a * std::sin(5.0), 1e-5);
    for (int i : {1, 2, 3, 5, 6, 7}) EXPECT_EQ(y[h * hd + i], x[h * hd + i]);
  }
}

TEST(CpuBackend, GeluTanhMatchesPyTorch) {
  // torch.nn.functional.gelu(x, approximate="tanh") for x = 1, -0.5, 3.
  EXPECT_NEAR(gelu_tanh(1.0f), 0.8411920070648193, 1e-6);
  EXPECT_NEAR(gelu_tanh(-0.5f), -0.1542859971523285, 1e-6);
  EXPECT_NEAR(gelu_tanh(3.0f), 2.9963626861572266, 1e-6);
  CpuBackend backend(1);
  std::vector<float> gate{1.0f, -0.5f}, mul{2.0f, 4.0f}, out(2);
  backend.gelu_tanh_mul(Rows::dense(gate.data(), 1, 2), Rows::dense(mul.data(), 1, 2),
                        Rows::dense(out.data(), 1, 2));
  EXPECT_NEAR(out[0], 2 * 0.8411920070648193, 1e-6);
  EXPECT_NEAR(out[1], 4 * -0.1542859971523285, 1e-6);
}

TEST(CpuBackend, SoftcapAndScale) {
  CpuBackend backend(1);
  std::vector<float> x{45.0f, -3.0f};
  backend.softcap(Rows::dense(x.data(), 1, 2), 30.0f);
  EXPECT_NEAR(x[0], 30.0 * std::tanh(1.5), 1e-5);
  EXPECT_NEAR(x[1], 30.0 * std::tanh(-0.1), 1e-5);
  const std::vector<float> column{2.0f, 3.0f};
  backend.scale(Rows::dense(x.data(), 1, 2), column.data(), 0.5f);
  EXPECT_NEAR(x[1], 30.0 * std::tanh(-0.1) * 3.0 * 0.5, 1e-5);
}

// Naive attention of one query head against explicit (position, k, v) triples.
std::vector<double> reference_attention(const float* q, int hd, int64_t query_position, int window,
                                        const std::vector<int32_t>& key_positions,
                                        const std::vector<const float*>& keys,
                                        const std::vector<const float*>& values) {
  std::vector<double> scores;
  std::vector<size_t> visible;
  for (size_t j = 0; j < key_positions.size(); ++j) {
    const int64_t p = key_positions[j];
    if (p < 0 || p > query_position || (window > 0 && query_position - p >= window)) continue;
    double s = 0;
    for (int d = 0; d < hd; ++d) s += double{q[d]} * keys[j][d];
    scores.push_back(s);
    visible.push_back(j);
  }
  double max = -1e300, sum = 0;
  for (double s : scores) max = std::max(max, s);
  for (double& s : scores) sum += (s = std::exp(s - max));
  std::vector<double> out(hd, 0.0);
  for (size_t i = 0; i < visible.size(); ++i)
    for (int d = 0; d < hd; ++d) out[d] += scores[i] / sum * values[visible[i]][d];
  return out;
}

TEST(CpuBackend, AttentionOverARingWithSlidingAndCausalMasks) {
  CpuBackend backend(2);
  const int hd = 4, kv_heads = 1, q_heads = 2, slots = 6;
  std::vector<float> keys(slots * hd), values(slots * hd);
  std::vector<int32_t> slot_positions(slots, -1);
  KvView kv{keys.data(), values.data(), slot_positions.data(), slots, kv_heads, hd};

  // Write positions 0..8 three at a time; the ring keeps 3..8.
  auto k_all = testing::random_normal(9 * hd, 5), v_all = testing::random_normal(9 * hd, 6);
  for (int p = 0; p < 9; p += 3) {
    std::vector<int32_t> pos{p, p + 1, p + 2};
    backend.write_kv(kv, Rows::dense(k_all.data() + p * hd, 3, hd),
                     Rows::dense(v_all.data() + p * hd, 3, hd), pos.data());
  }
  EXPECT_EQ(slot_positions, (std::vector<int32_t>{6, 7, 8, 3, 4, 5}));

  auto q = testing::random_normal(2 * q_heads * hd, 7);
  const std::vector<int32_t> query_positions{7, 8};
  for (int window : {0, 4}) {
    std::vector<float> out(2 * q_heads * hd);
    backend.attention(Rows::dense(q.data(), 2, q_heads * hd), query_positions.data(), kv, window,
                      1.0f, Rows::dense(out.data(), 2, q_heads * hd));
    std::vector<int32_t> held{3, 4, 5, 6, 7, 8};
    std::vector<const float*> ks, vs;
    for (int p : held) {
      ks.push_back(k_all.data() + p * hd);
      vs.push_back(v_all.data() + p * hd);
    }
    for (int t = 0; t < 2; ++t) {
      for (int h = 0; h < q_heads; ++h) {
        auto expected = reference_attention(q.data() + (t * q_heads + h) * hd, hd,
                                            query_positions[t], window, held, ks, vs);
        for (int d = 0; d < hd; ++d)
          EXPECT_NEAR(out[(t * q_heads + h) * hd + d], expected[d], 1e-5)
              << "window " << window << " t " << t << " h " << h;
      }
    }
  }

  backend.forget_kv(kv, 7);
  EXPECT_EQ(slot_positions, (std::vector<int32_t>{6, -1, -1, 3, 4, 5}));
}

TEST(CpuBackend, RouterTopKTiesRenormalisationAndExpertScale) {
  CpuBackend backend(1);
  // Experts 1 and 3 tie for first, 0 and 2 tie below: top-3 = 1, 3, 0 (lower id first).
  std::vector<float> logits{1.0f, 2.0f, 1.0f, 2.0f};
  const std::vector<float> per_expert_scale{0.5f, 2.0f, 1.0f, 3.0f};
  std::vector<int32_t> ids(3);
  std::vector<float> weights(3);
  backend.route_experts(Rows::dense(logits.data(), 1, 4), {3, per_expert_scale.data()}, ids.data(),
                        weights.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 3, 0}));
  const double e = std::exp(1.0), kept = 2 * e * e + e;
  EXPECT_NEAR(weights[0], e * e / kept * 2.0, 1e-6);
  EXPECT_NEAR(weights[1], e * e / kept * 3.0, 1e-6);
  EXPECT_NEAR(weights[2], e / kept * 0.5, 1e-6);
}

TEST(CpuBackend, ExpertsWeightedSum) {
  CpuBackend backend(1);
  const int h = 4, inner = 2, experts = 3;
  std::vector<std::vector<float>> store;
  std::vector<model::ExpertMatrices> matrices(experts);
  for (int e = 0; e < experts; ++e) {
    store.push_back(testing::random_normal(inner * h, 10 + e));
    store.push_back(testing::random_normal(inner * h, 20 + e));
    store.push_back(testing::random_normal(h * inner, 30 + e));
  }
  for (int e = 0; e < experts; ++e) {
    matrices[e].gate = f32_matrix(store[3 * e], inner, h);
    matrices[e].up = f32_matrix(store[3 * e + 1], inner, h);
    matrices[e].down = f32_matrix(store[3 * e + 2], h, inner);
  }
  auto x = testing::random_normal(2 * h, 40);
  const std::vector<int32_t> ids{2, 0, 1, 2};
  const std::vector<float> weights{0.25f, 0.75f, 1.5f, -0.5f};
  std::vector<float> out(2 * h);
  backend.run_experts(matrices, Rows::dense(x.data(), 2, h), ids.data(), weights.data(), 2,
                      Rows::dense(out.data(), 2, h));
  for (int t = 0; t < 2; ++t) {
    std::vector<double> expected(h, 0.0);
    for (int k = 0; k < 2; ++k) {
      const int e = ids[t * 2 + k];
      std::vector<double> act(inner);
      for (int i = 0; i < inner; ++i) {
        double g = 0, u = 0;
        for (int j = 0; j < h; ++j) {
          g += store[3 * e][i * h + j] * x[t * h + j];
          u += store[3 * e + 1][i * h + j] * x[t * h + j];
        }
        act[i] = 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))) * u;
      }
      for (int j = 0; j < h; ++j) {
        double y = 0;
        for (int i = 0; i < inner; ++i) y += store[3 * e + 2][j * inner + i] * act[i];
        expected[j] += weights[t * 2 + k] * y;
      }
    }
    for (int j = 0; j < h; ++j) EXPECT_NEAR(out[t * h + j], expected[j], 1e-5);
  }
}

}  // namespace
}  // namespace gemma4::backend::cpu
