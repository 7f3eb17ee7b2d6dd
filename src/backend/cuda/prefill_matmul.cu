// The tensor-core matmul's bf16 operands (prefill_kernels.h). One thread per 8 consecutive
// elements of an output row: one 16-byte store; the packed formats decode those 8 from one
// 32-bit word (4-bit formats) or one 8-byte load (kW8, kW8A), with the scale of their group, using
// the fp32 formulas of dequant.cuh's weight_at (the CPU reference's), rounded to bf16 once.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>

#include "backend/cuda/dequant.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/prefill_kernels.h"

namespace gemma4::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

__device__ __forceinline__ void store_bf16x8(const float (&v)[8], void* out) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    words[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  *static_cast<uint4*>(out) = make_uint4(words[0], words[1], words[2], words[3]);
}

// The 8 int8 values at `p` (8-byte aligned: one load) as floats (kW8, kW8A).
__device__ __forceinline__ void int8_levels(const uint8_t* p, float (&levels)[8]) {
  const uint2 q = *reinterpret_cast<const uint2*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t word = i < 4 ? q.x : q.y;
    levels[i] = static_cast<float>(static_cast<int8_t>((word >> (8 * (i % 4))) & 0xFF));
  }
}

// Elements k0 .. k0 + 7 of weight row `row` (zeros past cols).
__device__ __forceinline__ void weight_chunk(const MatrixView& m, int64_t row, int64_t k0,
                                             float (&v)[8]) {
  const auto* bytes = static_cast<const uint8_t*>(m.data);
  switch (m.format) {
    case MatrixFormat::kW4G32: {
      const uint32_t word = static_cast<const uint32_t*>(m.data)[row * (m.cols / 8) + k0 / 8];
      const float scale = group_scale(m, row * (m.cols / 32) + k0 / 32);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[i] = static_cast<float>(static_cast<int>((word >> (4 * i)) & 0xF) - 8) * scale;
      }
      return;
    }
    case MatrixFormat::kNVFP4: {
      // Element 2j in the low nibble of byte j: nibble i of the little-endian word is k0 + i.
      const uint32_t word = *reinterpret_cast<const uint32_t*>(bytes + row * (m.cols / 2) + k0 / 2);
      const float block =
          e4m3_bits_to_float(static_cast<const uint8_t*>(m.scales)[row * (m.cols / 16) + k0 / 16]);
      const float factor = m.nv_global_is_divisor ? block / m.nv_global : block * m.nv_global;
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = e2m1_bits_to_float((word >> (4 * i)) & 0xF) * factor;
      return;
    }
    case MatrixFormat::kW4G32A: {
      const uint32_t word = *reinterpret_cast<const uint32_t*>(bytes + row * (m.cols / 2) + k0 / 2);
      const float* scale_min =
          static_cast<const float*>(m.scales) + 2 * (row * (m.cols / 32) + k0 / 32);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // Two roundings, as weight_at and the CPU reference (no FMA contraction).
        v[i] = __fsub_rn(__fmul_rn(scale_min[0], static_cast<float>((word >> (4 * i)) & 0xF)),
                         scale_min[1]);
      }
      return;
    }
    case MatrixFormat::kW8: {
      float levels[8];
      int8_levels(bytes + row * m.cols + k0, levels);
      const float scale = group_scale(m, row * (m.cols / m.group_size) + k0 / m.group_size);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = levels[i] * scale;
      return;
    }
    case MatrixFormat::kW8A: {
      float levels[8];
      int8_levels(bytes + row * m.cols + k0, levels);
      const float* scale_min =
          static_cast<const float*>(m.scales) + 2 * (row * (m.cols / 32) + k0 / 32);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // Two roundings, as weight_at and the CPU reference (no FMA contraction).
        v[i] = __fsub_rn(__fmul_rn(scale_min[0], levels[i]), scale_min[1]);
      }
      return;
    }
    default:  // plain fp32 / bf16 / fp16: any K, so element by element
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = k0 + i < m.cols ? weight_at(m, row, k0 + i) : 0.0f;
      return;
  }
}

