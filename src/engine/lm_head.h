// How the engine holds the logits matrix (EngineOptions::lm_head, `--lm-head`). A checkpoint that
// keeps its logits matrix unquantized (the tied bf16 embedding of the 26B-A4B NVFP4 checkpoints:
// 262144 x 2816, 1.48 GB, 46 % of a decode step's reads) can have it quantized at load to 8 bits
// (quant/quantize_w8.h: 0.78 GB), at a small, measured cost in logit accuracy.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/status.h"
#include "quant/qmatrix.h"

namespace gemma4::engine {

enum class LmHeadFormat : uint8_t {
  // The checkpoint's matrix, exactly (a device keeps a bf16 one on the int4 grid in 4 bits,
  // losslessly: engine/memory_plan.h pack_table_for_device).
  kExact,
  // A float one (f32, bf16, f16) that is not on the int4 grid: quantize_w8g32's int8 copy (one
  // fp16 scale per 32 values), on every backend, so the CPU reference computes what a device
  // does. Embedding lookups keep reading the exact table, and so do passes of more than
  // kLmHeadQ8MaxRows logits rows when it is the tied one. Any other matrix stays exact.
  kQ8,
};

// Passes that take the logits of more rows than this (batched decode of many streams) read the
// exact tied table instead of the 8-bit copy (ResidentWeights::lm_head_batched): there the read is
// shared by the rows, and a device multiplies bf16 on tensor cores where it has no fast 8-bit
// kernel (H200, 26B at 32 streams: 3,015 tok/s with the 8-bit matrix against 3,292 exact).
inline constexpr int64_t kLmHeadQ8MaxRows = 16;

// "exact", "q8" (the --lm-head values).
const char* lm_head_format_name(LmHeadFormat format);
// The inverse of lm_head_format_name; a clear error for anything else.
Expected<LmHeadFormat> parse_lm_head_format(std::string_view name);

// Whether the engine holds `lm_head` as quantize_w8g32's copy under `format` (see kQ8). Scans a
// bf16 matrix for the int4 grid (quant::check_w4g32_exact) when `format` is kQ8.
bool lm_head_quantizes(const quant::QMatrix& lm_head, LmHeadFormat format);

}  // namespace gemma4::engine
