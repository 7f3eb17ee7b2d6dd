// GEMV kernels against quant's CPU oracle (quant::dequantize_row: the formulas of
// weight-formats.md 2.3-2.4, 3.1-3.3 and 5) on fresh random weights at real shapes, every
// format and epilogue; the epilogues against PyTorch's gelu(approximate="tanh") formula in
// double.
#include "backend/cuda/gemv.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv_mma.h"
#include "backend/cuda/gemv_w8_mma.h"
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

// Uploads x (M rows of K fp32) as the activation type under test. Returns what the kernel
// multiplies: the bf16-rounded values (kBF16, and kF32 with round_to_bf16), or for kQ8 the values
// the quantizer produced (checked here against its contract: scale = max|x| / 127 per 32,
// |x − q·scale| <= scale / 2).
std::vector<float> upload_activations(const std::vector<float>& x, int m, int64_t k, ActType type,
                                      bool round_to_bf16, DeviceArray<uint8_t>& device) {
  std::vector<float> effective = x;
  if (type == ActType::kF32) {
    cudaMemcpy(device.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice);
    if (round_to_bf16) {
      for (float& value : effective) value = round_bf16(value);
    }
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

const char* epilogue_name(GemvEpilogue epilogue) {
  return epilogue == GemvEpilogue::kGeluMul     ? "gelu_mul"
         : epilogue == GemvEpilogue::kGeluPairs ? "gelu_pairs"
                                                : "none";
}

// PyTorch gelu(approximate="tanh"), in double.
double gelu_tanh_reference(double u) {
  return 0.5 * u * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u)));
}
// Bounds |d gelu_tanh / du| (its maximum is about 1.13): how far an error in u moves gelu(u).
constexpr double kGeluSlopeBound = 1.2;

// Σ_k W[n][k] x[m][k] in double for every (m, n), and Σ|W x| (the scale of fp32 accumulation
// error): [m][n] row-major. tensor_cores: W as the tensor-core GEMV dequantizes it (w4g32 rounded
// to bf16, testing::mma_dequantize_row).
struct Products {
  std::vector<double> value, magnitude;
};
Products reference_products(const HostMatrix& host, const std::vector<float>& x, int m,
                            bool tensor_cores = false) {
  const int64_t n = host.rows, k = host.cols;
  Products p{std::vector<double>(m * n), std::vector<double>(m * n)};
  const QMatrix host_view = host.view();
  testing::parallel_for(n, [&](int64_t row) {
    std::vector<float> w(k);
    if (tensor_cores) {
      testing::mma_dequantize_row(host, row, w.data());
    } else {
      quant::dequantize_row(host_view, row, w.data());
    }
    for (int mi = 0; mi < m; ++mi) {
      double sum = 0.0, abs_sum = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const double product = static_cast<double>(w[j]) * x[mi * k + j];
        sum += product;
        abs_sum += std::fabs(product);
      }
      p.value[mi * n + row] = sum;
      p.magnitude[mi * n + row] = abs_sum;
    }
  });
  return p;
}

// The activations check_gemv draws (uniform in [lo, hi)) and the bound it checks.
struct GemvCheckOptions {
  float x_lo = -1.0f, x_hi = 1.0f;
  double tolerance = kTolerance;
};

