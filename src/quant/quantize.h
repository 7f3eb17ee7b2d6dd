// Producers of packed weights on the host (synthetic checkpoints, tests): float rows ->
// w4g32 / nvfp4, and back. Both producers choose scales so that every dequantized value is
// exactly representable in bf16: the bf16 file of a quantized twin then holds exactly the values
// the packed file encodes, and the two are the same function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "quant/qmatrix.h"

namespace gemma4::quant {

// Owns the bytes of a matrix packed on the host; view() borrows them (keep this alive).
// The byte layouts are exactly the checkpoint tensors (weight-formats.md 2.2, 3.2):
//   kW4G32: data = compressed-tensors `weight_packed` I32 [rows, cols/8],
//           scales = `weight_scale` BF16 [rows, cols/32].
//   kNVFP4: data = `weight_packed` / ModelOpt `weight` U8 [rows, cols/2],
//           scales = `weight_scale` F8_E4M3 [rows, cols/16], nv_global = the global factor.
//   kW4G32A, kW8, kW8A (repacked GGUF blocks): the layouts of qmatrix.h.
struct PackedMatrix {
  WeightFormat format = WeightFormat::kW4G32;
  int64_t rows = 0;
  int64_t cols = 0;
  ScaleType scale_type = ScaleType::kBF16;
  NvGlobalScale nv_global;
  int group_size = 32;  // kW8 only
  std::vector<std::byte> data;
  std::vector<std::byte> scales;

  QMatrix view() const;
};

// Symmetric int4, one bf16 scale per 32 (spec 2.4): per group s = amax / 7.5, and
// q = clamp(round_half_even(w / s), -8, 7) with the stored s, in fp32. One deviation from the
// plain rule, for bf16 exactness: s is rounded (to nearest, ties to even) to 5 significant bits
// instead of bf16's 8. Why: |q| <= 8 has at most 3 significant bits (5 and 7 have 3), so q * s
// has at most 5 + 3 = 8 significant bits and is exact in bf16; with an 8-bit s it would not be
// (e.g. s = 1 + 2^-7, q = 7 gives 7 + 7 * 2^-7, 10 significant bits). All-zero groups get s = 0.
// `values` is [rows, cols] row-major, finite, cols a multiple of 32.
Expected<PackedMatrix> quantize_w4g32(std::span<const float> values, int64_t rows, int64_t cols);

// The w4g32 rule above for one group of 32: writes q in [-8, 7] and returns the scale (a bf16
// value with at most 5 significant bits; 0 for an all-zero group). Shared with quantize_q4_0.
float quantize_int4_group(std::span<const float, 32> group, std::span<int8_t, 32> q);

// NVFP4 per spec 3.2: per 16-element block, scale byte = e4m3(block_amax / 6 in global units)
// (compressed-tensors: gs * amax / 6 with the divisor gs; ModelOpt: amax / (6 * s2) with the
// multiplier s2), code = nearest e2m1 of w / global.apply(e4m3 scale), ties to the even code,
// clamped to +-6. With a power-of-two `global` every dequantized value is exact in bf16: e2m1
// has <= 2 significant bits, e4m3 <= 4, so their product has <= 6 (< 8) and the power of two
// only shifts the exponent. `values` is [rows, cols] row-major, finite, cols a multiple of 16.
Expected<PackedMatrix> quantize_nvfp4(std::span<const float> values, int64_t rows, int64_t cols,
                                      NvGlobalScale global);

// The compressed-tensors global scale 448 * 6 / amax rounded down to a power of two (a divisor,
// so block scales stay <= 448); 1 when amax is 0 or not finite. Its reciprocal is the matching
// ModelOpt multiplier, also exact.
float nvfp4_power_of_two_global_scale(float amax);

// All rows of `m` dequantized: [rows, cols] row-major.
std::vector<float> dequantize(const QMatrix& m);

}  // namespace gemma4::quant
