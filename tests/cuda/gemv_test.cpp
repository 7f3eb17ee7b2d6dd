// GEMV kernels against quant's CPU oracle (quant::dequantize_row: the formulas of
// weight-formats.md 2.3-2.4 and 3.1-3.3) on fresh random weights at real shapes.
#include "backend/cuda/gemv.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/numeric.h"
#include "cuda_test_util.h"
#include "packed_matrix.h"

namespace gemma4::cuda {
namespace {

using quant::QMatrix;
using quant::ScaleType;
using quant::WeightFormat;
using testing::DeviceArray;
using testing::DeviceMatrix;
using testing::HostMatrix;
using testing::random_matrix;

// Kernels multiply exactly and accumulate in fp32; the bound is relative to Σ|w·x| and far
// tighter than bf16 rounding (2^-8), which is what the engine's tolerance budget allows.
constexpr double kTolerance = 2e-4;

// Runs y = W x for M activation rows and checks every output against the reference.
// Uploads x (M rows of K fp32) as the activation type under test. Returns what the kernel
// multiplies: the bf16-rounded values, or for kQ8 the values the quantizer produced (checked
// here against its contract: scale = max|x| / 127 per 32, |x − q·scale| <= scale / 2).
std::vector<float> upload_activations(const std::vector<float>& x, int m, int64_t k, ActType type,
                                      DeviceArray<uint8_t>& device) {
  std::vector<float> effective = x;
  if (type == ActType::kF32) {
    cudaMemcpy(device.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice);
  } else if (type == ActType::kBF16) {
    std::vector<uint16_t> bits(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      bits[i] = float_to_bf16(x[i]);
      effective[i] = bf16_to_float(bits[i]);
    }
    cudaMemcpy(device.get(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice);
  } else {
    DeviceArray<float> x_f32(x);
    EXPECT_EQ(quantize_activations_q8(x_f32.get(), m, k, k, device.get(), k, Launch{}),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint8_t> q8 = device.download();
    for (int r = 0; r < m; ++r) {
      const uint8_t* row = q8.data() + r * q8_row_bytes(k);
      for (int64_t c = 0; c < k / 32; ++c) {
        float scale;
        int32_t sum;
        std::memcpy(&scale, row + k + 4 * c, 4);
        std::memcpy(&sum, row + k + k / 8 + 4 * c, 4);
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[r * k + c * 32 + i]));
        EXPECT_EQ(scale, amax / 127.0f);
        int32_t q_sum = 0;
        for (int i = 0; i < 32; ++i) {
          const int e = i % 8;
          const int8_t q = static_cast<int8_t>(row[c * 32 + (i / 8) * 8 + (e % 2 ? 4 : 0) + e / 2]);
          q_sum += q;
          const float value = x[r * k + c * 32 + i];
          effective[r * k + c * 32 + i] = static_cast<float>(q) * scale;
          EXPECT_LE(std::fabs(value - q * scale), scale * 0.5001f)
              << "row " << r << " element " << c * 32 + i;
        }
        EXPECT_EQ(sum, q_sum);
      }
    }
  }
  return effective;
}

const char* act_name(ActType type) {
  return type == ActType::kBF16 ? "bf16" : type == ActType::kQ8 ? "q8" : "f32";
}

// Runs y = W x for M activation rows and checks every output against the reference.
void check_gemv(const HostMatrix& host, const DeviceMatrix& device, int m, ActType x_type,
                int tiling, uint32_t seed) {
  SCOPED_TRACE(std::string(quant::weight_format_name(host.format)) + " " +
               std::to_string(host.rows) + "x" + std::to_string(host.cols) + " M=" +
               std::to_string(m) + " x=" + act_name(x_type) + " tiling=" + std::to_string(tiling));
  const int64_t n = host.rows;
  const int64_t k = host.cols;
  const std::vector<float> x_source = testing::random_floats(m * k, -1.0f, 1.0f, seed);
  DeviceArray<uint8_t> x_device(m * k * 4);
  DeviceArray<float> y(m * n);
  ASSERT_TRUE(x_device.ok() && y.ok() && device.data.ok());
  const std::vector<float> x = upload_activations(x_source, m, k, x_type, x_device);

  const GemvInput input = {x_device.get(), x_type, m, k};
  CUDA_ASSERT_OK(gemv(device.view, input, GemvOutput{y.get(), n}, Launch{}, tiling));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<float> got = y.download();

  std::vector<double> expected(m * n), magnitude(m * n);
  const QMatrix host_view = host.view();
  testing::parallel_for(n, [&](int64_t row) {
    std::vector<float> w(k);
    quant::dequantize_row(host_view, row, w.data());
    for (int mi = 0; mi < m; ++mi) {
      double sum = 0.0, abs_sum = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const double p = static_cast<double>(w[j]) * x[mi * k + j];
        sum += p;
        abs_sum += std::fabs(p);
      }
      expected[mi * n + row] = sum;
      magnitude[mi * n + row] = abs_sum;
    }
  });
  testing::expect_close(got, expected, magnitude, kTolerance, "gemv");
}

struct Shape {
  int64_t rows, cols;
};
// E2B: QKV, gate+up, down; 26B-A4B: one expert's gate+up and down.
constexpr Shape kShapes[] = {{2560, 1536}, {12288, 1536}, {1536, 6144}, {1408, 2816}, {2816, 704}};

TEST(Gemv, W4G32RealShapes) {
  uint32_t seed = 100;
  for (const Shape& s : kShapes) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, s.rows, s.cols, seed++);
    const DeviceMatrix device(host);
    for (int m : {1, 2, 8, 64}) {
      for (ActType x_type : {ActType::kBF16, ActType::kF32}) {
        check_gemv(host, device, m, x_type, -1, seed++);
      }
    }
  }
}