// Runs y = epilogue(W x) for M activation rows and checks every output against the reference
// (the bound: options.tolerance on each product, carried through the epilogue). Returns the
// outputs.
std::vector<float> check_gemv(const HostMatrix& host, const DeviceMatrix& device, int m,
                              ActType x_type, int tiling, uint32_t seed,
                              GemvEpilogue epilogue = GemvEpilogue::kNone,
                              bool round_to_bf16 = false, const GemvCheckOptions& options = {}) {
  SCOPED_TRACE(std::string(quant::weight_format_name(host.format)) + " " +
               std::to_string(host.rows) + "x" + std::to_string(host.cols) +
               " M=" + std::to_string(m) + " x=" + act_name(x_type) +
               (round_to_bf16 ? " rounded to bf16" : "") + " tiling=" + std::to_string(tiling) +
               " epilogue=" + epilogue_name(epilogue));
  const int64_t n = host.rows;
  const int64_t k = host.cols;
  const int64_t width = epilogue == GemvEpilogue::kGeluPairs ? n / 2 : n;
  const std::vector<float> x_source =
      testing::random_floats(m * k, options.x_lo, options.x_hi, seed);
  const std::vector<float> multiplier = testing::random_floats(m * n, -2.0f, 2.0f, seed + 1);
  DeviceArray<uint8_t> x_device(m * k * 4);
  DeviceArray<float> multiplier_device(multiplier);
  DeviceArray<float> y(m * width);
  EXPECT_TRUE(x_device.ok() && multiplier_device.ok() && y.ok() && device.data.ok());
  if (!x_device.ok() || !multiplier_device.ok() || !y.ok() || !device.data.ok()) return {};
  std::vector<float> x = upload_activations(x_source, m, k, x_type, round_to_bf16, x_device);

  const GemvInput input = {x_device.get(), x_type, m, k, round_to_bf16};
  // Batched bf16 products go to the tensor cores (gemv()'s dispatch), which multiply bf16
  // activations (kQ8: q · scale rounded) by bf16-dequantized weights (gemv_mma_kernels.h).
  const bool tensor_cores = tiling < 0 && gemv_mma_takes(device.view, input);
  if (tensor_cores) {
    for (float& value : x) value = round_bf16(value);
  }
  const GemvOutput output = {y.get(), width, epilogue, multiplier_device.get(), n};
  EXPECT_EQ(gemv(device.view, input, output, Launch{}, tiling), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = y.download();

  const Products p = reference_products(host, x, m, tensor_cores);
  std::vector<double> expected(m * width), magnitude(m * width);
  for (int64_t i = 0; i < m * width; ++i) {
    if (epilogue == GemvEpilogue::kNone) {
      expected[i] = p.value[i];
      magnitude[i] = p.magnitude[i];
    } else if (epilogue == GemvEpilogue::kGeluMul) {
      expected[i] = gelu_tanh_reference(p.value[i]) * multiplier[i];
      magnitude[i] = kGeluSlopeBound * p.magnitude[i] * std::fabs(multiplier[i]);
    } else {
      const int64_t gate = (i / width) * n + 2 * (i % width), up = gate + 1;
      const double gelu = gelu_tanh_reference(p.value[gate]);
      expected[i] = gelu * p.value[up];
      magnitude[i] = kGeluSlopeBound * p.magnitude[gate] * std::fabs(p.value[up]) +
                     std::fabs(gelu) * p.magnitude[up];
    }
  }
  testing::expect_close(got, expected, magnitude, options.tolerance, "gemv");
  return got;
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

// fp32 activations multiplied as they are (CudaBackend's --fp32 mode) by w4g32 weights: within
// fp32 accumulation error, 4 ulp of Σ|w·x| (a plain fp32 dot product: the CPU reference's
// order differs by about that much), at E2B's shapes (QKV, o_proj, gate+up, down, the PLE gate
// and projection) through the default dispatch at 1, 2 and 64 rows and a ragged M tile, then on
// every compiled tiling. The activations have a nonzero mean, as normed hidden states do: there
// the bf16 paths' biased nibble products (device_math.cuh NibbleDot) exceed the bound by up to
// ~10×.
TEST(Gemv, W4G32F32ActivationsAtFp32Accuracy) {
  const GemvCheckOptions fp32_accuracy = {-0.5f, 1.5f, 4.0 / (1 << 24)};
  uint32_t seed = 1900;
  const Shape e2b[] = {{2560, 1536}, {1536, 2048}, {12288, 1536},
                       {1536, 6144}, {256, 1536},  {1536, 256}};
  for (const Shape& s : e2b) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, s.rows, s.cols, seed++);
    const DeviceMatrix device(host);
    for (int m : {1, 2, 37, 64}) {
      check_gemv(host, device, m, ActType::kF32, -1, seed++, GemvEpilogue::kNone, false,
                 fp32_accuracy);
    }
  }
  const auto tilings = gemv_tilings();
  for (ScaleType scale_type : {ScaleType::kBF16, ScaleType::kF32}) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, 2560, 1536, seed++, scale_type);
    const DeviceMatrix device(host);
    for (int t = 0; t < static_cast<int>(tilings.size()); ++t) {
      if (!gemv_tiling_compiled(t)) continue;
      check_gemv(host, device, tilings[t].m_tile == 1 ? 1 : 11, ActType::kF32, t, seed++,
                 GemvEpilogue::kNone, false, fp32_accuracy);
    }
  }
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

// kF32 activations rounded to bf16 (CudaBackend's default): staged in shared memory, exact
// against the rounded values, on every compiled tiling (ragged coverage K 704, ragged M tile).
TEST(Gemv, F32RoundedToBF16EveryTiling) {
  const auto tilings = gemv_tilings();
  uint32_t seed = 1600;
  for (const Shape& s : {Shape{2560, 1536}, Shape{2816, 704}}) {
    for (WeightFormat format :
         {WeightFormat::kW4G32, WeightFormat::kW8, WeightFormat::kBF16, WeightFormat::kNVFP4}) {
      const HostMatrix host = random_matrix(format, s.rows, s.cols, seed++, ScaleType::kF16);
      const DeviceMatrix device(host);
      for (int t = 0; t < static_cast<int>(tilings.size()); ++t) {
        if (!gemv_tiling_compiled(t)) continue;
        const int m = tilings[t].m_tile == 1 ? 1 : 11;
        check_gemv(host, device, m, ActType::kF32, t, seed++, GemvEpilogue::kNone, true);
      }
    }
  }
}

