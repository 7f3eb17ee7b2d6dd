// A whole residual step folded into the GEMV after it (GemvResidualNorm with next_norm and a done
// counter, gemv_kernels.h) and CudaBackend::add_rms_norm_matmul, which uses it:
//  * the block that stages last writes the residual and next as the stand-alone add_rms_norm
//    kernel does (within the last bits: the norms are reduced in another order), the counter is
//    back at zero after each launch (a second launch does the same), and the GEMV multiplies
//    exactly the bf16 rounding of the `next` it wrote (the plain GEMV over those rows gives the
//    same bits);
//  * the backend operation and engine::Backend's default order on the same GPU backend write the
//    same acc and next, the folded y matches the host product of its own next rounded to bf16,
//    and it takes one kernel fewer where it folds (one row outside kF32 mode).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "engine/backend.h"
#include "engine/gemma4_engine.h"
#include "packed_matrix.h"
#include "quant/qmatrix.h"
#include "synth_support.h"

namespace gemma4::cuda {
namespace {

using testing::BackendRows;
using testing::DeviceArray;
using testing::random_floats;

void expect_near(const std::vector<float>& got, const std::vector<float>& expected,
                 const std::string& what, double tolerance) {
  std::vector<double> reference(expected.begin(), expected.end()), magnitude(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) magnitude[i] = 1.0 + std::fabs(reference[i]);
  testing::expect_close(got, reference, magnitude, tolerance, what.c_str());
}

// Tolerances against add_rms_norm (relative to 1 + |value|): the residual (|values| up to ~44)
// moves by the last bit of a norm, next by a few ulps of its inverse RMS.
constexpr double kResidualTolerance = 1e-6;
constexpr double kNextTolerance = 1e-5;

std::vector<float> first(const std::vector<float>& v, int64_t n) {
  return {v.begin(), v.begin() + n};
}

// The folded step's GEMV against add_rms_norm (acc, next) and against the plain GEMV over the next
// rows it wrote (y, bit for bit): E2B's gate+up (GELU pairs) and QKV widths, a 31B-wide K (5376,
// several passes per row), a null next weight, a scalar other than one (the 31B layer scalar),
// NVFP4 weights. Rows at a padded stride.
TEST(GemvResidualStep, FoldedStepWritesWhatAddRmsNormWrites) {
  struct Case {
    quant::WeightFormat format;
    int64_t rows, cols;
    GemvEpilogue epilogue;
    float scalar;
    bool next_weight;
  };
  const Case cases[] = {
      {quant::WeightFormat::kW4G32, 2048, 1536, GemvEpilogue::kGeluPairs, 1.0f, true},
      {quant::WeightFormat::kW4G32, 2560, 1536, GemvEpilogue::kNone, 1.0f, true},
      {quant::WeightFormat::kW4G32, 1024, 5376, GemvEpilogue::kNone, 0.75f, true},
      {quant::WeightFormat::kW4G32, 512, 5376, GemvEpilogue::kGeluPairs, 1.0f, false},
      {quant::WeightFormat::kNVFP4, 1024, 2816, GemvEpilogue::kNone, 1.0f, true},
  };
  uint32_t seed = 900;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::to_string(c.rows) + " x " + std::to_string(c.cols));
    const testing::HostMatrix host = testing::random_matrix(c.format, c.rows, c.cols, seed++);
    const testing::DeviceMatrix w(host);
    const int64_t k = c.cols, stride = k + 64;
    const int64_t outputs = c.epilogue == GemvEpilogue::kGeluPairs ? c.rows / 2 : c.rows;
    const DeviceArray<float> weight(random_floats(k, -1.0f, 1.5f, seed++));
    const DeviceArray<float> next_weight(random_floats(k, -1.0f, 1.5f, seed++));
    const float* next_scale = c.next_weight ? next_weight.get() : nullptr;
    const std::vector<float> residual = random_floats(stride, -40.0f, 40.0f, seed++);
    const DeviceArray<float> x(random_floats(k, -3.0f, 3.0f, seed++));
    const engine::NormParams norm = {0.0f, 1e-6f};
    const int tiling = default_gemv_tiling(w.view, 1, ActType::kF32);

