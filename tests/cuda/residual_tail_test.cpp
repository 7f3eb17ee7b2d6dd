// The residual step in the tail of the GEMV before it (GemvResidualTail, gemv_kernels.h;
// gemv_residual_tail.cuh) and CudaBackend::matmul_add_rms_norm, which uses it:
//  * the GEMV with the tail stores the same y as without, and its last block writes the residual,
//    next and their companions bit for bit as the stand-alone add_rms_norm kernel does after the
//    plain GEMV (the tail sums in that kernel's own layout): E2B's and 31B's o_proj / down shapes,
//    bf16 and fp32 activations, in a captured graph replayed several times (the done counter is
//    back at zero after each launch);
//  * shapes and layouts it cannot take are refused before anything is enqueued;
//  * the backend operation and engine::Backend's default order (matmul, then add_rms_norm) write
//    the same bits with one kernel fewer where the tail runs (one row outside kF32 mode).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "engine/backend.h"
#include "packed_matrix.h"
#include "quant/qmatrix.h"

namespace gemma4::cuda {
namespace {

using testing::BackendRows;
using testing::DeviceArray;
using testing::random_floats;

template <typename T>
void expect_same_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t first_difference = got.size();
  for (size_t i = 0; i < got.size() && first_difference == got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) first_difference = i;
  }
  EXPECT_EQ(first_difference, got.size())
      << what << " differs first at element " << first_difference;
}

// y = W x with the step in its tail against the plain GEMV (same tiling) followed by add_rms_norm
// (with the bf16 and kQ8 companions of next, or of the residual without next), as a graph of
// [restore the residual; the tailed GEMV] replayed three times.
// With moe, the MoE inputs too (add_rms_norm_moe against the tail's router_in / expert_in).
struct TailCase {
  int64_t rows, cols;  // W: rows = the step's width
  ActType x_type;
  int m;
  float scalar;
  bool next;
  quant::WeightFormat format = quant::WeightFormat::kW4G32;
  bool moe = false;
  int tiling = -1;  // -1: the shape's default (one row) or kGemvTailTilings[0]
};

