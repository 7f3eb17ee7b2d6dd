// Lossless repacking of GGUF blocks into the internal formats (weight-formats.md section 5):
// the dequantized values of the result are bit-identical to ggml's fp32 dequantization.
//
//   Q4_0          -> kW4G32, fp16 scale d (repack_q4_0_to_w4g32)
//   Q4_1          -> kW4G32A: scale = d, min = -m
//   Q4_K          -> kW4G32A: per 32-element sub-block scale = d * sc, min = dmin * mn (fp32
//                    products of an fp16 and a 6-bit integer: exact)
//   Q8_0          -> kW8 g32, fp16 scale d, q = qs
//   Q5_0          -> kW8 g32, fp16 scale d, q = u - 16
//   IQ4_NL        -> kW8 g32, fp16 scale d, q = table value
//   Q6_K          -> kW8 g16, fp32 scale = d * scales[s] (exact), q = 6-bit value - 32
//   Q5_1          -> kW8A: q = 5-bit level, scale = d, min = -m
//   Q5_K          -> kW8A: q = 5-bit level, per 32-element sub-block scale = d * sc,
//                    min = dmin * mn (exact, as Q4_K)
// Other quantized types (Q2_K, Q3_K, the IQ2/IQ3 family, MXFP4, ...) are kUnsupported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/status.h"
#include "quant/quantize.h"

namespace gemma4::quant {

// True for the ggml types repack_ggml accepts.
bool ggml_type_repackable(uint32_t type);

// `rows` rows of `cols` elements of ggml type `type`, packed back to back as in a GGUF tensor,
// repacked into owned memory.
Expected<PackedMatrix> repack_ggml(uint32_t type, std::span<const std::byte> data, int64_t rows,
                                   int64_t cols);

}  // namespace gemma4::quant
