// The tensor-core batched GEMV (gemv_mma.h) against quant's CPU oracle (quant::dequantize_row,
// weight-formats.md 2.3, 3.1-3.3; w4g32 weights rounded to bf16 as the kernel documents) on fresh
// random w4g32 and NVFP4 weights: every row count 1..64, real E2B and 26B-A4B shapes through
// gemv()'s dispatch, every epilogue, every tiling option, partial row tiles and K splits, every
// activation type (fp32 rounded to bf16, bf16, q8); outputs poisoned first (NaN), so an unwritten
// element fails. The epilogues against PyTorch's gelu(approximate="tanh") formula in double.
#include "backend/cuda/gemv_mma.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "cuda_test_util.h"
#include "packed_matrix.h"

namespace gemma4::cuda {
namespace {

using quant::ScaleType;
using quant::WeightFormat;
using testing::DeviceArray;
using testing::DeviceMatrix;
using testing::HostMatrix;
using testing::random_matrix;

// Products are exact (a bf16 weight times a bf16 activation) and summed in fp32: the bound,
// relative to Σ|w·x|, is far below bf16 rounding (2^-8).
constexpr double kTolerance = 2e-4;
// Bounds |d gelu_tanh / du| (its maximum is about 1.13).
constexpr double kGeluSlopeBound = 1.2;

double gelu_tanh_reference(double u) {
  return 0.5 * u * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u)));
}

constexpr ActType kActivationTypes[] = {ActType::kF32, ActType::kBF16, ActType::kQ8};

struct Case {
  int m = 2;
  ActType x_type = ActType::kF32;
  GemvEpilogue epilogue = GemvEpilogue::kNone;
  MmaGemvTiling tiling = {0, 0};  // {0, 0}: through gemv() and its default choice
  uint32_t seed = 1;
};

std::string describe(const HostMatrix& w, const Case& c) {
  return std::to_string(w.rows) + "x" + std::to_string(w.cols) + " M=" + std::to_string(c.m) +
         (c.x_type == ActType::kBF16 ? " x=bf16"
          : c.x_type == ActType::kQ8 ? " x=q8"
                                     : " x=f32 rounded") +
         " epilogue=" + std::to_string(static_cast<int>(c.epilogue)) +
         " warps=" + std::to_string(c.tiling.warps) + "x" + std::to_string(c.tiling.k_warps) +
         " tiles_per_warp=" + std::to_string(c.tiling.tiles_per_warp) +
         " splits=" + std::to_string(c.tiling.splits) +
         " row_blocks=" + std::to_string(c.tiling.row_blocks) +
         " trigger=" + std::to_string(static_cast<int>(c.tiling.trigger)) +
         (c.tiling.sm_exclusive ? " sm_exclusive" : "") +
         " activation_blocks=" + std::to_string(c.tiling.activation_blocks);
}

