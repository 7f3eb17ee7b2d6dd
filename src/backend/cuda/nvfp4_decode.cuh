// NVFP4 weights decoded for the tensor cores: the e2m1 codes of a packed 32-bit word (8 codes,
// nibble i = element i; code c = sign (c & 8), magnitude code c & 7) as exact 16-bit float pairs
// for m16n8k16 A fragments, the block's e4m3 scale applied by one packed multiply. One home for
// the decode every NVFP4 tensor-core kernel uses (the MoE decode kernels through moe_decode.cuh's
// mma_round; the batched GEMV may take the bf16 form).
//
// Pair order: pair s (s = 0..3) holds nibbles (s, s + 4) in its (low, high) half, the order in
// which those kernels give a lane's 8 elements of a word to its k slots (moe.cu's "Decode path on
// tensor cores", gemv_mma_kernel.cuh's "Fragment order").
//
// Both bit placements are __host__ __device__ (pure integer operations) so that the host tests
// check them against core/numeric.h for every code; the multiplies are the device's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace gemma4::cuda {

// fp16 form. Code c placed as fp16 bits (c & 8) << 12 | (c & 7) << 9 is e2m1(c) · 2^-14 (c = 1 an
// fp16 subnormal): the half's high byte is (c & 8) << 4 | (c & 7) << 1 and its low byte zero. So
// each byte of `even` holds the low nibble of the word's byte formatted that way (codes 0, 2, 4,
// 6), each byte of `odd` its high nibble (codes 1, 3, 5, 7), and each pair is two bytes of one of
// them moved to the halves' high bytes (one PRMT or one AND): 11 integer instructions per word,
// where shifting and masking every pair from the word took 16.
__host__ __device__ __forceinline__ void e2m1_half2_bits(uint32_t word, uint32_t (&pairs)[4]) {
  const uint32_t even = ((word << 1) & 0x0E0E0E0Eu) | ((word << 4) & 0x80808080u);
  const uint32_t odd = ((word >> 3) & 0x0E0E0E0Eu) | (word & 0x80808080u);
#ifdef __CUDA_ARCH__  // the same bytes; nvcc makes a shift and an AND of the host form
  pairs[0] = __byte_perm(even, 0u, 0x2404);  // bytes 0, 2 of `even` into bytes 1, 3; zeros
  pairs[1] = __byte_perm(odd, 0u, 0x2404);
#else
  pairs[0] = (even << 8) & 0xFF00FF00u;
  pairs[1] = (odd << 8) & 0xFF00FF00u;
#endif
  pairs[2] = even & 0xFF00FF00u;
  pairs[3] = odd & 0xFF00FF00u;
}

// bf16 form. Code c placed as bf16 bits (c & 8) << 12 | (c & 7) << 6 is e2m1(c) · 2^-126 (c = 1 a
// bf16 subnormal). The magnitude straddles the halves' byte boundary, so each pair is shifted
// and masked from the word: 4 integer instructions per pair.
__host__ __device__ __forceinline__ uint32_t e2m1_bf16_bits(uint32_t word, int s) {
  const uint32_t top = word << (12 - 4 * s);  // nibbles s, s + 4 in bits 12..15, 28..31
  return (top & 0x80008000u) | ((top >> 6) & 0x01C001C0u);
}

#ifdef __CUDACC__  // the multiplies: device code (host tests see the placements only)

// e2m1 · 2^-14 · `scale` for the 8 codes of `word`, pairs as above. Exact when `scale` is an e4m3
// value times 2^k, 0 <= k <= 18 (the MoE kernels' k = 7: moe_decode.cuh's e4m3_scale_pairs): the
// products are multiples of 2^(k - 24) with at most 6 significant bits (e2m1 has 2, e4m3 4) below
// 6 · 448 · 2^(k - 14) < 65504, so fp16 holds them, subnormals included.
__device__ __forceinline__ void scaled_e2m1_half2_pairs(uint32_t word, __half2 scale,
                                                        uint32_t (&pairs)[4]) {
  e2m1_half2_bits(word, pairs);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const __half2 scaled = __hmul2(*reinterpret_cast<const __half2*>(&pairs[s]), scale);
    pairs[s] = *reinterpret_cast<const uint32_t*>(&scaled);
  }
}

// e2m1 · `scale` · 2^-7 for the 8 codes of `word`, pairs as above, with `scale` an e4m3 value
// times 2^119 (exact in bf16: 448 · 2^119 < 2^128): the product of e2m1 · 2^-126 and it has at most
// 6 significant bits and lies in [2^-17, 21], so bf16 holds it exactly (bf16 multiplies keep
// subnormal inputs).
__device__ __forceinline__ void scaled_e2m1_bf16_pairs(uint32_t word, __nv_bfloat162 scale,
                                                       uint32_t (&pairs)[4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t bits = e2m1_bf16_bits(word, s);
    const __nv_bfloat162 scaled = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), scale);
    pairs[s] = *reinterpret_cast<const uint32_t*>(&scaled);
  }
}

#endif  // __CUDACC__

}  // namespace gemma4::cuda