// Every compiled tiling at the 31B (K 5376, 8192, 21504) and 26B-A4B dense (K 2816, 2112, 4096)
// row lengths, which the wide tilings cover in one pass exactly, in several passes, or with idle
// lanes; row counts that leave every block height a partial last block. The checkpoint formats
// with the engine's activations (bf16 companions, fp32 rounded to bf16 and staged), NVFP4 in both
// global-factor conventions.
TEST(Gemv, EveryTilingLongRows) {
  const Shape shapes[] = {{72, 5376},  {40, 21504}, {40, 8192},
                          {264, 2816}, {264, 2112}, {136, 4096}};
  const auto tilings = gemv_tilings();
  uint32_t seed = 1700;
  bool divisor = false;
  for (const Shape& s : shapes) {
    for (WeightFormat format : {WeightFormat::kW4G32, WeightFormat::kNVFP4}) {
      divisor = !divisor;
      const HostMatrix host =
          random_matrix(format, s.rows, s.cols, seed++, ScaleType::kBF16, divisor);
      const DeviceMatrix device(host);
      for (int t = 0; t < static_cast<int>(tilings.size()); ++t) {
        if (!gemv_tiling_compiled(t)) continue;
        // Two rows for a prefetching tiling: the second reloads the first passes.
        const int m = tilings[t].m_tile > 1 ? 3 : tilings[t].prefetch_next_pass ? 2 : 1;
        check_gemv(host, device, m, ActType::kBF16, t, seed++);
        check_gemv(host, device, m, ActType::kF32, t, seed++, GemvEpilogue::kNone, true);
      }
    }
  }
}

// default_gemv_tiling picks only tilings of kDefaultGemvTilings, the ones a normal build compiles
// (gemv_kernels.h), at every model shape and row count.
TEST(Gemv, DefaultTilingsAreCompiledByEveryBuild) {
  for (WeightFormat format : {WeightFormat::kW4G32, WeightFormat::kNVFP4, WeightFormat::kBF16,
                              WeightFormat::kW4G32A, WeightFormat::kW8, WeightFormat::kF16}) {
    for (int64_t rows :
         {256, 1536, 2560, 2816, 4224, 5376, 8192, 12288, 16384, 24576, 43008, 262144}) {
      for (int64_t cols :
           {256, 640, 704, 1536, 2048, 2112, 2816, 4096, 5376, 6144, 8192, 12288, 21504}) {
        QMatrix w;
        w.format = format;
        w.rows = rows;
        w.cols = cols;
        for (int m : {1, 2, 8, 64}) {
          for (ActType x_type : {ActType::kF32, ActType::kBF16, ActType::kQ8}) {
            const int tiling = default_gemv_tiling(w, m, x_type);
            const auto listed = [&](const auto& defaults) {
              return std::find(std::begin(defaults), std::end(defaults), tiling) !=
                     std::end(defaults);
            };
            EXPECT_TRUE(is_gemv_stream_tiling(tiling)   ? gemv_stream_tiling_compiled(tiling)
                        : is_gemv_splitk_tiling(tiling) ? listed(kDefaultGemvSplitKTilings)
                                                        : listed(kDefaultGemvTilings))
                << quant::weight_format_name(format) << " " << rows << "x" << cols << " M=" << m
                << ": tiling " << tiling;
          }
        }
      }
    }
  }
}

// The GGUF repacks (quant/gguf_repack.h) and their scale layouts.
struct GgufFormat {
  WeightFormat format;
  ScaleType scale_type;  // kW8's (kW4G32A: fp32 pairs regardless)
  int group_size;        // kW8's
};
constexpr GgufFormat kGgufFormats[] = {
    {WeightFormat::kW4G32A, ScaleType::kF32, 32},  // Q4_K, Q4_1
    {WeightFormat::kW8, ScaleType::kF16, 32},      // Q8_0, Q5_0, IQ4_NL
    {WeightFormat::kW8, ScaleType::kF32, 16},      // Q6_K
    {WeightFormat::kF16, ScaleType::kBF16, 32},    // F16
};

HostMatrix random_gguf_matrix(const GgufFormat& f, int64_t rows, int64_t cols, uint32_t seed) {
  return random_matrix(f.format, rows, cols, seed, f.scale_type, false, f.group_size);
}

// Gemma 3 270M (hidden 640: QKV 1536, gate+up 2 × 2048, down from 2048) and E2B (QKV, down).
constexpr Shape kGgufShapes[] = {{1536, 640}, {4096, 640}, {640, 2048}, {2560, 1536}, {1536, 6144}};

// fp32 activations (what the engine passes), single and batched.
TEST(Gemv, GgufFormatsRealShapes) {
  uint32_t seed = 1000;
  for (const GgufFormat& f : kGgufFormats) {
    for (const Shape& s : kGgufShapes) {
      const HostMatrix host = random_gguf_matrix(f, s.rows, s.cols, seed++);
      const DeviceMatrix device(host);
      for (int m : {1, 2, 8, 64}) check_gemv(host, device, m, ActType::kF32, -1, seed++);
    }
  }
}