// Runs one case and checks every output against the reference. Returns the outputs.
std::vector<float> check(const HostMatrix& host, const DeviceMatrix& device, const Case& c) {
  SCOPED_TRACE(describe(host, c));
  const int64_t n = host.rows, k = host.cols;
  const int64_t width = c.epilogue == GemvEpilogue::kGeluPairs ? n / 2 : n;
  // Activation rows with a stride wider than K, as the engine's scratch rows may be.
  const int64_t stride = k + 32;
  const std::vector<float> source = testing::random_floats(c.m * stride, -1.0f, 1.0f, c.seed);
  const std::vector<float> multiplier = testing::random_floats(c.m * n, -2.0f, 2.0f, c.seed + 1);
  std::vector<float> x(source.size());  // what the tensor cores multiply: bf16 values
  std::vector<uint16_t> bits(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    bits[i] = float_to_bf16(source[i]);
    x[i] = bf16_to_float(bits[i]);
  }
  DeviceArray<float> x_f32(source);
  DeviceArray<uint16_t> x_bf16(bits);
  DeviceArray<uint8_t> x_q8(c.m * q8_row_bytes(stride));
  if (c.x_type == ActType::kQ8) {
    // The quantizer's output (its own tests check it against its contract); what the kernel
    // multiplies is q · scale rounded to bf16.
    EXPECT_EQ(quantize_activations_q8(x_f32.get(), c.m, k, stride, x_q8.get(), stride, Launch{}),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint8_t> q8 = x_q8.download();
    for (int m = 0; m < c.m; ++m) {
      const uint8_t* row = q8.data() + m * q8_row_bytes(stride);
      for (int64_t e = 0; e < k; ++e) {
        float scale;
        std::memcpy(&scale, row + stride + 4 * (e / 32), 4);
        const int in_group = e % 8;
        const int8_t q =
            static_cast<int8_t>(row[e / 8 * 8 + (in_group % 2 ? 4 : 0) + in_group / 2]);
        x[m * stride + e] = round_bf16(static_cast<float>(q) * scale);
      }
    }
  }
  DeviceArray<float> multiplier_device(multiplier);
  DeviceArray<float> y(c.m * width);
  const void* x_device = c.x_type == ActType::kBF16 ? static_cast<const void*>(x_bf16.get())
                         : c.x_type == ActType::kQ8 ? static_cast<const void*>(x_q8.get())
                                                    : x_f32.get();
  const GemvInput input = {x_device, c.x_type, c.m, stride, c.x_type == ActType::kF32};
  const GemvOutput output = {y.get(), width, c.epilogue, multiplier_device.get(), n};
  const cudaError_t status = c.tiling.warps == 0
                                 ? gemv(device.view, input, output, Launch{})
                                 : gemv_mma(device.view, input, output, Launch{}, c.tiling);
  EXPECT_EQ(status, cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = y.download();

  std::vector<double> products(c.m * n), magnitudes(c.m * n);
  testing::parallel_for(n, [&](int64_t row) {
    std::vector<float> w(k);
    testing::mma_dequantize_row(host, row, w.data());
    for (int m = 0; m < c.m; ++m) {
      double sum = 0.0, magnitude = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const double product = static_cast<double>(w[j]) * x[m * stride + j];
        sum += product;
        magnitude += std::fabs(product);
      }
      products[m * n + row] = sum;
      magnitudes[m * n + row] = magnitude;
    }
  });
  std::vector<double> expected(c.m * width), bound(c.m * width);
  for (int m = 0; m < c.m; ++m) {
    for (int64_t i = 0; i < width; ++i) {
      const int64_t out = m * width + i, at = m * n + i;
      if (c.epilogue == GemvEpilogue::kNone) {
        expected[out] = products[at];
        bound[out] = magnitudes[at];
      } else if (c.epilogue == GemvEpilogue::kGeluMul) {
        expected[out] = gelu_tanh_reference(products[at]) * multiplier[at];
        bound[out] = kGeluSlopeBound * magnitudes[at] * std::fabs(multiplier[at]);
      } else {
        const int64_t gate = m * n + 2 * i, up = gate + 1;
        const double gelu = gelu_tanh_reference(products[gate]);
        expected[out] = gelu * products[up];
        bound[out] = kGeluSlopeBound * magnitudes[gate] * std::fabs(products[up]) +
                     std::fabs(gelu) * magnitudes[up];
      }
    }
  }
  testing::expect_close(got, expected, bound, kTolerance, "gemv_mma");
  return got;
}

// Every row count, with row tiles and K splits that do not divide the matrix: 200 rows (a
// partial 16-row tile and a partial block) by 7 groups of K.
TEST(GemvMma, EveryRowCountPartialTiles) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 200, 224, 11);
  const DeviceMatrix device(host);
  for (int m = kMmaGemvMinRows; m <= kMmaGemvMaxRows; ++m) {
    Case c;
    c.m = m;
    c.x_type = kActivationTypes[m % 3];
    const MmaGemvWarpLayout& layout = kMmaGemvWarpLayouts[(m / 3) % kNumMmaGemvWarpLayouts];
    c.tiling = mma_gemv_tiling(layout, 1 + m % 5);
    c.seed = 100 + m;
    check(host, device, c);
  }
}