void check_tail(const TailCase& c, uint32_t seed) {
  const testing::HostMatrix host = testing::random_matrix(c.format, c.rows, c.cols, seed);
  const testing::DeviceMatrix w(host);
  const int64_t width = c.rows, stride = width + 32;  // padded rows
  const std::vector<float> x_values = random_floats(c.m * c.cols, -2.0f, 2.0f, seed + 1);
  std::vector<uint16_t> x_bf16(x_values.size());
  for (size_t i = 0; i < x_values.size(); ++i) x_bf16[i] = float_to_bf16(x_values[i]);
  const DeviceArray<float> x_f32(x_values);
  const DeviceArray<uint16_t> x_b16(x_bf16);
  const bool bf16 = c.x_type == ActType::kBF16;
  const GemvInput input = {bf16 ? static_cast<const void*>(x_b16.get()) : x_f32.get(), c.x_type,
                           c.m, c.cols, !bf16};
  const DeviceArray<float> weight(random_floats(width, -1.0f, 1.5f, seed + 2));
  const DeviceArray<float> next_weight(random_floats(width, -1.0f, 1.5f, seed + 3));
  const std::vector<float> residual = random_floats(c.m * stride, -40.0f, 40.0f, seed + 4);
  const DeviceArray<float> pristine_residual(residual);
  const DeviceArray<float> router_scale(random_floats(width, -2.0f, 2.0f, seed + 5));
  const DeviceArray<float> expert_weight(random_floats(width, -1.0f, 1.5f, seed + 6));
  const float router_factor = 1.0f / std::sqrt(static_cast<float>(width));
  // One row: the shape's default tiling (the backend's choice) where it has a tail build; else
  // tiling 9 explicitly (a default without one, e.g. a streaming tiling, makes the backend run the
  // step in its own kernel; the batched default is a tiling of 8-row m tiles without a tail build).
  const int default_tiling = default_gemv_tiling(w.view, 1, c.x_type);
  const bool default_has_tail =
      gemv_tiling_has_tail(default_tiling) || is_gemv_splitk_tiling(default_tiling);
  const int tiling = c.tiling >= 0                  ? c.tiling
                     : c.m == 1 && default_has_tail ? default_tiling
                                                    : kGemvTailTilings[0];
  // Every split-K tiling has a tail build.
  ASSERT_TRUE(gemv_tiling_has_tail(tiling) || is_gemv_splitk_tiling(tiling)) << "tiling " << tiling;

  // Companions of what the step's reader takes: next's, or the residual's without next.
  const auto companion_arrays = [&](DeviceArray<uint16_t>& b16, DeviceArray<uint8_t>& q8) {
    return ActivationCompanions{b16.get(), q8.get(), width};
  };
  const size_t bf16_count = c.m * width, q8_bytes = c.m * q8_row_bytes(width);

  // The separate kernels.
  DeviceArray<float> plain_y(c.m * width), plain_residual(residual), plain_next(c.m * stride);
  DeviceArray<uint16_t> plain_b16(bf16_count);
  DeviceArray<uint8_t> plain_q8(q8_bytes);
  CUDA_ASSERT_OK(gemv(w.view, input, {plain_y.get(), width}, Launch{}, tiling));
  AddNormSpec spec;
  spec.weight = weight.get();
  spec.next_weight = next_weight.get();
  spec.scalar = c.scalar;
  (c.next ? spec.next_companions : spec.residual_companions) =
      companion_arrays(plain_b16, plain_q8);
  const RowsView next_view = c.next ? RowsView{plain_next.get(), c.m, width, stride} : RowsView{};
  DeviceArray<float> plain_router(c.m * width), plain_expert(c.m * width);
  if (c.moe) {
    const MoeInputsSpec moe = {router_scale.get(), router_factor, expert_weight.get(),
                               RowsView{plain_router.get(), c.m, width, width},
                               RowsView{plain_expert.get(), c.m, width, width}};
    CUDA_ASSERT_OK(add_rms_norm_moe({plain_y.get(), c.m, width, width},
                                    {plain_residual.get(), c.m, width, stride}, next_view, spec,
                                    moe, Launch{}));
  } else {
    CUDA_ASSERT_OK(add_rms_norm({plain_y.get(), c.m, width, width},
                                {plain_residual.get(), c.m, width, stride}, next_view, spec,
                                Launch{}));
  }
  CUDA_ASSERT_OK(cudaDeviceSynchronize());

  // The tail, captured once (with PDL, as the engine records it), replayed.
  DeviceArray<float> tail_y(c.m * width), tail_residual(residual), tail_next(c.m * stride);
  DeviceArray<uint16_t> tail_b16(bf16_count);
  DeviceArray<uint8_t> tail_q8(q8_bytes);
  DeviceArray<float> tail_router(c.m * width), tail_expert(c.m * width);
  DeviceArray<unsigned int> counter(std::vector<unsigned int>{0u});
  GemvOutput out = {tail_y.get(), width};
  out.residual_tail = {.residual = tail_residual.get(),
                       .residual_stride = stride,
                       .weight = weight.get(),
                       .next_weight = next_weight.get(),
                       .scalar = c.scalar,
                       .next = c.next ? tail_next.get() : nullptr,
                       .next_stride = stride,
                       .done_counter = counter.get()};
  (c.next ? out.residual_tail.next_companions : out.residual_tail.residual_companions) =
      companion_arrays(tail_b16, tail_q8);
  if (c.moe) {
    GemvResidualTail& t = out.residual_tail;
    t.router_in = tail_router.get();
    t.router_in_stride = width;
    t.router_scale = router_scale.get();
    t.router_factor = router_factor;
    t.expert_in = tail_expert.get();
    t.expert_in_stride = width;
    t.expert_weight = expert_weight.get();
  }
  cudaStream_t stream;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_ASSERT_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  CUDA_ASSERT_OK(cudaMemcpyAsync(tail_residual.get(), pristine_residual.get(),
                                 sizeof(float) * residual.size(), cudaMemcpyDeviceToDevice,
                                 stream));
  CUDA_ASSERT_OK(gemv(w.view, input, out, {stream, true}, tiling));
  CUDA_ASSERT_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_ASSERT_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    tail_y.poison();
    tail_next.poison();
    tail_b16.poison();
    tail_q8.poison();
    tail_router.poison();
    tail_expert.poison();
    CUDA_ASSERT_OK(cudaGraphLaunch(exec, stream));
    CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
    expect_same_bits(tail_y.download(), plain_y.download(), "y");
    expect_same_bits(tail_residual.download(), plain_residual.download(), "residual");
    if (c.next) {
      // Only the rows' widths: the padding is nobody's.
      std::vector<float> got = tail_next.download(), want = plain_next.download();
      for (int r = 0; r < c.m; ++r) {
        expect_same_bits(
            std::vector<float>(got.begin() + r * stride, got.begin() + r * stride + width),
            std::vector<float>(want.begin() + r * stride, want.begin() + r * stride + width),
            "next");
      }
    }
    expect_same_bits(tail_b16.download(), plain_b16.download(), "bf16 companion");
    expect_same_bits(tail_q8.download(), plain_q8.download(), "q8 companion");
    if (c.moe) {
      expect_same_bits(tail_router.download(), plain_router.download(), "router_in");
      expect_same_bits(tail_expert.download(), plain_expert.download(), "expert_in");
    }
    EXPECT_EQ(counter.download(), std::vector<unsigned int>{0u}) << "the counter after a launch";
  }
  CUDA_ASSERT_OK(cudaGraphExecDestroy(exec));
  CUDA_ASSERT_OK(cudaGraphDestroy(graph));
  CUDA_ASSERT_OK(cudaStreamDestroy(stream));
}