// The 270M's tied embedding as the lm_head (Q8_0 or Q6_K in the usual GGUF files).
TEST(Gemv, GgufLmHead) {
  for (const GgufFormat& f : {kGgufFormats[1], kGgufFormats[2]}) {
    const HostMatrix host = random_gguf_matrix(f, 262144, 640, 1100);
    const DeviceMatrix device(host);
    check_gemv(host, device, 1, ActType::kF32, -1, 1101);
  }
}

// Every epilogue on every format, single and batched (a ragged M tile), at real shapes: E2B's
// interleaved gate+up (12288 rows = 6144 pairs) and PLE gate (256 × 1536), the 270M's gate+up.
TEST(Gemv, EpiloguesEveryFormat) {
  std::vector<GgufFormat> formats(std::begin(kGgufFormats), std::end(kGgufFormats));
  formats.push_back({WeightFormat::kW4G32, ScaleType::kBF16, 32});
  formats.push_back({WeightFormat::kNVFP4, ScaleType::kBF16, 32});
  formats.push_back({WeightFormat::kBF16, ScaleType::kBF16, 32});
  uint32_t seed = 1200;
  for (const GgufFormat& f : formats) {
    for (const Shape& s : {Shape{12288, 1536}, Shape{256, 1536}, Shape{4096, 640}}) {
      const HostMatrix host = random_gguf_matrix(f, s.rows, s.cols, seed++);
      const DeviceMatrix device(host);
      for (int m : {1, 11, 64}) {
        for (GemvEpilogue e : {GemvEpilogue::kGeluMul, GemvEpilogue::kGeluPairs}) {
          check_gemv(host, device, m, ActType::kF32, -1, seed++, e);
        }
      }
    }
  }
}

// kF32 activations rounded to bf16, every format and scale type, every epilogue, M = 1, 2, 8, 64
// at the PLE gate shape (256 × 1536: every m tile staged) and the PLE projection (1536 × 256);
// E2B's down (K 6144: staged for M = 1, rounded in registers for the batched tilings, whose 8-row
// tile does not fit) and double-wide gate+up (24576 × 1536: tiling 1).
TEST(Gemv, F32RoundedToBF16EveryFormatAndEpilogue) {
  std::vector<GgufFormat> formats(std::begin(kGgufFormats), std::end(kGgufFormats));
  for (ScaleType type : {ScaleType::kBF16, ScaleType::kF16, ScaleType::kF32}) {
    formats.push_back({WeightFormat::kW4G32, type, 32});
  }
  formats.push_back({WeightFormat::kBF16, ScaleType::kBF16, 32});
  uint32_t seed = 1700;
  const auto check_all = [&](const HostMatrix& host, const DeviceMatrix& device) {
    for (int m : {1, 2, 8, 64}) {
      for (GemvEpilogue e :
           {GemvEpilogue::kNone, GemvEpilogue::kGeluMul, GemvEpilogue::kGeluPairs}) {
        check_gemv(host, device, m, ActType::kF32, -1, seed++, e, true);
      }
    }
  };
  for (const GgufFormat& f : formats) {
    for (const Shape& s : {Shape{256, 1536}, Shape{1536, 256}}) {
      const HostMatrix host = random_gguf_matrix(f, s.rows, s.cols, seed++);
      check_all(host, DeviceMatrix(host));
    }
  }
  for (bool divisor : {true, false}) {
    const HostMatrix host =
        random_matrix(WeightFormat::kNVFP4, 256, 1536, seed++, ScaleType::kBF16, divisor);
    check_all(host, DeviceMatrix(host));
  }
  const HostMatrix down = random_matrix(WeightFormat::kW4G32, 1536, 6144, seed++);
  const DeviceMatrix down_device(down);
  for (int m : {1, 8}) check_gemv(down, down_device, m, ActType::kF32, -1, seed++, {}, true);
  const HostMatrix gate_up = random_matrix(WeightFormat::kW4G32, 24576, 1536, seed++);
  check_gemv(gate_up, DeviceMatrix(gate_up), 1, ActType::kF32, -1, seed++, GemvEpilogue::kGeluPairs,
             true);
}

// Both reductions (one warp, shared-memory split-K) store through the epilogue: every compiled
// tiling, 32- and 16-element chunks, ragged coverage (K 704) and ragged row blocks (2 · 1409 rows).
TEST(Gemv, EpiloguesEveryTiling) {
  const auto tilings = gemv_tilings();
  uint32_t seed = 1300;
  for (const Shape& s : {Shape{2560, 1536}, Shape{2818, 704}}) {
    for (const GgufFormat& f : {GgufFormat{WeightFormat::kW4G32, ScaleType::kBF16, 32},
                                kGgufFormats[1], kGgufFormats[3]}) {
      const HostMatrix host = random_gguf_matrix(f, s.rows, s.cols, seed++);
      const DeviceMatrix device(host);
      for (int t = 0; t < static_cast<int>(tilings.size()); ++t) {
        if (!gemv_tiling_compiled(t)) continue;
        const int m = tilings[t].m_tile == 1 ? 1 : 11;
        check_gemv(host, device, m, ActType::kF32, t, seed++, GemvEpilogue::kGeluPairs);
        check_gemv(host, device, m, ActType::kF32, t, seed++, GemvEpilogue::kGeluMul);
      }
    }
  }
}