// Blocks that loop over row tiles (a fixed count that leaves some blocks one tile more than
// others, and the resident count) at every warp layout, split and activation type whose
// activations and two partial-sum buffers fit shared memory: a row count and K (46 groups) that
// no tile or split divides, every epilogue.
TEST(GemvMma, LoopingBlocks) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 1000, 1472, 21);
  const DeviceMatrix device(host);
  uint32_t seed = 1100;
  int index = 0;
  int checked = 0;
  for (const MmaGemvWarpLayout& layout : kMmaGemvWarpLayouts) {
    for (int splits : {1, 3, 8}) {
      for (int row_blocks : {2, 3, kMmaGemvResidentRowBlocks}) {
        for (int m : {8, 17, 32, 64}) {
          Case c;
          c.m = m;
          c.x_type = kActivationTypes[index % 3];
          c.epilogue = static_cast<GemvEpilogue>(index % 3);
          c.tiling = mma_gemv_tiling(layout, splits, row_blocks);
          c.seed = seed++;
          ++index;
          if (mma_gemv_shared_bytes(c.tiling, m, host.cols / 32) > kMmaGemvMaxSharedBytes) {
            continue;
          }
          check(host, device, c);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 140);
  const HostMatrix nvfp4 = random_matrix(WeightFormat::kNVFP4, 2600, 2816, 22);
  const DeviceMatrix nvfp4_device(nvfp4);
  for (int m : {8, 17, 32, 64}) {
    Case c;
    c.m = m;
    c.tiling = {4, 8, 2, 5};
    c.seed = seed++;
    check(nvfp4, nvfp4_device, c);
  }
}

TEST(GemvMma, EveryTilingEveryEpilogue) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 1040, 1536, 12);
  const DeviceMatrix device(host);
  uint32_t seed = 300;
  for (const MmaGemvWarpLayout& layout : kMmaGemvWarpLayouts) {
    for (int splits = 1; splits <= kMmaGemvMaxSplits; ++splits) {
      for (GemvEpilogue e :
           {GemvEpilogue::kNone, GemvEpilogue::kGeluMul, GemvEpilogue::kGeluPairs}) {
        Case c;
        c.m = splits % 2 ? 37 : 12;
        c.x_type = kActivationTypes[(splits + layout.warps + layout.k_warps) % 3];
        c.epilogue = e;
        c.tiling = mma_gemv_tiling(layout, splits);
        c.seed = seed++;
        check(host, device, c);
      }
    }
  }
}

// Real shapes through gemv() (each row range of their measured tilings): E2B QKV, gate+up and
// the double-wide one (GELU pairs, as the engine runs them), down, o_proj, the PLE gate (GELU
// times the per-layer input) and projection; 26B-A4B expert gate+up and down.
TEST(GemvMma, RealShapesThroughGemv) {
  struct Shape {
    int64_t rows, cols;
    GemvEpilogue epilogue;
  };
  const Shape shapes[] = {
      {2560, 1536, GemvEpilogue::kNone},       {12288, 1536, GemvEpilogue::kGeluPairs},
      {24576, 1536, GemvEpilogue::kGeluPairs}, {1536, 6144, GemvEpilogue::kNone},
      {1536, 2048, GemvEpilogue::kNone},       {256, 1536, GemvEpilogue::kGeluMul},
      {1536, 256, GemvEpilogue::kNone},        {1408, 2816, GemvEpilogue::kGeluPairs},
      {2816, 704, GemvEpilogue::kNone}};
  uint32_t seed = 500;
  for (const Shape& s : shapes) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, s.rows, s.cols, seed++);
    const DeviceMatrix device(host);
    for (int m : {2, 9, 24, 64}) {
      for (ActType x_type : kActivationTypes) {
        Case c;
        c.m = m;
        c.x_type = x_type;
        c.epilogue = s.epilogue;
        c.seed = seed++;
        check(host, device, c);
      }
    }
  }
}

TEST(GemvMma, ScaleTypes) {
  uint32_t seed = 700;
  for (ScaleType type : {ScaleType::kBF16, ScaleType::kF16, ScaleType::kF32}) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, 512, 1536, seed++, type);
    const DeviceMatrix device(host);
    Case c;
    c.m = 24;
    c.seed = seed++;
    check(host, device, c);
  }
}

