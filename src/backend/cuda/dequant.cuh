// Device-side element access to a packed matrix (backend_kernels.h MatrixView): the value of one
// weight, computed exactly as the CPU reference quant::dequantize_row does. For the slow generic
// paths (embedding rows, the fallback matmul); the GEMV kernels decode whole 16-byte chunks.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/backend_kernels.h"

namespace gemma4::cuda {

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// F8_E4M3 (e4m3fn): bias 7, subnormals, 0x7F/0xFF NaN.
__device__ __forceinline__ float e4m3_bits_to_float(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = __int_as_float(0x7FC00000);
  } else if (exponent == 0) {
    magnitude = ldexpf(static_cast<float>(mantissa), -9);
  } else {
    magnitude = ldexpf(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  }
  return (bits & 0x80) ? -magnitude : magnitude;
}

// FP4 E2M1: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float e2m1_bits_to_float(uint8_t code) {
  constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float magnitude = kMagnitudes[code & 0x7];
  return (code & 0x8) ? -magnitude : magnitude;
}

// kW4G32 / kW8 group scale `index` of the row-major scale array.
__device__ __forceinline__ float group_scale(const MatrixView& m, int64_t index) {
  switch (m.scale_type) {
    case 0:  // bf16
      return bf16_bits_to_float(static_cast<const uint16_t*>(m.scales)[index]);
    case 1:  // f16
      return __half2float(static_cast<const __half*>(m.scales)[index]);
    default:  // f32
      return static_cast<const float*>(m.scales)[index];
  }
}

// W[row][k] as fp32.
__device__ __forceinline__ float weight_at(const MatrixView& m, int64_t row, int64_t k) {
  switch (m.format) {
    case MatrixFormat::kF32:
      return static_cast<const float*>(m.data)[row * m.cols + k];
    case MatrixFormat::kBF16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(m.data)[row * m.cols + k]);
    case MatrixFormat::kW4G32: {
      const uint32_t word = static_cast<const uint32_t*>(m.data)[row * (m.cols / 8) + k / 8];
      const int u = static_cast<int>((word >> (4 * (k % 8))) & 0xF);
      return static_cast<float>(u - 8) * group_scale(m, row * (m.cols / 32) + k / 32);
    }
    case MatrixFormat::kF16:
      return __half2float(__ushort_as_half(static_cast<const uint16_t*>(m.data)[row * m.cols + k]));
    case MatrixFormat::kW4G32A: {
      const uint8_t byte = static_cast<const uint8_t*>(m.data)[row * (m.cols / 2) + k / 2];
      const int u = (k % 2 == 0) ? (byte & 0xF) : (byte >> 4);
      const float* scale_min =
          static_cast<const float*>(m.scales) + 2 * (row * (m.cols / 32) + k / 32);
      // Two roundings, as the CPU reference: nvcc would otherwise fuse this into one FMA, which
      // agrees only while scale · u is exact (true of real K-quant scales, not of any fp32).
      return __fsub_rn(__fmul_rn(scale_min[0], static_cast<float>(u)), scale_min[1]);
    }
    case MatrixFormat::kW8: {
      const int8_t q = static_cast<const int8_t*>(m.data)[row * m.cols + k];
      return static_cast<float>(q) *
             group_scale(m, row * (m.cols / m.group_size) + k / m.group_size);
    }
    case MatrixFormat::kW8A: {
      const int8_t q = static_cast<const int8_t*>(m.data)[row * m.cols + k];
      const float* scale_min =
          static_cast<const float*>(m.scales) + 2 * (row * (m.cols / 32) + k / 32);
      return __fsub_rn(__fmul_rn(scale_min[0], static_cast<float>(q)), scale_min[1]);  // as kW4G32A
    }
    case MatrixFormat::kNVFP4: {
      const uint8_t byte = static_cast<const uint8_t*>(m.data)[row * (m.cols / 2) + k / 2];
      const uint8_t code = (k % 2 == 0) ? (byte & 0xF) : (byte >> 4);
      const float block =
          e4m3_bits_to_float(static_cast<const uint8_t*>(m.scales)[row * (m.cols / 16) + k / 16]);
      const float factor = m.nv_global_is_divisor ? block / m.nv_global : block * m.nv_global;
      return e2m1_bits_to_float(code) * factor;
    }
  }
  return 0.0f;
}

}  // namespace gemma4::cuda
