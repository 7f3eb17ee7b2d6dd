// CpuBackend::matmul_gelu_pairs against its definition: a = x · Wᵀ by matmul(), then
// gelu_tanh(a[2i]) · a[2i + 1], and against the formula in double precision.
#include <gtest/gtest.h>

#include "test_support.h"

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"

namespace gemma4::backend::cpu {
namespace {

using engine::Rows;

TEST(CpuBackend, MatmulGeluPairsIsTheMatmulThenThePairs) {
  CpuBackend backend(2);
  const int64_t pairs = 23, k = 64, tokens = 3;
  const std::vector<float> w = testing::random_normal(2 * pairs * k, 11, 0.5f);
  const std::vector<float> x = testing::random_normal(tokens * k, 12, 0.5f);
  quant::QMatrix m;
  m.format = quant::WeightFormat::kF32;
  m.rows = 2 * pairs;
  m.cols = k;
  m.data = w.data();

  std::vector<float> a(tokens * 2 * pairs), y(tokens * pairs);
  std::vector<float> x_copy = x;
  backend.matmul(m, Rows::dense(x_copy.data(), tokens, k),
                 Rows::dense(a.data(), tokens, 2 * pairs));
  backend.matmul_gelu_pairs(m, Rows::dense(x_copy.data(), tokens, k),
                            Rows::dense(y.data(), tokens, pairs));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < pairs; ++i) {
      const float* a_row = a.data() + t * 2 * pairs;
      // Bit for bit: the engine's CPU results must not change when it uses interleaved weights.
      EXPECT_EQ(y[t * pairs + i], gelu_tanh(a_row[2 * i]) * a_row[2 * i + 1]) << t << "," << i;
      double gate = 0, up = 0;
      for (int64_t j = 0; j < k; ++j) {
        gate += double{w[(2 * i) * k + j]} * x[t * k + j];
        up += double{w[(2 * i + 1) * k + j]} * x[t * k + j];
      }
      const double expected =
          0.5 * gate *
          (1 + std::tanh(std::sqrt(2 / M_PI) * (gate + 0.044715 * gate * gate * gate))) * up;
      EXPECT_NEAR(y[t * pairs + i], expected, 1e-5);
    }
  }
}

}  // namespace
}  // namespace gemma4::backend::cpu