// NVFP4 (e4m3 block scales, zero blocks among them) in both global-factor conventions: 26B-A4B
// shapes (QKV of a sliding layer, dense MLP gate+up with GELU pairs and down, an expert).
TEST(GemvMma, Nvfp4BothConventions) {
  struct Shape {
    int64_t rows, cols;
    GemvEpilogue epilogue;
  };
  const Shape shapes[] = {{8192, 2816, GemvEpilogue::kNone},
                          {4224, 2816, GemvEpilogue::kGeluPairs},
                          {2816, 2112, GemvEpilogue::kNone},
                          {1408, 2816, GemvEpilogue::kGeluMul}};
  uint32_t seed = 900;
  for (bool divisor : {true, false}) {
    for (const Shape& s : shapes) {
      const HostMatrix host =
          random_matrix(WeightFormat::kNVFP4, s.rows, s.cols, seed++, ScaleType::kBF16, divisor);
      const DeviceMatrix device(host);
      for (int m : {2, 17, 32}) {
        Case c;
        c.m = m;
        c.x_type = m == 17 ? ActType::kBF16 : ActType::kF32;
        c.epilogue = s.epilogue;
        c.seed = seed++;
        check(host, device, c);
      }
    }
  }
  const HostMatrix host = random_matrix(WeightFormat::kNVFP4, 300, 704, seed++);
  const DeviceMatrix device(host);
  for (const MmaGemvWarpLayout& layout : kMmaGemvWarpLayouts) {
    for (int splits : {1, 3, 8}) {
      for (int m : {1, 64}) {  // one row: only when called directly (kernel_bench)
        Case c;
        c.m = m;
        c.tiling = mma_gemv_tiling(layout, splits);
        c.seed = seed++;
        check(host, device, c);
      }
    }
  }
}

// Every e4m3 block scale but NaN, one per row so that each row's sum is checked at its own
// magnitude: the kernel forms e2m1 · scale in bf16 from a subnormal e2m1 placement and the
// scale · 2^119 (gemv_mma_kernel.cuh's scaled_e2m1_pairs), exact from the subnormal scales up to
// ±448, at each n-tile count.
TEST(GemvMma, Nvfp4EveryScale) {
  HostMatrix host = random_matrix(WeightFormat::kNVFP4, 256, 512, 950);
  const int64_t blocks_per_row = host.cols / 16;
  for (int64_t row = 0; row < host.rows; ++row) {
    const auto code = static_cast<uint8_t>(row);
    const std::byte scale{(code & 0x7F) == 0x7F ? uint8_t{0x7E} : code};
    std::fill_n(host.scales.begin() + row * blocks_per_row, blocks_per_row, scale);
  }
  const DeviceMatrix device(host);
  uint32_t seed = 960;
  for (int m : {8, 16, 32, 64}) {
    for (const MmaGemvTiling tiling :
         {MmaGemvTiling{4, 1, 1}, MmaGemvTiling{4, 2, 2}, MmaGemvTiling{16, 2, 1, 0, 1}}) {
      Case c;
      c.m = m;
      c.tiling = tiling;
      c.seed = seed++;
      check(host, device, c);
    }
  }
}

// The streamed kernel (MmaGemvTiling::streamed: NVFP4, bf16 activations): every layout at 1, 3
// and 8 splits, every row count 1..32 and 33..64
// in two activation blocks, every epilogue, on a matrix of partial row tiles (300 rows) and a K
// range not of whole quads per split (22 groups); then the 26B-A4B dense shapes through gemv()
// at 2..32 rows; and its determinism.
TEST(GemvMma, StreamedEveryRowCount) {
  const HostMatrix host = random_matrix(WeightFormat::kNVFP4, 300, 704, 31);
  const DeviceMatrix device(host);
  uint32_t seed = 1300;
  for (const MmaGemvWarpLayout& layout : kMmaGemvStreamedLayouts) {
    for (int splits : {1, 3, 8}) {
      for (int m = 1; m <= 64; m += (m < 32 ? 1 : 11)) {
        Case c;
        c.m = m;
        c.x_type = ActType::kBF16;
        c.epilogue = static_cast<GemvEpilogue>(m % 3);
        c.tiling = mma_gemv_tiling(layout, splits);
        c.tiling.streamed = true;
        c.tiling.activation_blocks = m > 32 ? 2 : 1;
        c.tiling.trigger = m % 2 ? MmaGemvTrigger::kAtStart : MmaGemvTrigger::kAfterProducts;
        c.seed = seed++;
        check(host, device, c);
      }
    }
  }
  const int64_t shapes[][2] = {{8192, 2816}, {4224, 2816}, {2816, 2112}, {2816, 4096}};
  for (const auto& shape : shapes) {
    const HostMatrix real = random_matrix(WeightFormat::kNVFP4, shape[0], shape[1], seed++);
    const DeviceMatrix real_device(real);
    for (int m : {2, 9, 17, 32}) {
      Case c;
      c.m = m;
      c.x_type = ActType::kBF16;
      c.epilogue = shape[0] == 4224 ? GemvEpilogue::kGeluPairs : GemvEpilogue::kNone;
      c.seed = seed++;
      check(real, real_device, c);
    }
  }
  Case c;
  c.m = 32;
  c.x_type = ActType::kBF16;
  c.tiling = {8, 8, 1, 0, 1};
  c.tiling.streamed = true;
  const std::vector<float> first = check(host, device, c);
  EXPECT_EQ(check(host, device, c), first);
}

