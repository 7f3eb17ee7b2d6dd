// Embedding lookup and the generic matmul (backend_kernels.h): element-wise dequantization
// through dequant.cuh, fp32 math.
#include <algorithm>

#include "backend/cuda/backend_kernels.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/launch.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    embed_kernel(MatrixView table, const int32_t* ids, float scale, RowsView out) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t t = blockIdx.y;
  const int32_t id = ids[t];
  const bool valid = id >= 0 && id < table.rows;
  float* row = out.data + t * out.stride;
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < out.width;
       j += int64_t{gridDim.x} * blockDim.x) {
    row[j] = valid ? weight_at(table, id, j) * scale : 0.0f;
  }
}

// Tokens per block of the generic matmul: each weight element is dequantized once for these.
constexpr int kMatmulTokens = 4;
constexpr int kMatmulWarps = kThreads / 32;

// Warp w of block (bx, by) computes y[t][n] for n = bx · 8 + w and the kMatmulTokens tokens of
// tile by; lanes stride K, then a shuffle reduction.
__global__ void __launch_bounds__(kThreads) matmul_kernel(MatrixView w, RowsView x, RowsView y) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int lane = threadIdx.x & 31;
  const int64_t n = blockIdx.x * int64_t{kMatmulWarps} + threadIdx.x / 32;
  const int64_t first_token = blockIdx.y * int64_t{kMatmulTokens};
  if (n >= w.rows) return;
  const int tokens = static_cast<int>(min(int64_t{kMatmulTokens}, x.rows - first_token));
  float acc[kMatmulTokens] = {};
  for (int64_t k = lane; k < w.cols; k += 32) {
    const float weight = weight_at(w, n, k);
#pragma unroll
    for (int i = 0; i < kMatmulTokens; ++i) {
      if (i < tokens) acc[i] = fmaf(x.data[(first_token + i) * x.stride + k], weight, acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < kMatmulTokens; ++i) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      acc[i] += __shfl_xor_sync(0xFFFFFFFFu, acc[i], offset);
    if (lane == 0 && i < tokens) y.data[(first_token + i) * y.stride + n] = acc[i];
  }
}

bool valid_matrix(const MatrixView& m) {
  const int64_t group = scale_group(m);
  return m.rows > 0 && m.cols > 0 && m.data != nullptr && group >= 0 &&
         (group == 0 || (m.scales != nullptr && m.cols % group == 0));
}

bool valid_rows(const RowsView& v) {
  return v.data != nullptr && v.rows >= 1 && v.width >= 1 && v.stride >= v.width;
}

}  // namespace

cudaError_t embed_rows(const MatrixView& table, const int32_t* ids, float scale,
                       const RowsView& out, const Launch& launch) {
  if (!valid_matrix(table) || ids == nullptr || !valid_rows(out) || out.width != table.cols ||
      out.rows > 65535) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks_x = std::min<int64_t>((out.width + kThreads - 1) / kThreads, 1024);
  return launch_kernel(embed_kernel,
                       dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(out.rows)),
                       dim3(kThreads), 0, launch, table, ids, scale, out);
}

cudaError_t matmul_rows(const MatrixView& w, const RowsView& x, const RowsView& y,
                        const Launch& launch) {
  if (!valid_matrix(w) || !valid_rows(x) || !valid_rows(y) || x.width != w.cols ||
      y.width != w.rows || y.rows != x.rows) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks_x = (w.rows + kMatmulWarps - 1) / kMatmulWarps;
  const int64_t blocks_y = (x.rows + kMatmulTokens - 1) / kMatmulTokens;
  if (blocks_x > 0x7FFFFFFF || blocks_y > 65535) return cudaErrorInvalidValue;
  return launch_kernel(matmul_kernel,
                       dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y)),
                       dim3(kThreads), 0, launch, w, x, y);
}

}  // namespace gemma4::cuda
