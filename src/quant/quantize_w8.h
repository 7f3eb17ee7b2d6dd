// Lossy 8-bit copy of a float matrix, made at load (`--lm-head q8`): the bf16 logits matrix of a
// checkpoint that keeps it unquantized (26B-A4B NVFP4: 262144 x 2816, 1.48 GB read by every
// decode step) in kW8 g32 with fp16 scales: 0.78 GB.
#pragma once

#include "core/status.h"
#include "quant/quantize.h"

namespace gemma4::quant {

// Symmetric int8 per group of 32 consecutive K values of a row, one fp16 scale per group:
//   s = the smallest fp16 >= amax / 127 (amax = the group's largest |w|, the quotient in fp32),
//   q = clamp(round_half_even(w / s), -127, 127) in fp32;
// an all-zero group gets s = 0 and q = 0. Rounding s up keeps |w / s| <= 127 (up to the
// division's own rounding), so every dequantized value is within s / 2 of w (plus that rounding)
// and -128 is never used (the levels are symmetric). fp16 subnormal scales are kept: they widen
// to normal fp32 values.
//
// `source`: kF32, kBF16 or kF16 (what dequantize_row reads exactly), cols a multiple of 32, every
// value finite with amax / 127 within fp16's range; else a clear error. `threads` = 0: the
// hardware concurrency (rows are independent).
Expected<PackedMatrix> quantize_w8g32(const QMatrix& source, int threads = 0);

// The layout quantize_w8g32 produces for a [rows, cols] source, without data: kW8, group 32,
// fp16 scales (bytes() is what reading it costs).
QMatrix w8g32_layout(int64_t rows, int64_t cols);

}  // namespace gemma4::quant
