// Kernels of the prefill paths (passes of many rows), used by CudaBackend (prefill_backend.cpp):
//  * the tensor-core matmul's operands: fp32 activation rows and tiles of a packed weight matrix
//    converted to bf16 (cuBLAS then multiplies them, fp32 accumulation and output);
//  * prefill attention: a chunk of queries of one sequence against its fp32, bf16 or e4m3 KV slots,
//    flash style (online softmax over key tiles) on bf16 tensor cores (mma.sync, fp32
//    accumulation), each K/V tile in shared memory serving every q head of its group and
//    several queries, the cache split among blocks when the rows alone do not fill the GPU.
// Plain parameter blocks (backend_kernels.h); every kernel is graph-capturable and takes the
// PDL hooks of launch.cuh.
#pragma once

#include <cstdint>

#include "backend/cuda/attention.h"
#include "backend/cuda/backend_kernels.h"
#include "backend/cuda/launch.h"

namespace gemma4::cuda {

// K as the bf16 operands store it: padded with zeros to a multiple of 8 elements, so every
// operand row starts 16-byte aligned (what cuBLAS's tensor-core kernels want).
inline int64_t bf16_padded_cols(int64_t cols) {
  return (cols + 7) / 8 * 8;
}

// Whether bf16_weight_tile/bf16_activations take these operands (formats, group sizes, the
// alignment of packed data) for y = x · wᵀ, and the shapes fit cuBLAS's int dimensions. No
// kernel is launched for operands it rejects.
bool tensor_core_matmul_accepts(const MatrixView& w, const RowsView& x, const RowsView& y);

// out[r][k] = bf16(x[r][k]) for k < x.width, 0 up to padded_cols; out is dense
// [x.rows][padded_cols], 16-byte aligned.
cudaError_t bf16_activations(const RowsView& x, int64_t padded_cols, void* out,
                             const Launch& launch);

// out[r][k] = bf16(w[first_row + r][k]) for r < rows, k < w.cols (dequantized exactly as
// quant::dequantize_row, then rounded to nearest), 0 up to padded_cols; out dense
// [rows][padded_cols], 16-byte aligned.
cudaError_t bf16_weight_tile(const MatrixView& w, int64_t first_row, int64_t rows,
                             int64_t padded_cols, void* out, const Launch& launch);

// engine::Backend::attention for any number of queries (q.rows) of one sequence: out[t] =
// softmax(scale · q[t] · Kᵀ + mask) · V per q head over the slots of `kv` (a uniform view of one
// sequence, fp32, bf16 or e4m3 K/V; same visibility rule: position p is visible to the query at
// P = positions[t] iff p <= P and (window == 0 or P − p < window); nothing visible gives
// zeros). head_dim 256 or 512; keys/values 16-byte aligned. Q, K, V and the softmax weights
// are rounded to bf16 for the tensor cores; scores, softmax and sums are fp32. With splits > 1
// the cache is divided among that many blocks per row tile, whose partials (`partials`:
// prefill_attention_partials_floats) a second kernel merges. Returns cudaErrorInvalidValue,
// launching nothing, for shapes it does not take (the generic attention_rows does).
cudaError_t prefill_attention(const RowsView& q, const int32_t* positions, const KvCacheView& kv,
                              int window, float scale, const RowsView& out, float* partials,
                              int splits, const Launch& launch);

// prefill_attention over the slots of `kv` and of `staged` together: a chunk's queries against
// the cache as it was before the chunk (its slots never hold a position of the chunk) and the
// chunk's own K/V, stored by prepare_attention into `staged` (a view of the same kv_heads,
// head_dim and element type; its slots hold nothing else) instead of the cache. So a sliding
// ring too small to write a chunk and then attend it (window - 1 + chunk live slots) attends it
// in one launch; store_staged_kv then updates the ring.
cudaError_t prefill_chunk_attention(const RowsView& q, const int32_t* positions,
                                    const KvCacheView& kv, const KvCacheView& staged, int window,
                                    float scale, const RowsView& out, float* partials, int splits,
                                    const Launch& launch);

// Leaves `kv` (the cache prefill_chunk_attention read, as a SequenceKv: first_row and rows unused)
// as writing every staged position's K/V in position order would: the staged slots whose position
// is among the last kv.slots staged ones are copied to slot position % kv.slots, which then
// records that position. One launch; cudaErrorInvalidValue, launching nothing, for views
// prefill_chunk_attention does not take.
cudaError_t store_staged_kv(const KvCacheView& staged, const SequenceKv& kv, const Launch& launch);

// Splits that fill the GPU for `queries` queries of q_heads heads against `kv` (a function of
// the shapes and the cache's capacity only, so a recorded pass replays the same launches).
int prefill_attention_splits(int64_t queries, int q_heads, const KvCacheView& kv);

// Floats of partials prefill_attention needs with `splits` > 1.
size_t prefill_attention_partials_floats(int64_t queries, int q_heads, int head_dim, int splits);

}  // namespace gemma4::cuda