// What the streamed kernel refuses: w4g32 weights, fp32 activations, an odd group count (its
// block scales are copied two groups at a time), more than 32 rows a block, two k warps.
TEST(GemvMma, StreamedRefusesWhatItDoesNotTake) {
  DeviceArray<uint16_t> x(std::vector<uint16_t>(80 * 96, 0));
  DeviceArray<float> y(80 * 300);
  const GemvOutput output = {y.get(), 300};
  MmaGemvTiling tiling = {8, 2, 1, 0, 1};
  tiling.streamed = true;
  const HostMatrix nvfp4 = random_matrix(WeightFormat::kNVFP4, 300, 96, 32);
  const DeviceMatrix nvfp4_device(nvfp4);  // 3 groups
  EXPECT_EQ(gemv_mma(nvfp4_device.view, {x.get(), ActType::kBF16, 8, 96}, output, Launch{}, tiling),
            cudaErrorInvalidValue);
  const HostMatrix even = random_matrix(WeightFormat::kNVFP4, 300, 64, 33);
  const DeviceMatrix even_device(even);
  auto run = [&](const quant::QMatrix& w, ActType type, int m, const MmaGemvTiling& t) {
    return gemv_mma(w, {x.get(), type, m, 96, type == ActType::kF32}, output, Launch{}, t);
  };
  EXPECT_EQ(run(even_device.view, ActType::kBF16, 8, tiling), cudaSuccess);
  EXPECT_EQ(run(even_device.view, ActType::kF32, 8, tiling), cudaErrorInvalidValue);
  EXPECT_EQ(run(even_device.view, ActType::kBF16, 33, tiling), cudaErrorInvalidValue);
  MmaGemvTiling two_k_warps = tiling;
  two_k_warps.k_warps = 2;
  EXPECT_EQ(run(even_device.view, ActType::kBF16, 8, two_k_warps), cudaErrorInvalidValue);
  const HostMatrix w4g32 = random_matrix(WeightFormat::kW4G32, 300, 64, 34);
  const DeviceMatrix w4g32_device(w4g32);
  EXPECT_EQ(run(w4g32_device.view, ActType::kBF16, 8, tiling), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The cluster adds its partial sums in a fixed order: two runs give the same bits.
TEST(GemvMma, Deterministic) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 1536, 6144, 13);
  const DeviceMatrix device(host);
  Case c;
  c.m = 64;
  c.tiling = {4, 8};
  const std::vector<float> first = check(host, device, c);
  const std::vector<float> second = check(host, device, c);
  EXPECT_EQ(first, second);
  // Looping blocks add the same partial sums in the same order.
  c.tiling.row_blocks = 5;
  EXPECT_EQ(check(host, device, c), first);
}

// The default tiling of every shape the engines run (and small ones) is one gemv_mma accepts.
TEST(GemvMma, DefaultTilingsAreValid) {
  const int64_t shapes[][2] = {{2560, 1536},  {2048, 1536},  {4096, 1536},   {5120, 1536},
                               {12288, 1536}, {24576, 1536}, {1536, 6144},   {1536, 12288},
                               {1536, 2048},  {1536, 4096},  {262144, 1536}, {8192, 2816},
                               {4224, 2816},  {2816, 2112},  {2816, 4096},   {2816, 704},
                               {256, 1536},   {1536, 256},   {16, 32},       {200, 96}};
  for (const auto& shape : shapes) {
    for (int m = kMmaGemvMinRows; m <= kMmaGemvMaxRows; ++m) {
      for (ActType x_type : kActivationTypes) {
        const MmaGemvTiling t = default_mma_gemv_tiling(shape[0], shape[1], m, x_type);
        SCOPED_TRACE(std::to_string(shape[0]) + "x" + std::to_string(shape[1]) +
                     " M=" + std::to_string(m));
        EXPECT_GE(mma_gemv_warp_layout(t), 0);
        EXPECT_GE(t.splits, 1);
        EXPECT_LE(t.splits, std::min<int64_t>(kMmaGemvMaxSplits, shape[1] / 32));
        EXPECT_LE(mma_gemv_shared_bytes(t, m, shape[1] / 32), kMmaGemvMaxSharedBytes);
      }
    }
  }
}

