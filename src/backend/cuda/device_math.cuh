// Device math shared by several kernel files: GELU, and how a 16-byte chunk of packed weights
// (w4g32, w4g32a, NVFP4: 32 elements; w8: 16; bf16, f16: 8) and its scale turn into a dot product
// with as many activations, dequantized in registers (gemv.cu, moe.cu). The parameter-block
// functions take any struct with the members they read (scales, chunks_per_row, scale_type,
// nv_global, nv_global_is_divisor), so the GEMV's GemvArgs and the MoE expert descriptors share
// them. Design and measurements: spec/h200-decode-notes.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda {

// quant::ScaleType values.
constexpr int kScaleBF16 = 0;
constexpr int kScaleF16 = 1;
constexpr int kScaleF32 = 2;

template <PackedFormat F>
constexpr int kChunkElems = packed_chunk_elements(F);

// The raw scale data of one chunk: a {scale, min} fp32 pair for w4g32a, else one 32-bit word
// (a 16- or 32-bit scale, or NVFP4's two e4m3 bytes).
template <PackedFormat F>
using ScaleBits = std::conditional_t<F == PackedFormat::kW4G32A, uint2, uint32_t>;

// The activations one chunk of weights multiplies, as fp32. `offset` (w4g32, w4g32a) is
// 264·Σx_even + 24·Σx_odd: dot_w4g32 works on biased nibbles and subtracts it once per chunk
// (shared by every row the thread handles); `sum` (w4g32a's min term) is Σx.
template <int N>
struct XChunk {
  float v[N];
  float offset;
  float sum;
};

// One chunk of kQ8 activations: 32 int8 in the permuted order, their scale and their sum.
struct XChunkQ8 {
  uint32_t words[8];
  float scale;
  int sum;
};

template <ActType XT, int N>
struct XChunkFor {
  using type = XChunk<N>;
};
template <int N>
struct XChunkFor<ActType::kQ8, N> {
  using type = XChunkQ8;
};

__device__ __forceinline__ void load_x_chunk_q8(const void* x, int64_t row, int64_t stride,
                                                int64_t chunk, XChunkQ8& out) {
  const uint8_t* base = static_cast<const uint8_t*>(x) + row * (stride + stride / 4);
  const uint4* values = reinterpret_cast<const uint4*>(base + chunk * 32);
  const uint4 lo = __ldg(values), hi = __ldg(values + 1);
  out.words[0] = lo.x, out.words[1] = lo.y, out.words[2] = lo.z, out.words[3] = lo.w;
  out.words[4] = hi.x, out.words[5] = hi.y, out.words[6] = hi.z, out.words[7] = hi.w;
  out.scale = __ldg(reinterpret_cast<const float*>(base + stride) + chunk);
  out.sum = __ldg(reinterpret_cast<const int*>(base + stride + stride / 8) + chunk);
}

// Unpacks 8 bf16 values (one 16-byte word, element 2j in the low half of word j) to fp32.
__device__ __forceinline__ void unpack_bf16x8(const uint4& q, float* out) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = __uint_as_float(words[j] << 16);
    out[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
  }
}

// v rounded to the nearest bf16 (ties to even), back as fp32.
__device__ __forceinline__ float bf16_rounded(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// lo and hi rounded to bf16 (ties to even) in one word, lo in the low half (unpack_bf16x8's order).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The chunk's offset and sum from its values (XChunk).
template <int N>
__device__ __forceinline__ void finish_x_chunk(XChunk<N>& out) {
  float even = 0.0f, odd = 0.0f;
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    even += out.v[i];
    odd += out.v[i + 1];
  }
  out.offset = 264.0f * even + 24.0f * odd;
  out.sum = even + odd;
}

// Activations first .. first + N − 1 of x (kF32 or kBF16, global memory); kF32 values are rounded
// to bf16 when `to_bf16` (the products a bf16 model computes).
template <ActType XT, int N>
__device__ __forceinline__ void load_x_chunk(const void* x, int64_t first, XChunk<N>& out,
                                             bool to_bf16 = false) {
  if constexpr (XT == ActType::kBF16) {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(x) + first);
#pragma unroll
    for (int i = 0; i < N / 8; ++i) unpack_bf16x8(__ldg(p + i), out.v + 8 * i);
  } else {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + first);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 q = __ldg(p + i);
      out.v[4 * i] = q.x;
      out.v[4 * i + 1] = q.y;
      out.v[4 * i + 2] = q.z;
      out.v[4 * i + 3] = q.w;
    }
    if (to_bf16) {
#pragma unroll
      for (int i = 0; i < N; ++i) out.v[i] = bf16_rounded(out.v[i]);
    }
  }
  finish_x_chunk(out);
}

