// The feed-forward residual step folded into the PLE gate GEMV (GemvResidualNorm, gemv_kernels.h)
// and CudaBackend::add_rms_norm_ple, which pairs it with add_rms_norm_deferred:
//  * the GEMV multiplies residual + rms_norm(x; weight), as the stand-alone add_rms_norm kernel
//    followed by the plain GEMV on the updated rows would, and writes no residual;
//  * the fused backend operation and engine::Backend's default order run on the same GPU backend
//    (the unfused kernels), each against the host reference for the activations its GEMVs read,
//    in every activation mode, with fewer kernels where it fuses (one row outside kF32 mode: one
//    launch at E2B's widths, ple_step.h, else one kernel fewer; several rows keep the default
//    order).
// Tolerances: the GEMV's blocks reduce the norm in another order than add_rms_norm, so a staged
// bf16 value can round the other way when the fp32 sums differ in the last bit; nothing else
// differs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/ple_step.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "engine/backend.h"
#include "packed_matrix.h"
#include "quant/qmatrix.h"

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
// CudaBackend::add_rms_norm_ple (fused) and engine::Backend's default order on the same backend,
// each against the host reference of arch spec 2.4 steps 6–7 for the activations its GEMVs read.

using testing::BackendRows;

// What a GEMV multiplies (cuda_backend.h: ActivationMode): the fp32 rows in kF32 mode; outside it
// their bf16 rounding, or their q8 quantization (scale = max|chunk of 32| / 127, q rounded to
// nearest even) where the q8 mode's w4g32 GEMV reads a q8 companion.
enum class GemvReads { kF32, kBF16, kQ8 };

// The operand a GEMV multiplies when it reads a vector the kernel computed in fp32 within
// slack[j] of exact[j]: the values, and how far each may move when the kernel's own fp32 value
// lies elsewhere in that interval (a bf16 or q8 rounding that goes the other way).
struct GemvOperand {
  std::vector<double> values, uncertainty;
};

GemvOperand gemv_operand(const std::vector<double>& exact, const std::vector<double>& slack,
                         GemvReads reads) {
  const size_t n = exact.size();
  GemvOperand operand{std::vector<double>(n), std::vector<double>(n)};
  for (size_t chunk = 0; chunk < n; chunk += 32) {
    double amax = 0.0;
    for (size_t j = chunk; j < chunk + 32; ++j) amax = std::max(amax, std::fabs(exact[j]));
    const double scale = static_cast<float>(amax) / 127.0f;
    // q of a value, a hair wider than the slack for the kernel's fp32 division.
    const auto q = [&](double value, double margin) {
      return scale > 0.0 ? std::nearbyint(value / scale + margin) : 0.0;
    };
    for (size_t j = chunk; j < chunk + 32; ++j) {
      const double lo = exact[j] - slack[j], hi = exact[j] + slack[j];
      switch (reads) {
        case GemvReads::kF32:
          operand.values[j] = exact[j];
          operand.uncertainty[j] = slack[j];
          break;
        case GemvReads::kBF16:
          operand.values[j] = round_bf16(static_cast<float>(exact[j]));
          operand.uncertainty[j] =
              round_bf16(static_cast<float>(hi)) - round_bf16(static_cast<float>(lo));
          break;
        case GemvReads::kQ8:
          operand.values[j] = q(exact[j], 0.0) * scale;
          // The scale moves with the chunk's largest value, by at most slack / 127 per unit of q.
          operand.uncertainty[j] = (q(hi, 1e-5) - q(lo, -1e-5)) * scale + slack[j];
          break;
      }
    }
  }
  return operand;
}

// y = W · operand and, per output, the most a kernel's y may differ: the operand's uncertainty
// through |W| plus fp32 accumulation (well above the ~1e-6 of a K-term sum's rounding).
// tensor_cores: the batched GEMV on tensor cores (gemv_mma.h) multiplies bf16-dequantized
// weights (testing::mma_dequantize_row) by the operand rounded to bf16 (q8: q · scale rounded;
// a neighbouring q may round to a neighbouring bf16 value: 2^-8 of the value more uncertainty).
struct GemvReference {
  std::vector<double> y, bound;
};

