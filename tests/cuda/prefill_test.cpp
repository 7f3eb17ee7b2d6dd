// CudaBackend's prefill paths (passes of more than 16 rows: prefill_matmul.h, prefill_kernels.h)
// against the CPU reference backend on fresh random inputs: the tensor-core matmul for every
// weight format (K not a multiple of 8, a matrix over several weight tiles, 17..1024 rows,
// strided rows) and prefill attention (chunks of 17..129 queries, head_dim 256 and 512, GQA,
// sliding windows, a wrapped ring, empty slots holding NaN). Outputs start as NaN and padding
// between rows must stay untouched.
//
// The tolerances are bounds derived from the bf16 roundings, not fitted to results:
//  * fp32 sums: K terms in any order are within K · 2^-24 of exact relative to Σ|terms| on the
//    CPU, and within K · 2^-23 on tensor cores (their fp32 accumulation may truncate): together
//    below 4K · 2^-24 · Σ|terms|.
//  * matmul: x and w are each rounded to bf16 (unit roundoff u = 2^-9), so every product is
//    within 2u + u² of the exact one. Bound: (2^-8 + 2^-17 + 4K · 2^-24) · Σ_k |x_k · w_k|.
//  * attention: q, K and V are bf16-exact (rounded before either backend sees them), so the
//    tensor cores' Q·K products are exact and a score differs from the CPU's only by fp32
//    summation order: ε ≤ scale · 4 · head_dim · 2^-24 · Σ_d |q_d k_d|. The softmax weights are
//    rounded to bf16 (u) and normalised by the sum of the rounded weights, so every normalised
//    weight is within a factor β = e^{2ε} (1 + u) / (1 − u) of the CPU's, and the output within
//    (β − 1 + 8 · slots · 2^-24) · max|v| (the last term: fp32 sums of up to `slots` terms
//    on both sides, and the per-tile rescaling and the division).
//  * attention with q = 0: every score is exactly 0 on both sides and every weight exactly 1,
//    so the output is the mean of the visible values up to fp32 sums: 8 · slots · 2^-24 · max|v|.
//    One key too many or too few (a mask, ring or head mapping error) moves it by ~max|v| / 130.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numbers>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/prefill_kernels.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "packed_matrix.h"

namespace gemma4::cuda {
namespace {

using backend::cpu::CpuBackend;
using engine::Rows;
using quant::ScaleType;
using quant::WeightFormat;
using testing::DeviceArray;
using testing::HostMatrix;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kPadding = 7.25f;  // between strided rows: an operation must leave it alone
constexpr double kBf16Roundoff = 1.0 / 512;
constexpr double kFp32Roundoff = 1.0 / 16777216;

using testing::make_gpu;

// `count` rows of `width` floats, `stride` apart, on the host and on the device.
class TwinRows {
 public:
  TwinRows(int64_t count, int64_t width, int64_t stride, std::vector<float> values)
      : count_(count), width_(width), stride_(stride), host_(std::move(values)), device_(host_) {}
  Rows cpu() { return {host_.data(), count_, width_, stride_}; }
  Rows gpu() const { return {device_.get(), count_, width_, stride_}; }
  const std::vector<float>& cpu_values() const { return host_; }
  std::vector<float> gpu_values() const {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the backend's stream is non-blocking
    return device_.download();
  }
  float at(int64_t row, int64_t column) const { return host_[row * stride_ + column]; }