// Launches `enqueue` plain, then records it in a CUDA graph with PDL and replays it three times,
// `poison` overwriting the outputs before each replay: every replay must give the plain launch's
// bits in `result`.
template <typename Enqueue, typename Poison>
void expect_replays_match_plain(cudaStream_t stream, Enqueue& enqueue, Poison poison,
                                const DeviceArray<float>& result) {
  CUDA_ASSERT_OK(enqueue(false));
  CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
  const std::vector<float> plain = result.download();
  const testing::RecordedGraph graph(stream, enqueue);
  CUDA_ASSERT_OK(graph.status());
  for (int replay = 0; replay < 3; ++replay) {
    poison();
    CUDA_ASSERT_OK(graph.launch(stream));
    CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(result.download(), plain) << "replay " << replay;
  }
}

// Two dependent GEMVs (the second reads the first's output: the first 1536 columns of each row),
// through gemv() and its default choice (tiling.warps 0) or gemv_mma with `tiling`, launched
// plain, then captured in a CUDA graph with PDL (as the engine's decode graphs launch them: a
// cluster launch inside a capture) and replayed: every replay gives the plain launch's bits.
void expect_pdl_chain_matches_plain(const MmaGemvTiling& tiling) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 2560, 1536, 17);
  const DeviceMatrix device(host);
  const int m = 40;
  DeviceArray<float> x(testing::random_floats(m * 1536, -1.0f, 1.0f, 18));
  DeviceArray<float> first(m * 2560), second(m * 2560);
  cudaStream_t stream;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto multiply = [&](const float* in, int64_t stride, float* out, const Launch& launch) {
    const GemvInput input = {in, ActType::kF32, m, stride, true};
    return tiling.warps == 0 ? gemv(device.view, input, {out, 2560}, launch)
                             : gemv_mma(device.view, input, {out, 2560}, launch, tiling);
  };
  auto enqueue = [&](bool pdl) {
    const Launch launch = {stream, pdl};
    const cudaError_t status = multiply(x.get(), 1536, first.get(), launch);
    if (status != cudaSuccess) return status;
    return multiply(first.get(), 2560, second.get(), launch);
  };
  expect_replays_match_plain(
      stream, enqueue,
      [&] {
        first.poison();
        second.poison();
      },
      second);
  CUDA_ASSERT_OK(cudaStreamDestroy(stream));
}

TEST(GemvMma, GraphReplayWithPdlMatchesPlainLaunch) {
  expect_pdl_chain_matches_plain({0, 0});
}

// The streamed kernel in a PDL chain: the second NVFP4 GEMV reads the bf16 companion the first
// writes (copied after its wait, the weights before it), plain and replayed in a graph with PDL,
// same bits; the 26B down shape at 8 and 32 rows through gemv(), which takes the streamed kernel
// there (gemv_mma.cpp's kStreamedTilings).
TEST(GemvMma, StreamedPdlChainMatchesPlainLaunch) {
  constexpr int64_t kRows = 2816, kCols = 2112;
  const HostMatrix host = random_matrix(WeightFormat::kNVFP4, kRows, kCols, 35);
  const DeviceMatrix device(host);
  for (const int m : {8, 32}) {
    SCOPED_TRACE("M=" + std::to_string(m));
    const std::vector<float> values = testing::random_floats(m * kCols, -1.0f, 1.0f, 36);
    std::vector<uint16_t> bits(values.size());
    std::transform(values.begin(), values.end(), bits.begin(), float_to_bf16);
    DeviceArray<uint16_t> x(bits), first_bf16(m * kRows);
    DeviceArray<float> first(m * kRows), second(m * kRows);
    cudaStream_t stream;
    CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto enqueue = [&](bool pdl) {
      const Launch launch = {stream, pdl};
      GemvOutput to_first = {first.get(), kRows};
      to_first.companions = {first_bf16.get(), nullptr, kRows};
      const cudaError_t status =
          gemv(device.view, {x.get(), ActType::kBF16, m, kCols}, to_first, launch);
      if (status != cudaSuccess) return status;
      return gemv(device.view, {first_bf16.get(), ActType::kBF16, m, kRows}, {second.get(), kRows},
                  launch);
    };
    expect_replays_match_plain(
        stream, enqueue,
        [&] {
          first.poison();
          first_bf16.poison();
          second.poison();
        },
        second);
    CUDA_ASSERT_OK(cudaStreamDestroy(stream));
  }
}

