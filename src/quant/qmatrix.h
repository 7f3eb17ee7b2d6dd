// Internal weight formats (DESIGN.md "Internal weight formats") and the view every kernel reads.
// A QMatrix never owns its bytes: it points into an mmapped checkpoint, a host buffer or device
// memory, so a packed matrix is never expanded to 16 bits in memory.
//
// The CPU reference functions below (dequantize_row, dot_row) are the oracle every other kernel
// is checked against: plain loops, exactly the formulas of weight-formats.md. They read through
// memcpy, so the data and scale pointers need no alignment (checkpoint tensors may be unaligned,
// spec 1.3); the host must be little-endian like the files.
#pragma once

#include <cstdint>

#include "core/status.h"

namespace gemma4::quant {

enum class WeightFormat : uint8_t {
  kF32,
  kBF16,
  // int4, offset-binary (q+8), 8 per u32 word, element 0 in the low nibble, one scale per 32
  // consecutive K elements, symmetric: w = (u - 8) * scale. (compressed-tensors pack-quantized,
  // GGUF Q4_0.)
  kW4G32,
  // e2m1 pairs per byte (even element in the low nibble), one e4m3 scale per 16 K elements and
  // one fp32 per-tensor factor (compressed-tensors / ModelOpt NVFP4).
  kNVFP4,
  // int4, unsigned u in 0..15 packed like kW4G32 (element 2j in the low nibble of byte j), one
  // fp32 {scale, min} pair per 32 consecutive K elements, asymmetric: w = scale * u - min.
  // (GGUF Q4_K with scale = d * sc and min = dmin * mn, and Q4_1 with scale = d, min = -m:
  // exact, spec 5.)
  kW4G32A,
  // int8, symmetric per group of group_size (32 or 16) K elements, fp16 or fp32 scale:
  // w = q * scale. (GGUF Q8_0, Q5_0 (q = u - 16), IQ4_NL (q = table value): g32 with fp16 d;
  // Q6_K: g16 with fp32 d * sc. All exact, spec 5.)
  kW8,
  kF16,  // plain fp16 (GGUF F16 tensors, read in place)
  // int8, one fp32 {scale, min} pair per 32 consecutive K elements, asymmetric:
  // w = scale * q - min, laid out like kW4G32A's scales. (GGUF Q5_1 with scale = d, min = -m,
  // and Q5_K with scale = d * sc, min = dmin * mn, q the unsigned 5-bit level: exact, spec 5.)
  kW8A,
};

// Element type of the w4g32 group scales (the checkpoint's own dtype, kept as is).
enum class ScaleType : uint8_t { kBF16, kF16, kF32 };

// NVFP4 per-tensor factor. compressed-tensors stores a divisor (weight_global_scale), ModelOpt a
// multiplier (weight_scale_2); keeping the stored value and the operation reproduces each
// reference's fp32 rounding (weight-formats.md 3.3).
struct NvGlobalScale {
  float value = 1.0f;
  bool is_divisor = false;
  // The effective scale of a 16-element block whose e4m3 scale decodes to `block_scale`.
  float apply(float block_scale) const {
    return is_divisor ? block_scale / value : block_scale * value;
  }
};

// A row-major weight matrix [rows = N = out features, cols = K = in features]: y = W x.
struct QMatrix {
  WeightFormat format = WeightFormat::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  // kF32 / kBF16 / kF16: rows*cols elements. kW4G32: u32 words [rows, cols/8].
  // kNVFP4, kW4G32A: bytes [rows, cols/2]. kW8, kW8A: int8 [rows, cols].
  const void* data = nullptr;
  // kW4G32: [rows, cols/32] of scale_type. kNVFP4: e4m3 bytes [rows, cols/16].
  // kW4G32A, kW8A: fp32 pairs {scale, min} [rows, cols/32, 2]. kW8: [rows, cols/group_size] of
  // scale_type (kF16 or kF32). Else unused.
  const void* scales = nullptr;
  ScaleType scale_type = ScaleType::kBF16;
  NvGlobalScale nv_global;  // kNVFP4 only
  int group_size = 32;      // kW8 only: 32 or 16

  // Bytes a full read of the matrix touches (weights + scales + the fp32 global factor): the
  // decode cost model.
  int64_t bytes() const;
};

// "f32", "bf16", "f16", "w4g32", "nvfp4", "w4g32a", "w8", "w8a"
const char* weight_format_name(WeightFormat format);
const char* scale_type_name(ScaleType type);  // "bf16", "f16", "f32"

// Bytes of data / of scales in one row.
int64_t row_data_bytes(const QMatrix& m);
int64_t row_scale_bytes(const QMatrix& m);

// Checks what every function here assumes: positive dims, cols a multiple of the group (32 for
// kW4G32 / kW4G32A / kW8A, 16 for kNVFP4, group_size 16 or 32 for kW8), non-null pointers, a
// finite non-zero NVFP4 global factor, kW8 scales fp16 or fp32, kW4G32A / kW8A scales fp32.
Status validate(const QMatrix& m);

// Rows [first, first + count) of `m` as a view (e.g. the gate and up halves of a fused
// gate_up matrix). Requires 0 <= first, count >= 0 and first + count <= m.rows.
QMatrix row_slice(const QMatrix& m, int64_t first, int64_t count);

// out[0..cols) = the fp32 values of row `row`:
//   kF32 / kBF16 / kF16: the stored values (bf16 and fp16 widened exactly).
//   kW4G32: w = (u - 8) * scale in fp32; exact for bf16/f16 scales ((u - 8) has at most 3
//           significant bits, the scale at most 11, fp32 holds 24).
//   kNVFP4: w = e2m1(code) * nv_global.apply(e4m3(block scale)), the block factor computed once
//           in fp32 first, as the references do (spec 3.3).
//   kW4G32A: w = scale * u - min in fp32: scale * u is exact (a K-quant scale d * sc has at
//           most 17 significant bits, u 4), so the one rounding is ggml's own subtraction.
//   kW8: w = q * scale in fp32, exact (q has at most 8 significant bits, the scale at most 19).
//   kW8A: w = scale * q - min in fp32, two roundings like kW4G32A (scale * q is exact for the
//           GGUF repacks: q has 5 significant bits, d * sc at most 17).
void dequantize_row(const QMatrix& m, int64_t row, float* out);

// sum_k W[row, k] * x[k] over the dequantized row, accumulated in double so the oracle's own
// rounding stays far below any tolerance it is used with.
float dot_row(const QMatrix& m, int64_t row, const float* x);

}  // namespace gemma4::quant
