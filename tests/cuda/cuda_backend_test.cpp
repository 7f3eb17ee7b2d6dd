// CudaBackend against the CPU reference backend, operation by operation on fresh random inputs
// (odd shapes, strided rows, aliasing where the interface allows it; outputs start as NaN so an
// element left unwritten fails), then the whole engine: CUDA logits against transformers' golden
// fixtures and against the CPU engine on a prefill longer than the sliding window followed by
// batched decode steps.
#include "backend/cuda/cuda_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "cuda_test_util.h"
#include "engine/gemma4_engine.h"
#include "golden_support.h"
#include "model/synth.h"
#include "model/weights.h"
#include "packed_matrix.h"
#include "quant/quantize.h"
#include "synth_support.h"

namespace gemma4::cuda {
namespace {

using backend::cpu::CpuBackend;
using engine::Rows;
using quant::ScaleType;
using quant::WeightFormat;
using testing::HostMatrix;
using testing::Mirrored;
using testing::random_matrix;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
// What padding between strided rows holds: an operation must leave it alone.
constexpr float kPadding = 7.25f;

// This file checks the fp32 kernels at fp32 tolerance, so every matmul multiplies the exact fp32
// activations (set_fp32_activations); prefill_test.cpp checks the bf16 tensor-core prefill paths,
// gemv_test.cpp the GEMVs' bf16-rounded activations.
std::unique_ptr<engine::Backend> make_gpu() {
  auto gpu = testing::make_gpu();
  if (gpu) static_cast<CudaBackend&>(*gpu).set_fp32_activations(true);
  return gpu;
}

// `count` rows of `width` floats, `stride` apart, on both sides.
class TwinRows {
 public:
  TwinRows(engine::Backend& gpu, int64_t count, int64_t width, int64_t stride,
           const std::vector<float>& values)
      : count_(count), width_(width), stride_(stride), twin_(gpu, values) {}
  Rows cpu() { return {twin_.cpu(), count_, width_, stride_}; }
  Rows gpu() const { return {twin_.gpu(), count_, width_, stride_}; }
  const std::vector<float>& cpu_values() const { return twin_.cpu_values(); }
  std::vector<float> gpu_values() const { return twin_.gpu_values(); }