// The fused epilogues compute exactly what the unfused kernels do from the same products: GELU
// gating bit for bit as the elementwise gelu_tanh_mul, pairs as gemv_epilogue (the generic
// matmul's fallback).
TEST(Gemv, FusedEpiloguesEqualTheUnfusedKernels) {
  uint32_t seed = 1400;
  for (const GgufFormat& f :
       {kGgufFormats[0], kGgufFormats[2], GgufFormat{WeightFormat::kW4G32, ScaleType::kBF16, 32}}) {
    const HostMatrix host = random_gguf_matrix(f, 4096, 640, seed++);
    const DeviceMatrix device(host);
    const int64_t n = host.rows, k = host.cols;
    for (int m : {1, 5}) {
      SCOPED_TRACE(std::string(quant::weight_format_name(f.format)) + " M=" + std::to_string(m));
      const DeviceArray<float> x(testing::random_floats(m * k, -1.0f, 1.0f, seed++));
      const DeviceArray<float> multiplier(testing::random_floats(m * n, -2.0f, 2.0f, seed++));
      DeviceArray<float> products(m * n), fused_mul(m * n), unfused_mul(m * n);
      DeviceArray<float> fused_pairs(m * n / 2), unfused_pairs(m * n / 2);
      const GemvInput input = {x.get(), ActType::kF32, m, k};
      CUDA_ASSERT_OK(gemv(device.view, input, {products.get(), n}, Launch{}));
      CUDA_ASSERT_OK(gemv(device.view, input,
                          {fused_mul.get(), n, GemvEpilogue::kGeluMul, multiplier.get(), n},
                          Launch{}));
      CUDA_ASSERT_OK(
          gemv(device.view, input, {fused_pairs.get(), n / 2, GemvEpilogue::kGeluPairs}, Launch{}));
      const RowsView products_view = {products.get(), m, n, n};
      CUDA_ASSERT_OK(gelu_tanh_mul(products_view, {multiplier.get(), m, n, n},
                                   {unfused_mul.get(), m, n, n}, Launch{}));
      CUDA_ASSERT_OK(gemv_epilogue(products.get(), m, n, n,
                                   {unfused_pairs.get(), n / 2, GemvEpilogue::kGeluPairs},
                                   Launch{}));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      EXPECT_EQ(fused_mul.download(), unfused_mul.download());
      EXPECT_EQ(fused_pairs.download(), unfused_pairs.download());
    }
  }
}

// gemv_epilogue over products of any width and stride: odd widths (no pairs), in-place gating.
TEST(Gemv, EpilogueAloneMatchesTheFormula) {
  const int m = 3;
  const int64_t n = 1001, stride = 1004;
  const std::vector<float> products = testing::random_floats(m * stride, -4.0f, 4.0f, 1500);
  const std::vector<float> multiplier = testing::random_floats(m * stride, -2.0f, 2.0f, 1501);
  DeviceArray<float> products_device(products), gated(multiplier);
  CUDA_ASSERT_OK(gemv_epilogue(products_device.get(), m, n, stride,
                               {gated.get(), stride, GemvEpilogue::kGeluMul, gated.get(), stride},
                               Launch{}));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<float> got = gated.download();
  for (int r = 0; r < m; ++r) {
    for (int64_t i = 0; i < stride; ++i) {
      const int64_t at = r * stride + i;
      if (i >= n) {
        EXPECT_EQ(got[at], multiplier[at]) << "padding " << at;  // left alone
        continue;
      }
      const double expected = gelu_tanh_reference(products[at]) * multiplier[at];
      EXPECT_NEAR(got[at], expected, 1e-6 * (1.0 + std::fabs(expected))) << at;
    }
  }
  DeviceArray<float> y(1);
  EXPECT_EQ(gemv_epilogue(products_device.get(), 1, n, stride,
                          {y.get(), n, GemvEpilogue::kGeluPairs}, Launch{}),
            cudaErrorInvalidValue);  // odd width: no pairs
}

// Whether streaming tiling t stages a row of `cols` in shared memory and takes its layout (aligned
// addresses; gemv refuses it otherwise).
bool stream_tiling_fits(int t, int64_t cols) {
  const GemvStreamTiling& tiling = kGemvStreamTilings[t - kGemvStreamTilingBase];
  return gemv_stream_layout_ok(tiling, cols / 32, 0, 0) &&
         gemv_stream_shared_bytes(tiling, cols / 32) <= kGemvStreamMaxSharedBytes;
}