GemvReference gemv_reference(const testing::HostMatrix& w, const GemvOperand& x,
                             bool tensor_cores) {
  constexpr double kAccumulation = 2e-5;
  GemvReference out{std::vector<double>(w.rows), std::vector<double>(w.rows)};
  std::vector<float> row(w.cols);
  for (int64_t i = 0; i < w.rows; ++i) {
    if (tensor_cores) {
      testing::mma_dequantize_row(w, i, row.data());
    } else {
      quant::dequantize_row(w.view(), i, row.data());
    }
    double sum = 0.0, magnitude = 0.0, moved = 0.0;
    for (int64_t j = 0; j < w.cols; ++j) {
      const double value = tensor_cores ? round_bf16(static_cast<float>(x.values[j])) : x.values[j];
      const double uncertainty =
          x.uncertainty[j] + (tensor_cores ? 0x1p-8 * std::fabs(value) : 0.0);
      sum += row[j] * value;
      magnitude += std::fabs(row[j] * value);
      moved += std::fabs(row[j]) * uncertainty;
    }
    out.y[i] = sum;
    out.bound[i] = moved + kAccumulation * magnitude;
  }
  return out;
}

// rms_norm(x; weight) in double (arch spec: x / sqrt(mean(x²) + eps) · (offset + weight)).
std::vector<double> rms_norm_reference(const float* x, int64_t n, const std::vector<float>& weight,
                                       const engine::NormParams& norm) {
  double squares = 0.0;
  for (int64_t j = 0; j < n; ++j) squares += static_cast<double>(x[j]) * x[j];
  const double inverse = 1.0 / std::sqrt(squares / static_cast<double>(n) + norm.eps);
  std::vector<double> out(n);
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * inverse * (norm.weight_offset + weight[j]);
  return out;
}

// How far a kernel's fp32 norm output (a block's sum of squares, rsqrt, two products) and its
// stored sums (one rounding each) may lie from the double reference, relative to their sizes.
constexpr double kNormSlack = 4e-6;
constexpr double kStoreSlack = 2.4e-7;

double gelu_tanh_reference(double u) {
  return 0.5 * u * (1.0 + std::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)));
}

// Every element of `got` within bound[i] of expected[i] (and finite).
void expect_within(const std::vector<float>& got, const std::vector<double>& expected,
                   const std::vector<double>& bound, const std::string& what) {
  testing::expect_close(got, expected, bound, 1.0, what.c_str());
}