    // The unfused step: add_rms_norm into `next`, as the engine ran it.
    DeviceArray<float> plain_residual(residual), plain_next(stride);
    AddNormSpec spec;
    spec.weight = weight.get();
    spec.next_weight = next_scale;
    spec.weight_offset = norm.weight_offset;
    spec.eps = norm.eps;
    spec.scalar = c.scalar;
    CUDA_ASSERT_OK(add_rms_norm({x.get(), 1, k, k}, {plain_residual.get(), 1, k, stride},
                                {plain_next.get(), 1, k, stride}, spec, Launch{}));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    const std::vector<float> want_residual = first(plain_residual.download(), k);
    const std::vector<float> want_next = first(plain_next.download(), k);

    DeviceArray<unsigned int> counter(std::vector<unsigned int>{0u});
    for (int launch = 0; launch < 2; ++launch) {
      SCOPED_TRACE("launch " + std::to_string(launch));
      DeviceArray<float> fused_residual(residual), fused_next(stride), fused_y(outputs),
          plain_y(outputs);
      GemvInput input = {x.get(), ActType::kF32, 1, k, true};
      input.residual_norm = {
          fused_residual.get(), stride,     weight.get(),  norm.weight_offset, norm.eps, c.scalar,
          /*next_norm=*/true,   next_scale, counter.get(), fused_next.get(),   stride};
      CUDA_ASSERT_OK(gemv(w.view, input, {fused_y.get(), outputs, c.epilogue}, Launch{}));
      // The plain GEMV (same kernel and tiling) over the rows the fused one wrote.
      CUDA_ASSERT_OK(gemv(w.view, {fused_next.get(), ActType::kF32, 1, stride, true},
                          {plain_y.get(), outputs, c.epilogue}, Launch{}, tiling));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());

      const std::vector<float> got_residual = fused_residual.download();
      expect_near(first(got_residual, k), want_residual, "residual", kResidualTolerance);
      expect_near(first(fused_next.download(), k), want_next, "next", kNextTolerance);
      EXPECT_EQ(std::vector<float>(got_residual.begin() + k, got_residual.end()),
                std::vector<float>(residual.begin() + k, residual.end()))
          << "the row's padding changed";
      const std::vector<float> got_y = fused_y.download(), want_y = plain_y.download();
      EXPECT_EQ(std::memcmp(got_y.data(), want_y.data(), sizeof(float) * got_y.size()), 0)
          << "y differs from the GEMV over the written next rows";
      for (float value : got_y) ASSERT_TRUE(std::isfinite(value));
      EXPECT_EQ(counter.download(), std::vector<unsigned int>{0u}) << "the counter after a launch";
    }
  }
}

TEST(GemvResidualStep, RefusesAWriteBackItCannotDo) {
  const testing::HostMatrix host =
      testing::random_matrix(quant::WeightFormat::kW4G32, 256, 1536, 950);
  const testing::DeviceMatrix w(host);
  DeviceArray<float> x(3 * 1536), residual(3 * 1536), next(3 * 1536 + 4), y(3 * 256);
  DeviceArray<unsigned int> counter(std::vector<unsigned int>{0u});
  const GemvOutput out = {y.get(), 256};
  GemvInput input = {x.get(), ActType::kF32, 1, 1536, true};
  input.residual_norm = {residual.get(), 1536,    nullptr,       0.0f,       1e-6f, 1.0f,
                         true,           nullptr, counter.get(), next.get(), 1536};
  EXPECT_EQ(gemv(w.view, input, out, Launch{}), cudaSuccess);
  input.residual_norm.next = next.get() + 1;  // not 16-byte aligned
  EXPECT_EQ(gemv(w.view, input, out, Launch{}), cudaErrorInvalidValue);
  input.residual_norm.next = nullptr;  // nowhere to write the normed rows
  EXPECT_EQ(gemv(w.view, input, out, Launch{}), cudaErrorInvalidValue);
  input.residual_norm.next = next.get();
  // Three rows through a single-row tiling: one staged row per m tile, while the write-back
  // needs every row in one.
  input.rows = 3;
  const int one_row_tiling = default_gemv_tiling(w.view, 1, ActType::kF32);
  EXPECT_EQ(gemv(w.view, input, out, Launch{}, one_row_tiling), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(counter.download(), std::vector<unsigned int>{0u});
}

// The folded GEMV's y for one row against the host: W (dequantized) times next rounded to bf16
// (what the fused GEMV staged), in double; per output the bound of fp32 accumulation (2e-5 of
// Σ|w·x|, well above a K-term sum's rounding) and, for GELU pairs, that bound through
// gelu_tanh(gate) · up (|gelu_tanh'| < 1.13) plus tanhf's few ulps.
double gelu_tanh_reference(double u) {
  return 0.5 * u * (1.0 + std::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)));
}