// The streaming kernel (gemv_stream_kernels.h), every compiled tiling: row counts that leave a
// partial last tile, K runs that split into whole and partial slices (K 5376: 168 chunks; K 1536;
// K 21504; K 8192), a K too short for every warp to get a quad (K 256: empty runs), more tiles than
// the GPU holds blocks (each block loops), both activation types, every epilogue, fp16 scales.
TEST(Gemv, StreamTilings) {
  uint32_t seed = 2000;
  const Shape shapes[] = {{72, 5376},   {40, 1536},    {24, 21504},
                          {20000, 256}, {12304, 1536}, {200, 8192}};
  for (const Shape& s : shapes) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, s.rows, s.cols, seed++);
    const DeviceMatrix device(host);
    for (int t = kGemvStreamTilingBase; t < kGemvStreamTilingBase + kNumGemvStreamTilings; ++t) {
      if (!gemv_stream_tiling_compiled(t)) continue;
      if (!stream_tiling_fits(t, s.cols)) {
        DeviceArray<float> x(s.cols), y(s.rows);
        EXPECT_EQ(gemv(device.view, GemvInput{x.get(), ActType::kBF16, 1, s.cols},
                       GemvOutput{y.get(), s.rows}, Launch{}, t),
                  cudaErrorInvalidValue)
            << t;
        continue;
      }
      check_gemv(host, device, 1, ActType::kBF16, t, seed++);
      check_gemv(host, device, 1, ActType::kF32, t, seed++, GemvEpilogue::kNone, true);
      check_gemv(host, device, 1, ActType::kBF16, t, seed++, GemvEpilogue::kGeluPairs);
      check_gemv(host, device, 1, ActType::kF32, t, seed++, GemvEpilogue::kGeluMul, true);
    }
  }
  const HostMatrix f16_scales =
      random_matrix(WeightFormat::kW4G32, 88, 5376, seed++, ScaleType::kF16);
  const DeviceMatrix f16_device(f16_scales);
  for (int t = kGemvStreamTilingBase; t < kGemvStreamTilingBase + kNumGemvStreamTilings; ++t) {
    if (gemv_stream_tiling_compiled(t) && stream_tiling_fits(t, 5376)) {
      check_gemv(f16_scales, f16_device, 1, ActType::kBF16, t, seed++);
    }
  }
}

// The producer-warp tilings over many tiles a block (each ring wraps around, the last round of
// tiles is short) and a partial last tile, at K 5376 and 1536; the split-K ones also at the 31B
// down's K 21504 (more tiles than clusters: the partial-sum buffers wrap around).
TEST(Gemv, StreamProducerRings) {
  uint32_t seed = 2200;
  for (const Shape& s : {Shape{16392, 5376}, Shape{40008, 1536}, Shape{5384, 21504}}) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, s.rows, s.cols, seed++);
    const DeviceMatrix device(host);
    for (int t = kGemvStreamTilingBase; t < kGemvStreamTilingBase + kNumGemvStreamTilings; ++t) {
      if (!gemv_stream_tiling_compiled(t) ||
          !kGemvStreamTilings[t - kGemvStreamTilingBase].producer ||
          !stream_tiling_fits(t, s.cols)) {
        continue;
      }
      check_gemv(host, device, 1, ActType::kBF16, t, seed++);
      check_gemv(host, device, 1, ActType::kF32, t, seed++, GemvEpilogue::kGeluPairs, true);
    }
  }
}

// A single-row kernel's bf16 companion is y rounded to bf16 (n: a companion stride, a multiple of
// 32), and the kernel refuses what is not its own: exact fp32 products, two activation rows, NVFP4
// weights and, with `w4g32_f32_scales_refused`, w4g32 weights with fp32 scales.
void check_companion_and_limits(int tiling, int64_t n, int64_t k, uint32_t seed,
                                bool w4g32_f32_scales_refused) {
  const HostMatrix host = random_matrix(WeightFormat::kW4G32, n, k, seed);
  const DeviceMatrix device(host);
  const DeviceArray<float> x(testing::random_floats(2 * k, -1.0f, 1.0f, seed + 1));
  DeviceArray<float> y(2 * n);
  DeviceArray<uint16_t> y_bf16(n);
  GemvOutput out = {y.get(), n};
  out.companions = {y_bf16.get(), nullptr, n};
  const GemvInput rounded = {x.get(), ActType::kF32, 1, k, true};
  CUDA_ASSERT_OK(gemv(device.view, rounded, out, Launch{}, tiling));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<float> got = y.download();
  const std::vector<uint16_t> got_bf16 = y_bf16.download();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(got_bf16[i], float_to_bf16(got[i])) << i;
    ASSERT_TRUE(std::isfinite(got[i])) << i;
  }

  const GemvOutput plain = {y.get(), n};
  EXPECT_EQ(gemv(device.view, GemvInput{x.get(), ActType::kF32, 1, k}, plain, Launch{}, tiling),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      gemv(device.view, GemvInput{x.get(), ActType::kF32, 2, k, true}, plain, Launch{}, tiling),
      cudaErrorInvalidValue);
  const HostMatrix nv = random_matrix(WeightFormat::kNVFP4, n, k, seed + 2);
  EXPECT_EQ(gemv(DeviceMatrix(nv).view, rounded, plain, Launch{}, tiling), cudaErrorInvalidValue);
  if (w4g32_f32_scales_refused) {
    const HostMatrix f32_scales =
        random_matrix(WeightFormat::kW4G32, n, k, seed + 3, ScaleType::kF32);
    EXPECT_EQ(gemv(DeviceMatrix(f32_scales).view, rounded, plain, Launch{}, tiling),
              cudaErrorInvalidValue);
  }
}