// Chunk `chunk` of an activation row staged in shared memory as bf16, piece-major: the k-th
// 8-element piece of chunk c at staged[k · chunks_per_row + c], so that lanes reading
// consecutive chunks read consecutive 16-byte words (no bank conflicts).
template <int N>
__device__ __forceinline__ void load_x_chunk_staged(const uint4* staged, int64_t chunks_per_row,
                                                    int64_t chunk, XChunk<N>& out) {
#pragma unroll
  for (int i = 0; i < N / 8; ++i) unpack_bf16x8(staged[i * chunks_per_row + chunk], out.v + 8 * i);
  finish_x_chunk(out);
}

// Streaming weight load: read once, keep L1 for the activations.
__device__ __forceinline__ uint4 load_weights_nc(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// (a & mask) | bits in one LOP3 (the compiler splits it in two otherwise: SASS takes only one
// 32-bit immediate).
template <uint32_t kMask>
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(kMask), "r"(bits));
  return d;
}

// A 16- or 32-bit scale (a.scale_type) at `index` of the scale array, as raw bits.
template <typename Params>
__device__ __forceinline__ uint32_t load_group_scale_bits(const Params& a, int64_t index) {
  if (a.scale_type == kScaleF32) return __ldg(static_cast<const uint32_t*>(a.scales) + index);
  return __ldg(static_cast<const uint16_t*>(a.scales) + index);
}

// Raw scale bits of one chunk, loaded before the activations are ready.
template <PackedFormat F, typename Params>
__device__ __forceinline__ ScaleBits<F> load_scale_bits(const Params& a, int64_t row,
                                                        int64_t chunk) {
  if constexpr (F == PackedFormat::kW4G32) {
    return load_group_scale_bits(a, row * a.chunks_per_row + chunk);
  } else if constexpr (F == PackedFormat::kW4G32A) {
    return __ldg(static_cast<const uint2*>(a.scales) + row * a.chunks_per_row + chunk);
  } else if constexpr (F == PackedFormat::kW8) {
    // One scale per group_size (16 or 32) elements: per 1 or 2 chunks (a shift, not a 64-bit
    // division). Groups never straddle rows (K is a multiple of the group), so the chunk's index
    // in the matrix gives its group's.
    return load_group_scale_bits(a, (row * a.chunks_per_row + chunk) >> (a.group_size >> 5));
  } else if constexpr (F == PackedFormat::kNVFP4) {
    // Two e4m3 group-16 scales per 32-element chunk, adjacent bytes.
    return __ldg(static_cast<const uint16_t*>(a.scales) + row * a.chunks_per_row + chunk);
  } else {
    return 0;
  }
}

// A scale loaded by load_group_scale_bits, as fp32.
template <typename Params>
__device__ __forceinline__ float scale_from_bits(const Params& a, uint32_t bits) {
  if (a.scale_type == kScaleBF16) return __uint_as_float(bits << 16);
  if (a.scale_type == kScaleF16) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
  return __uint_as_float(bits);
}

// The NVFP4 factor of one group, exactly as the checkpoint's convention computes it in fp32
// (weight-formats.md 3.3), times 2^14 (the e2m1 decode below yields value · 2^-14).
template <typename Params>
__device__ __forceinline__ float nvfp4_factor(const Params& a, uint32_t e4m3_bits) {
  const __half_raw h =
      __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(e4m3_bits & 0xFF), __NV_E4M3);
  const float block = __half2float(__half(h));
  const float factor = a.nv_global_is_divisor ? block / a.nv_global : block * a.nv_global;
  return factor * 16384.0f;
}

