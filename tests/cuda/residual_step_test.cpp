// The feed-forward residual step folded into the PLE gate GEMV (GemvResidualNorm, gemv_kernels.h)
// and CudaBackend::add_rms_norm_ple, which pairs it with add_rms_norm_deferred:
//  * the GEMV multiplies residual + rms_norm(x; weight), as the stand-alone add_rms_norm kernel
//    followed by the plain GEMV on the updated rows would, and writes no residual;
//  * the fused backend operation against engine::Backend's default order run on the same GPU
//    backend (the unfused kernels), in every activation mode, with one kernel fewer where it fuses
//    (one row outside kF32 mode; several rows keep the default order).
// Tolerances: the GEMV's blocks reduce the norm in another order than add_rms_norm, so a staged
// bf16 value can round the other way when the fp32 sums differ in the last bit; nothing else
// differs.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv.h"
#include "cuda_test_util.h"
#include "engine/backend.h"
#include "packed_matrix.h"

namespace gemma4::cuda {
namespace {

using testing::DeviceArray;
using testing::random_floats;

constexpr double kTolerance = 1e-4;

void expect_near(const std::vector<float>& got, const std::vector<float>& expected,
                 const std::string& what, double tolerance = kTolerance) {
  std::vector<double> reference(expected.begin(), expected.end()), magnitude(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) magnitude[i] = 1.0 + std::fabs(reference[i]);
  testing::expect_close(got, reference, magnitude, tolerance, what.c_str());
}

// E2B's PLE gate (256 x 1536, GELU-gated by the layer's per-layer input) and a wider plain GEMV,
// for one row, a batch of three and one of 40 (several m tiles of the batched tiling). Residual
// rows at a padded stride.
TEST(GemvResidualStep, MultipliesResidualPlusNormWithoutWritingIt) {
  struct Shape {
    int64_t rows, cols;
    GemvEpilogue epilogue;
  };
  uint32_t seed = 300;
  for (const Shape shape :
       {Shape{256, 1536, GemvEpilogue::kGeluMul}, Shape{2048, 1536, GemvEpilogue::kNone}}) {
    const testing::HostMatrix host =
        testing::random_matrix(quant::WeightFormat::kW4G32, shape.rows, shape.cols, seed++);
    const testing::DeviceMatrix w(host);
    const int64_t k = shape.cols, stride = k + 64;
    const std::vector<float> weight = random_floats(k, -1.0f, 1.5f, seed++);
    const DeviceArray<float> d_weight(weight);
    for (const int m : {1, 3, 40}) {
      SCOPED_TRACE(std::to_string(shape.rows) + " rows, m " + std::to_string(m));
      const std::vector<float> residual = random_floats(m * stride, -40.0f, 40.0f, seed++);
      const DeviceArray<float> x(random_floats(m * k, -3.0f, 3.0f, seed++));
      const DeviceArray<float> multiplier(random_floats(m * shape.rows, -2.0f, 2.0f, seed++));
      DeviceArray<float> unchanged(residual), updated(residual);
      DeviceArray<float> fused_y(m * shape.rows), plain_y(m * shape.rows);
      GemvOutput out = {fused_y.get(), shape.rows, shape.epilogue, multiplier.get(), shape.rows};

      GemvInput input = {x.get(), ActType::kF32, m, k, true};
      input.residual_norm = {unchanged.get(), stride, d_weight.get(), 0.0f, 1e-6f};
      CUDA_ASSERT_OK(gemv(w.view, input, out, Launch{}));

      AddNormSpec step;
      step.weight = d_weight.get();
      CUDA_ASSERT_OK(
          add_rms_norm({x.get(), m, k, k}, {updated.get(), m, k, stride}, {}, step, Launch{}));
      // The kernel and tiling the folded step runs with (batches would take tensor cores).
      out.data = plain_y.get();
      CUDA_ASSERT_OK(gemv(w.view, {updated.get(), ActType::kF32, m, stride, true}, out, Launch{},
                          default_gemv_tiling(w.view, m, ActType::kF32)));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());

      expect_near(fused_y.download(), plain_y.download(), "y");
      EXPECT_EQ(unchanged.download(), residual) << "the GEMV wrote the residual";
    }
  }
}

TEST(GemvResidualStep, RefusesWhatItCannotStage) {
  const testing::HostMatrix host =
      testing::random_matrix(quant::WeightFormat::kW4G32, 256, 1536, 310);
  const testing::DeviceMatrix w(host);
  DeviceArray<float> x(1536), residual(1536 + 4), y(256);
  const GemvOutput out = {y.get(), 256};
  GemvInput input = {x.get(), ActType::kF32, 1, 1536, true};
  input.residual_norm = {residual.get(), 1536};
  EXPECT_EQ(gemv(w.view, input, out, Launch{}), cudaSuccess);
  input.round_to_bf16 = false;  // exact fp32 products are not staged
  EXPECT_EQ(gemv(w.view, input, out, Launch{}), cudaErrorInvalidValue);
  input.round_to_bf16 = true;
  input.residual_norm.residual = residual.get() + 1;  // not 16-byte aligned
  EXPECT_EQ(gemv(w.view, input, out, Launch{}), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// ---------------------------------------------------------------------------------------------
// CudaBackend::add_rms_norm_ple against the default order on the same backend.

using testing::BackendRows;

class PleStepInMode : public ::testing::TestWithParam<ActivationMode> {};

// E2B's widths (hidden 1536, per-layer inputs 256 as a column view of all layers' inputs), with
// and without the next layer's input norm.
TEST_P(PleStepInMode, MatchesTheDefaultOrderWithOneKernelLess) {
  auto gpu = testing::make_gpu_in_mode(GetParam());
  ASSERT_TRUE(gpu);
  // In q8 mode the fused step feeds the PLE gate bf16 (made in its prologue), where the default
  // order feeds it q8: the gate's exact twin is then the default order of a bf16-mode backend,
  // and everything after the gate differs from the q8 default order by q8's input rounding
  // (scale = max|chunk| / 127: ~1 % of the gate's outputs), hence the wider bound there.
  const bool q8 = GetParam() == ActivationMode::kQ8;
  auto bf16_gpu = q8 ? testing::make_gpu_in_mode(ActivationMode::kBF16) : nullptr;
  ASSERT_TRUE(!q8 || bf16_gpu);
  const double after_gate_tolerance = q8 ? 3e-2 : kTolerance;
  const int64_t hidden = 1536, ple = 256, layers = 3;
  const testing::HostMatrix gate_host =
      testing::random_matrix(quant::WeightFormat::kW4G32, ple, hidden, 320);
  const testing::HostMatrix projection_host =
      testing::random_matrix(quant::WeightFormat::kW4G32, hidden, ple, 321);
  const testing::DeviceMatrix gate(gate_host), projection(projection_host);
  const DeviceArray<float> weight(random_floats(hidden, -1.0f, 1.5f, 322));
  const DeviceArray<float> projected_weight(random_floats(hidden, -1.0f, 1.5f, 323));
  const DeviceArray<float> next_weight(random_floats(hidden, -1.0f, 1.5f, 324));
  const engine::NormParams norm = {0.0f, 1e-6f};
  uint32_t seed = 330;
  for (const int64_t n : {1, 3}) {
    for (const bool with_next : {true, false}) {
      SCOPED_TRACE(std::to_string(n) + " rows" + (with_next ? ", next" : ""));
      const auto acc_values = random_floats(n * hidden, -40.0f, 40.0f, seed++);
      const auto x_values = random_floats(n * hidden, -3.0f, 3.0f, seed++);
      const auto ple_values = random_floats(n * layers * ple, -2.0f, 2.0f, seed++);
      const std::vector<float> zeros(n * hidden, 0.0f);
      struct Run {
        std::vector<float> acc, next, gated, projected;
        int64_t kernels;
      };
      auto run_on = [&](CudaBackend* backend, bool fused) {
        BackendRows acc(*backend, n, hidden), x(*backend, n, hidden),
            all_ple(*backend, n, layers * ple);
        BackendRows gated(*backend, n, ple), projected(*backend, n, hidden),
            next(*backend, n, hidden);
        acc.set(*backend, acc_values);
        x.set(*backend, x_values);
        all_ple.set(*backend, ple_values);
        gated.set(*backend, std::vector<float>(n * ple, 0.0f));
        projected.set(*backend, zeros);
        next.set(*backend, zeros);
        const engine::Rows multiplier = all_ple.rows.columns(ple, ple);  // layer 1's inputs
        const engine::Rows next_rows = with_next ? next.rows : engine::Rows{};
        const int64_t before = *backend->kernels_launched();
        if (fused) {
          backend->add_rms_norm_ple(
              acc.rows, x.rows, weight.get(), gate.view, multiplier, gated.rows, projection.view,
              projected.rows, projected_weight.get(), 0.625f, next_weight.get(), next_rows, norm);
        } else {
          backend->engine::Backend::add_rms_norm_ple(
              acc.rows, x.rows, weight.get(), gate.view, multiplier, gated.rows, projection.view,
              projected.rows, projected_weight.get(), 0.625f, next_weight.get(), next_rows, norm);
        }
        if (with_next && n == 1 && GetParam() != ActivationMode::kF32) {
          EXPECT_NE(backend->live_companions(next.rows), nullptr) << "the next GEMV's input";
        }
        const int64_t kernels = *backend->kernels_launched() - before;
        return Run{acc.get(*backend), next.get(*backend), gated.get(*backend),
                   projected.get(*backend), kernels};
      };
      const Run unfused = run_on(gpu.get(), false), fused = run_on(gpu.get(), true);
      ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
      // Only one row takes the fused path (batched rows keep the default order).
      const bool gate_reads_bf16 = q8 && n == 1;
      const Run gate_twin = gate_reads_bf16 ? run_on(bf16_gpu.get(), false) : unfused;
      expect_near(fused.gated, gate_twin.gated, "gated");
      const double tolerance = gate_reads_bf16 ? after_gate_tolerance : kTolerance;
      expect_near(fused.projected, unfused.projected, "projected", tolerance);
      expect_near(fused.acc, unfused.acc, "acc", tolerance);
      expect_near(fused.next, unfused.next, "next", tolerance);
      const bool fuses = GetParam() != ActivationMode::kF32 && n == 1;
      EXPECT_EQ(fused.kernels, unfused.kernels - (fuses ? 1 : 0));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, PleStepInMode,
                         ::testing::Values(ActivationMode::kF32, ActivationMode::kBF16,
                                           ActivationMode::kQ8),
                         [](const ::testing::TestParamInfo<ActivationMode>& info) {
                           return std::string(activation_mode_name(info.param));
                         });

}  // namespace
}  // namespace gemma4::cuda