// E2B o_proj (1536 x 2048: tiling 9 with bf16 activations, 27 with fp32 ones; 384 virtual
// threads of one quad), 31B o_proj (5376 x 8192: tiling 9; 672 virtual threads of two quads),
// the layer scalar, two rows, the last layer's step without a final norm (no next), and the 26B's
// o_proj (NVFP4 2816 x 4096: tiling 27; 704 virtual threads) with the MoE inputs.
TEST(GemvResidualTail, WritesWhatTheGemvThenAddRmsNormWrite) {
  const TailCase cases[] = {
      {1536, 2048, ActType::kBF16, 1, 1.0f, true},
      {1536, 2048, ActType::kF32, 1, 1.0f, true},
      {5376, 8192, ActType::kBF16, 1, 0.75f, true},
      {5376, 8192, ActType::kF32, 1, 1.0f, true},
      {1536, 2048, ActType::kBF16, 2, 0.5f, true},
      {5376, 8192, ActType::kBF16, 1, 0.5f, false},
      {2816, 4096, ActType::kBF16, 1, 1.0f, true, quant::WeightFormat::kNVFP4, true},
  };
  uint32_t seed = 4100;
  for (const TailCase& c : cases) {
    SCOPED_TRACE(std::to_string(c.rows) + " x " + std::to_string(c.cols) +
                 (c.x_type == ActType::kBF16 ? " bf16 x" : " fp32 x") + ", m " +
                 std::to_string(c.m) + (c.next ? "" : ", no next") + (c.moe ? ", moe" : ""));
    check_tail(c, seed);
    seed += 10;
  }
}

// The split-K GEMV's tail (gemv_splitk_kernels.h), every compiled tiling: 31B o_proj with bf16
// activations, E2B down with fp32 ones and no next.
TEST(GemvResidualTail, SplitKTilings) {
  uint32_t seed = 4300;
  for (int t = kGemvSplitKTilingBase; t < kGemvSplitKTilingBase + kNumGemvSplitKTilings; ++t) {
    if (!gemv_splitk_tiling_compiled(t)) continue;
    SCOPED_TRACE("tiling " + std::to_string(t));
    TailCase o_proj = {5376, 8192, ActType::kBF16, 1, 0.75f, true};
    TailCase down = {1536, 6144, ActType::kF32, 1, 1.0f, false};
    o_proj.tiling = down.tiling = t;
    check_tail(o_proj, seed);
    check_tail(down, seed + 10);
    seed += 20;
  }
}