__global__ void __launch_bounds__(kThreads)
    weight_tile_kernel(MatrixView w, int64_t first_row, int64_t rows, int64_t padded_cols,
                       __nv_bfloat16* out) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();  // the previous tile's GEMM may still read `out`
  const int64_t chunks_per_row = padded_cols / 8;
  const int64_t chunks = rows * chunks_per_row;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < chunks;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / chunks_per_row;
    const int64_t k0 = (i - r * chunks_per_row) * 8;
    float v[8];
    weight_chunk(w, first_row + r, k0, v);
    store_bf16x8(v, out + r * padded_cols + k0);
  }
}

__global__ void __launch_bounds__(kThreads)
    activations_kernel(RowsView x, int64_t padded_cols, __nv_bfloat16* out) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t chunks_per_row = padded_cols / 8;
  const int64_t chunks = x.rows * chunks_per_row;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < chunks;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / chunks_per_row;
    const int64_t k0 = (i - r * chunks_per_row) * 8;
    const float* row = x.data + r * x.stride;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = k0 + j < x.width ? row[k0 + j] : 0.0f;
    store_bf16x8(v, out + r * padded_cols + k0);
  }
}

// Alignment the vector loads of weight_chunk need from the data pointer (every row then keeps
// it: packed rows are whole groups).
uintptr_t data_alignment(MatrixFormat format) {
  switch (format) {
    case MatrixFormat::kW4G32:
    case MatrixFormat::kNVFP4:
    case MatrixFormat::kW4G32A:
      return 4;
    case MatrixFormat::kW8:
    case MatrixFormat::kW8A:
      return 8;
    default:
      return 1;
  }
}

bool aligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

dim3 grid_for(int64_t chunks) {
  return dim3(static_cast<unsigned>(
      std::clamp<int64_t>((chunks + kThreads - 1) / kThreads, 1, kMaxBlocks)));
}

bool valid_weights(const MatrixView& w) {
  const int64_t group = scale_group(w);
  return w.rows > 0 && w.cols > 0 && w.data != nullptr && group >= 0 &&
         (group == 0 || (w.scales != nullptr && w.cols % group == 0)) &&
         aligned(w.data, data_alignment(w.format));
}

}  // namespace

bool tensor_core_matmul_accepts(const MatrixView& w, const RowsView& x, const RowsView& y) {
  const bool valid_rows = x.data != nullptr && y.data != nullptr && x.rows >= 1 &&
                          x.stride >= x.width && y.stride >= y.width;
  // cuBLAS takes int dimensions and leading dimensions.
  return valid_weights(w) && valid_rows && x.width == w.cols && y.width == w.rows &&
         y.rows == x.rows && bf16_padded_cols(w.cols) <= INT_MAX && w.rows <= INT_MAX &&
         x.rows <= INT_MAX && y.stride <= INT_MAX;
}

cudaError_t bf16_activations(const RowsView& x, int64_t padded_cols, void* out,
                             const Launch& launch) {
  if (x.data == nullptr || x.rows < 1 || padded_cols % 8 != 0 || padded_cols < x.width ||
      !aligned(out, 16)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel(activations_kernel, grid_for(x.rows * (padded_cols / 8)), dim3(kThreads), 0,
                       launch, x, padded_cols, static_cast<__nv_bfloat16*>(out));
}

cudaError_t bf16_weight_tile(const MatrixView& w, int64_t first_row, int64_t rows,
                             int64_t padded_cols, void* out, const Launch& launch) {
  if (!valid_weights(w) || first_row < 0 || rows < 1 || first_row + rows > w.rows ||
      padded_cols % 8 != 0 || padded_cols < w.cols || !aligned(out, 16)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel(weight_tile_kernel, grid_for(rows * (padded_cols / 8)), dim3(kThreads), 0,
                       launch, w, first_row, rows, padded_cols, static_cast<__nv_bfloat16*>(out));
}

}  // namespace gemma4::cuda
