// The tensor-core matmul (prefill_matmul.h) and CudaBackend's use of it.
#include "backend/cuda/prefill_matmul.h"

#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/prefill_kernels.h"

namespace gemma4::cuda {
namespace {

// cuBLAS's recommended workspace on Hopper (its split-K kernels use it).
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
constexpr int64_t kGemmTileEdge = 128;

Error cublas_error(const char* what, cublasStatus_t status) {
  return make_error(ErrorCode::kInternal, "CUDA backend: {}: {}", what,
                    cublasGetStatusString(status));
}

}  // namespace

int64_t weight_tile_rows(int64_t rows, int64_t padded_cols) {
  const auto cap = static_cast<int64_t>(kWeightTileBytes / (sizeof(uint16_t) * padded_cols));
  const int64_t edges = cap / kGemmTileEdge * kGemmTileEdge;
  return std::clamp<int64_t>(edges > 0 ? edges : cap, 1, rows);
}

int64_t pair_tile_rows(int64_t tile_rows, int64_t tokens) {
  const auto cap = static_cast<int64_t>(kPairProductsBytes / (sizeof(float) * tokens));
  int64_t rows = std::min(tile_rows, std::max(kGemmTileEdge, cap / kGemmTileEdge * kGemmTileEdge));
  rows -= rows % 2;
  return std::max<int64_t>(rows, 2);
}

Expected<std::unique_ptr<CublasContext>> CublasContext::create(cudaStream_t stream) {
  void* workspace = nullptr;
  if (const cudaError_t status = cudaMalloc(&workspace, kCublasWorkspaceBytes);
      status != cudaSuccess) {
    cudaGetLastError();
    return make_error(ErrorCode::kResourceExhausted,
                      "CUDA backend: no {} bytes of GPU memory for the cuBLAS workspace: {}",
                      kCublasWorkspaceBytes, cudaGetErrorString(status));
  }
  cublasHandle_t handle = nullptr;
  cublasStatus_t status = cublasCreate(&handle);
  if (status == CUBLAS_STATUS_SUCCESS) status = cublasSetStream(handle, stream);
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasSetWorkspace(handle, workspace, kCublasWorkspaceBytes);
  }
  if (status != CUBLAS_STATUS_SUCCESS) {
    if (handle != nullptr) cublasDestroy(handle);
    cudaFree(workspace);
    return cublas_error("creating the cuBLAS handle", status);
  }
  return std::unique_ptr<CublasContext>(new CublasContext(handle, workspace));
}

CublasContext::~CublasContext() {
  cublasDestroy(handle_);
  cudaFree(workspace_);
}

Status CublasContext::gemm(const void* w_bf16, int64_t weight_rows, const void* x_bf16,
                           int64_t tokens, int64_t k, float* y, int64_t y_stride) {
  // Column-major, cuBLAS's view: y is the weight_rows × tokens matrix yᵀ (ld y_stride), the
  // row-major w [weight_rows][k] is the k × weight_rows matrix wᵀ, so yᵀ = (wᵀ)ᵀ · xᵀ.
  const float one = 1.0f, zero = 0.0f;
  const auto m = static_cast<int>(weight_rows), n = static_cast<int>(tokens);
  const auto depth = static_cast<int>(k), ldc = static_cast<int>(y_stride);
  const cublasStatus_t status = cublasGemmEx(
      handle_, CUBLAS_OP_T, CUBLAS_OP_N, m, n, depth, &one, w_bf16, CUDA_R_16BF, depth, x_bf16,
      CUDA_R_16BF, depth, &zero, y, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (status != CUBLAS_STATUS_SUCCESS) return cublas_error("matmul (cublasGemmEx)", status);
  return Status::ok_status();
}

bool CudaBackend::tensor_core_rows(int64_t rows) const {
  return !fp32_activations_ && rows > kTensorCoreMaxGemvRows;
}

void CudaBackend::tensor_core_matmul(const MatrixView& w, const RowsView& x, const RowsView& y,
                                     bool gelu_pairs) {
  join_side_branch();  // cuBLAS and the scratch below serve the main stream
  if (cublas_ == nullptr) {
    launch();  // the device current
    auto created = CublasContext::create(stream_);
    if (!created.ok()) {
      fail(created.error().code, created.error().message);
      return;
    }
    cublas_ = std::move(*created);
  }
  const int64_t padded_cols = bf16_padded_cols(w.cols);
  // bf16 weights whose rows are already the GEMM's (no padding, 16-byte aligned: the tied
  // lm_head, an NVFP4 checkpoint's unquantized layers) go to cuBLAS where they are: a tile copy
  // would be an exact bf16 copy, a write and a read of the whole matrix more. Then one GEMM
  // covers the matrix unless the GELU pairs need their products per tile.
  const bool in_place = w.format == MatrixFormat::kBF16 && w.cols == padded_cols &&
                        reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
  int64_t tile_rows = in_place ? w.rows : weight_tile_rows(w.rows, padded_cols);
  float* products = nullptr;  // gelu_pairs: one tile's products
  if (gelu_pairs) {
    tile_rows = pair_tile_rows(std::min(tile_rows, weight_tile_rows(w.rows, padded_cols)), x.rows);
    products = static_cast<float*>(
        scratch(pair_products_, sizeof(float) * static_cast<size_t>(x.rows * tile_rows)));
    if (products == nullptr) return;
  }
  void* activations =
      scratch(prefill_activations_, sizeof(uint16_t) * static_cast<size_t>(x.rows * padded_cols));
  void* copied = in_place
                     ? nullptr
                     : scratch(prefill_weights_,
                               sizeof(uint16_t) * static_cast<size_t>(tile_rows * padded_cols));
  if (activations == nullptr || (!in_place && copied == nullptr)) return;
  launched(bf16_activations(x, padded_cols, activations, launch()), "matmul (bf16 activations)");
  for (int64_t first = 0; first < w.rows && status_.ok(); first += tile_rows) {
    const int64_t rows = std::min(tile_rows, w.rows - first);
    const void* weights = copied;
    if (in_place) {
      weights = static_cast<const uint16_t*>(w.data) + first * w.cols;
    } else {
      launched(bf16_weight_tile(w, first, rows, padded_cols, copied, launch()),
               "matmul (bf16 weight tile)");
    }
    if (!status_.ok()) return;
    const Status gemm = products != nullptr ? cublas_->gemm(weights, rows, activations, x.rows,
                                                            padded_cols, products, rows)
                                            : cublas_->gemm(weights, rows, activations, x.rows,
                                                            padded_cols, y.data + first, y.stride);
    if (!gemm.ok()) {
      fail(gemm.error().code, gemm.error().message);
      return;
    }
    ++kernels_;
    if (products != nullptr) {
      const GemvOutput pairs = {y.data + first / 2, y.stride, GemvEpilogue::kGeluPairs};
      launched(gemv_epilogue(products, x.rows, rows, rows, pairs, launch()),
               "matmul_gelu_pairs (epilogue)");
    }
  }
}

}  // namespace gemma4::cuda