// Σ_k (u_k − 8) x_k over the 32 nibbles u of a w4g32 / w4g32a chunk. Each byte of a word is
// shifted to bits 15..22, the mantissa of 0x43000000 (fp32 128.0): masked with one LOP3, the even
// element becomes the fp32 128 + u/2 and the odd one 128 + 8u, with no integer-to-float
// conversion.
//   kBiased (bf16-valued activations): Σ(u−8)x = 2·Σ(128 + u_e/2)x_e + Σ(128 + 8u_o)x_o / 8 −
//     offset. The products are exact only while x has at most 15 significant bits (bf16's 8), and
//     the sums are ~256× the result's terms, so their fp32 roundings cancel into errors ~50–100×
//     a plain fp32 dot product's: fine under bf16 products, not for fp32 activations.
//   kCentered (fp32 activations): one FADD per element re-centres the value first: (u−8)/2 and
//     8(u−8), both exact, so each product is rounded once (in the FMA) and the sums have the
//     magnitude of the result's terms: a plain fp32 dot product, as the CPU reference computes.
enum class NibbleDot : uint8_t { kBiased, kCentered };

template <NibbleDot D>
__device__ __forceinline__ float dot_centered_nibbles(const uint4& q, const XChunk<32>& x) {
  const uint32_t magic = 0x43000000u;
  // kCentered: 128 + u/2 − 132 = (u − 8)/2 and 128 + 8u − 192 = 8(u − 8).
  constexpr float kEvenBias = D == NibbleDot::kCentered ? 132.0f : 0.0f;
  constexpr float kOddBias = D == NibbleDot::kCentered ? 192.0f : 0.0f;
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  float even0 = 0.0f, even1 = 0.0f, odd0 = 0.0f, odd1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = words[i];
    // Byte b of w (elements 8i+2b, 8i+2b+1) moved to bits 15..22.
    const uint32_t bytes[4] = {w << 15, w << 7, w >> 1, w >> 9};
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      float lo = __uint_as_float(and_or<0x00078000u>(bytes[b], magic));
      float hi = __uint_as_float(and_or<0x00780000u>(bytes[b], magic));
      if constexpr (D == NibbleDot::kCentered) {
        lo -= kEvenBias;
        hi -= kOddBias;
      }
      const int k = 8 * i + 2 * b;
      if (b & 1) {
        even1 = fmaf(lo, x.v[k], even1);
        odd1 = fmaf(hi, x.v[k + 1], odd1);
      } else {
        even0 = fmaf(lo, x.v[k], even0);
        odd0 = fmaf(hi, x.v[k + 1], odd0);
      }
    }
  }
  const float sum = 2.0f * (even0 + even1) + 0.125f * (odd0 + odd1);
  return D == NibbleDot::kCentered ? sum : sum - x.offset;
}

// w4g32: w = (u − 8) · scale.
template <NibbleDot D = NibbleDot::kBiased>
__device__ __forceinline__ float dot_w4g32(const uint4& q, float scale, const XChunk<32>& x) {
  return scale * dot_centered_nibbles<D>(q, x);
}

// w4g32a: w = scale · u − min, so Σwx = scale · Σ(u − 8)x + (8 · scale − min) · Σx.
template <NibbleDot D = NibbleDot::kBiased>
__device__ __forceinline__ float dot_w4g32a(const uint4& q, uint2 scale_min, const XChunk<32>& x) {
  const float scale = __uint_as_float(scale_min.x);
  const float min = __uint_as_float(scale_min.y);
  return fmaf(scale, dot_centered_nibbles<D>(q, x), (8.0f * scale - min) * x.sum);
}

// w8: Σ q·x over 16 int8, times the group scale. q + 128 (the sign bit flipped) is placed by one
// PRMT in the low byte of the mantissa of 2^23, and 2^23 + 128 subtracted: q exactly, as fp32,
// without an integer-to-float conversion.
__device__ __forceinline__ float dot_w8(const uint4& q, float scale, const XChunk<16>& x) {
  const uint32_t words[4] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u, q.z ^ 0x80808080u,
                             q.w ^ 0x80808080u};
  float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      // Result bytes: byte b of the word, 0x00, 0x00, 0x4B (the bytes 4, 5, 7 of 0x4B000000).
      const float biased = __uint_as_float(__byte_perm(words[i], 0x4B000000u, 0x7540u + b));
      const float value = biased - 8388736.0f;  // 2^23 + 128
      if (b & 1) {
        acc1 = fmaf(value, x.v[4 * i + b], acc1);
      } else {
        acc0 = fmaf(value, x.v[4 * i + b], acc0);
      }
    }
  }
  return scale * (acc0 + acc1);
}

__device__ __forceinline__ float dot_f16(const uint4& q, const XChunk<8>& x) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 w = __half22float2(*reinterpret_cast<const __half2*>(&words[j]));
    acc0 = fmaf(w.x, x.v[2 * j], acc0);
    acc1 = fmaf(w.y, x.v[2 * j + 1], acc1);
  }
  return acc0 + acc1;
}