TEST(GemvResidualTail, RefusesWhatItCannotDo) {
  const testing::HostMatrix host =
      testing::random_matrix(quant::WeightFormat::kW4G32, 1536, 2048, 4200);
  const testing::DeviceMatrix w(host);
  DeviceArray<float> x(2048), y(1536 + 4), residual(1536 + 4), next(1536 + 4),
      weight(random_floats(1536, -1.0f, 1.0f, 4201));
  DeviceArray<unsigned int> counter(std::vector<unsigned int>{0u});
  const GemvInput input = {x.get(), ActType::kF32, 1, 2048, true};
  GemvOutput good = {y.get(), 1536};
  good.residual_tail = {.residual = residual.get(),
                        .residual_stride = 1536,
                        .weight = weight.get(),
                        .next = next.get(),
                        .next_stride = 1536,
                        .done_counter = counter.get()};
  EXPECT_EQ(gemv(w.view, input, good, Launch{}), cudaSuccess);
  auto refused = [&](GemvOutput out, const char* why, int tiling = -1) {
    EXPECT_EQ(gemv(w.view, input, out, Launch{}, tiling), cudaErrorInvalidValue) << why;
  };
  GemvOutput bad = good;
  bad.residual_tail.next = next.get() + 1;
  refused(bad, "next not 16-byte aligned");
  bad = good;
  bad.residual_tail.residual = residual.get() + 2;
  refused(bad, "residual not 16-byte aligned");
  bad = good;
  bad.residual_tail.done_counter = nullptr;
  refused(bad, "no done counter");
  bad = good;
  bad.epilogue = GemvEpilogue::kGeluPairs;
  refused(bad, "an epilogue");
  bad = good;
  bad.residual_tail.next = nullptr;
  bad.residual_tail.next_companions = {reinterpret_cast<uint16_t*>(next.get()), nullptr, 1536};
  refused(bad, "next's companions without next");
  refused(good, "a tiling without a tail kernel", 8);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(counter.download(), std::vector<unsigned int>{0u});
}

// CudaBackend::matmul_add_rms_norm against engine::Backend's default (the matmul alone, then
// add_rms_norm) on the same backend at E2B's o_proj shape: the same y, acc, next and next's
// companions (what the next GEMV reads); one kernel fewer where the tail runs (one row outside
// kF32 mode), the same kernels and a false return elsewhere.
class ResidualTailInMode : public ::testing::TestWithParam<ActivationMode> {};

TEST_P(ResidualTailInMode, MatchesTheDefaultOrderWithOneKernelFewer) {
  const ActivationMode mode = GetParam();
  auto gpu = testing::make_gpu_in_mode(mode);
  ASSERT_TRUE(gpu);
  gpu->set_tail_residual_steps(true);
  const int64_t hidden = 1536, k = 2048;
  const engine::NormParams norm = {0.0f, 1e-6f};
  const DeviceArray<float> weight(random_floats(hidden, -1.0f, 1.5f, 4300));
  const DeviceArray<float> next_weight(random_floats(hidden, -1.0f, 1.5f, 4301));
  const testing::HostMatrix host =
      testing::random_matrix(quant::WeightFormat::kW4G32, hidden, k, 4302);
  const testing::DeviceMatrix w(host);
  uint32_t seed = 4310;
  for (const int64_t n : {1, 3}) {
    SCOPED_TRACE(std::to_string(n) + " rows");
    const auto acc_values = random_floats(n * hidden, -40.0f, 40.0f, seed++);
    const auto x_values = random_floats(n * k, -2.0f, 2.0f, seed++);
    struct Run {
      std::vector<float> acc, next, y;
      std::vector<uint16_t> next_bf16;
      std::vector<uint8_t> next_q8;
      int64_t kernels;
      bool tailed;
    };
    auto run_on = [&](bool tail) {
      BackendRows acc(*gpu, n, hidden), x(*gpu, n, k), next(*gpu, n, hidden), y(*gpu, n, hidden);
      acc.set(*gpu, acc_values);
      x.set(*gpu, x_values);
      const int64_t before = *gpu->kernels_launched();
      const bool tailed =
          tail ? gpu->matmul_add_rms_norm(w.view, x.rows, y.rows, acc.rows, weight.get(), 0.5f,
                                          next_weight.get(), next.rows, norm)
               : gpu->engine::Backend::matmul_add_rms_norm(w.view, x.rows, y.rows, acc.rows,
                                                           weight.get(), 0.5f, next_weight.get(),
                                                           next.rows, norm);
      if (!tailed) {
        gpu->add_rms_norm(acc.rows, y.rows, weight.get(), 0.5f, next_weight.get(), next.rows, norm);
      }
      Run run{acc.get(*gpu), next.get(*gpu), y.get(*gpu), {}, {}, *gpu->kernels_launched() - before,
              tailed};
      if (const ActivationCompanions* c = gpu->live_companions(next.rows)) {
        if (c->bf16 != nullptr) {
          run.next_bf16.resize(n * c->stride);
          gpu->download(run.next_bf16.data(), c->bf16, sizeof(uint16_t) * run.next_bf16.size());
        }
        if (c->q8 != nullptr) {
          run.next_q8.resize(n * q8_row_bytes(c->stride));
          gpu->download(run.next_q8.data(), c->q8, run.next_q8.size());
        }
      }
      return run;
    };
    const Run plain = run_on(false), tailed = run_on(true);
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    // q8 mode: the o_proj GEMV reads kQ8 activations, for which no tail kernel is built.
    const bool tails = mode == ActivationMode::kBF16 && n == 1;
    EXPECT_FALSE(plain.tailed);
    EXPECT_EQ(tailed.tailed, tails);
    expect_same_bits(tailed.y, plain.y, "y");
    expect_same_bits(tailed.acc, plain.acc, "acc");
    expect_same_bits(tailed.next, plain.next, "next");
    expect_same_bits(tailed.next_bf16, plain.next_bf16, "next's bf16 companion");
    expect_same_bits(tailed.next_q8, plain.next_q8, "next's q8 companion");
    EXPECT_EQ(tailed.kernels, plain.kernels - (tails ? 1 : 0));
  }
}