// The streaming kernel's companion and limits (16-bit scales only).
TEST(Gemv, StreamCompanionsAndLimits) {
  const int tiling = kDefaultGemvStreamTilings[0];
  const int64_t k = 5376;
  check_companion_and_limits(tiling, 1056, k, 2100, /*w4g32_f32_scales_refused=*/true);
  // The default falls back to the register kernel where the streaming one does not apply.
  const HostMatrix tall = random_matrix(WeightFormat::kW4G32, 16384, k, 2104);
  const DeviceMatrix tall_device(tall);
  ASSERT_TRUE(is_gemv_stream_tiling(default_gemv_tiling(tall_device.view, 1, ActType::kF32)));
  check_gemv(tall, tall_device, 1, ActType::kF32, -1, 2105);  // exact fp32 products
  check_gemv(tall, tall_device, 1, ActType::kBF16, -1, 2106);
  // The 31B down goes to a split-K producer tiling (tensor-map copies) by default.
  const HostMatrix down = random_matrix(WeightFormat::kW4G32, 5376, 21504, 2107);
  const DeviceMatrix down_device(down);
  const int down_tiling = default_gemv_tiling(down_device.view, 1, ActType::kBF16);
  ASSERT_TRUE(is_gemv_stream_tiling(down_tiling));
  ASSERT_GT(kGemvStreamTilings[down_tiling - kGemvStreamTilingBase].splits, 1);
  check_gemv(down, down_device, 1, ActType::kBF16, -1, 2108);
}

// The split-K kernel (gemv_splitk_kernels.h), every compiled tiling: row counts that leave a
// partial last block, K parts of unequal length (K 21504, 8192, 12288, 6144, 2048 over 1 to 8
// blocks), parts with no chunk at all (K 32 over a cluster), both activation types, every
// epilogue, every scale type, and a bf16 companion.
TEST(Gemv, SplitKTilings) {
  uint32_t seed = 2200;
  const Shape shapes[] = {{38, 21504}, {22, 8192}, {52, 12288}, {70, 6144}, {18, 2048}, {6, 32}};
  for (const Shape& s : shapes) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, s.rows, s.cols, seed++);
    const DeviceMatrix device(host);
    for (int t = kGemvSplitKTilingBase; t < kGemvSplitKTilingBase + kNumGemvSplitKTilings; ++t) {
      if (!gemv_splitk_tiling_compiled(t)) continue;
      check_gemv(host, device, 1, ActType::kBF16, t, seed++);
      check_gemv(host, device, 1, ActType::kF32, t, seed++, GemvEpilogue::kNone, true);
      check_gemv(host, device, 1, ActType::kBF16, t, seed++, GemvEpilogue::kGeluPairs);
      check_gemv(host, device, 1, ActType::kF32, t, seed++, GemvEpilogue::kGeluMul, true);
    }
  }
  for (ScaleType scale_type : {ScaleType::kF16, ScaleType::kF32}) {
    const HostMatrix host = random_matrix(WeightFormat::kW4G32, 40, 8192, seed++, scale_type);
    const DeviceMatrix device(host);
    for (int t = kGemvSplitKTilingBase; t < kGemvSplitKTilingBase + kNumGemvSplitKTilings; ++t) {
      if (gemv_splitk_tiling_compiled(t)) check_gemv(host, device, 1, ActType::kBF16, t, seed++);
    }
  }
}

// The split-K kernel's companion and limits (it also takes no residual step).
TEST(Gemv, SplitKCompanionsAndLimits) {
  const int tiling = kDefaultGemvSplitKTilings[0];
  check_companion_and_limits(tiling, 1056, 8192, 2300, /*w4g32_f32_scales_refused=*/false);
  // The default sends E2B's 1536-row down (K 6144) with bf16 activations here.
  const HostMatrix down = random_matrix(WeightFormat::kW4G32, 1536, 6144, 2303);
  const DeviceMatrix down_device(down);
  ASSERT_TRUE(is_gemv_splitk_tiling(default_gemv_tiling(down_device.view, 1, ActType::kBF16)));
  check_gemv(down, down_device, 1, ActType::kBF16, -1, 2304);
}