 private:
  int64_t count_, width_, stride_;
  Mirrored<float> twin_;
};

TwinRows random_rows(engine::Backend& gpu, int64_t count, int64_t width, int64_t stride,
                     uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  auto values = testing::random_floats(count * stride, lo, hi, seed);
  for (int64_t i = 0; i < count * stride; ++i)
    if (i % stride >= width) values[i] = kPadding;
  return TwinRows(gpu, count, width, stride, values);
}

// An output: NaN where the operation writes, kPadding between rows.
TwinRows output_rows(engine::Backend& gpu, int64_t count, int64_t width, int64_t stride) {
  std::vector<float> values(count * stride);
  for (int64_t i = 0; i < count * stride; ++i) values[i] = i % stride < width ? kNaN : kPadding;
  return TwinRows(gpu, count, width, stride, values);
}

// Every element (padding included) finite and within tolerance · (1 + |reference|).
void expect_same(const TwinRows& rows, double tolerance, const char* what) {
  const std::vector<float> expected = rows.cpu_values();
  std::vector<double> reference(expected.begin(), expected.end()), magnitude(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) magnitude[i] = 1.0 + std::fabs(reference[i]);
  testing::expect_close(rows.gpu_values(), reference, magnitude, tolerance, what);
}

// A packed matrix on the host and in CUDA backend buffers.
struct TwinMatrix {
  TwinMatrix(engine::Backend& gpu, HostMatrix matrix)
      : host(std::move(matrix)),
        data(gpu, host.data),
        scales(gpu, host.scales.empty() ? std::vector<std::byte>(1) : host.scales) {
    cpu = host.view();
    device = cpu;
    device.data = data.gpu();
    device.scales = host.scales.empty() ? nullptr : scales.gpu();
  }
  HostMatrix host;
  Mirrored<std::byte> data, scales;
  quant::QMatrix cpu, device;
};

HostMatrix random_f32_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  HostMatrix m;
  m.format = WeightFormat::kF32;
  m.rows = rows;
  m.cols = cols;
  m.data = testing::as_bytes(testing::random_floats(rows * cols, -0.05f, 0.05f, seed));
  return m;
}

struct MatrixCase {
  const char* name;
  WeightFormat format;
  ScaleType scale_type;
  bool nv_divisor;
  int64_t rows, cols;
};

HostMatrix make_matrix(const MatrixCase& c, uint32_t seed) {
  return c.format == WeightFormat::kF32
             ? random_f32_matrix(c.rows, c.cols, seed)
             : random_matrix(c.format, c.rows, c.cols, seed, c.scale_type, c.nv_divisor);
}

const MatrixCase kTables[] = {
    {"f32", WeightFormat::kF32, ScaleType::kBF16, false, 37, 72},
    {"bf16", WeightFormat::kBF16, ScaleType::kBF16, false, 37, 64},
    {"w4g32_bf16", WeightFormat::kW4G32, ScaleType::kBF16, false, 37, 96},
    {"w4g32_f16", WeightFormat::kW4G32, ScaleType::kF16, false, 37, 64},
    {"w4g32_f32", WeightFormat::kW4G32, ScaleType::kF32, false, 37, 32},
    {"nvfp4_divisor", WeightFormat::kNVFP4, ScaleType::kBF16, true, 37, 48},
    {"nvfp4_multiplier", WeightFormat::kNVFP4, ScaleType::kBF16, false, 37, 64},
};

TEST(CudaBackend, EmbedEveryTableFormatExactly) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  uint32_t seed = 1;
  for (const MatrixCase& c : kTables) {
    TwinMatrix table(*gpu, make_matrix(c, seed++));
    const std::vector<int32_t> ids = {5, 0, 36, 17, 5};
    Mirrored id_twin(*gpu, ids);
    TwinRows out = output_rows(*gpu, std::ssize(ids), c.cols, c.cols + 3);
    cpu.embed(table.cpu, id_twin.cpu(), 1.75f, out.cpu());
    gpu->embed(table.device, id_twin.gpu(), 1.75f, out.gpu());
    expect_same(out, 0.0, c.name);  // the same fp32 products: bit-identical
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

struct MatmulCase {
  MatrixCase matrix;
  int64_t tokens, x_stride, y_stride;
};

// y = w x on both backends for random strided x; the CUDA result within fp32 accumulation in
// another order of the CPU one: relative to Σ|x·w| (far below bf16's 2^-8).
void expect_matmul_matches_cpu(CpuBackend& cpu, engine::Backend& gpu, TwinMatrix& w,
                               const MatmulCase& c, uint32_t seed) {
  TwinRows x = random_rows(gpu, c.tokens, c.matrix.cols, c.x_stride, seed);
  TwinRows y = output_rows(gpu, c.tokens, c.matrix.rows, c.y_stride);
  cpu.matmul(w.cpu, x.cpu(), y.cpu());
  gpu.matmul(w.device, x.gpu(), y.gpu());
  const std::vector<float> xs = x.cpu_values(), expected = y.cpu_values();
  std::vector<double> reference(expected.begin(), expected.end());
  std::vector<double> magnitude(expected.size(), 1.0);
  std::vector<float> row(c.matrix.cols);
  for (int64_t n = 0; n < c.matrix.rows; ++n) {
    quant::dequantize_row(w.cpu, n, row.data());
    for (int64_t t = 0; t < c.tokens; ++t) {
      double sum = 0.0;
      for (int64_t k = 0; k < c.matrix.cols; ++k)
        sum += std::fabs(double{row[k]} * xs[t * c.x_stride + k]);
      magnitude[t * c.y_stride + n] = sum + 1e-6;
    }
  }
  testing::expect_close(y.gpu_values(), reference, magnitude, 1e-4, c.matrix.name);
}

TEST(CudaBackend, MatmulEveryFormatShapeAndStride) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  const MatmulCase cases[] = {
      {{"bf16 decode", WeightFormat::kBF16, ScaleType::kBF16, false, 40, 64}, 1, 64, 40},
      {{"w4g32 strided", WeightFormat::kW4G32, ScaleType::kBF16, false, 72, 128}, 5, 132, 75},
      {{"w4g32 f16 two slices", WeightFormat::kW4G32, ScaleType::kF16, false, 64, 96}, 100, 96, 64},
      {{"w4g32 f32 64 rows", WeightFormat::kW4G32, ScaleType::kF32, false, 33, 32}, 64, 32, 33},
      {{"nvfp4 divisor", WeightFormat::kNVFP4, ScaleType::kBF16, true, 48, 64}, 3, 64, 48},
      {{"nvfp4 K % 32 != 0", WeightFormat::kNVFP4, ScaleType::kBF16, false, 48, 48}, 2, 48, 48},
      {{"f32 generic", WeightFormat::kF32, ScaleType::kBF16, false, 20, 50}, 7, 53, 21},
      {{"bf16 unaligned rows", WeightFormat::kBF16, ScaleType::kBF16, false, 16, 64}, 3, 67, 16},
      {{"w4g32 prefill 130", WeightFormat::kW4G32, ScaleType::kBF16, false, 96, 256}, 130, 256, 96},
      // bf16 weights on the tensor cores: read in place (K of 8s), else copied padded.
      {{"bf16 32 rows in place", WeightFormat::kBF16, ScaleType::kBF16, false, 200, 64},
       32,
       64,
       200},
      {{"bf16 20 rows padded K", WeightFormat::kBF16, ScaleType::kBF16, false, 40, 60}, 20, 61, 40},
  };
  uint32_t seed = 100;
  for (const MatmulCase& c : cases) {
    SCOPED_TRACE(c.matrix.name);
    TwinMatrix w(*gpu, make_matrix(c.matrix, seed++));
    expect_matmul_matches_cpu(cpu, *gpu, w, c, seed++);
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// The GGUF formats (quant/qmatrix.h): random matrices with the layouts the GGUF loader makes.
struct GgufMatrixCase {
  MatrixCase matrix;  // scale_type: the kW8 scale type
  int group_size;     // kW8: 16 or 32
};

TwinMatrix gguf_matrix(engine::Backend& gpu, const GgufMatrixCase& c, uint32_t seed) {
  return TwinMatrix(gpu, random_matrix(c.matrix.format, c.matrix.rows, c.matrix.cols, seed,
                                       c.matrix.scale_type, false, c.group_size));
}

// K % 32 == 0 takes the packed GEMV (aligned rows), the others the generic matmul; w8a always
// the generic matmul (no packed GEMV kernel yet), prefill the tensor-core path.
const GgufMatrixCase kGgufMatrices[] = {
    {{"w4g32a", WeightFormat::kW4G32A, ScaleType::kF32, false, 37, 96}, 32},
    {{"w8a (Q5_1, Q5_K)", WeightFormat::kW8A, ScaleType::kF32, false, 37, 96}, 32},
    {{"w8 g32 f16 (Q8_0)", WeightFormat::kW8, ScaleType::kF16, false, 37, 64}, 32},
    {{"w8 g16 f32 (Q6_K)", WeightFormat::kW8, ScaleType::kF32, false, 37, 48}, 16},
    {{"w8 g16 f32 K 64", WeightFormat::kW8, ScaleType::kF32, false, 38, 64}, 16},
    {{"f16 odd K", WeightFormat::kF16, ScaleType::kBF16, false, 37, 45}, 32},
    {{"f16", WeightFormat::kF16, ScaleType::kBF16, false, 37, 64}, 32},
};

TEST(CudaBackend, EmbedGgufFormatsExactly) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  uint32_t seed = 300;
  for (const GgufMatrixCase& c : kGgufMatrices) {
    TwinMatrix table = gguf_matrix(*gpu, c, seed++);
    const std::vector<int32_t> ids = {5, 0, 36, 17, 5};
    Mirrored id_twin(*gpu, ids);
    TwinRows out = output_rows(*gpu, std::ssize(ids), c.matrix.cols, c.matrix.cols + 3);
    cpu.embed(table.cpu, id_twin.cpu(), 1.75f, out.cpu());
    gpu->embed(table.device, id_twin.gpu(), 1.75f, out.gpu());
    expect_same(out, 0.0, c.matrix.name);  // the same fp32 roundings: bit-identical
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// Decode, strided (unaligned: the generic matmul) and prefill-sized inputs (GEMV slices of 64).
TEST(CudaBackend, MatmulGgufFormats) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  uint32_t seed = 400;
  for (const GgufMatrixCase& c : kGgufMatrices) {
    TwinMatrix w = gguf_matrix(*gpu, c, seed++);
    const int64_t cols = c.matrix.cols, rows = c.matrix.rows;
    for (const MatmulCase& m :
         {MatmulCase{c.matrix, 1, cols, rows}, MatmulCase{c.matrix, 5, cols + 3, rows + 2},
          MatmulCase{c.matrix, 70, cols, rows}}) {
      SCOPED_TRACE(::testing::Message() << c.matrix.name << ", " << m.tokens << " tokens");
      expect_matmul_matches_cpu(cpu, *gpu, w, m, seed++);
    }
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// Σ|w[n][k] · x[t][k]| for every (t, n): the scale of a product's fp32 accumulation error.
std::vector<double> product_magnitudes(const quant::QMatrix& w, const std::vector<float>& x,
                                       int64_t tokens, int64_t x_stride) {
  std::vector<double> magnitude(tokens * w.rows);
  std::vector<float> row(w.cols);
  for (int64_t n = 0; n < w.rows; ++n) {
    quant::dequantize_row(w, n, row.data());
    for (int64_t t = 0; t < tokens; ++t) {
      double sum = 0.0;
      for (int64_t k = 0; k < w.cols; ++k) sum += std::fabs(double{row[k]} * x[t * x_stride + k]);
      magnitude[t * w.rows + n] = sum;
    }
  }
  return magnitude;
}

// matmul_gelu_mul and matmul_gelu_pairs against the CPU backend: the GEMV epilogues (every
// packed format, decode and 70-row prefill) and the generic fallbacks (fp32, unaligned rows).
// The bound carries the products' accumulation error (1e-4 of Σ|w·x|) through GELU, whose
// slope stays below 1.2.
TEST(CudaBackend, MatmulGeluMulAndPairsEveryFormat) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  EXPECT_TRUE(gpu->fuses_gate_up());
  CpuBackend cpu(2);
  constexpr double kTolerance = 1e-4, kGeluSlope = 1.2;
  const GgufMatrixCase cases[] = {
      {{"bf16", WeightFormat::kBF16, ScaleType::kBF16, false, 64, 64}, 32},
      {{"w4g32", WeightFormat::kW4G32, ScaleType::kBF16, false, 72, 128}, 32},
      {{"nvfp4", WeightFormat::kNVFP4, ScaleType::kBF16, true, 48, 64}, 32},
      {{"w4g32a", WeightFormat::kW4G32A, ScaleType::kF32, false, 38, 96}, 32},
      {{"w8a (generic)", WeightFormat::kW8A, ScaleType::kF32, false, 38, 64}, 32},
      {{"w8 g16 f32", WeightFormat::kW8, ScaleType::kF32, false, 38, 64}, 16},
      {{"w8 g32 f16", WeightFormat::kW8, ScaleType::kF16, false, 40, 64}, 32},
      {{"f16", WeightFormat::kF16, ScaleType::kBF16, false, 36, 64}, 32},
      {{"f32 (generic)", WeightFormat::kF32, ScaleType::kBF16, false, 20, 50}, 32},
  };
  uint32_t seed = 900;
  for (const GgufMatrixCase& c : cases) {
    TwinMatrix w(*gpu, c.matrix.format == WeightFormat::kF32
                           ? random_f32_matrix(c.matrix.rows, c.matrix.cols, seed++)
                           : random_matrix(c.matrix.format, c.matrix.rows, c.matrix.cols, seed++,
                                           c.matrix.scale_type, c.matrix.nv_divisor, c.group_size));
    const int64_t n = c.matrix.rows, k = c.matrix.cols;
    for (const auto& [tokens, x_stride] :
         {std::pair<int64_t, int64_t>{1, k}, {5, k + 3}, {70, k}}) {
      SCOPED_TRACE(::testing::Message()
                   << c.matrix.name << ", " << tokens << " tokens, x stride " << x_stride);
      TwinRows x = random_rows(*gpu, tokens, k, x_stride, seed++);
      const std::vector<float> xs = x.cpu_values();
      const std::vector<double> products = product_magnitudes(w.cpu, xs, tokens, x_stride);

      TwinRows multiplier = random_rows(*gpu, tokens, n, n + 1, seed++, -2.0f, 2.0f);
      TwinRows gated = output_rows(*gpu, tokens, n, n + 2);
      cpu.matmul_gelu_mul(w.cpu, x.cpu(), multiplier.cpu(), gated.cpu());
      gpu->matmul_gelu_mul(w.device, x.gpu(), multiplier.gpu(), gated.gpu());
      const std::vector<float> multipliers = multiplier.cpu_values(),
                               gated_cpu = gated.cpu_values();
      std::vector<double> reference(gated_cpu.begin(), gated_cpu.end());
      std::vector<double> magnitude(reference.size(), 1e-6);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t i = 0; i < n; ++i) {
          magnitude[t * (n + 2) + i] +=
              kGeluSlope * products[t * n + i] * std::fabs(multipliers[t * (n + 1) + i]);
        }
      }
      testing::expect_close(gated.gpu_values(), reference, magnitude, kTolerance,
                            "matmul_gelu_mul");

      // The pairs' gate and up products themselves, for the bound (|gelu(u)| <= |u|).
      TwinRows plain = output_rows(*gpu, tokens, n, n);
      cpu.matmul(w.cpu, x.cpu(), plain.cpu());
      const std::vector<float> acc = plain.cpu_values();
      TwinRows paired = output_rows(*gpu, tokens, n / 2, n / 2 + 1);
      cpu.matmul_gelu_pairs(w.cpu, x.cpu(), paired.cpu());
      gpu->matmul_gelu_pairs(w.device, x.gpu(), paired.gpu());
      const std::vector<float> paired_cpu = paired.cpu_values();
      reference.assign(paired_cpu.begin(), paired_cpu.end());
      magnitude.assign(reference.size(), 1e-6);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t i = 0; i < n / 2; ++i) {
          const int64_t gate = t * n + 2 * i, up = gate + 1;
          magnitude[t * (n / 2 + 1) + i] += kGeluSlope * products[gate] * std::fabs(acc[up]) +
                                            std::fabs(acc[gate]) * products[up];
        }
      }
      testing::expect_close(paired.gpu_values(), reference, magnitude, kTolerance,
                            "matmul_gelu_pairs");
    }
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// The --fp32 mode's w4g32 matmuls at E2B's shapes (QKV, o_proj, down; gate+up with its GELU
// pairs) for a decode row, batched decode rows, a full GEMV slice and a prefill chunk of several
// slices, against the products in double (quant::dequantize_row's weights, weight-formats.md 2.3):
// within fp32 accumulation error, 4 ulp of Σ|w·x| (the CPU reference's own order differs from
// exact by about that much), plus 4 ulp of each GELU pair for its evaluation. Normed hidden states
// have a nonzero mean: the activations here too (what the biased nibble products of the bf16
// paths, device_math.cuh NibbleDot, get wrong).
TEST(CudaBackend, Fp32ModeW4G32MatmulsAtFp32Accuracy) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  constexpr double kFp32Tolerance = 4.0 / (1 << 24), kGeluSlope = 1.2;
  struct Fp32Case {
    MatrixCase matrix;
    bool gelu_pairs;
  };
  const Fp32Case cases[] = {
      {{"qkv", WeightFormat::kW4G32, ScaleType::kBF16, false, 2560, 1536}, false},
      {{"o_proj", WeightFormat::kW4G32, ScaleType::kBF16, false, 1536, 2048}, false},
      {{"down", WeightFormat::kW4G32, ScaleType::kBF16, false, 1536, 6144}, false},
      {{"gate+up", WeightFormat::kW4G32, ScaleType::kBF16, false, 12288, 1536}, true},
  };
  uint32_t seed = 1300;
  for (const Fp32Case& c : cases) {
    TwinMatrix w(*gpu, make_matrix(c.matrix, seed++));
    const int64_t n = c.matrix.rows, k = c.matrix.cols;
    for (int64_t tokens : {1, 5, 64, 130}) {
      SCOPED_TRACE(::testing::Message() << c.matrix.name << ", " << tokens << " tokens");
      TwinRows x = random_rows(*gpu, tokens, k, k, seed++, -0.5f, 1.5f);
      const std::vector<float> xs = x.cpu_values();
      // The products in double and Σ|w·x|, [tokens][n].
      std::vector<double> exact(tokens * n), magnitude(tokens * n);
      testing::parallel_for(n, [&](int64_t row) {
        std::vector<float> weights(k);
        quant::dequantize_row(w.cpu, row, weights.data());
        for (int64_t t = 0; t < tokens; ++t) {
          double sum = 0.0, abs_sum = 0.0;
          for (int64_t i = 0; i < k; ++i) {
            const double product = double{weights[i]} * xs[t * k + i];
            sum += product;
            abs_sum += std::fabs(product);
          }
          exact[t * n + row] = sum;
          magnitude[t * n + row] = abs_sum;
        }
      });
      if (c.gelu_pairs) {
        TwinRows y = output_rows(*gpu, tokens, n / 2, n / 2);
        gpu->matmul_gelu_pairs(w.device, x.gpu(), y.gpu());
        std::vector<double> expected(tokens * n / 2), bound(tokens * n / 2);
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t i = 0; i < n / 2; ++i) {
            const int64_t gate = t * n + 2 * i, up = gate + 1;
            const double u = exact[gate];
            const double gelu =
                0.5 * u * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u)));
            expected[t * n / 2 + i] = gelu * exact[up];
            bound[t * n / 2 + i] = kGeluSlope * magnitude[gate] * std::fabs(exact[up]) +
                                   std::fabs(gelu) * magnitude[up] + std::fabs(gelu * exact[up]);
          }
        }
        testing::expect_close(y.gpu_values(), expected, bound, kFp32Tolerance, "matmul_gelu_pairs");
      } else {
        TwinRows y = output_rows(*gpu, tokens, n, n);
        gpu->matmul(w.device, x.gpu(), y.gpu());
        testing::expect_close(y.gpu_values(), exact, magnitude, kFp32Tolerance, "matmul");
      }
    }
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

