// The tensor-core matmul of prefill passes (host side; the operand kernels are in
// prefill_kernels.h): y = x · Wᵀ as bf16 × bf16 products with fp32 accumulation and output
// (cublasGemmEx), the packed W dequantized to bf16 one tile of rows at a time into a bounded
// scratch (no 16-bit copy of a matrix outlives the call), the fp32 x rounded to bf16 once.
//
// When: more than kTensorCoreMaxGemvRows rows. The decode GEMV reads the packed weights once per
// 64 rows but multiplies on CUDA cores: from M = 8 on it is compute-bound (bench/RESULTS.md run
// 1: E2B gate+up 5.6 µs at M = 1, 33 µs at M = 8, 234 µs at M = 64), while the tensor-core path
// costs about one packed read plus a bf16 write and read of the matrix (~20 µs for that gate+up)
// at any M up to the thousands. Up to 16 rows stay on the GEMV, so batched decode of up to 16
// sequences keeps the fp32 numerics of single-sequence decode.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/status.h"

namespace gemma4::cuda {

inline constexpr int64_t kTensorCoreMaxGemvRows = 16;

// Bytes of dequantized bf16 weights one GEMM takes at most: 32 MB stays within the H200's L2
// (60 MB), so the GEMM reads the tile mostly where the dequantizer just wrote it, and bounds
// the scratch (an lm_head of 262144 x 1536 takes 25 tiles).
inline constexpr size_t kWeightTileBytes = size_t{32} << 20;

// Rows of a W with padded_cols bf16 columns per weight tile: a multiple of 128 (the GEMM's
// tile edge) when the cap allows, never more than the matrix, at least one.
int64_t weight_tile_rows(int64_t rows, int64_t padded_cols);

// fp32 products of one weight tile that the GELU-pairs matmul keeps for its epilogue: small
// enough to be read back from L2 (the products of a whole pass, x.rows · W.rows floats, are
// 200 MB for E2B's gate/up at 2048 rows: written to and read back from HBM).
inline constexpr size_t kPairProductsBytes = size_t{24} << 20;

// Rows of a weight tile (tile_rows from weight_tile_rows) whose products for `tokens` rows fit
// kPairProductsBytes: a multiple of 128 when possible, even (whole gate/up pairs), at least 2.
int64_t pair_tile_rows(int64_t tile_rows, int64_t tokens);

// A cuBLAS handle bound to one stream, with a workspace of its own: cuBLAS then never
// allocates (legal inside a graph capture) and picks the same kernels every call
// (deterministic results).
class CublasContext {
 public:
  // The device must be current.
  static Expected<std::unique_ptr<CublasContext>> create(cudaStream_t stream);
  ~CublasContext();
  CublasContext(const CublasContext&) = delete;
  CublasContext& operator=(const CublasContext&) = delete;

  // Row-major y[t][n] (ld y_stride) = Σ_k x[t][k] · w[n][k] over bf16 operands, both dense
  // with row length k (a multiple of 8): `weight_rows` rows of w, `tokens` rows of x.
  Status gemm(const void* w_bf16, int64_t weight_rows, const void* x_bf16, int64_t tokens,
              int64_t k, float* y, int64_t y_stride);

 private:
  CublasContext(cublasHandle_t handle, void* workspace) : handle_(handle), workspace_(workspace) {}
  cublasHandle_t handle_;
  void* workspace_;
};

}  // namespace gemma4::cuda
