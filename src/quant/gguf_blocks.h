// GGUF block formats (weight-formats.md 4.6): reference decoders, and the Q4_0 / Q4_K encoders
// that synthetic GGUF checkpoints use. Blocks are little-endian, packed with no padding; the
// functions read through memcpy, so blocks need no alignment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "quant/quantize.h"

namespace gemma4::quant {

// ggml type ids these functions handle (the same numbers as io::GgufType).
inline constexpr uint32_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ4_0 = 2, kGgmlQ8_0 = 8, kGgmlQ4_K = 12,
                          kGgmlBF16 = 30;

inline constexpr int64_t kQ4_0BlockElements = 32, kQ4_0BlockBytes = 18;
inline constexpr int64_t kQ8_0BlockElements = 32, kQ8_0BlockBytes = 34;
inline constexpr int64_t kQ4_KBlockElements = 256, kQ4_KBlockBytes = 144;

// One block to floats, in ggml's fp32 arithmetic:
//   Q4_0: d * (nibble(i) - 8), nibble(i) = low nibble of qs[i] for i < 16, else high of qs[i-16].
//   Q8_0: d * qs[i].
//   Q4_K: (d * sc) * q - (dmin * mn) with the 6-bit sub-block scales/mins of spec 4.6.
void dequantize_q4_0_block(const std::byte* block, float* out);
void dequantize_q8_0_block(const std::byte* block, float* out);
void dequantize_q4_k_block(const std::byte* block, float* out);

// `rows` rows of `cols` elements of ggml type `type` (F32, F16, BF16, Q4_0, Q8_0, Q4_K) to
// floats; kUnsupported names other types, kInvalidArgument a size mismatch.
Expected<std::vector<float>> dequantize_ggml(uint32_t type, std::span<const std::byte> data,
                                             int64_t rows, int64_t cols);

// Q4_0 blocks of `values` [rows, cols] (cols % 32 == 0) with exactly the q and scales of
// quantize_w4g32 (one rule for both, so a synthetic GGUF and its w4g32 twin hold the same
// weights): scales have 5 significant bits, so with fp16 d in the normal range every value is
// exact in bf16.
Expected<std::vector<std::byte>> quantize_q4_0(std::span<const float> values, int64_t rows,
                                               int64_t cols);

// Q4_K blocks of `values` [rows, cols] (cols % 256 == 0). A simple synthetic-checkpoint rule,
// not llama.cpp's search: per super-block d = dmin = the smallest power of two that lets every
// sub-block's range [min(0, lo), max(0, hi)] fit sc <= 15 and mn <= 63; per sub-block
// sc = ceil(range / 15d), mn = round(-lo / d), q = clamp(round_half_even((w + d mn) / (d sc)),
// 0, 15). Why sc <= 15 (not 63): every value is then d * (sc q - mn) with |sc q - mn| < 256, an
// 8-bit integer times a power of two, so it is exact in bf16 (and in fp32 whatever the order).
Expected<std::vector<std::byte>> quantize_q4_k(std::span<const float> values, int64_t rows,
                                               int64_t cols);

// Lossless repack of Q4_0 blocks [rows, cols] into w4g32 with f16 scales (spec 5: q = nibble - 8,
// s = d, exact; only the nibble order changes, from Q4_0's split halves to even/odd pairs). The
// sign of d is kept (ggml's d = max / -8 is often negative).
Expected<PackedMatrix> repack_q4_0_to_w4g32(std::span<const std::byte> data, int64_t rows,
                                            int64_t cols);

}  // namespace gemma4::quant