// Blocks along the activation rows (activation_blocks; the last block's rows partial where they
// do not divide), of one row tile each and looping over the tiles (2 blocks for 5 tiles, and the
// resident clusters shared by the activation blocks): every activation type and epilogue reads
// and writes the block's own rows.
TEST(GemvMma, ActivationRowBlocks) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 600, 1536, 29);
  const DeviceMatrix device(host);
  for (const int m : {9, 40, 64}) {
    for (const int blocks : {2, 3}) {
      for (const int row_blocks : {0, 2, kMmaGemvResidentRowBlocks}) {
        Case c;
        c.m = m;
        c.tiling = {8, 4, 1, row_blocks, 1};
        c.tiling.activation_blocks = blocks;
        for (const ActType x_type : kActivationTypes) {
          c.x_type = x_type;
          check(host, device, c);
        }
        c.x_type = ActType::kF32;
        for (const GemvEpilogue epilogue : {GemvEpilogue::kGeluMul, GemvEpilogue::kGeluPairs}) {
          c.epilogue = epilogue;
          check(host, device, c);
        }
      }
    }
  }
}

// Every PDL trigger point, with and without SM-exclusive blocks (shared memory padded to
// kMmaGemvExclusiveSharedBytes), for blocks of one row tile and looping ones: a dependent chain
// replays the bits of plain launches, and the values match the reference.
TEST(GemvMma, EveryTriggerPointAndExclusiveBlocks) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 600, 1536, 19);
  const DeviceMatrix device(host);
  for (const MmaGemvTrigger trigger :
       {MmaGemvTrigger::kAtStart, MmaGemvTrigger::kAfterStaging, MmaGemvTrigger::kAfterProducts}) {
    for (const bool exclusive : {false, true}) {
      for (const int row_blocks : {0, 2}) {
        MmaGemvTiling tiling = {8, 4, 1, row_blocks, 1};
        tiling.trigger = trigger;
        tiling.sm_exclusive = exclusive;
        SCOPED_TRACE(describe(host, {64, ActType::kF32, GemvEpilogue::kNone, tiling}));
        expect_pdl_chain_matches_plain(tiling);
        Case c;
        c.m = 64;
        c.tiling = tiling;
        check(host, device, c);
      }
    }
  }
}

// Resident looping blocks (313 row tiles: more than the clusters that fit) launched first inside
// a capture (the launch asks the occupancy calculator then, for a configuration no other test
// uses) replay the bits of a plain launch.
TEST(GemvMma, ResidentBlocksFirstLaunchedInACapture) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 40000, 1536, 23);
  const DeviceMatrix device(host);
  const int m = 20;
  DeviceArray<float> x(testing::random_floats(m * 1536, -1.0f, 1.0f, 24));
  DeviceArray<float> y(m * 40000);
  const MmaGemvTiling tiling = {4, 7, 1, kMmaGemvResidentRowBlocks};
  cudaStream_t stream;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto enqueue = [&](bool pdl) {
    return gemv_mma(device.view, {x.get(), ActType::kF32, m, 1536, true}, {y.get(), 40000},
                    {stream, pdl}, tiling);
  };
  const testing::RecordedGraph graph(stream, enqueue);
  CUDA_ASSERT_OK(graph.status());
  y.poison();
  CUDA_ASSERT_OK(graph.launch(stream));
  CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
  const std::vector<float> replayed = y.download();
  y.poison();
  CUDA_ASSERT_OK(enqueue(false));
  CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(y.download(), replayed);
  CUDA_ASSERT_OK(cudaStreamDestroy(stream));
  Case c;  // and the values
  c.m = m;
  c.tiling = tiling;
  check(host, device, c);
}

