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
inline constexpr uint32_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ5_0 = 6,
                          kGgmlQ5_1 = 7, kGgmlQ8_0 = 8, kGgmlQ4_K = 12, kGgmlQ5_K = 13,
                          kGgmlQ6_K = 14, kGgmlIQ4_NL = 20, kGgmlBF16 = 30;

inline constexpr int64_t kQ4_0BlockElements = 32, kQ4_0BlockBytes = 18;
inline constexpr int64_t kQ4_1BlockElements = 32, kQ4_1BlockBytes = 20;
inline constexpr int64_t kQ5_0BlockElements = 32, kQ5_0BlockBytes = 22;
inline constexpr int64_t kQ5_1BlockElements = 32, kQ5_1BlockBytes = 24;
inline constexpr int64_t kQ8_0BlockElements = 32, kQ8_0BlockBytes = 34;
inline constexpr int64_t kIQ4_NLBlockElements = 32, kIQ4_NLBlockBytes = 18;
inline constexpr int64_t kQ4_KBlockElements = 256, kQ4_KBlockBytes = 144;
inline constexpr int64_t kQ5_KBlockElements = 256, kQ5_KBlockBytes = 176;
inline constexpr int64_t kQ6_KBlockElements = 256, kQ6_KBlockBytes = 210;

// IQ4_NL's non-uniform levels (spec 4.6), all int8.
inline constexpr int8_t kIQ4_NLLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};

// Integer fields of one block (spec 4.6 addressing), shared by the decoders below and the
// repackers (gguf_repack.h).
// Element i of a 32-element block whose 16 bytes `qs` hold element j in the low nibble and
// j + 16 in the high nibble of byte j (Q4_0, Q4_1, Q5_0, IQ4_NL).
int split_nibble(const std::byte* qs, int i);
// Q5_0 element i as the signed level u - 16 in [-16, 15].
int q5_0_level(const std::byte* block, int i);
// Q5_1 element i as the unsigned level in [0, 31] (Q5_0's bits after d and m).
int q5_1_level(const std::byte* block, int i);
// Q4_K (and Q5_K: the same d, dmin and 12 scale bytes lead its block) sub-block j's (0..7)
// 6-bit scale and min.
void q4_k_scale_min(const std::byte* block, int j, int& sc, int& mn);
// Q4_K element e's (0..255) 4-bit level.
int q4_k_level(const std::byte* block, int e);
// Q5_K element e's (0..255) unsigned 5-bit level: Q4_K's nibble addressing over qs, plus bit
// e / 32 of qh[e % 32].
int q5_k_level(const std::byte* block, int e);
// Q6_K element e's (0..255) signed level in [-32, 31].
int q6_k_level(const std::byte* block, int e);

// One block to floats, in ggml's fp32 arithmetic:
//   Q4_0: d * (nibble(i) - 8), nibble(i) = low nibble of qs[i] for i < 16, else high of qs[i-16].
//   Q8_0: d * qs[i].
//   Q4_1: d * nibble(i) + m.
//   Q5_0: d * ((nibble(i) | bit i of qh << 4) - 16).
//   Q5_1: d * (nibble(i) | bit i of qh << 4) + m.
//   IQ4_NL: d * kIQ4_NLLevels[nibble(i)].
//   Q4_K: (d * sc) * q - (dmin * mn) with the 6-bit sub-block scales/mins of spec 4.6.
//   Q5_K: as Q4_K with the 5-bit q of q5_k_level.
//   Q6_K: d * scales[e / 16] * q, q = 6-bit value - 32 (spec 4.6 addressing).
void dequantize_q4_0_block(const std::byte* block, float* out);
void dequantize_q4_1_block(const std::byte* block, float* out);
void dequantize_q5_0_block(const std::byte* block, float* out);
void dequantize_q5_1_block(const std::byte* block, float* out);
void dequantize_q8_0_block(const std::byte* block, float* out);
void dequantize_iq4_nl_block(const std::byte* block, float* out);
void dequantize_q4_k_block(const std::byte* block, float* out);
void dequantize_q5_k_block(const std::byte* block, float* out);
void dequantize_q6_k_block(const std::byte* block, float* out);

// `rows` rows of `cols` elements of ggml type `type` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, IQ4_NL, Q4_K, Q5_K, Q6_K) to floats; kUnsupported names other types, kInvalidArgument a
// size mismatch.
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