 private:
  int64_t count_, width_, stride_;
  std::vector<float> host_;
  DeviceArray<float> device_;
};

// Random values in [lo, hi] (rounded to bf16 when bf16_exact), kPadding between rows.
TwinRows random_rows(int64_t count, int64_t width, int64_t stride, uint32_t seed,
                     bool bf16_exact = false, float lo = -1.0f, float hi = 1.0f) {
  auto values = testing::random_floats(count * stride, lo, hi, seed);
  for (int64_t i = 0; i < count * stride; ++i) {
    if (i % stride >= width) {
      values[i] = kPadding;
    } else if (bf16_exact) {
      values[i] = round_bf16(values[i]);
    }
  }
  return TwinRows(count, width, stride, std::move(values));
}

// An output: NaN where the operation writes, kPadding between rows.
TwinRows output_rows(int64_t count, int64_t width, int64_t stride) {
  std::vector<float> values(count * stride);
  for (int64_t i = 0; i < count * stride; ++i) values[i] = i % stride < width ? kNaN : kPadding;
  return TwinRows(count, width, stride, std::move(values));
}

// ---------------------------------------------------------------------------------------------
// Matmul

struct MatmulCase {
  const char* name;
  WeightFormat format;
  ScaleType scale_type;  // kW4G32 / kW8
  bool nv_divisor;       // kNVFP4
  int group_size;        // kW8
  int64_t rows, cols, tokens, x_stride, y_stride;
};

HostMatrix make_matrix(const MatmulCase& c, uint32_t seed) {
  if (c.format != WeightFormat::kF32) {
    return testing::random_matrix(c.format, c.rows, c.cols, seed, c.scale_type, c.nv_divisor,
                                  c.group_size);
  }
  HostMatrix m;
  m.format = WeightFormat::kF32;
  m.rows = c.rows;
  m.cols = c.cols;
  m.data = testing::as_bytes(testing::random_floats(c.rows * c.cols, -0.05f, 0.05f, seed));
  return m;
}

void expect_matmul_within_bf16_bound(CpuBackend& cpu, engine::Backend& gpu, const MatmulCase& c,
                                     uint32_t seed) {
  const HostMatrix host = make_matrix(c, seed);
  const testing::DeviceMatrix device(host);
  const quant::QMatrix w = host.view();
  TwinRows x = random_rows(c.tokens, c.cols, c.x_stride, seed + 1);
  TwinRows y = output_rows(c.tokens, c.rows, c.y_stride);
  cpu.matmul(w, x.cpu(), y.cpu());
  gpu.matmul(device.view, x.gpu(), y.gpu());

  const double relative = 2 * kBf16Roundoff + kBf16Roundoff * kBf16Roundoff +
                          4.0 * static_cast<double>(c.cols) * kFp32Roundoff;
  const std::vector<float>& expected = y.cpu_values();
  std::vector<double> reference(expected.begin(), expected.end());
  // Padding: compared exactly (bound 0 + the floor of expect_close).
  std::vector<double> bound(expected.size(), 0.0);
  testing::parallel_for(c.rows, [&](int64_t n) {
    std::vector<float> row(c.cols);
    quant::dequantize_row(w, n, row.data());
    for (int64_t t = 0; t < c.tokens; ++t) {
      double sum = 0.0;
      for (int64_t k = 0; k < c.cols; ++k) sum += std::fabs(double{row[k]} * x.at(t, k));
      bound[t * c.y_stride + n] = relative * sum;
    }
  });
  testing::expect_close(y.gpu_values(), reference, bound, 1.0, c.name);
}

TEST(PrefillMatmul, EveryFormatWithinTheBf16Bound) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(0);
  const MatmulCase cases[] = {
      // name, format, scale type, NVFP4 divisor, w8 group, N, K, tokens, x stride, y stride
      {"w4g32 bf16, 17 rows", WeightFormat::kW4G32, ScaleType::kBF16, true, 32, 96, 256, 17, 256,
       96},
      {"w4g32 f16 strided", WeightFormat::kW4G32, ScaleType::kF16, true, 32, 72, 128, 100, 132, 75},
      {"w4g32 f32, 1024 rows", WeightFormat::kW4G32, ScaleType::kF32, true, 32, 40, 64, 1024, 64,
       40},
      {"nvfp4 divisor", WeightFormat::kNVFP4, ScaleType::kBF16, true, 32, 64, 128, 33, 128, 64},
      {"nvfp4 multiplier K 48", WeightFormat::kNVFP4, ScaleType::kBF16, false, 32, 48, 48, 65, 51,
       48},
      {"bf16", WeightFormat::kBF16, ScaleType::kBF16, true, 32, 64, 72, 129, 72, 64},
      {"bf16 K 45 (padded to 48)", WeightFormat::kBF16, ScaleType::kBF16, true, 32, 37, 45, 20, 47,
       39},
      {"f32 K 50", WeightFormat::kF32, ScaleType::kBF16, true, 32, 20, 50, 30, 53, 21},
      {"f16 K 45", WeightFormat::kF16, ScaleType::kBF16, true, 32, 37, 45, 70, 45, 37},
      {"w4g32a", WeightFormat::kW4G32A, ScaleType::kF32, true, 32, 37, 96, 50, 96, 40},
      {"w8a", WeightFormat::kW8A, ScaleType::kF32, true, 32, 37, 96, 50, 98, 40},
      {"w8 g32 f16", WeightFormat::kW8, ScaleType::kF16, true, 32, 37, 64, 40, 64, 37},
      {"w8 g16 f32", WeightFormat::kW8, ScaleType::kF32, true, 16, 37, 48, 18, 50, 37},
      // 17000 x 1024 bf16 is 34.8 MB: two weight tiles of at most 32 MB, the second partial.
      {"w4g32 over two weight tiles", WeightFormat::kW4G32, ScaleType::kBF16, true, 32, 17000, 1024,
       17, 1024, 17003},
  };
  uint32_t seed = 1000;
  for (const MatmulCase& c : cases) {
    SCOPED_TRACE(c.name);
    expect_matmul_within_bf16_bound(cpu, *gpu, c, seed);
    seed += 10;
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// matmul_gelu_pairs on tensor cores: y[t][i] = gelu_tanh(p[t][2i]) · p[t][2i + 1] of the
// products p = x · Wᵀ, the pair epilogue applied after each weight tile's GEMM, against the
// spec's formula in double. A product is within δ = the matmul bound above of exact, and
// |gelu_tanh'| < 1.13, so an output is within 1.13 δ_a (|b| + δ_b) + (|gelu(a)| + 1.13 δ_a) δ_b,
// plus the fp32 evaluation of gelu_tanh (a few 2^-24 of |a|, times |b| + δ_b).
TEST(PrefillMatmul, GeluPairsPerWeightTileWithinTheBf16Bound) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  struct Case {
    const char* name;
    WeightFormat format;
    int64_t rows, cols, tokens, x_stride, y_stride;
  };
  // 1024 tokens keep 6144 weight rows of products (kPairProductsBytes): 8320 rows are two
  // tiles, the second partial.
  const Case cases[] = {{"w4g32 two pair tiles", WeightFormat::kW4G32, 8320, 64, 1024, 64, 4163},
                        {"bf16 one tile, strided", WeightFormat::kBF16, 96, 72, 20, 75, 50}};
  uint32_t seed = 3000;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const HostMatrix host = testing::random_matrix(c.format, c.rows, c.cols, seed);
    const testing::DeviceMatrix device(host);
    TwinRows x = random_rows(c.tokens, c.cols, c.x_stride, seed + 1);
    TwinRows y = output_rows(c.tokens, c.rows / 2, c.y_stride);
    gpu->matmul_gelu_pairs(device.view, x.gpu(), y.gpu());

    const double relative = 2 * kBf16Roundoff + kBf16Roundoff * kBf16Roundoff +
                            4.0 * static_cast<double>(c.cols) * kFp32Roundoff;
    std::vector<double> expected(c.tokens * c.y_stride, kPadding), bound(expected.size(), 0.0);
    testing::parallel_for(c.rows / 2, [&](int64_t i) {
      std::vector<float> gate(c.cols), up(c.cols);
      quant::dequantize_row(host.view(), 2 * i, gate.data());
      quant::dequantize_row(host.view(), 2 * i + 1, up.data());
      for (int64_t t = 0; t < c.tokens; ++t) {
        double a = 0.0, b = 0.0, a_magnitude = 0.0, b_magnitude = 0.0;
        for (int64_t k = 0; k < c.cols; ++k) {
          a += double{gate[k]} * x.at(t, k);
          b += double{up[k]} * x.at(t, k);
          a_magnitude += std::fabs(double{gate[k]} * x.at(t, k));
          b_magnitude += std::fabs(double{up[k]} * x.at(t, k));
        }
        const double gelu =
            0.5 * a *
            (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (a + 0.044715 * a * a * a)));
        const double delta_a = relative * a_magnitude, delta_b = relative * b_magnitude;
        expected[t * c.y_stride + i] = gelu * b;
        bound[t * c.y_stride + i] = 1.13 * delta_a * (std::fabs(b) + delta_b) +
                                    (std::fabs(gelu) + 1.13 * delta_a) * delta_b +
                                    16 * kFp32Roundoff * std::fabs(a) * (std::fabs(b) + delta_b);
      }
    });
    testing::expect_close(y.gpu_values(), expected, bound, 1.0, c.name);
    seed += 10;
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// set_fp32_activations keeps a 100-row pass on the fp32 kernels: within fp32 summation error.
TEST(PrefillMatmul, Fp32PrefillStaysOnTheFp32Kernels) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  static_cast<CudaBackend&>(*gpu).set_fp32_activations(true);
  CpuBackend cpu(0);
  const HostMatrix host = testing::random_matrix(WeightFormat::kW4G32, 64, 256, 7);
  const testing::DeviceMatrix device(host);
  TwinRows x = random_rows(100, 256, 256, 8);
  TwinRows y = output_rows(100, 64, 64);
  cpu.matmul(host.view(), x.cpu(), y.cpu());
  gpu->matmul(device.view, x.gpu(), y.gpu());
  const std::vector<float>& expected = y.cpu_values();
  std::vector<double> bound(expected.size());
  std::vector<float> row(256);
  for (int64_t n = 0; n < 64; ++n) {
    quant::dequantize_row(host.view(), n, row.data());
    for (int64_t t = 0; t < 100; ++t) {
      double sum = 0.0;
      for (int64_t k = 0; k < 256; ++k) sum += std::fabs(double{row[k]} * x.at(t, k));
      bound[t * 64 + n] = 2 * 256 * kFp32Roundoff * sum;  // both sides' fp32 sums
    }
  }
  testing::expect_close(y.gpu_values(), std::vector<double>(expected.begin(), expected.end()),
                        bound, 1.0, "fp32 prefill");
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// ---------------------------------------------------------------------------------------------
// Attention

struct AttentionCase {
  const char* name;
  int head_dim, q_heads, kv_heads;
  int64_t slots;
  int window;
  int32_t first_position;  // of the chunk's first query
  int64_t chunk;           // queries at first_position, first_position + 1, ...
};

void PrintTo(const AttentionCase& c, std::ostream* os) {
  *os << c.name;
}

// One layer's KV slots on the host and the device, filled as the engine leaves them once a
// chunk's K/V are stored: the last `slots` positions up to the chunk's last at slot p % slots
// (a ring wraps), slots never written empty, and a few slots emptied (forgotten). Empty slots
// hold NaN: attention must not read them into its sums.
struct TwinKv {
  TwinKv(const AttentionCase& c, uint32_t seed)
      : width(int64_t{c.kv_heads} * c.head_dim),
        keys(c.slots * width, kNaN),
        values(c.slots * width, kNaN),
        positions(c.slots, -1),
        view{nullptr, nullptr, nullptr, c.slots, c.kv_heads, c.head_dim} {
    const int32_t last = c.first_position + static_cast<int32_t>(c.chunk) - 1;
    const auto k = testing::random_floats(c.slots * width, -1.0f, 1.0f, seed);
    const auto v = testing::random_floats(c.slots * width, -1.0f, 1.0f, seed + 1);
    for (int32_t p = std::max<int32_t>(0, last - static_cast<int32_t>(c.slots) + 1); p <= last;
         ++p) {
      const int64_t slot = p % c.slots;
      positions[slot] = p;
      for (int64_t j = slot * width; j < (slot + 1) * width; ++j) {
        keys[j] = round_bf16(k[j]);
        values[j] = round_bf16(v[j]);
      }
    }
    // Forget three slots holding positions the chunk would see.
    for (int32_t p : {last, last - 5, std::max(0, last - 40)}) {
      const int64_t slot = p % c.slots;
      positions[slot] = -1;
      std::fill(keys.begin() + slot * width, keys.begin() + (slot + 1) * width, kNaN);
      std::fill(values.begin() + slot * width, values.begin() + (slot + 1) * width, kNaN);
    }
    device_keys = std::make_unique<DeviceArray<float>>(keys);
    device_values = std::make_unique<DeviceArray<float>>(values);
    device_positions = std::make_unique<DeviceArray<int32_t>>(positions);
  }
  engine::KvView cpu() {
    engine::KvView kv = view;
    kv.keys = keys.data();
    kv.values = values.data();
    kv.slot_positions = positions.data();
    return kv;
  }
  engine::KvView gpu() const {
    engine::KvView kv = view;
    kv.keys = device_keys->get();
    kv.values = device_values->get();
    kv.slot_positions = device_positions->get();
    return kv;
  }
  // max |v| over the slots of kv head h.
  double max_abs_value(int h, int head_dim) const {
    double m = 0.0;
    for (int64_t slot = 0; slot < view.slots; ++slot) {
      if (positions[slot] < 0) continue;
      for (int d = 0; d < head_dim; ++d) {
        m = std::max(m, double{std::fabs(values[slot * width + h * head_dim + d])});
      }
    }
    return m;
  }