TEST(CudaBackend, RmsNormWeightedPlainAliasedAndPerHead) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  Mirrored weight(*gpu, testing::random_floats(100, -0.5f, 1.5f, 1));
  for (float offset : {0.0f, 1.0f}) {
    TwinRows x = random_rows(*gpu, 3, 100, 104, 2, -3.0f, 3.0f);
    TwinRows y = output_rows(*gpu, 3, 100, 101);
    cpu.rms_norm(x.cpu(), weight.cpu(), offset, 1e-6f, y.cpu());
    gpu->rms_norm(x.gpu(), weight.gpu(), offset, 1e-6f, y.gpu());
    expect_same(y, 1e-5, "rms_norm weighted");
  }
  TwinRows y = output_rows(*gpu, 3, 100, 100);
  TwinRows x = random_rows(*gpu, 3, 100, 100, 3);
  cpu.rms_norm(x.cpu(), nullptr, 0.0f, 1e-6f, y.cpu());
  gpu->rms_norm(x.gpu(), nullptr, 0.0f, 1e-6f, y.gpu());
  expect_same(y, 1e-5, "rms_norm without weight");
  // In place, per head of 32 (a [2, 4·32] matrix as 8 rows).
  TwinRows heads = random_rows(*gpu, 2, 128, 128, 4);
  cpu.rms_norm(heads.cpu().heads(32), weight.cpu(), 0.0f, 1e-6f, heads.cpu().heads(32));
  gpu->rms_norm(heads.gpu().heads(32), weight.gpu(), 0.0f, 1e-6f, heads.gpu().heads(32));
  expect_same(heads, 1e-5, "rms_norm per head, in place");
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

