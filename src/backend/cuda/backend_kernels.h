// The kernels behind CudaBackend's operations that the decode kernels (gemv.h, elementwise.h,
// attention.h) do not cover: embedding lookup, a matmul for any shape and format, RoPE on its
// own, row maps (add, scale, softcap, copy), the KV store, attention for any head_dim and for
// prefill chunks, the MoE router and the gather/scatter of the simple expert loop. Plain
// parameter blocks only (no quant/ or model/ headers: nvcc cannot parse fmt); cuda_backend.cpp
// translates. All pointers are device pointers; every kernel is graph-capturable (per-step values
// are read from device memory).
#pragma once

#include <cstdint>

#include "backend/cuda/attention.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/launch.h"

namespace gemma4::cuda {

// quant::WeightFormat values (static_asserted in cuda_backend.cpp).
enum class MatrixFormat : uint8_t { kF32, kBF16, kW4G32, kNVFP4, kW4G32A, kW8, kF16, kW8A };

// A quant::QMatrix in device memory (see quant/qmatrix.h for the layouts).
struct MatrixView {
  MatrixFormat format = MatrixFormat::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  const void* data = nullptr;
  const void* scales = nullptr;  // kW4G32A, kW8A: fp32 {scale, min} pairs, the mins included
  int scale_type = 0;            // quant::ScaleType value (kW4G32, kW8)
  float nv_global = 1.0f;
  int nv_global_is_divisor = 0;
  int group_size = 32;  // K elements per kW8 scale (16 or 32)
};

// K elements per scale of `m` (0: no scales; -1: a kW8 group size the kernels do not take).
inline int64_t scale_group(const MatrixView& m) {
  switch (m.format) {
    case MatrixFormat::kW4G32:
    case MatrixFormat::kW4G32A:
    case MatrixFormat::kW8A:
      return 32;
    case MatrixFormat::kNVFP4:
      return 16;
    case MatrixFormat::kW8:
      return m.group_size == 16 || m.group_size == 32 ? m.group_size : -1;
    default:
      return 0;
  }
}

// out[t] = row ids[t] of `table`, dequantized exactly as quant::dequantize_row, times `scale`.
// An id outside [0, table.rows) gives a zero row.
cudaError_t embed_rows(const MatrixView& table, const int32_t* ids, float scale,
                       const RowsView& out, const Launch& launch);

// y[t][n] = Σ_k x[t][k] · w[n][k] for any shape, stride and alignment: the fallback for what the
// packed GEMV does not take (fp32 weights, K not a multiple of 32, unaligned rows). Dequantizes
// element by element: correct, not fast.
cudaError_t matmul_rows(const MatrixView& w, const RowsView& x, const RowsView& y,
                        const Launch& launch);

// In place, half-split RoPE of every head (head_dim wide) of x[t]: pair (i, i + head_dim/2)
// rotates by fp32(positions[t]) · inv_freq[i] (inv_freq: head_dim/2 floats,
// engine::rope_inverse_frequencies uploaded once, so the angles equal the CPU reference's).
cudaError_t rope_rows(const RowsView& x, int head_dim, const int32_t* positions,
                      const float* inv_freq, const Launch& launch);

enum class RowMap : uint8_t {
  kAdd,      // acc += x
  kScale,    // acc = (acc · column_scale[j]) · scalar (column_scale may be null)
  kSoftcap,  // acc = scalar · tanh(acc / scalar)
  kCopy,     // acc = x
};
// Applies `map` to every element of `acc` (x: same shape, unused by kScale/kSoftcap).
cudaError_t map_rows(RowMap map, const RowsView& acc, const RowsView& x, const float* column_scale,
                     float scalar, const Launch& launch);

// One sequence's KV store for one layer (engine::KvView): `slots` entries of
// [kv_heads · head_dim] elements of `type` for K and V, and the position each slot holds (-1 =
// empty).
struct KvSlots {
  void* keys = nullptr;
  void* values = nullptr;
  int32_t* slot_positions = nullptr;
  int64_t slots = 0;
  int kv_heads = 0;
  int head_dim = 0;
  KvType type = KvType::kF32;
};

// Stores k[t], v[t] (rounded to the cache's type) at slot positions[t] % slots and records the
// position. The rows' positions
// must fall in distinct slots (the engine never writes more than `slots` tokens in one pass).
cudaError_t write_kv(const KvSlots& kv, const RowsView& k, const RowsView& v,
                     const int32_t* positions, const Launch& launch);

// Marks every slot holding a position >= from_position empty.
cudaError_t forget_kv(const KvSlots& kv, int64_t from_position, const Launch& launch);

// Attention of q.rows queries of one sequence (query t at positions[t]) against its slots, any
// head_dim that is a multiple of 32 up to 512 (engine::Backend::attention semantics). One block
// per (query head, query): correct for prefill chunks and odd shapes; decode of the real models
// goes through decode_attention (attention.h).
cudaError_t attention_rows(const RowsView& q, const int32_t* positions, const KvSlots& kv,
                           int window, float scale, const RowsView& out, const Launch& launch);

}  // namespace gemma4::cuda
