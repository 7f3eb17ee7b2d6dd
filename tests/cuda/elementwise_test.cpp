// RMSNorm (+ residual, + next norm, + RoPE) and GELU-tanh gating against the formulas of
// gemma4-architecture.md 2.1, 2.4 and 2.5, evaluated in double.
#include "backend/cuda/elementwise.h"

#include "backend/cuda/gemv.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cuda_test_util.h"

namespace gemma4::cuda {
namespace {

using testing::DeviceArray;

constexpr double kEps = 1e-6;

RowsView view(const DeviceArray<float>& a, int64_t rows, int64_t width) {
  return {a.get(), rows, width, width};
}

std::vector<double> reference_norm(const std::vector<float>& x, int64_t rows, int64_t width,
                                   const std::vector<float>* weight, double offset) {
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (int64_t j = 0; j < width; ++j)
      sum += static_cast<double>(x[r * width + j]) * x[r * width + j];
    const double inv = 1.0 / std::sqrt(sum / width + kEps);
    for (int64_t j = 0; j < width; ++j) {
      y[r * width + j] = x[r * width + j] * inv * (weight ? offset + (*weight)[j] : 1.0);
    }
  }
  return y;
}

// Tolerance relative to max(1, |expected|): fp32 arithmetic against double.
void expect_near_all(const std::vector<float>& got, const std::vector<double>& expected,
                     double tolerance, const char* what) {
  std::vector<double> magnitude(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) magnitude[i] = std::max(1.0, std::fabs(expected[i]));
  testing::expect_close(got, expected, magnitude, tolerance, what);
}

// Rows in registers (one and two quads per thread, 16-byte and scalar accesses) and a row too
// wide for them (the strided kernel).
TEST(RmsNorm, WithAndWithoutWeightInPlace) {
  for (int64_t width : {256, 1536, 2816, 5376, 1001, 9000}) {
    const int64_t rows = 3;
    const auto x = testing::random_floats(rows * width, -4.0f, 4.0f, 11);
    const auto w = testing::random_floats(width, -2.0f, 2.0f, 12);
    DeviceArray<float> dx(x), dw(w), dy(rows * width);
    CUDA_ASSERT_OK(rms_norm(view(dx, rows, width), dw.get(), 0.0f, kEps, view(dy, rows, width),
                            nullptr, Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    expect_near_all(dy.download(), reference_norm(x, rows, width, &w, 0.0), 1e-5, "weighted");
    // No weight (v_norm, router norm), in place, with a weight offset ignored.
    CUDA_ASSERT_OK(rms_norm(view(dx, rows, width), nullptr, 1.0f, kEps, view(dx, rows, width),
                            nullptr, Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    expect_near_all(dx.download(), reference_norm(x, rows, width, nullptr, 0.0), 1e-5,
                    "unweighted");
  }
}

// q_norm + RoPE over [tokens, heads, head_dim]: default rope (hd 256, theta 1e4, all 128 pairs)
// and proportional rope (hd 512, theta 1e6, 64 of 256 pairs, exponent denominator 512).
TEST(RmsNorm, FusedRope) {
  struct Case {
    int head_dim, rotated_pairs, denominator;
    float theta;
  };
  for (const Case& c : {Case{256, 128, 256, 10000.0f}, Case{512, 64, 512, 1000000.0f}}) {
    const std::vector<int32_t> positions = {0, 7, 1000, 131071};
    const int64_t heads = 8;
    const int64_t rows = heads * static_cast<int64_t>(positions.size());
    const int64_t hd = c.head_dim;
    const auto x = testing::random_floats(rows * hd, -3.0f, 3.0f, 21);
    const auto w = testing::random_floats(hd, 0.5f, 1.5f, 22);
    DeviceArray<float> dx(x), dw(w), dy(rows * hd);
    DeviceArray<int32_t> dpos(positions);
    const RopeSpec rope = {dpos.get(), static_cast<int>(heads), c.theta, c.rotated_pairs,
                           c.denominator};
    CUDA_ASSERT_OK(
        rms_norm(view(dx, rows, hd), dw.get(), 0.0f, kEps, view(dy, rows, hd), &rope, Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());

    const auto normed = reference_norm(x, rows, hd, &w, 0.0);
    std::vector<double> expected(normed.size());
    const int64_t half = hd / 2;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < half; ++i) {
        // transformers: fp32 inv_freq, angle = fp32(pos) · inv_freq rounded to fp32.
        const float inv_freq =
            i < c.rotated_pairs
                ? static_cast<float>(1.0 / std::pow(static_cast<double>(c.theta),
                                                    static_cast<double>(2 * i) / c.denominator))
                : 0.0f;
        const float angle = static_cast<float>(positions[r / heads]) * inv_freq;
        const double a = normed[r * hd + i], b = normed[r * hd + i + half];
        expected[r * hd + i] = a * std::cos(angle) - b * std::sin(angle);
        expected[r * hd + i + half] = b * std::cos(angle) + a * std::sin(angle);
      }
    }
    expect_near_all(dy.download(), expected, 1e-5, "rope");
  }
}

// The fused norm → int8 activations equals the norm followed by the stand-alone quantizer
// (which gemv_test checks against its contract), byte for byte.
TEST(RmsNorm, Q8OutputMatchesNormThenQuantize) {
  for (int64_t width : {256, 1536}) {
    const int64_t rows = 3, stride = width + 64;
    const auto x = testing::random_floats(rows * width, -4.0f, 4.0f, 61);
    const auto w = testing::random_floats(width, -2.0f, 2.0f, 62);
    DeviceArray<float> dx(x), dw(w), normed(rows * width);
    DeviceArray<uint8_t> fused(rows * q8_row_bytes(stride)), separate(rows * q8_row_bytes(stride));
    CUDA_ASSERT_OK(cudaMemset(fused.get(), 0, rows * q8_row_bytes(stride)));
    CUDA_ASSERT_OK(cudaMemset(separate.get(), 0, rows * q8_row_bytes(stride)));
    CUDA_ASSERT_OK(
        rms_norm_q8(view(dx, rows, width), dw.get(), 0.0f, kEps, fused.get(), stride, Launch{}));
    CUDA_ASSERT_OK(rms_norm(view(dx, rows, width), dw.get(), 0.0f, kEps, view(normed, rows, width),
                            nullptr, Launch{}));
    CUDA_ASSERT_OK(quantize_activations_q8(normed.get(), rows, width, width, separate.get(), stride,
                                           Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    EXPECT_EQ(fused.download(), separate.download()) << "width " << width;
  }
}

// One quad of the row per thread (1536), two (5376: 31B), an unaligned row (scalar accesses).
TEST(RmsNorm, ResidualAddAndNextNorm) {
  for (int64_t width : {1536, 5376, 1001}) {
    SCOPED_TRACE(width);
    const int64_t rows = 2;
    const auto x = testing::random_floats(rows * width, -3.0f, 3.0f, 31);
    const auto residual = testing::random_floats(rows * width, -50.0f, 50.0f, 32);
    const auto w1 = testing::random_floats(width, -1.0f, 1.0f, 33);
    const auto w2 = testing::random_floats(width, -1.0f, 1.0f, 34);
    DeviceArray<float> dx(x), dr(residual), dw1(w1), dw2(w2), dy(rows * width);
    AddNormSpec spec;
    spec.weight = dw1.get();
    spec.next_weight = dw2.get();
    spec.eps = kEps;
    CUDA_ASSERT_OK(add_rms_norm(view(dx, rows, width), view(dr, rows, width), view(dy, rows, width),
                                spec, Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    const auto post = reference_norm(x, rows, width, &w1, 0.0);
    std::vector<double> updated(post.size());
    std::vector<float> updated_f(post.size());
    for (size_t i = 0; i < post.size(); ++i) {
      updated[i] = residual[i] + post[i];
      updated_f[i] = static_cast<float>(updated[i]);
    }
    expect_near_all(dr.download(), updated, 1e-5, "residual");
    expect_near_all(dy.download(), reference_norm(updated_f, rows, width, &w2, 0.0), 1e-5,
                    "next norm");
  }
}

// A step whose output all but cancels the residual (|new residual| ~1e-3 of both): the next
// norm's sum of squares cannot come from the old residual's sums (expanded_sum_of_squares gives
// up), the kernel reduces the new residual's own.
TEST(RmsNorm, ResidualAddThatCancelsTheResidual) {
  for (int64_t width : {1536, 5376}) {
    SCOPED_TRACE(width);
    const int64_t rows = 2;
    const auto x = testing::random_floats(rows * width, -3.0f, 3.0f, 35);
    const auto w = testing::random_floats(width, 0.5f, 1.5f, 36);
    const auto w_next = testing::random_floats(width, -1.0f, 1.0f, 37);
    const auto noise = testing::random_floats(rows * width, -1e-3f, 1e-3f, 38);
    const auto post = reference_norm(x, rows, width, &w, 0.0);
    std::vector<float> residual(rows * width);
    for (size_t i = 0; i < residual.size(); ++i) {
      residual[i] = static_cast<float>(-post[i]) + noise[i];
    }
    DeviceArray<float> dx(x), dr(residual), dw(w), dw_next(w_next), dy(rows * width);
    AddNormSpec spec;
    spec.weight = dw.get();
    spec.next_weight = dw_next.get();
    spec.eps = kEps;
    CUDA_ASSERT_OK(add_rms_norm(view(dx, rows, width), view(dr, rows, width), view(dy, rows, width),
                                spec, Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    // The next norm of the residual the kernel wrote (the step's own rounding is not at issue).
    expect_near_all(dy.download(), reference_norm(dr.download(), rows, width, &w_next, 0.0), 1e-5,
                    "next norm");
  }
}

// add_rms_norm_deferred is the two residual steps it stands for, bit for bit: the deferred step's
// norm reduced as add_rms_norm reduces it, the products rounded in the same order. Registers with
// one and two quads per thread, 16-byte and scalar accesses, with and without a next norm.
TEST(RmsNorm, DeferredResidualStepEqualsTwoResidualSteps) {
  struct Case {
    int64_t width;
    float weight_offset, scalar;
    bool next;
  };
  uint32_t seed = 40;
  for (const Case c : {Case{1536, 0.0f, 0.625f, true}, Case{1536, 0.0f, 0.625f, false},
                       Case{5376, 0.0f, 1.0f, true}, Case{1001, 1.0f, 0.75f, true},
                       Case{8191, 0.0f, 0.5f, true}}) {
    SCOPED_TRACE(c.width);
    const int64_t rows = 3, width = c.width;
    const auto deferred = testing::random_floats(rows * width, -3.0f, 3.0f, seed++);
    const auto x = testing::random_floats(rows * width, -2.0f, 2.0f, seed++);
    const auto residual = testing::random_floats(rows * width, -50.0f, 50.0f, seed++);
    const auto w_deferred = testing::random_floats(width, -1.0f, 1.0f, seed++);
    const auto w = testing::random_floats(width, -1.0f, 1.0f, seed++);
    const auto w_next = testing::random_floats(width, -1.0f, 1.0f, seed++);
    DeviceArray<float> d_deferred(deferred), dx(x), d_wd(w_deferred), dw(w), d_wn(w_next);
    DeviceArray<float> two_steps(residual), one_kernel(residual);
    DeviceArray<float> next_two(rows * width), next_one(rows * width);
    AddNormSpec first;
    first.weight = d_wd.get();
    first.weight_offset = c.weight_offset;
    AddNormSpec second = first;
    second.weight = dw.get();
    second.next_weight = d_wn.get();
    second.scalar = c.scalar;
    const RowsView no_next{};
    CUDA_ASSERT_OK(add_rms_norm(view(d_deferred, rows, width), view(two_steps, rows, width),
                                no_next, first, Launch{}));
    CUDA_ASSERT_OK(add_rms_norm(view(dx, rows, width), view(two_steps, rows, width),
                                c.next ? view(next_two, rows, width) : no_next, second, Launch{}));
    CUDA_ASSERT_OK(add_rms_norm_deferred(view(dx, rows, width), view(d_deferred, rows, width),
                                         d_wd.get(), view(one_kernel, rows, width),
                                         c.next ? view(next_one, rows, width) : no_next, second,
                                         Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    const auto a = two_steps.download(), b = one_kernel.download();
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * a.size())) << "residual";
    if (c.next) {
      const auto na = next_two.download(), nb = next_one.download();
      EXPECT_EQ(0, std::memcmp(na.data(), nb.data(), sizeof(float) * na.size())) << "next";
    }
  }
  DeviceArray<float> dx(64), dr(64);
  EXPECT_EQ(add_rms_norm_deferred(view(dx, 1, 64), RowsView{}, nullptr, view(dr, 1, 64), RowsView{},
                                  AddNormSpec{}, Launch{}),
            cudaErrorInvalidValue);
}

// The row lives in registers: wider rows are refused before anything is launched.
TEST(RmsNorm, ResidualAddRefusesRowsWiderThan8192) {
  const int64_t width = 8193;
  DeviceArray<float> dx(width), dr(width);
  EXPECT_EQ(
      add_rms_norm(view(dx, 1, width), view(dr, 1, width), RowsView{}, AddNormSpec{}, Launch{}),
      cudaErrorInvalidValue);
}

TEST(GeluTanhMul, FusedGateUpRows) {
  const int64_t rows = 3, width = 6144;
  // gate | up side by side, as the fused gate+up GEMV writes them.
  const auto gate_up = testing::random_floats(rows * 2 * width, -6.0f, 6.0f, 41);
  DeviceArray<float> dgu(gate_up), dout(rows * width);
  const RowsView gate = {dgu.get(), rows, width, 2 * width};
  const RowsView up = {dgu.get() + width, rows, width, 2 * width};
  CUDA_ASSERT_OK(gelu_tanh_mul(gate, up, view(dout, rows, width), Launch{}));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  std::vector<double> expected(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      const double u = gate_up[r * 2 * width + j];
      const double g =
          0.5 * u * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u)));
      expected[r * width + j] = g * gate_up[r * 2 * width + width + j];
    }
  }
  expect_near_all(dout.download(), expected, 1e-5, "gelu");
}

}  // namespace
}  // namespace gemma4::cuda