// NVFP4: code c (sign bit 3, magnitude e1 e0 m) placed as fp16 bits (c&8)<<12 | (c&7)<<9 is
// exactly e2m1(c) · 2^-14 (code 1 becomes the subnormal 2^-15). Elements s and s+4 of a word
// decode together as one half2.
// factor0 / factor1: nvfp4_factor of the chunk's two group scales.
__device__ __forceinline__ float dot_nvfp4_factors(const uint4& q, float factor0, float factor1,
                                                   const XChunk<32>& x) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  float group[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float acc = 0.0f;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t t = words[i] >> (4 * s);
      const uint32_t h = ((t << 9) & 0x0E000E00u) | ((t << 12) & 0x80008000u);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
      acc = fmaf(f.x, x.v[8 * i + s], acc);
      acc = fmaf(f.y, x.v[8 * i + s + 4], acc);
    }
    group[i / 2] += acc;
  }
  return factor0 * group[0] + factor1 * group[1];
}

template <typename Params>
__device__ __forceinline__ float dot_nvfp4(const uint4& q, uint32_t scale_bits, const Params& a,
                                           const XChunk<32>& x) {
  return dot_nvfp4_factors(q, nvfp4_factor(a, scale_bits), nvfp4_factor(a, scale_bits >> 8), x);
}

__device__ __forceinline__ float dot_bf16(const uint4& q, const XChunk<8>& x) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc0 = fmaf(__uint_as_float(words[j] << 16), x.v[2 * j], acc0);
    acc1 = fmaf(__uint_as_float(words[j] & 0xFFFF0000u), x.v[2 * j + 1], acc1);
  }
  return acc0 + acc1;
}

// w4g32 × kQ8: lo/hi = the even/odd nibbles of a word as 4 bytes each, dotted with the
// matching permuted activation bytes by dp4a: Σ u·q exactly in int32, then Σ(u−8)·q = that −
// 8·Σq.
__device__ __forceinline__ float dot_w4g32_q8(const uint4& q, float scale, const XChunkQ8& x) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  int acc = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = __dp4a(static_cast<int>(words[i] & 0x0F0F0F0Fu), static_cast<int>(x.words[2 * i]), acc);
    acc = __dp4a(static_cast<int>((words[i] >> 4) & 0x0F0F0F0Fu),
                 static_cast<int>(x.words[2 * i + 1]), acc);
  }
  return scale * x.scale * static_cast<float>(acc - 8 * x.sum);
}

template <PackedFormat F, typename Params>
__device__ __forceinline__ float dot_chunk(const uint4& q, uint32_t scale_bits, const Params& a,
                                           const XChunkQ8& x) {
  static_assert(F == PackedFormat::kW4G32, "kQ8 activations pair with w4g32 weights only");
  return dot_w4g32_q8(q, scale_from_bits(a, scale_bits), x);
}

// D: how w4g32 / w4g32a nibbles meet the activations (NibbleDot: kBiased for bf16-valued x,
// kCentered for fp32 x); the other formats' products are exact either way.
template <PackedFormat F, NibbleDot D = NibbleDot::kBiased, typename Params>
__device__ __forceinline__ float dot_chunk(const uint4& q, ScaleBits<F> scale_bits, const Params& a,
                                           const XChunk<kChunkElems<F>>& x) {
  if constexpr (F == PackedFormat::kW4G32) {
    return dot_w4g32<D>(q, scale_from_bits(a, scale_bits), x);
  } else if constexpr (F == PackedFormat::kW4G32A) {
    return dot_w4g32a<D>(q, scale_bits, x);
  } else if constexpr (F == PackedFormat::kW8) {
    return dot_w8(q, scale_from_bits(a, scale_bits), x);
  } else if constexpr (F == PackedFormat::kNVFP4) {
    return dot_nvfp4(q, scale_bits, a, x);
  } else if constexpr (F == PackedFormat::kF16) {
    return dot_f16(q, x);
  } else {
    return dot_bf16(q, x);
  }
}

// PyTorch gelu(approximate="tanh").
__device__ __forceinline__ float gelu_tanh(float u) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * u * (1.0f + tanhf(kSqrt2OverPi * (u + 0.044715f * u * u * u)));
}

}  // namespace gemma4::cuda
