// Lossless bf16 -> w4g32 packing: for a bf16 matrix whose values already lie on an int4 grid
// (a quantization-aware-trained checkpoint stored "unquantized", e.g. the per-layer embedding
// table), recover the grid exactly and store it in 4 bits + one bf16 scale per 32 (DESIGN.md
// "Internal weight formats": Google QAT bf16, grid recovered exactly). Nothing is rounded: a
// matrix with one group off the grid is reported, not approximated.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "quant/quantize.h"

namespace gemma4::quant {

// Packs `matrix` (kBF16, cols a multiple of 32) into kW4G32 with bf16 scales iff every group of
// 32 consecutive values of a row equals q·s exactly, with q in [-8, 7] and one bf16 scale s per
// group; else fails with kUnsupported naming the first group off the grid (the lowest row among
// those the threads reached). Dequantizing the result gives back every value exactly, except
// that a zero is always +0 (the sign of a zero never changes a sum, a product's magnitude or a
// comparison the model makes).
//
// The scale of a group: if v_max is a value of largest magnitude and q_max its level, then
// |s| = |v_max| / |q_max| with |q_max| in 1..8, so the only candidates are ±|v_max| / k for
// k = 1..8; a candidate works iff it is a normal bf16 and every v / s is an integer in [-8, 7]
// with (v / s)·s == v. Positive scales and larger k are tried first. Negative scales matter for
// a group whose largest value is +8·|s| (q = -8 with s < 0); q = -8·s with s > 0 is the
// positive candidate k = 8. An all-zero group gets s = 0. Subnormal scales are refused: a
// device kernel may flush them to zero.
//
// `threads` = 0: the hardware concurrency. Packing a row touches only that row.
Expected<PackedMatrix> pack_w4g32_exact(const QMatrix& matrix, int threads = 0);

// Whether pack_w4g32_exact would succeed, without writing the packed bytes (the same scan; the
// error is the one it would return).
Status check_w4g32_exact(const QMatrix& matrix, int threads = 0);

}  // namespace gemma4::quant