// gemv() keeps on the CUDA-core GEMV what the tensor-core kernel cannot stage.
TEST(GemvMma, TakesOnlyWhatFits) {
  quant::QMatrix w;
  w.format = WeightFormat::kW4G32;
  w.rows = 1536;
  w.cols = 12288;
  const GemvInput x = {nullptr, ActType::kF32, 64, 0, true};
  EXPECT_TRUE(gemv_mma_takes(w, x));
  w.cols = 32768;  // 128 groups per split at 64 rows: over the shared memory
  EXPECT_FALSE(gemv_mma_takes(w, x));
  EXPECT_TRUE(gemv_mma_takes(w, {nullptr, ActType::kF32, 8, 0, true}));
  // A single row runs on the tensor cores only when called directly (kernel_bench).
  EXPECT_FALSE(gemv_mma_takes(w, {nullptr, ActType::kF32, 1, 0, true}));
}

TEST(GemvMma, RefusesWhatItDoesNotTake) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 64, 64, 14);
  const DeviceMatrix device(host);
  DeviceArray<float> x(65 * 64), y(65 * 64);
  const GemvOutput output = {y.get(), 64};
  auto run = [&](int m, ActType type, bool rounded, MmaGemvTiling tiling, int64_t stride = 64) {
    return gemv_mma(device.view, {x.get(), type, m, stride, rounded}, output, Launch{}, tiling);
  };
  EXPECT_EQ(run(0, ActType::kF32, true, {}), cudaErrorInvalidValue);      // no rows
  EXPECT_EQ(run(65, ActType::kF32, true, {}), cudaErrorInvalidValue);     // more than 64
  EXPECT_EQ(run(8, ActType::kF32, false, {}), cudaErrorInvalidValue);     // exact fp32 products
  EXPECT_EQ(run(8, ActType::kQ8, false, {}, 80), cudaErrorInvalidValue);  // q8 stride not of 32s
  EXPECT_EQ(run(8, ActType::kF32, true, {6, 1}), cudaErrorInvalidValue);  // no such layout
  EXPECT_EQ(run(8, ActType::kF32, true, {8, 1, 2}), cudaErrorInvalidValue);
  EXPECT_EQ(run(8, ActType::kF32, true, {4, 1, 1, 0, 1}), cudaErrorInvalidValue);
  EXPECT_EQ(run(8, ActType::kF32, true, {8, 1, 1, 0, 1}), cudaSuccess);
  EXPECT_EQ(run(8, ActType::kF32, true, {4, 3}), cudaErrorInvalidValue);  // splits > K / 32
  EXPECT_EQ(run(8, ActType::kF32, true, {4, 2}), cudaSuccess);
  EXPECT_EQ(run(8, ActType::kF32, true, {4, 2, 1, -2}), cudaErrorInvalidValue);  // no such count
  for (const int activation_blocks : {0, 9}) {
    MmaGemvTiling tiling = {4, 2};
    tiling.activation_blocks = activation_blocks;
    EXPECT_EQ(run(8, ActType::kF32, true, tiling), cudaErrorInvalidValue);
  }
  const HostMatrix nvfp4 = random_matrix(WeightFormat::kNVFP4, 64, 64, 15);
  const DeviceMatrix nvfp4_device(nvfp4);
  EXPECT_EQ(gemv_mma(nvfp4_device.view, {x.get(), ActType::kQ8, 8, 64}, output, Launch{}),
            cudaErrorInvalidValue);               // q8 activations pair with w4g32 only
  quant::QMatrix odd_scales = nvfp4_device.view;  // a group's two e4m3 scales load as one u16
  odd_scales.scales = static_cast<const char*>(odd_scales.scales) + 1;
  EXPECT_EQ(gemv_mma(odd_scales, {x.get(), ActType::kF32, 8, 64, true}, output, Launch{}),
            cudaErrorInvalidValue);
  const HostMatrix bf16 = random_matrix(WeightFormat::kBF16, 64, 64, 16);
  const DeviceMatrix bf16_device(bf16);
  EXPECT_EQ(gemv_mma(bf16_device.view, {x.get(), ActType::kF32, 8, 64, true}, output, Launch{}),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace gemma4::cuda