void expect_folded_product(const quant::QMatrix& w, const float* next, const std::vector<float>& y,
                           bool gelu_pairs) {
  constexpr double kAccumulation = 2e-5;
  std::vector<double> products(w.rows), bounds(w.rows);
  std::vector<float> row(w.cols);
  for (int64_t i = 0; i < w.rows; ++i) {
    quant::dequantize_row(w, i, row.data());
    double sum = 0.0, magnitude = 0.0;
    for (int64_t j = 0; j < w.cols; ++j) {
      const double product = double{row[j]} * round_bf16(next[j]);
      sum += product;
      magnitude += std::fabs(product);
    }
    products[i] = sum;
    bounds[i] = kAccumulation * magnitude + 1e-30;
  }
  if (!gelu_pairs) {
    testing::expect_close(y, products, bounds, 1.0, "y");
    return;
  }
  std::vector<double> expected(w.rows / 2), bound(w.rows / 2);
  for (int64_t i = 0; i < w.rows / 2; ++i) {
    const double gate = products[2 * i], up = products[2 * i + 1];
    const double g = gelu_tanh_reference(gate);
    expected[i] = g * up;
    bound[i] = std::fabs(up) * (1.13 * bounds[2 * i] + 6e-8 * std::fabs(gate)) +
               std::fabs(g) * bounds[2 * i + 1] + 1e-5 * std::fabs(g * up) + 1e-30;
  }
  testing::expect_close(y, expected, bound, 1.0, "y");
}

// CudaBackend::add_rms_norm_matmul against engine::Backend's default order (add_rms_norm, then
// the matmul) on the same backend, one row and three, with and without GELU pairs: the same acc
// and next; where it folds (one row outside kF32 mode) one kernel fewer and y the product of its
// own next; elsewhere the same kernels, so the same y bit for bit.
class ResidualMatmulInMode : public ::testing::TestWithParam<ActivationMode> {};