// add_rms_norm_ple in `mode` with hidden width `hidden` (per-layer inputs 256 as a column view of
// all layers' inputs), one row and three, with and without the next layer's input norm: the fused
// operation and the default order, each against the reference. Each stage is checked against the
// reference applied to the previous stage's device output (what the next kernel read), so that the
// bounds stay those of one stage. One row outside kF32 mode fuses: E2B's widths (hidden 1536) in
// one launch (ple_step.h) instead of four kernels, others in three (the residual step folded
// into the gate GEMV). ple_step is also called directly in each of its cluster sizes.
// With matmul_rows > 0, add_rms_norm_ple_matmul instead (where there is a next): the step, then a
// w4g32 [matmul_rows, hidden] matmul of next, checked against the reference of the device next;
// one row in kBF16 mode at E2B's widths in one launch (ple_step_matmul, also called directly).
void check_ple_step(ActivationMode mode, int64_t hidden, int64_t matmul_rows = 0) {
  SCOPED_TRACE("hidden " + std::to_string(hidden) + ", matmul rows " + std::to_string(matmul_rows));
  auto gpu = testing::make_gpu_in_mode(mode);
  ASSERT_TRUE(gpu);
  const int64_t ple = 256, layers = 3;
  const float scalar = 0.625f;
  const testing::HostMatrix gate_host =
      testing::random_matrix(quant::WeightFormat::kW4G32, ple, hidden, 320);
  const testing::HostMatrix projection_host =
      testing::random_matrix(quant::WeightFormat::kW4G32, hidden, ple, 321);
  const testing::DeviceMatrix gate(gate_host), projection(projection_host);
  const std::vector<float> weight_values = random_floats(hidden, -1.0f, 1.5f, 322);
  const std::vector<float> projected_weight_values = random_floats(hidden, -1.0f, 1.5f, 323);
  const std::vector<float> next_weight_values = random_floats(hidden, -1.0f, 1.5f, 324);
  const DeviceArray<float> weight(weight_values), projected_weight(projected_weight_values),
      next_weight(next_weight_values);
  const testing::HostMatrix matmul_host = testing::random_matrix(
      quant::WeightFormat::kW4G32, std::max<int64_t>(matmul_rows, 1), hidden, 325);
  const testing::DeviceMatrix matmul(matmul_host);
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
        std::vector<float> acc, next, gated, projected, matmul_out;
        int64_t kernels;
      };
      const bool with_matmul = matmul_rows > 0 && with_next;
      auto run_on = [&](bool fused) {
        BackendRows acc(*gpu, n, hidden), x(*gpu, n, hidden), all_ple(*gpu, n, layers * ple);
        BackendRows gated(*gpu, n, ple), projected(*gpu, n, hidden), next(*gpu, n, hidden);
        BackendRows matmul_out(*gpu, n, std::max<int64_t>(matmul_rows, 1));
        acc.set(*gpu, acc_values);
        x.set(*gpu, x_values);
        all_ple.set(*gpu, ple_values);
        gated.set(*gpu, std::vector<float>(n * ple, 0.0f));
        projected.set(*gpu, zeros);
        next.set(*gpu, zeros);
        const engine::Rows multiplier = all_ple.rows.columns(ple, ple);  // layer 1's inputs
        const engine::Rows next_rows = with_next ? next.rows : engine::Rows{};
        const int64_t before = *gpu->kernels_launched();
        if (with_matmul) {
          matmul_out.set(*gpu, std::vector<float>(n * matmul_rows, 0.0f));
          if (fused) {
            gpu->add_rms_norm_ple_matmul(acc.rows, x.rows, weight.get(), gate.view, multiplier,
                                         gated.rows, projection.view, projected.rows,
                                         projected_weight.get(), scalar, next_weight.get(),
                                         next.rows, norm, matmul.view, matmul_out.rows);
          } else {
            gpu->engine::Backend::add_rms_norm_ple_matmul(
                acc.rows, x.rows, weight.get(), gate.view, multiplier, gated.rows, projection.view,
                projected.rows, projected_weight.get(), scalar, next_weight.get(), next.rows, norm,
                matmul.view, matmul_out.rows);
          }
        } else if (fused) {
          gpu->add_rms_norm_ple(acc.rows, x.rows, weight.get(), gate.view, multiplier, gated.rows,
                                projection.view, projected.rows, projected_weight.get(), scalar,
                                next_weight.get(), next_rows, norm);
        } else {
          gpu->engine::Backend::add_rms_norm_ple(
              acc.rows, x.rows, weight.get(), gate.view, multiplier, gated.rows, projection.view,
              projected.rows, projected_weight.get(), scalar, next_weight.get(), next_rows, norm);
        }
        if (with_next && n == 1 && mode != ActivationMode::kF32) {
          EXPECT_NE(gpu->live_companions(next.rows), nullptr) << "the next GEMV's input";
        }
        const int64_t kernels = *gpu->kernels_launched() - before;
        return Run{acc.get(*gpu),
                   next.get(*gpu),
                   gated.get(*gpu),
                   projected.get(*gpu),
                   with_matmul ? matmul_out.get(*gpu) : std::vector<float>{},
                   kernels};
      };
      // What the PLE gate reads: one row in q8 mode fuses (the GEMV stages bf16 itself); the
      // default order's gate reads the q8 companion add_rms_norm wrote. The projection reads the
      // gate's bf16 companion (one row) or rounds the fp32 rows (several) outside kF32 mode.
      const auto check = [&](const Run& run, bool fused) {
        SCOPED_TRACE(fused ? "fused" : "default order");
        const GemvReads gate_reads = mode == ActivationMode::kF32    ? GemvReads::kF32
                                     : mode == ActivationMode::kBF16 ? GemvReads::kBF16
                                     : fused && n == 1               ? GemvReads::kBF16
                                                                     : GemvReads::kQ8;
        const GemvReads projection_reads =
            mode == ActivationMode::kF32 ? GemvReads::kF32 : GemvReads::kBF16;
        // Several rows of bf16 products run on the tensor cores (gemv()'s dispatch).
        const bool tensor_cores = mode != ActivationMode::kF32 && n > 1;
        std::vector<double> gated(n * ple), gated_bound(n * ple), projected(n * hidden),
            projected_bound(n * hidden), acc(n * hidden), acc_bound(n * hidden), next(n * hidden),
            next_bound(n * hidden);
        for (int64_t r = 0; r < n; ++r) {
          // acc + norm(x; weight): the gate's input.
          const std::vector<double> normed =
              rms_norm_reference(x_values.data() + r * hidden, hidden, weight_values, norm);
          std::vector<double> stepped(hidden), stepped_slack(hidden);
          for (int64_t j = 0; j < hidden; ++j) {
            stepped[j] = acc_values[r * hidden + j] + normed[j];
            stepped_slack[j] =
                kNormSlack * std::fabs(normed[j]) + kStoreSlack * std::fabs(stepped[j]);
          }
          const GemvReference gate_y = gemv_reference(
              gate_host, gemv_operand(stepped, stepped_slack, gate_reads), tensor_cores);
          for (int64_t i = 0; i < ple; ++i) {
            // |gelu_tanh'| < 1.13 everywhere; tanhf's few ulps scale with |u|.
            const double m = ple_values[r * layers * ple + ple + i];
            const double g = gelu_tanh_reference(gate_y.y[i]);
            gated[r * ple + i] = g * m;
            gated_bound[r * ple + i] =
                std::fabs(m) *
                    (1.13 * gate_y.bound[i] + 1e-5 * std::fabs(g) + 6e-8 * std::fabs(gate_y.y[i])) +
                1e-30;
          }
          // The projection of the gate's device output.
          const std::vector<double> device_gated(run.gated.begin() + r * ple,
                                                 run.gated.begin() + (r + 1) * ple);
          const GemvReference projection_y = gemv_reference(
              projection_host,
              gemv_operand(device_gated, std::vector<double>(ple, 0.0), projection_reads),
              tensor_cores);
          std::copy(projection_y.y.begin(), projection_y.y.end(), projected.begin() + r * hidden);
          std::copy(projection_y.bound.begin(), projection_y.bound.end(),
                    projected_bound.begin() + r * hidden);
          // (acc + norm(x) + norm(device projected)) · scalar, and the next norm of the device
          // acc.
          const std::vector<double> projected_normed = rms_norm_reference(
              run.projected.data() + r * hidden, hidden, projected_weight_values, norm);
          const std::vector<double> next_normed =
              rms_norm_reference(run.acc.data() + r * hidden, hidden, next_weight_values, norm);
          for (int64_t j = 0; j < hidden; ++j) {
            const double sum = stepped[j] + projected_normed[j];
            acc[r * hidden + j] = sum * scalar;
            acc_bound[r * hidden + j] =
                (stepped_slack[j] + kNormSlack * std::fabs(projected_normed[j]) +
                 2 * kStoreSlack * std::fabs(sum)) *
                scalar;
            next[r * hidden + j] = with_next ? next_normed[j] : 0.0;
            next_bound[r * hidden + j] = kNormSlack * std::fabs(next_normed[j]) + 1e-30;
          }
        }
        if (with_matmul) {
          // The matmul of the device next: what it reads of it as the projection reads gated
          // (the q8 mode's one-row GEMV the q8 companion the step wrote).
          const GemvReads matmul_reads =
              mode == ActivationMode::kQ8 && n == 1 ? GemvReads::kQ8 : projection_reads;
          std::vector<double> matmul_y(n * matmul_rows), matmul_bound(n * matmul_rows);
          for (int64_t r = 0; r < n; ++r) {
            const std::vector<double> device_next(run.next.begin() + r * hidden,
                                                  run.next.begin() + (r + 1) * hidden);
            const GemvReference y = gemv_reference(
                matmul_host,
                gemv_operand(device_next, std::vector<double>(hidden, 0.0), matmul_reads),
                tensor_cores);
            std::copy(y.y.begin(), y.y.end(), matmul_y.begin() + r * matmul_rows);
            std::copy(y.bound.begin(), y.bound.end(), matmul_bound.begin() + r * matmul_rows);
          }
          expect_within(run.matmul_out, matmul_y, matmul_bound, "matmul");
        }
        expect_within(run.gated, gated, gated_bound, "gated");
        expect_within(run.projected, projected, projected_bound, "projected");
        expect_within(run.acc, acc, acc_bound, "acc");
        expect_within(run.next, next, next_bound, "next");
      };
      // ple_step itself on the same inputs with `cluster_blocks` (the backend launches the
      // default size), one row.
      auto run_ple_step = [&](int cluster_blocks) {
        SCOPED_TRACE("ple_step on " + std::to_string(cluster_blocks) + " blocks");
        const std::vector<float> layer_inputs(ple_values.begin() + ple,
                                              ple_values.begin() + 2 * ple);  // layer 1's
        const DeviceArray<float> acc(acc_values), x(x_values), multiplier(layer_inputs);
        const DeviceArray<float> gated(ple), projected(hidden), next(hidden);
        const auto one_row = [&](float* data) { return RowsView{data, 1, hidden, hidden}; };
        const auto view_of = [](const quant::QMatrix& m) {
          return MatrixView{MatrixFormat::kW4G32,          m.rows, m.cols, m.data, m.scales,
                            static_cast<int>(m.scale_type)};
        };
        AddNormSpec spec;
        spec.weight = projected_weight.get();
        spec.next_weight = next_weight.get();
        spec.weight_offset = norm.weight_offset;
        spec.eps = norm.eps;
        spec.scalar = scalar;
        const PleStepArgs args = {one_row(acc.get()),
                                  one_row(x.get()),
                                  weight.get(),
                                  view_of(gate.view),
                                  multiplier.get(),
                                  gated.get(),
                                  view_of(projection.view),
                                  projected.get(),
                                  with_next ? one_row(next.get()) : RowsView{},
                                  spec};
        if (!with_matmul) {
          EXPECT_EQ(ple_step(args, Launch{}, cluster_blocks), cudaSuccess);
          EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          return Run{acc.download(),
                     with_next ? next.download() : zeros,
                     gated.download(),
                     projected.download(),
                     {},
                     1};
        }
        // ple_step_matmul on its own counter, which it leaves at zero.
        const DeviceArray<float> matmul_out(matmul_rows);
        const DeviceArray<unsigned> acc_readers(std::vector<unsigned>{0u});
        EXPECT_EQ(ple_step_matmul(args, {view_of(matmul.view), matmul_out.get(), acc_readers.get()},
                                  Launch{}),
                  cudaSuccess);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(acc_readers.download(), std::vector<unsigned>{0u});
        return Run{acc.download(),       next.download(),       gated.download(),
                   projected.download(), matmul_out.download(), 1};
      };
      const Run unfused = run_on(false), fused = run_on(true);
      ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
      // With the matmul both run CudaBackend::add_rms_norm_ple's step (the default calls it).
      check(unfused, with_matmul);
      check(fused, true);
      const bool fuses = mode != ActivationMode::kF32 && n == 1;
      if (with_matmul) {
        // One launch for the step and the matmul: kBF16 mode (the matmul's bf16 operand) at
        // E2B's widths; else the step as add_rms_norm_ple runs it, then the matmul.
        if (mode == ActivationMode::kBF16 && n == 1 && hidden == 1536) {
          EXPECT_EQ(fused.kernels, 1);
          EXPECT_EQ(unfused.kernels, 2);
          check(run_ple_step(8), true);
        } else {
          EXPECT_EQ(fused.kernels, unfused.kernels);
        }
      } else if (fuses && hidden == 1536) {
        EXPECT_EQ(fused.kernels, 1);
        for (const int cluster_blocks : {8, 16}) check(run_ple_step(cluster_blocks), true);
      } else {
        EXPECT_EQ(fused.kernels, unfused.kernels - (fuses ? 1 : 0));
      }
    }
  }
}

class PleStepInMode : public ::testing::TestWithParam<ActivationMode> {};

TEST_P(PleStepInMode, MatchesTheReferenceWithFewerKernels) {
  check_ple_step(GetParam(), 1536);
  check_ple_step(GetParam(), 2048);
}

// The next layer's first matmul in the same launch: E2B's q (2048 rows: 8 clusters) and q+k+v
// (2560: 10 clusters), the full layers' q and q+k+v (4096, 5120: two passes), a matmul that
// leaves blocks without rows (200); at another width the two calls.
TEST_P(PleStepInMode, RunsTheNextMatmulInTheSameLaunch) {
  for (const int64_t rows : {2048, 2560, 4096, 5120, 200}) check_ple_step(GetParam(), 1536, rows);
  check_ple_step(GetParam(), 2048, 2560);
}

INSTANTIATE_TEST_SUITE_P(Modes, PleStepInMode,
                         ::testing::Values(ActivationMode::kF32, ActivationMode::kBF16,
                                           ActivationMode::kQ8),
                         [](const ::testing::TestParamInfo<ActivationMode>& info) {
                           return std::string(activation_mode_name(info.param));
                         });

}  // namespace
}  // namespace gemma4::cuda