TEST(Gemv, W4G32LmHead) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 262144, 1536, 7);
  const DeviceMatrix device(host);
  check_gemv(host, device, 1, ActType::kBF16, -1, 8);
  check_gemv(host, device, 1, ActType::kF32, -1, 9);
  check_gemv(host, device, 2, ActType::kF32, -1, 10);
  check_gemv(host, device, 1, ActType::kQ8, -1, 11);
}

// int8 activations (dp4a): exact against the quantized values, every tiling, real shapes.
TEST(Gemv, W4G32Q8Activations) {
  uint32_t seed = 800;
  for (const Shape& s : kShapes) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, s.rows, s.cols, seed++);
    const DeviceMatrix device(host);
    for (int m : {1, 2, 8, 64}) check_gemv(host, device, m, ActType::kQ8, -1, seed++);
  }
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 2560, 1536, seed++);
  const DeviceMatrix device(host);
  const auto tilings = gemv_tilings();
  for (int t = 0; t < static_cast<int>(tilings.size()); ++t) {
    if (!gemv_tiling_compiled(t)) continue;
    check_gemv(host, device, tilings[t].m_tile == 1 ? 1 : 11, ActType::kQ8, t, seed++);
  }
  // No dp4a kernel for NVFP4 weights.
  const HostMatrix nv = random_matrix(WeightFormat::kNVFP4, 64, 64, 1);
  const DeviceMatrix nv_device(nv);
  DeviceArray<uint8_t> x(q8_row_bytes(64));
  DeviceArray<float> y(64);
  EXPECT_EQ(gemv(nv_device.view, GemvInput{x.get(), ActType::kQ8, 1, 64}, GemvOutput{y.get(), 64},
                 Launch{}),
            cudaErrorInvalidValue);
}

TEST(Gemv, W4G32ScaleTypes) {
  for (ScaleType type : {ScaleType::kF16, ScaleType::kF32}) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, 1408, 2816, 20, type);
    const DeviceMatrix device(host);
    check_gemv(host, device, 1, ActType::kF32, -1, 21);
    check_gemv(host, device, 8, ActType::kBF16, -1, 22);
  }
}

TEST(Gemv, NVFP4RealShapesBothConventions) {
  uint32_t seed = 300;
  bool divisor = true;
  for (const Shape& s : kShapes) {
    const HostMatrix host =
        random_matrix(WeightFormat::kNVFP4, s.rows, s.cols, seed++, ScaleType::kBF16, divisor);
    divisor = !divisor;
    const DeviceMatrix device(host);
    for (int m : {1, 2, 8, 64}) check_gemv(host, device, m, ActType::kF32, -1, seed++);
    check_gemv(host, device, 1, ActType::kBF16, -1, seed++);
  }
}

TEST(Gemv, BF16Weights) {
  uint32_t seed = 500;
  for (const Shape& s : {Shape{2560, 1536}, Shape{1536, 6144}, Shape{4096, 1536}}) {
    const HostMatrix host = random_matrix(WeightFormat::kBF16, s.rows, s.cols, seed++);
    const DeviceMatrix device(host);
    for (int m : {1, 8}) {
      check_gemv(host, device, m, ActType::kBF16, -1, seed++);
      check_gemv(host, device, m, ActType::kF32, -1, seed++);
    }
  }
}

// Every tiling this build compiled, including ragged coverage (K = 704: 22 chunks) and a ragged M
// tile.
TEST(Gemv, EveryTiling) {
  const auto tilings = gemv_tilings();
  for (const Shape& s : {Shape{2560, 1536}, Shape{2816, 704}}) {
    for (WeightFormat format : {WeightFormat::kW4G32, WeightFormat::kNVFP4, WeightFormat::kBF16}) {
      const HostMatrix host = random_matrix(format, s.rows, s.cols, 700);
      const DeviceMatrix device(host);
      for (int t = 0; t < static_cast<int>(tilings.size()); ++t) {
        if (!gemv_tiling_compiled(t)) continue;
        const int m = tilings[t].m_tile == 1 ? 1 : 11;
        check_gemv(host, device, m, t % 2 ? ActType::kF32 : ActType::kBF16, t, 701 + t);
      }
    }
  }
}

TEST(Gemv, RejectsUnsupportedShapes) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, 64, 64, 1);
  DeviceMatrix device(host);
  DeviceArray<float> x(64 * 65), y(64 * 65);
  const GemvOutput out{y.get(), 64};
  EXPECT_EQ(gemv(device.view, GemvInput{x.get(), ActType::kF32, 65, 64}, out, Launch{}),
            cudaErrorInvalidValue);
  QMatrix ragged = device.view;
  ragged.cols = 40;
  EXPECT_EQ(gemv(ragged, GemvInput{x.get(), ActType::kF32, 1, 40}, out, Launch{}),
            cudaErrorInvalidValue);
  QMatrix f32 = device.view;
  f32.format = WeightFormat::kF32;
  EXPECT_EQ(gemv(f32, GemvInput{x.get(), ActType::kF32, 1, 64}, out, Launch{}),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace gemma4::cuda