TEST_P(ResidualMatmulInMode, MatchesTheDefaultOrderWithOneKernelFewer) {
  const ActivationMode mode = GetParam();
  auto gpu = testing::make_gpu_in_mode(mode);
  ASSERT_TRUE(gpu);
  gpu->set_fold_residual_steps(true);
  const int64_t hidden = 1536;
  const float scalar = 0.5f;
  const engine::NormParams norm = {0.0f, 1e-6f};
  const DeviceArray<float> weight(random_floats(hidden, -1.0f, 1.5f, 960));
  const DeviceArray<float> next_weight(random_floats(hidden, -1.0f, 1.5f, 961));
  uint32_t seed = 970;
  for (const bool gelu_pairs : {true, false}) {
    const testing::HostMatrix host =
        testing::random_matrix(quant::WeightFormat::kW4G32, 2048, hidden, seed++);
    const testing::DeviceMatrix w(host);
    const int64_t outputs = gelu_pairs ? 1024 : 2048;
    for (const int64_t n : {1, 3}) {
      SCOPED_TRACE(std::to_string(n) + " rows" + (gelu_pairs ? ", gelu pairs" : ""));
      const auto acc_values = random_floats(n * hidden, -40.0f, 40.0f, seed++);
      const auto x_values = random_floats(n * hidden, -3.0f, 3.0f, seed++);
      struct Run {
        std::vector<float> acc, next, y;
        int64_t kernels;
      };
      auto run_on = [&](bool folded) {
        BackendRows acc(*gpu, n, hidden), x(*gpu, n, hidden), next(*gpu, n, hidden),
            y(*gpu, n, outputs);
        acc.set(*gpu, acc_values);
        x.set(*gpu, x_values);
        const int64_t before = *gpu->kernels_launched();
        if (folded) {
          gpu->add_rms_norm_matmul(acc.rows, x.rows, weight.get(), scalar, next_weight.get(),
                                   next.rows, w.view, y.rows, gelu_pairs, norm);
        } else {
          gpu->engine::Backend::add_rms_norm_matmul(acc.rows, x.rows, weight.get(), scalar,
                                                    next_weight.get(), next.rows, w.view, y.rows,
                                                    gelu_pairs, norm);
        }
        const int64_t kernels = *gpu->kernels_launched() - before;
        return Run{acc.get(*gpu), next.get(*gpu), y.get(*gpu), kernels};
      };
      const Run plain = run_on(false), folded = run_on(true);
      ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
      expect_near(folded.acc, plain.acc, "acc", kResidualTolerance);
      expect_near(folded.next, plain.next, "next", kNextTolerance);
      const bool folds = mode != ActivationMode::kF32 && n == 1;
      if (folds) {
        expect_folded_product(host.view(), folded.next.data(), folded.y, gelu_pairs);
      } else {
        EXPECT_EQ(folded.y, plain.y);
      }
      EXPECT_EQ(folded.kernels, plain.kernels - (folds ? 1 : 0));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ResidualMatmulInMode,
                         ::testing::Values(ActivationMode::kF32, ActivationMode::kBF16,
                                           ActivationMode::kQ8),
                         [](const ::testing::TestParamInfo<ActivationMode>& info) {
                           return std::string(activation_mode_name(info.param));
                         });

// set_fold_residual_steps(false) (the default; the bench's --fold sets true) keeps the default
// order.
TEST(ResidualMatmul, FoldingCanBeSwitchedOff) {
  auto gpu = testing::make_gpu_in_mode(ActivationMode::kBF16);
  ASSERT_TRUE(gpu);
  const int64_t hidden = 1536;
  const testing::HostMatrix host =
      testing::random_matrix(quant::WeightFormat::kW4G32, 512, hidden, 990);
  const testing::DeviceMatrix w(host);
  BackendRows acc(*gpu, 1, hidden), x(*gpu, 1, hidden), next(*gpu, 1, hidden), y(*gpu, 1, 512);
  acc.set(*gpu, random_floats(hidden, -4.0f, 4.0f, 991));
  x.set(*gpu, random_floats(hidden, -4.0f, 4.0f, 992));
  const engine::NormParams norm = {0.0f, 1e-6f};
  int64_t kernels[2];
  for (const bool fold : {true, false}) {
    gpu->set_fold_residual_steps(fold);
    const int64_t before = *gpu->kernels_launched();
    gpu->add_rms_norm_matmul(acc.rows, x.rows, nullptr, 1.0f, nullptr, next.rows, w.view, y.rows,
                             false, norm);
    kernels[fold ? 0 : 1] = *gpu->kernels_launched() - before;
  }
  ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
  EXPECT_EQ(kernels[0] + 1, kernels[1]);
}

// ---------------------------------------------------------------------------------------------
// Whole decode steps of one sequence (bf16 mode, kernel by kernel), folding and not, against the
// CPU engine: tiny (E2B-style, the post-attention step folds into gate/up) and tiny-dense
// (31B-style, also the post-feed-forward step into the next layer's QKV). Both GPU engines round
// every GEMV input to bf16, so each stays within DecodeInMode's bound of the CPU (activation_test:
// 0.05 of the CPU logits' range), and the folding one launches exactly one kernel fewer per
// folded step.
class FoldedDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(FoldedDecode, MatchesTheCpuEngineWithOneKernelFewerPerFoldedStep) {
  const model::LoadedModel& m = gemma4::testing::tiny_w4a16_model(GetParam());
  engine::EngineOptions options;
  options.max_sequences = 1;
  options.max_context = 64;
  options.ring_history = 8;
  options.record_decode = false;
  auto engine_on = [&](std::unique_ptr<engine::Backend> backend) {
    auto made = engine::Gemma4Engine::create(m.config, m.weights, std::move(backend), options);
    EXPECT_TRUE(made.ok()) << made.error().to_string();
    return made.ok() ? std::move(*made) : nullptr;
  };
  std::unique_ptr<CudaBackend> folding_backend = testing::make_gpu_in_mode(ActivationMode::kBF16);
  std::unique_ptr<CudaBackend> plain_backend = testing::make_gpu_in_mode(ActivationMode::kBF16);
  ASSERT_TRUE(folding_backend && plain_backend);
  folding_backend->set_fold_residual_steps(true);
  plain_backend->set_fold_residual_steps(false);
  const CudaBackend& folding_gpu = *folding_backend;
  const CudaBackend& plain_gpu = *plain_backend;
  auto cpu = engine_on(std::make_unique<backend::cpu::CpuBackend>(1));
  auto folding = engine_on(std::move(folding_backend));
  auto plain = engine_on(std::move(plain_backend));
  ASSERT_TRUE(cpu && folding && plain);
  for (engine::Gemma4Engine* e : {cpu.get(), folding.get(), plain.get()}) {
    ASSERT_EQ(*e->open_sequence(), 0);
  }
  const model::ModelConfig& config = m.config;
  const int64_t folded_steps = config.num_layers + (config.ple_dim > 0 ? 0 : config.num_layers - 1);
  const int32_t vocab = cpu->vocab_size();
  std::vector<int32_t> tokens = gemma4::testing::prompt_ids(6, 9);
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const engine::StepInput input{0, tokens};
    std::vector<float> expected(vocab), got(vocab), unfolded(vocab);
    ASSERT_TRUE(cpu->step({&input, 1}, expected).ok());
    const int64_t folding_before = *folding_gpu.kernels_launched();
    const int64_t plain_before = *plain_gpu.kernels_launched();
    const Status folded_status = folding->step({&input, 1}, got);
    ASSERT_TRUE(folded_status.ok()) << folded_status.error().to_string();
    ASSERT_TRUE(plain->step({&input, 1}, unfolded).ok());
    if (step > 0) {  // one-row decode steps (the prompt's rows do not fold)
      EXPECT_EQ(*plain_gpu.kernels_launched() - plain_before,
                *folding_gpu.kernels_launched() - folding_before + folded_steps);
    }
    const auto [lo, hi] = std::minmax_element(expected.begin(), expected.end());
    const double bound = 0.05 * (*hi - *lo);
    double folded_delta = 0.0, plain_delta = 0.0;
    for (int32_t v = 0; v < vocab; ++v) {
      ASSERT_TRUE(std::isfinite(got[v]));
      folded_delta = std::max(folded_delta, double{std::fabs(got[v] - expected[v])});
      plain_delta = std::max(plain_delta, double{std::fabs(unfolded[v] - expected[v])});
    }
    EXPECT_LE(folded_delta, bound);
    EXPECT_LE(plain_delta, bound);
    std::printf("[ folded decode ] %s step %d: max |delta logit| folded %.3g, unfolded %.3g\n",
                GetParam().c_str(), step, folded_delta, plain_delta);
    tokens = {static_cast<int32_t>(hi - expected.begin())};  // the CPU's greedy pick
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, FoldedDecode, ::testing::Values("tiny", "tiny-dense"),
                         gemma4::testing::preset_test_name);

}  // namespace
}  // namespace gemma4::cuda
