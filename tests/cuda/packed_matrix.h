// Packed weight matrices for the CUDA kernel tests: seeded random matrices of every packed format
// (w4g32, NVFP4, bf16, and the GGUF repacks w4g32a, w8, f16 with the layouts the GGUF loader
// makes) on the host (viewed as quant::QMatrix for the CPU oracles) and their device copies.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/numeric.h"
#include "cuda_test_util.h"
#include "quant/qmatrix.h"
#include "quant/quantize.h"

namespace gemma4::cuda::testing {

using quant::QMatrix;
using quant::ScaleType;
using quant::WeightFormat;

// A packed matrix owned on the host; view() for quant's CPU oracle (dequantize_row).
using HostMatrix = quant::PackedMatrix;

template <typename T>
std::vector<std::byte> as_bytes(const std::vector<T>& v) {
  std::vector<std::byte> bytes(v.size() * sizeof(T));
  std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

// fp16 or fp32 (`type`) copies of `values`.
inline std::vector<std::byte> f16_or_f32_bytes(const std::vector<float>& values, ScaleType type) {
  if (type == ScaleType::kF32) return as_bytes(values);
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = float_to_fp16(values[i]);
  return as_bytes(bits);
}

// scale_type: the w4g32 / w8 scale type (w4g32a's and w8a's are always fp32); group_size: w8's (16,
// 32).
inline HostMatrix random_matrix(WeightFormat format, int64_t rows, int64_t cols, uint32_t seed,
                                ScaleType scale_type = ScaleType::kBF16, bool nv_divisor = true,
                                int group_size = 32) {
  HostMatrix m;
  m.format = format;
  m.rows = rows;
  m.cols = cols;
  const bool scale_min_pairs = format == WeightFormat::kW4G32A || format == WeightFormat::kW8A;
  m.scale_type = scale_min_pairs ? ScaleType::kF32 : scale_type;
  m.group_size = group_size;
  if (scale_min_pairs) {
    // {scale, min} pairs: K-quant-like positive scales, mins of either sign.
    const auto scales = testing::random_floats(rows * cols / 32, 0.002f, 0.03f, seed + 1);
    const auto mins = testing::random_floats(rows * cols / 32, -0.1f, 0.1f, seed + 2);
    std::vector<float> pairs;
    for (size_t g = 0; g < scales.size(); ++g) pairs.insert(pairs.end(), {scales[g], mins[g]});
    m.scales = as_bytes(pairs);
  }
  if (format == WeightFormat::kW4G32A) {
    m.data = as_bytes(testing::random_words(rows * cols / 8, seed));
  } else if (format == WeightFormat::kW8A) {
    // Every 5-bit level 0..31, as Q5_1 / Q5_K repack.
    m.data = as_bytes(testing::random_words(rows * cols / 4, seed));
    for (std::byte& level : m.data) level &= std::byte{31};
  } else if (format == WeightFormat::kW8) {
    // Every int8 value, -128 included (Q8_0 stores -127..127, Q6_K -32..31).
    m.data = as_bytes(testing::random_words(rows * cols / 4, seed));
    m.scales = f16_or_f32_bytes(
        testing::random_floats(rows * cols / group_size, -0.01f, 0.01f, seed + 1), scale_type);
  } else if (format == WeightFormat::kF16) {
    m.data =
        f16_or_f32_bytes(testing::random_floats(rows * cols, -0.05f, 0.05f, seed), ScaleType::kF16);
  } else if (format == WeightFormat::kW4G32) {
    m.data = as_bytes(testing::random_words(rows * cols / 8, seed));
    const auto s = testing::random_floats(rows * cols / 32, 0.002f, 0.03f, seed + 1);
    if (scale_type == ScaleType::kF32) {
      m.scales = as_bytes(s);
    } else {
      std::vector<uint16_t> bits(s.size());
      for (size_t i = 0; i < s.size(); ++i) {
        bits[i] = scale_type == ScaleType::kBF16 ? float_to_bf16(s[i]) : float_to_fp16(s[i]);
      }
      m.scales = as_bytes(bits);
    }
  } else if (format == WeightFormat::kNVFP4) {
    m.data = as_bytes(testing::random_words(rows * cols / 8, seed));
    // Positive e4m3 block scales from 2^-3 to ~2^3, and some all-zero blocks.
    const auto codes = testing::random_words(rows * cols / 16, seed + 1);
    m.scales.resize(codes.size());
    for (size_t i = 0; i < codes.size(); ++i) {
      m.scales[i] =
          codes[i] % 64 == 0 ? std::byte{0} : static_cast<std::byte>(0x20 + codes[i] % 0x30);
    }
    // Not a power of two: the divisor and multiplier conventions round differently.
    m.nv_global = nv_divisor ? quant::NvGlobalScale{3584.7f, true}
                             : quant::NvGlobalScale{1.0f / 3584.7f, false};
  } else {
    const auto w = testing::random_floats(rows * cols, -0.05f, 0.05f, seed);
    std::vector<uint16_t> bits(w.size());
    for (size_t i = 0; i < w.size(); ++i) bits[i] = float_to_bf16(w[i]);
    m.data = as_bytes(bits);
  }
  return m;
}

// Row `row` of the weights the tensor-core GEMV multiplies (gemv_mma_kernels.h): w4g32 as
// bf16((u − 8) · bf16(scale)) from the oracle's (u − 8) · scale (quant::dequantize_row), the other
// formats as the oracle's values (NVFP4's e2m1 · e4m3 are exact in bf16).
inline void mma_dequantize_row(const HostMatrix& host, int64_t row, float* w) {
  quant::dequantize_row(host.view(), row, w);
  if (host.format != WeightFormat::kW4G32) return;
  const int64_t groups = host.cols / 32;
  const int64_t scale_bytes = host.scale_type == ScaleType::kF32 ? 4 : 2;
  for (int64_t group = 0; group < groups; ++group) {
    const std::byte* bits = host.scales.data() + (row * groups + group) * scale_bytes;
    float scale = 0.0f;
    if (host.scale_type == ScaleType::kF32) {
      std::memcpy(&scale, bits, 4);
    } else {
      uint16_t half = 0;
      std::memcpy(&half, bits, 2);
      scale = host.scale_type == ScaleType::kBF16 ? bf16_to_float(half) : fp16_to_float(half);
    }
    for (int64_t e = 32 * group; e < 32 * (group + 1); ++e) {
      const float centered = scale == 0.0f ? 0.0f : std::nearbyint(w[e] / scale);  // u − 8
      w[e] = round_bf16(centered * round_bf16(scale));
    }
  }
}

struct DeviceMatrix {
  explicit DeviceMatrix(const HostMatrix& host)
      : data(host.data), scales(host.scales.empty() ? std::vector<std::byte>(1) : host.scales) {
    view.format = host.format;
    view.rows = host.rows;
    view.cols = host.cols;
    view.data = data.get();
    view.scales = host.scales.empty() ? nullptr : scales.get();
    view.scale_type = host.scale_type;
    view.nv_global = host.nv_global;
    view.group_size = host.group_size;
  }
  DeviceArray<std::byte> data;
  DeviceArray<std::byte> scales;
  QMatrix view;
};

}  // namespace gemma4::cuda::testing