// The tensor-core w8 kernel (gemv_w8_mma.h) at the 26B logits shape's K (rows not a multiple of
// 16) and E2B's: it multiplies the activations rounded to fp16 (bf16 ones are exact in fp16 at
// these magnitudes), products exact, sums fp32.
TEST(Gemv, W8TensorCoreKernel) {
  for (const Shape s : {Shape{1000, 2816}, Shape{4096, 1536}}) {
    const HostMatrix host = random_matrix(WeightFormat::kW8, s.rows, s.cols, 41, ScaleType::kF16);
    const DeviceMatrix device(host);
    for (const bool bf16_input : {false, true}) {
      SCOPED_TRACE(std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                   (bf16_input ? " x=bf16" : " x=f32"));
      const std::vector<float> x = testing::random_floats(s.cols, -2.0f, 2.0f, 43);
      DeviceArray<uint8_t> x_device(s.cols * 4);
      // fp32 rows go to fp16 directly (not through bf16): uploaded as they are.
      std::vector<float> effective = upload_activations(
          x, 1, s.cols, bf16_input ? ActType::kBF16 : ActType::kF32, false, x_device);
      for (float& value : effective) value = fp16_to_float(float_to_fp16(value));
      DeviceArray<float> y(s.rows);
      const GemvInput input = {x_device.get(), bf16_input ? ActType::kBF16 : ActType::kF32, 1,
                               s.cols, !bf16_input};
      ASSERT_EQ(gemv(device.view, input, {y.get(), s.rows}, Launch{}, kGemvW8MmaTiling),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Products p = reference_products(host, effective, 1);
      testing::expect_close(y.download(), p.value, p.magnitude, kTolerance, "w8 mma");
    }
  }
  // What it does not take: batched rows, exact fp32 products, an epilogue, fp32 scales, K not a
  // multiple of 256.
  const HostMatrix host = random_matrix(WeightFormat::kW8, 64, 256, 5, ScaleType::kF16);
  const HostMatrix f32_scales = random_matrix(WeightFormat::kW8, 64, 256, 6, ScaleType::kF32);
  const HostMatrix short_rows = random_matrix(WeightFormat::kW8, 64, 128, 7, ScaleType::kF16);
  const DeviceMatrix device(host), f32_device(f32_scales), short_device(short_rows);
  DeviceArray<float> x(2 * 256), y(2 * 64), multiplier(64);
  const GemvOutput plain = {y.get(), 64};
  const GemvOutput gelu_mul = {y.get(), 64, GemvEpilogue::kGeluMul, multiplier.get(), 64};
  const GemvInput one_row = {x.get(), ActType::kF32, 1, 256, true};
  const GemvInput two_rows = {x.get(), ActType::kF32, 2, 256, true};
  const GemvInput exact = {x.get(), ActType::kF32, 1, 256, false};
  const GemvInput short_row = {x.get(), ActType::kF32, 1, 128, true};
  for (const auto& [m, input, output] :
       {std::tuple{&device.view, two_rows, plain}, std::tuple{&device.view, exact, plain},
        std::tuple{&device.view, one_row, gelu_mul}, std::tuple{&f32_device.view, one_row, plain},
        std::tuple{&short_device.view, short_row, plain}}) {
    EXPECT_EQ(gemv(*m, input, output, Launch{}, kGemvW8MmaTiling), cudaErrorInvalidValue);
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
  // The GGUF formats take fp32 activations only; kW8 groups of 16 or 32.
  const HostMatrix w8_host = random_matrix(WeightFormat::kW8, 64, 64, 2, ScaleType::kF16);
  const DeviceMatrix w8(w8_host);
  EXPECT_EQ(gemv(w8.view, GemvInput{x.get(), ActType::kBF16, 1, 64}, out, Launch{}),
            cudaErrorInvalidValue);
  // Rounding to bf16 applies to fp32 activations only.
  EXPECT_EQ(gemv(device.view, GemvInput{x.get(), ActType::kBF16, 1, 64, true}, out, Launch{}),
            cudaErrorInvalidValue);
  QMatrix w8_group_64 = w8.view;
  w8_group_64.group_size = 64;
  EXPECT_EQ(gemv(w8_group_64, GemvInput{x.get(), ActType::kF32, 1, 64}, out, Launch{}),
            cudaErrorInvalidValue);
  // Epilogues: pairs need an even row count, gating a multiplier.
  QMatrix odd_rows = device.view;
  odd_rows.rows = 63;
  const GemvInput one = {x.get(), ActType::kF32, 1, 64};
  EXPECT_EQ(gemv(odd_rows, one, {y.get(), 64, GemvEpilogue::kGeluPairs}, Launch{}),
            cudaErrorInvalidValue);
  EXPECT_EQ(gemv(device.view, one, {y.get(), 64, GemvEpilogue::kGeluMul}, Launch{}),
            cudaErrorInvalidValue);
  EXPECT_EQ(gemv(device.view, GemvInput{x.get(), ActType::kF32, 2, 64},
                 {y.get(), 31, GemvEpilogue::kGeluPairs}, Launch{}),
            cudaErrorInvalidValue);  // batched: the stride must hold 32 outputs
}

}  // namespace
}  // namespace gemma4::cuda