TEST(CudaBackend, RopeDefaultAndProportionalAtLargePositions) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  Mirrored positions(*gpu, std::vector<int32_t>{0, 1, 777, 40000});
  const model::RopeParams kinds[] = {{10000.0, 16, 32}, {1000000.0, 4, 64}};
  uint32_t seed = 10;
  for (const model::RopeParams& rope : kinds) {
    TwinRows x = random_rows(*gpu, 4, 3 * 32, 100, seed++);
    cpu.rope(x.cpu(), 32, positions.cpu(), rope);
    gpu->rope(x.gpu(), 32, positions.gpu(), rope);
    // Same fp32 angles (shared inv_freq); sin/cos within a few ulp.
    expect_same(x, 1e-5, "rope");
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

TEST(CudaBackend, GeluAddScaleSoftcapCopy) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  {
    TwinRows gate = random_rows(*gpu, 5, 300, 301, 1, -4.0f, 4.0f);
    TwinRows multiplier = random_rows(*gpu, 5, 300, 304, 2);
    TwinRows out = output_rows(*gpu, 5, 300, 300);
    cpu.gelu_tanh_mul(gate.cpu(), multiplier.cpu(), out.cpu());
    gpu->gelu_tanh_mul(gate.gpu(), multiplier.gpu(), out.gpu());
    expect_same(out, 1e-6, "gelu_tanh_mul");
    cpu.gelu_tanh_mul(gate.cpu(), multiplier.cpu(), gate.cpu());  // out aliases gate
    gpu->gelu_tanh_mul(gate.gpu(), multiplier.gpu(), gate.gpu());
    expect_same(gate, 1e-6, "gelu_tanh_mul into gate");
    cpu.gelu_tanh_mul(out.cpu(), multiplier.cpu(), multiplier.cpu());  // out aliases multiplier
    gpu->gelu_tanh_mul(out.gpu(), multiplier.gpu(), multiplier.gpu());
    expect_same(multiplier, 1e-6, "gelu_tanh_mul into multiplier");
  }
  TwinRows acc = random_rows(*gpu, 3, 70, 75, 3);
  TwinRows x = random_rows(*gpu, 3, 70, 71, 4);
  cpu.add(acc.cpu(), x.cpu());
  gpu->add(acc.gpu(), x.gpu());
  expect_same(acc, 0.0, "add");
  Mirrored column_scale(*gpu, testing::random_floats(70, -2.0f, 2.0f, 5));
  cpu.scale(acc.cpu(), column_scale.cpu(), 0.125f);
  gpu->scale(acc.gpu(), column_scale.gpu(), 0.125f);
  expect_same(acc, 0.0, "scale by column and scalar");
  cpu.scale(acc.cpu(), nullptr, 3.0f);
  gpu->scale(acc.gpu(), nullptr, 3.0f);
  expect_same(acc, 0.0, "scale by scalar");
  TwinRows logits = random_rows(*gpu, 2, 1000, 1003, 6, -80.0f, 80.0f);
  cpu.softcap(logits.cpu(), 30.0f);
  gpu->softcap(logits.gpu(), 30.0f);
  expect_same(logits, 1e-6, "softcap");
  TwinRows copied = output_rows(*gpu, 3, 70, 72);
  cpu.copy(x.cpu(), copied.cpu());
  gpu->copy(x.gpu(), copied.gpu());
  expect_same(copied, 0.0, "copy");
  // Rows of whole aligned float4s take the 4-floats-a-thread kernels.
  TwinRows wide_acc = random_rows(*gpu, 3, 64, 68, 7);
  TwinRows wide_x = random_rows(*gpu, 3, 64, 72, 8);
  cpu.add(wide_acc.cpu(), wide_x.cpu());
  gpu->add(wide_acc.gpu(), wide_x.gpu());
  expect_same(wide_acc, 0.0, "add, float4 rows");
  Mirrored wide_scale(*gpu, testing::random_floats(64, -2.0f, 2.0f, 9));
  cpu.scale(wide_acc.cpu(), wide_scale.cpu(), 0.125f);
  gpu->scale(wide_acc.gpu(), wide_scale.gpu(), 0.125f);
  expect_same(wide_acc, 0.0, "scale by column and scalar, float4 rows");
  cpu.scale(wide_acc.cpu(), nullptr, 3.0f);
  gpu->scale(wide_acc.gpu(), nullptr, 3.0f);
  expect_same(wide_acc, 0.0, "scale by scalar, float4 rows");
  TwinRows wide_logits = random_rows(*gpu, 2, 1024, 1028, 10, -80.0f, 80.0f);
  cpu.softcap(wide_logits.cpu(), 30.0f);
  gpu->softcap(wide_logits.gpu(), 30.0f);
  expect_same(wide_logits, 1e-6, "softcap, float4 rows");
  TwinRows wide_copied = output_rows(*gpu, 3, 64, 76);
  cpu.copy(wide_x.cpu(), wide_copied.cpu());
  gpu->copy(wide_x.gpu(), wide_copied.gpu());
  expect_same(wide_copied, 0.0, "copy, float4 rows");
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// One layer's KV of one sequence on both sides.
struct TwinKv {
  TwinKv(engine::Backend& gpu, int64_t slots, int kv_heads, int head_dim)
      : keys(gpu, std::vector<float>(slots * kv_heads * head_dim)),
        values(gpu, std::vector<float>(slots * kv_heads * head_dim)),
        positions(gpu, std::vector<int32_t>(slots)),
        slots(slots),
        kv_heads(kv_heads),
        head_dim(head_dim) {}
  engine::KvView cpu() {
    return {keys.cpu(), values.cpu(), positions.cpu(), slots, kv_heads, head_dim};
  }
  engine::KvView gpu() const {
    return {keys.gpu(), values.gpu(), positions.gpu(), slots, kv_heads, head_dim};
  }
  Mirrored<float> keys, values;
  Mirrored<int32_t> positions;
  int64_t slots;
  int kv_heads, head_dim;
};

struct AttentionCase {
  const char* name;
  int head_dim, q_heads, kv_heads;
  int64_t slots;
  int window;
  int64_t length;  // positions 0..length-1 are written
  int64_t chunk;   // queries at the last `chunk` positions
};

void PrintTo(const AttentionCase& c, std::ostream* os) {
  *os << c.name;
}

class CudaAttention : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(CudaAttention, KvStoreForgetAndAttentionMatchTheReference) {
  const AttentionCase& c = GetParam();
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  TwinKv kv(*gpu, c.slots, c.kv_heads, c.head_dim);
  cpu.forget_kv(kv.cpu(), 0);
  gpu->forget_kv(kv.gpu(), 0);
  const int64_t kv_width = int64_t{c.kv_heads} * c.head_dim;
  // Written in passes of at most `slots` tokens (as the engine does), the ring wrapping.
  const int64_t pass = std::min<int64_t>(c.slots, 13);
  uint32_t seed = 1;
  for (int64_t first = 0; first < c.length; first += pass) {
    const int64_t n = std::min(pass, c.length - first);
    TwinRows k = random_rows(*gpu, n, kv_width, kv_width + 4, seed++);
    TwinRows v = random_rows(*gpu, n, kv_width, kv_width, seed++);
    std::vector<int32_t> written(n);
    std::iota(written.begin(), written.end(), static_cast<int32_t>(first));
    Mirrored positions(*gpu, written);
    cpu.write_kv(kv.cpu(), k.cpu(), v.cpu(), positions.cpu());
    gpu->write_kv(kv.gpu(), k.gpu(), v.gpu(), positions.gpu());
  }
  EXPECT_EQ(kv.keys.gpu_values(), kv.keys.cpu_values());
  EXPECT_EQ(kv.values.gpu_values(), kv.values.cpu_values());
  EXPECT_EQ(kv.positions.gpu_values(), kv.positions.cpu_values());

  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  auto attend = [&](int64_t first_position, int64_t count, const char* what) {
    const int64_t q_width = int64_t{c.q_heads} * c.head_dim;
    TwinRows q = random_rows(*gpu, count, q_width, q_width, seed++, -2.0f, 2.0f);
    TwinRows out = output_rows(*gpu, count, q_width, q_width + 8);
    std::vector<int32_t> query_positions(count);
    std::iota(query_positions.begin(), query_positions.end(), static_cast<int32_t>(first_position));
    Mirrored positions(*gpu, query_positions);
    cpu.attention(q.cpu(), positions.cpu(), kv.cpu(), c.window, scale, out.cpu());
    gpu->attention(q.gpu(), positions.gpu(), kv.gpu(), c.window, scale, out.gpu());
    expect_same(out, 2e-5, what);
  };
  attend(c.length - c.chunk, c.chunk, "attention chunk");
  attend(c.length - 1, 1, "attention decode");
  // Roll back three tokens: their slots empty; the next query sees the earlier ones only.
  cpu.forget_kv(kv.cpu(), c.length - 3);
  gpu->forget_kv(kv.gpu(), c.length - 3);
  EXPECT_EQ(kv.positions.gpu_values(), kv.positions.cpu_values());
  attend(c.length - 3, 1, "attention after forget_kv");
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttention,
                         ::testing::Values(
                             // name, head_dim, q heads, kv heads, slots, window, length, chunk
                             AttentionCase{"hd32_sliding_ring", 32, 4, 2, 12, 8, 40, 5},
                             AttentionCase{"hd64_full", 64, 4, 2, 128, 0, 70, 9},
                             AttentionCase{"hd256_full_splits", 256, 8, 1, 700, 0, 600, 7},
                             AttentionCase{"hd256_sliding_ring", 256, 8, 2, 20, 16, 45, 4},
                             AttentionCase{"hd512_full_gqa4", 512, 8, 2, 64, 0, 50, 3}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(CudaBackend, RouterMatchesTheReferenceIncludingTies) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  struct Case {
    int64_t tokens, experts;
    int top_k;
  };
  for (const Case& c : {Case{5, 8, 2}, Case{3, 128, 8}}) {
    auto logits = testing::random_floats(c.tokens * c.experts, -3.0f, 3.0f, 1);
    std::fill(logits.begin(), logits.begin() + c.experts, 0.5f);  // every expert tied
    logits[c.experts + 3] = logits[c.experts + 6] = 10.0f;        // two tied maxima
    TwinRows rows(*gpu, c.tokens, c.experts, c.experts, logits);
    Mirrored expert_scale(*gpu, testing::random_floats(c.experts, 0.5f, 2.0f, 2));
    Mirrored ids(*gpu, std::vector<int32_t>(c.tokens * c.top_k, -1));
    TwinRows weights = output_rows(*gpu, c.tokens, c.top_k, c.top_k);
    const engine::RouterParams cpu_router = {c.top_k, expert_scale.cpu()};
    const engine::RouterParams gpu_router = {c.top_k, expert_scale.gpu()};
    cpu.route_experts(rows.cpu(), cpu_router, ids.cpu(), weights.cpu().data);
    gpu->route_experts(rows.gpu(), gpu_router, ids.gpu(), weights.gpu().data);
    EXPECT_EQ(ids.gpu_values(), ids.cpu_values());
    expect_same(weights, 1e-6, "router weights");
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

TEST(CudaBackend, ExpertsMatchTheReference) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  constexpr int kExperts = 8, kTopK = 2;
  constexpr int64_t kHidden = 64, kInner = 32;
  for (WeightFormat format : {WeightFormat::kBF16, WeightFormat::kW4G32}) {
    std::vector<TwinMatrix> matrices;
    matrices.reserve(3 * kExperts);
    std::vector<model::ExpertMatrices> cpu_experts, gpu_experts;
    for (int e = 0; e < kExperts; ++e) {
      for (auto [rows, cols] :
           {std::pair{kInner, kHidden}, std::pair{kInner, kHidden}, std::pair{kHidden, kInner}}) {
        matrices.emplace_back(*gpu, random_matrix(format, rows, cols, 50 + matrices.size()));
      }
      const auto& m = matrices;
      const size_t i = m.size() - 3;
      cpu_experts.push_back({m[i].cpu, m[i + 1].cpu, m[i + 2].cpu});
      gpu_experts.push_back({m[i].device, m[i + 1].device, m[i + 2].device});
    }
    for (int64_t tokens : {1, 6, 70}) {
      SCOPED_TRACE(tokens);
      // Two distinct experts per token, some never chosen.
      std::vector<int32_t> ids(tokens * kTopK);
      for (int64_t t = 0; t < tokens; ++t) {
        ids[t * kTopK] = static_cast<int32_t>((t * 5) % 6);
        ids[t * kTopK + 1] = static_cast<int32_t>((t * 5 + 1 + t % 3) % 6);
      }
      Mirrored id_twin(*gpu, ids);
      Mirrored weights(*gpu, testing::random_floats(tokens * kTopK, 0.1f, 1.0f, 7));
      TwinRows x = random_rows(*gpu, tokens, kHidden, kHidden + 4, 8);
      TwinRows out = output_rows(*gpu, tokens, kHidden, kHidden + 1);
      cpu.run_experts(cpu_experts, x.cpu(), id_twin.cpu(), weights.cpu(), kTopK, out.cpu());
      gpu->run_experts(gpu_experts, x.gpu(), id_twin.gpu(), weights.gpu(), kTopK, out.gpu());
      expect_same(out, 1e-4, "run_experts");
    }
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// ---- The whole engine ----

// The test binary is built here and run on the GPU machine from a copy of the repository root:
// the compile-time source path may not exist there.
std::filesystem::path source_dir() {
  const std::filesystem::path built_in = GEMMA4_SOURCE_DIR;
  return std::filesystem::exists(built_in / "tests/data/golden") ? built_in
                                                                 : std::filesystem::current_path();
}

// A fresh folder for one synthesized checkpoint (the build tree may not exist either).
std::filesystem::path scratch_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / "gemma4-cuda-test" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Removes a synthesized checkpoint (about 120 MB: the real vocabulary) when the test ends.
using gemma4::testing::RemoveOnExit;

model::LoadedModel synthesize(const std::string& config, uint64_t seed, model::SynthFormat format,
                              model::SynthGrid grid, const std::filesystem::path& output) {
  model::SynthOptions synth;
  synth.config = config;
  synth.seed = seed;
  synth.format = format;
  synth.grid = grid;
  synth.output = output;
  auto loaded = gemma4::testing::synthesize_and_open(synth);
  EXPECT_TRUE(loaded.ok()) << loaded.error().to_string();
  if (!loaded.ok()) return {};
  return std::move(*loaded);
}

std::unique_ptr<engine::Gemma4Engine> cuda_engine(const model::LoadedModel& m,
                                                  const engine::EngineOptions& options) {
  auto backend = make_gpu();
  if (backend == nullptr) return nullptr;
  auto engine = engine::Gemma4Engine::create(m.config, m.weights, std::move(backend), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  return engine.ok() ? std::move(*engine) : nullptr;
}

using gemma4::testing::argmax;

struct GoldenCase {
  std::string fixture;  // tests/data/golden/<fixture>.json (config, seed, grid)
  model::SynthFormat format;
};

void PrintTo(const GoldenCase& c, std::ostream* os) {
  *os << c.fixture;
}

class CudaGolden : public ::testing::TestWithParam<GoldenCase> {};

// As tests/model/golden_test.cpp does for the CPU engine, with the same tolerance: both engines
// compute in fp32, so the CUDA one must stay as close to transformers' fp32 logits.
TEST_P(CudaGolden, MatchesTransformers) {
  constexpr double kTolerance = 1e-3;
  const GoldenCase& c = GetParam();
  const auto fixture = gemma4::testing::load_golden_fixture(source_dir(), c.fixture);
  ASSERT_TRUE(fixture.is_object());
  const auto grid = model::parse_synth_grid(fixture.value("grid", "none"));
  ASSERT_TRUE(grid.ok());
  const auto dir = scratch_dir("cuda_golden_" + c.fixture);
  const RemoveOnExit cleanup{dir};
  const model::LoadedModel m = synthesize(fixture["config"].get<std::string>(),
                                          fixture["seed"].get<uint64_t>(), c.format, *grid, dir);
  engine::EngineOptions options;
  options.max_sequences = 2;
  options.max_context = 256;
  options.ring_history = 4;
  auto engine = cuda_engine(m, options);
  ASSERT_TRUE(engine);
  gemma4::testing::expect_matches_golden(*engine, fixture, kTolerance, "cuda " + c.fixture);
}

INSTANTIATE_TEST_SUITE_P(Tiny, CudaGolden,
                         ::testing::Values(GoldenCase{"tiny", model::SynthFormat::kBF16},
                                           GoldenCase{"tiny_moe", model::SynthFormat::kBF16},
                                           GoldenCase{"tiny_w4g32", model::SynthFormat::kW4A16},
                                           GoldenCase{"tiny_nvfp4", model::SynthFormat::kNVFP4},
                                           GoldenCase{"tiny_moe_w4g32", model::SynthFormat::kW4A16},
                                           GoldenCase{"tiny_dense_w4g32",
                                                      model::SynthFormat::kW4A16}),
                         [](const auto& info) { return info.param.fixture; });

using gemma4::testing::prompt_ids;

// Re-encodes a model's matrices in the formats a GGUF file loads as (the values rounded to what
// the new format holds: the CPU and CUDA engines then run the same weights). Owns the bytes.
class GgufRequantizer {
 public:
  // kW8 as Q8_0 (group 32, fp16 scales) or Q6_K (group 16, fp32 scales) load.
  quant::QMatrix w8(const quant::QMatrix& m, int group_size, ScaleType scale_type) {
    const std::vector<float> values = quant::dequantize(m);
    std::vector<int8_t> q(values.size());
    std::vector<float> scales(values.size() / group_size);
    for (size_t g = 0; g < scales.size(); ++g) {
      const auto first = values.begin() + g * group_size;
      float max_abs = 0.0f;
      for (auto v = first; v != first + group_size; ++v) max_abs = std::max(max_abs, std::fabs(*v));
      float scale = max_abs / 127.0f;
      if (scale_type == ScaleType::kF16) scale = fp16_to_float(float_to_fp16(scale));
      scales[g] = scale;
      for (int j = 0; j < group_size; ++j) {
        const long level = scale == 0.0f ? 0 : std::lround(first[j] / scale);
        q[g * group_size + j] = static_cast<int8_t>(std::clamp(level, -127L, 127L));
      }
    }
    quant::QMatrix out = m;
    out.format = WeightFormat::kW8;
    out.group_size = group_size;
    out.scale_type = scale_type;
    out.data = keep(testing::as_bytes(q));
    out.scales = keep(testing::f16_or_f32_bytes(scales, scale_type));
    return out;
  }

  // kW4G32A as Q4_K loads: w = scale * u - min per group of 32.
  quant::QMatrix w4g32a(const quant::QMatrix& m) {
    const std::vector<float> values = quant::dequantize(m);
    std::vector<uint8_t> packed(values.size() / 2, 0);
    std::vector<float> pairs;  // {scale, min}
    for (size_t first = 0; first < values.size(); first += 32) {
      const auto [lo, hi] =
          std::minmax_element(values.begin() + first, values.begin() + first + 32);
      const float scale = (*hi - *lo) / 15.0f;
      pairs.insert(pairs.end(), {scale, -*lo});
      for (size_t j = first; j < first + 32; ++j) {
        const long level = scale == 0.0f ? 0 : std::lround((values[j] - *lo) / scale);
        packed[j / 2] |= static_cast<uint8_t>(std::clamp(level, 0L, 15L) << (4 * (j % 2)));
      }
    }
    quant::QMatrix out = m;
    out.format = WeightFormat::kW4G32A;
    out.scale_type = ScaleType::kF32;
    out.data = keep(testing::as_bytes(packed));
    out.scales = keep(testing::as_bytes(pairs));
    return out;
  }

  quant::QMatrix f16(const quant::QMatrix& m) {
    quant::QMatrix out = m;
    out.format = WeightFormat::kF16;
    out.data = keep(testing::f16_or_f32_bytes(quant::dequantize(m), ScaleType::kF16));
    out.scales = nullptr;
    return out;
  }

 private:
  const void* keep(std::vector<std::byte> bytes) {
    return kept_.emplace_back(std::move(bytes)).data();
  }
  std::deque<std::vector<std::byte>> kept_;
};

struct EngineCase {
  std::string name;    // the test name and scratch folder
  std::string config;  // synth preset
  model::SynthFormat format;
  bool gguf_formats = false;  // the matrices re-encoded by GgufRequantizer
  engine::LmHeadFormat lm_head = engine::LmHeadFormat::kExact;  // both engines'
};

void PrintTo(const EngineCase& c, std::ostream* os) {
  *os << c.name;
}

class CudaVsCpuEngine : public ::testing::TestWithParam<EngineCase> {};

// Prefill longer than the sliding window (two sequences in one step: 73 rows, so the matmuls
// run in two 64-row slices), then batched decode steps over three sequences.
TEST_P(CudaVsCpuEngine, LongPrefillThenBatchedDecode) {
  const EngineCase& c = GetParam();
  const auto dir = scratch_dir("cuda_vs_cpu_" + c.name);
  const RemoveOnExit cleanup{dir};
  // A GGUF checkpoint is one file (w4g32a where K % 256 == 0, w4g32 elsewhere, bf16 embedding).
  model::LoadedModel m = synthesize(c.config, 7, c.format, model::SynthGrid::kW4G32,
                                    model::is_gguf(c.format) ? dir / "model.gguf" : dir);
  GgufRequantizer requantized;
  if (c.gguf_formats) {
    // As Gemma 3 270M's GGUF: Q8_0 embedding (the tied lm_head too), Q4_K and Q6_K matrices.
    auto& w = m.weights;
    ASSERT_EQ(w.lm_head.data, w.embed_tokens.data);
    w.embed_tokens = w.lm_head = requantized.w8(w.embed_tokens, 32, ScaleType::kF16);
    for (auto& layer : w.layers) {
      layer.q_proj = requantized.w4g32a(layer.q_proj);
      layer.k_proj = requantized.w4g32a(layer.k_proj);
      layer.v_proj = requantized.f16(layer.v_proj);
      layer.o_proj = requantized.w4g32a(layer.o_proj);
      layer.gate_proj = requantized.w4g32a(layer.gate_proj);
      layer.up_proj = requantized.w4g32a(layer.up_proj);
      layer.down_proj = requantized.w8(layer.down_proj, 16, ScaleType::kF32);
    }
  }
  engine::EngineOptions options;
  options.max_sequences = 3;
  options.max_context = 160;
  options.ring_history = 72;  // whole prompts in one pass
  // --lm-head q8: both engines read the same 8-bit logits matrix (quant/quantize_w8.h).
  options.lm_head = c.lm_head;
  if (c.lm_head == engine::LmHeadFormat::kQ8) {
    ASSERT_TRUE(engine::lm_head_quantizes(m.weights.lm_head, c.lm_head));
  }
  auto gpu = cuda_engine(m, options);
  ASSERT_TRUE(gpu);
  auto made =
      engine::Gemma4Engine::create(m.config, m.weights, std::make_unique<CpuBackend>(), options);
  ASSERT_TRUE(made.ok());
  auto& cpu = **made;
  const int32_t vocab = cpu.vocab_size();

  std::vector<engine::SequenceId> sequences;
  for (int i = 0; i < 3; ++i) {
    auto a = cpu.open_sequence();
    auto b = gpu->open_sequence();
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(*a, *b);
    sequences.push_back(*a);
  }
  auto step_both = [&](const std::vector<std::vector<int32_t>>& tokens, const char* what) {
    std::vector<engine::StepInput> inputs;
    for (size_t i = 0; i < tokens.size(); ++i) inputs.push_back({sequences[i], tokens[i]});
    std::vector<float> expected(inputs.size() * vocab), got(inputs.size() * vocab);
    EXPECT_TRUE(cpu.step(inputs, expected).ok());
    const Status status = gpu->step(inputs, got);
    EXPECT_TRUE(status.ok()) << status.error().to_string();
    double max_delta = 0.0;
    int64_t not_finite = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!std::isfinite(got[i])) ++not_finite;
      max_delta = std::max(max_delta, double{std::fabs(got[i] - expected[i])});
    }
    EXPECT_EQ(not_finite, 0) << what;
    EXPECT_LT(max_delta, 1e-3) << what;
    std::printf("[ cuda vs cpu ] %s: max |delta logit| %.3g\n", what, max_delta);
    std::vector<int32_t> next;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::vector<float> row(expected.begin() + i * vocab,
                                   expected.begin() + (i + 1) * vocab);
      const std::vector<float> gpu_row(got.begin() + i * vocab, got.begin() + (i + 1) * vocab);
      EXPECT_EQ(argmax(gpu_row), argmax(row)) << what << " input " << i;
      next.push_back(argmax(row));
    }
    return next;
  };
  step_both({prompt_ids(50, 1), prompt_ids(23, 2)}, "prefill 50 + 23");
  auto next = step_both({prompt_ids(9, 3), prompt_ids(3, 4), prompt_ids(11, 5)}, "append");
  for (int i = 0; i < 6; ++i) {
    next = step_both({{next[0]}, {next[1]}, {next[2]}}, "batched decode");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Tiny, CudaVsCpuEngine,
    ::testing::Values(EngineCase{"tiny", "tiny", model::SynthFormat::kW4A16},
                      EngineCase{"tiny_moe", "tiny-moe", model::SynthFormat::kW4A16},
                      EngineCase{"tiny_dense", "tiny-dense", model::SynthFormat::kW4A16},
                      EngineCase{"tiny_gguf_q4_k", "tiny", model::SynthFormat::kGgufQ4_K},
                      EngineCase{"tiny_gguf_formats", "tiny", model::SynthFormat::kBF16, true},
                      EngineCase{"tiny_moe_nvfp4_lm_head_q8", "tiny-moe",
                                 model::SynthFormat::kNVFP4, false, engine::LmHeadFormat::kQ8}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace gemma4::cuda
