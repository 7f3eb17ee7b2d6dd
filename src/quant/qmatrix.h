// Internal weight formats (DESIGN.md "Internal weight formats") and the view every kernel reads.
// A QMatrix never owns its bytes: it points into an mmapped checkpoint, a host buffer or device
// memory, so a packed matrix is never expanded to 16 bits in memory.
#pragma once

#include <cstdint>

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
};

// Element type of the w4g32 group scales (the checkpoint's own dtype, kept as is).
enum class ScaleType : uint8_t { kBF16, kF16, kF32 };

// NVFP4 per-tensor factor. compressed-tensors stores a divisor (weight_global_scale), ModelOpt a
// multiplier (weight_scale_2); keeping the stored value and the operation reproduces each
// reference's fp32 rounding (weight-formats.md 3.3).
struct NvGlobalScale {
  float value = 1.0f;
  bool is_divisor = false;
  float apply(float block_scale) const { return is_divisor ? block_scale / value : block_scale * value; }
};

// A row-major weight matrix [rows = N = out features, cols = K = in features]: y = W x.
struct QMatrix {
  WeightFormat format = WeightFormat::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  // kF32 / kBF16: rows*cols elements. kW4G32: u32 words [rows, cols/8].
  // kNVFP4: bytes [rows, cols/2].
  const void* data = nullptr;
  // kW4G32: [rows, cols/32] of scale_type. kNVFP4: e4m3 bytes [rows, cols/16]. Else unused.
  const void* scales = nullptr;
  ScaleType scale_type = ScaleType::kBF16;
  NvGlobalScale nv_global;  // kNVFP4 only

  // Bytes a full read of the matrix touches (weights + scales): the decode cost model.
  int64_t bytes() const;
};

const char* weight_format_name(WeightFormat format);

}  // namespace gemma4::quant