  int64_t width;
  std::vector<float> keys, values;
  std::vector<int32_t> positions;
  engine::KvView view;
  std::unique_ptr<DeviceArray<float>> device_keys, device_values;
  std::unique_ptr<DeviceArray<int32_t>> device_positions;
};

class PrefillAttention : public ::testing::TestWithParam<AttentionCase> {
 protected:
  // Runs both backends on q (zero_query: all zeros) and checks every output element against
  // the bound of the file comment.
  void check(bool zero_query, uint32_t seed) {
    const AttentionCase& c = GetParam();
    auto gpu = make_gpu();
    ASSERT_TRUE(gpu);
    CpuBackend cpu(0);
    TwinKv kv(c, seed);
    const int64_t q_width = int64_t{c.q_heads} * c.head_dim;
    // Odd strides: rows not 16-byte aligned.
    TwinRows q = zero_query ? TwinRows(c.chunk, q_width, q_width + 3,
                                       std::vector<float>(c.chunk * (q_width + 3), 0.0f))
                            : random_rows(c.chunk, q_width, q_width + 3, seed + 2, true);
    TwinRows out = output_rows(c.chunk, q_width, q_width + 5);
    std::vector<int32_t> query_positions(c.chunk);
    for (int64_t t = 0; t < c.chunk; ++t) {
      query_positions[t] = c.first_position + static_cast<int32_t>(t);
    }
    DeviceArray<int32_t> device_positions(query_positions);
    // The scale makes scores spread over several units: the online softmax's rescaling matters.
    const float scale = 4.0f / std::sqrt(static_cast<float>(c.head_dim));
    cpu.attention(q.cpu(), query_positions.data(), kv.cpu(), c.window, scale, out.cpu());
    gpu->attention(q.gpu(), device_positions.get(), kv.gpu(), c.window, scale, out.gpu());

    const std::vector<float>& expected = out.cpu_values();
    std::vector<double> bound(expected.size(), 0.0);
    const int group = c.q_heads / c.kv_heads;
    const double sums = 8.0 * static_cast<double>(c.slots) * kFp32Roundoff;
    for (int64_t t = 0; t < c.chunk; ++t) {
      for (int h = 0; h < c.q_heads; ++h) {
        const int kv_head = h / group;
        double max_dot = 0.0;  // max over slots of Σ_d |q_d k_d|
        for (int64_t slot = 0; slot < c.slots; ++slot) {
          if (kv.positions[slot] < 0) continue;
          double dot = 0.0;
          for (int d = 0; d < c.head_dim; ++d) {
            dot += std::fabs(double{q.at(t, int64_t{h} * c.head_dim + d)} *
                             kv.keys[slot * kv.width + int64_t{kv_head} * c.head_dim + d]);
          }
          max_dot = std::max(max_dot, dot);
        }
        const double epsilon = scale * 4.0 * c.head_dim * kFp32Roundoff * max_dot;
        const double beta =
            zero_query ? 1.0 : std::exp(2 * epsilon) * (1 + kBf16Roundoff) / (1 - kBf16Roundoff);
        const double element_bound = (beta - 1 + sums) * kv.max_abs_value(kv_head, c.head_dim);
        for (int d = 0; d < c.head_dim; ++d) {
          bound[t * (q_width + 5) + int64_t{h} * c.head_dim + d] = element_bound;
        }
      }
    }
    testing::expect_close(out.gpu_values(), std::vector<double>(expected.begin(), expected.end()),
                          bound, 1.0, zero_query ? "uniform weights" : "random queries");
    EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
  }
};

TEST_P(PrefillAttention, UniformWeightsAverageExactlyTheVisibleValues) {
  check(/*zero_query=*/true, 1);
}

TEST_P(PrefillAttention, RandomQueriesWithinTheBf16Bound) {
  check(/*zero_query=*/false, 2);
}

INSTANTIATE_TEST_SUITE_P(
    Chunks, PrefillAttention,
    ::testing::Values(
        // name, head_dim, q heads, kv heads, slots, window, first position, chunk
        AttentionCase{"hd256_full_33", 256, 8, 1, 256, 0, 100, 33},
        AttentionCase{"hd256_sliding_ring_65", 256, 8, 1, 128, 64, 150, 65},
        AttentionCase{"hd256_gqa2_first_chunk_97", 256, 4, 2, 200, 0, 0, 97},
        AttentionCase{"hd256_gqa4_window_17", 256, 8, 2, 48, 16, 5, 17},
        AttentionCase{"hd512_full_129", 512, 8, 1, 160, 0, 20, 129},
        AttentionCase{"hd512_mha_ring_33", 512, 4, 4, 100, 40, 300, 33},
        AttentionCase{"hd512_gqa4_window_65", 512, 8, 2, 300, 50, 200, 65},
        // A head_dim the prefill kernel does not take: the generic kernel, as accurate.
        AttentionCase{"hd128_generic_fallback_33", 128, 4, 2, 64, 0, 10, 33},
        // A few rows (no tensor cores): one decode-kernel row per query, in fp32.
        AttentionCase{"hd256_gqa4_window_few_rows_5", 256, 8, 2, 48, 16, 30, 5},
        AttentionCase{"hd512_mha_ring_few_rows_12", 512, 4, 4, 100, 40, 300, 12}),
    [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Graphs: the engine records decode steps, and a batch of more than 16 sequences takes the
// tensor-core matmul (cuBLAS inside a stream capture, on its own workspace). A recorded
// tensor-core matmul and prefill attention replay bit for bit what plain launches computed.

TEST(PrefillGraph, RecordedPassesReplayBitForBit) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  ASSERT_TRUE(gpu->can_record());
  const HostMatrix host = testing::random_matrix(WeightFormat::kW4G32, 96, 256, 21);
  const testing::DeviceMatrix w(host);
  TwinRows x = random_rows(40, 256, 256, 22);
  TwinRows plain_y = output_rows(40, 96, 96), recorded_y = output_rows(40, 96, 96);

  const AttentionCase c{"graph", 256, 8, 1, 128, 64, 150, 33};
  TwinKv kv(c, 23);
  TwinRows q = random_rows(c.chunk, 8 * 256, 8 * 256, 24);
  TwinRows plain_out = output_rows(c.chunk, 8 * 256, 8 * 256);
  TwinRows recorded_out = output_rows(c.chunk, 8 * 256, 8 * 256);
  std::vector<int32_t> query_positions(c.chunk);
  for (int64_t t = 0; t < c.chunk; ++t) {
    query_positions[t] = c.first_position + static_cast<int32_t>(t);
  }
  DeviceArray<int32_t> positions(query_positions);

  // Plain first: it also creates what a recording may not (the cuBLAS handle, scratch).
  gpu->matmul(w.view, x.gpu(), plain_y.gpu());
  gpu->attention(q.gpu(), positions.get(), kv.gpu(), c.window, 0.0625f, plain_out.gpu());
  auto work = gpu->record([&] {
    gpu->matmul(w.view, x.gpu(), recorded_y.gpu());
    gpu->attention(q.gpu(), positions.get(), kv.gpu(), c.window, 0.0625f, recorded_out.gpu());
  });
  ASSERT_TRUE(work) << (gpu->status().ok() ? "" : gpu->status().error().to_string());
  gpu->replay(*work);
  EXPECT_EQ(recorded_y.gpu_values(), plain_y.gpu_values());
  EXPECT_EQ(recorded_out.gpu_values(), plain_out.gpu_values());
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// ---------------------------------------------------------------------------------------------
// Timings at E2B's shapes, for the GPU machine (not a check; run with
// --gtest_also_run_disabled_tests --gtest_filter='PrefillTiming.*'): the tensor-core matmul of
// each layer matrix (W4A16, bf16 scales) and prefill attention of the last 512- or 2048-query
// pass of a 4096-token prompt, median of 5 runs after a warm-up.

// Milliseconds `enqueue` takes on the backend's stream.
template <typename Enqueue>
double median_ms(engine::Backend& gpu, Enqueue enqueue) {
  cudaStream_t stream = static_cast<CudaBackend&>(gpu).stream();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  enqueue();  // warm-up: cuBLAS handle, scratch
  std::vector<double> runs;
  for (int i = 0; i < 5; ++i) {
    cudaEventRecord(start, stream);
    enqueue();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    runs.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

TEST(PrefillTiming, DISABLED_E2BShapes) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  struct Shape {
    const char* name;
    int64_t rows, cols;
  };
  const Shape shapes[] = {{"qkv", 2560, 1536},
                          {"o_proj", 1536, 2048},
                          {"gate_up", 12288, 1536},
                          {"down", 1536, 6144},
                          {"lm_head", 262144, 1536}};
  // x and y as large as the largest case: 4096 rows of K 6144 in, of N 12288 out.
  DeviceArray<float> x(size_t{4096} * 6144), y(size_t{4096} * 12288);
  CUDA_ASSERT_OK(cudaMemset(x.get(), 0, size_t{4096} * 6144 * sizeof(float)));
  for (const Shape& shape : shapes) {
    const testing::DeviceMatrix w(
        testing::random_matrix(WeightFormat::kW4G32, shape.rows, shape.cols, 1));
    // The lm_head sees one row per sequence (a 64-sequence batch); layers see whole passes.
    for (const int64_t tokens :
         shape.rows > 12288 ? std::vector<int64_t>{64} : std::vector<int64_t>{512, 4096}) {
      const Rows xs{x.get(), tokens, shape.cols, shape.cols};
      const Rows ys{y.get(), tokens, shape.rows, shape.rows};
      const double ms = median_ms(*gpu, [&] { gpu->matmul(w.view, xs, ys); });
      std::printf(
          "[ prefill timing ] matmul %-8s %6lld x %5lld, %4lld rows: %8.3f ms, %6.1f TFLOP/s\n",
          shape.name, static_cast<long long>(shape.rows), static_cast<long long>(shape.cols),
          static_cast<long long>(tokens), ms,
          2e-9 * static_cast<double>(shape.rows * shape.cols * tokens) / ms);
    }
  }
  // attention (the kernel itself, float and bf16 K/V, the backend's choice of splits): 8 q
  // heads on 1 kv head, the last pass of a 4096-token prompt (512 or 2048 queries) against a
  // sliding ring (window 512, window + pass - 1 slots) or a full cache (4096 slots).
  struct Layer {
    const char* name;
    int head_dim, window;
    int64_t queries;
  };
  cudaStream_t stream = static_cast<CudaBackend&>(*gpu).stream();
  for (const Layer& layer : {Layer{"sliding", 256, 512, 512}, Layer{"full", 512, 0, 512},
                             Layer{"sliding", 256, 512, 2048}, Layer{"full", 512, 0, 2048}}) {
    const int64_t queries = layer.queries, width = 8 * layer.head_dim;
    const int64_t slots = layer.window > 0 ? layer.window + queries - 1 : 4096;
    const int32_t first = static_cast<int32_t>(4096 - queries);
    std::vector<int32_t> slot_positions(slots), query_positions(queries);
    for (int32_t p = 0; p < 4096; ++p) slot_positions[p % slots] = p;
    for (int64_t t = 0; t < queries; ++t) query_positions[t] = first + static_cast<int32_t>(t);
    const auto k = testing::random_floats(slots * layer.head_dim, -1, 1, 2);
    const auto v = testing::random_floats(slots * layer.head_dim, -1, 1, 3);
    std::vector<uint16_t> k_bf16(k.size()), v_bf16(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k_bf16[i] = float_to_bf16(k[i]);
      v_bf16[i] = float_to_bf16(v[i]);
    }
    DeviceArray<float> keys(k), values(v);
    DeviceArray<uint16_t> keys_bf16(k_bf16), values_bf16(v_bf16);
    DeviceArray<int32_t> slots_device(slot_positions), positions(query_positions);
    DeviceArray<float> q(testing::random_floats(queries * width, -1, 1, 4));
    DeviceArray<float> out(static_cast<size_t>(queries * width));
    for (const KvType type : {KvType::kF32, KvType::kBF16}) {
      KvCacheView kv;
      kv.keys = type == KvType::kF32 ? static_cast<void*>(keys.get()) : keys_bf16.get();
      kv.values = type == KvType::kF32 ? static_cast<void*>(values.get()) : values_bf16.get();
      kv.slot_positions = slots_device.get();
      kv.type = type;
      kv.slots = slots;
      kv.kv_heads = 1;
      kv.head_dim = layer.head_dim;
      const int splits = prefill_attention_splits(queries, 8, kv);
      DeviceArray<float> partials(
          splits > 1 ? prefill_attention_partials_floats(queries, 8, layer.head_dim, splits) : 1);
      const double ms = median_ms(*gpu, [&] {
        CUDA_ASSERT_OK(prefill_attention({q.get(), queries, width, width}, positions.get(), kv,
                                         layer.window, 1.0f, {out.get(), queries, width, width},
                                         partials.get(), splits, Launch{stream, false}));
      });
      const double visible = layer.window > 0 ? layer.window : first + (queries + 1) / 2.0;
      std::printf(
          "[ prefill timing ] attention %-7s head_dim %d, %4lld queries, %s K/V, %d splits: %8.3f "
          "ms, %6.1f TFLOP/s\n",
          layer.name, layer.head_dim, static_cast<long long>(queries),
          type == KvType::kF32 ? "f32 " : "bf16", splits, ms,
          4e-9 * 8 * static_cast<double>(queries) * visible * layer.head_dim / ms);
    }
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

}  // namespace
}  // namespace gemma4::cuda