// CudaBackend::matmul_add_rms_norm_moe against engine::Backend's default (the matmul, then
// add_rms_norm_moe) at the 26B's o_proj shape, bf16 mode, the router's input in y as the engine
// has it: the same acc, next, router and expert inputs, one kernel fewer.
TEST(ResidualTail, MoeInputsMatchTheDefaultOrderWithOneKernelFewer) {
  auto gpu = testing::make_gpu_in_mode(ActivationMode::kBF16);
  ASSERT_TRUE(gpu);
  gpu->set_tail_residual_steps(true);
  const int64_t hidden = 2816, k = 4096;
  const engine::NormParams norm = {0.0f, 1e-6f};
  const DeviceArray<float> weight(random_floats(hidden, -1.0f, 1.5f, 4400));
  const DeviceArray<float> next_weight(random_floats(hidden, -1.0f, 1.5f, 4401));
  const DeviceArray<float> router_scale(random_floats(hidden, -2.0f, 2.0f, 4402));
  const DeviceArray<float> expert_weight(random_floats(hidden, -1.0f, 1.5f, 4403));
  const testing::HostMatrix host =
      testing::random_matrix(quant::WeightFormat::kNVFP4, hidden, k, 4404);
  const testing::DeviceMatrix w(host);
  const auto acc_values = random_floats(hidden, -40.0f, 40.0f, 4405);
  const auto x_values = random_floats(k, -2.0f, 2.0f, 4406);
  struct Run {
    std::vector<float> acc, next, router_in, expert_in;
    int64_t kernels;
  };
  auto run_on = [&](bool tail) {
    BackendRows acc(*gpu, 1, hidden), x(*gpu, 1, k), next(*gpu, 1, hidden), y(*gpu, 1, hidden),
        expert_in(*gpu, 1, hidden);
    acc.set(*gpu, acc_values);
    x.set(*gpu, x_values);
    const engine::MoeInputs moe = {router_scale.get(), 0.125f, expert_weight.get(), y.rows,
                                   expert_in.rows};
    const int64_t before = *gpu->kernels_launched();
    if (tail) {
      gpu->matmul_add_rms_norm_moe(w.view, x.rows, y.rows, acc.rows, weight.get(), 1.0f,
                                   next_weight.get(), next.rows, moe, norm);
    } else {
      gpu->engine::Backend::matmul_add_rms_norm_moe(w.view, x.rows, y.rows, acc.rows, weight.get(),
                                                    1.0f, next_weight.get(), next.rows, moe, norm);
    }
    const int64_t kernels = *gpu->kernels_launched() - before;
    return Run{acc.get(*gpu), next.get(*gpu), y.get(*gpu), expert_in.get(*gpu), kernels};
  };
  const Run plain = run_on(false), tailed = run_on(true);
  ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
  expect_same_bits(tailed.acc, plain.acc, "acc");
  expect_same_bits(tailed.next, plain.next, "next");
  expect_same_bits(tailed.router_in, plain.router_in, "router_in");
  expect_same_bits(tailed.expert_in, plain.expert_in, "expert_in");
  EXPECT_EQ(tailed.kernels, plain.kernels - 1);
}

INSTANTIATE_TEST_SUITE_P(Modes, ResidualTailInMode,
                         ::testing::Values(ActivationMode::kF32, ActivationMode::kBF16,
                                           ActivationMode::kQ8),
                         [](const ::testing::TestParamInfo<ActivationMode>& info) {
                           return std::string(activation_mode_name(info.param));
                         });

}  // namespace
}  // namespace gemma4::cuda
