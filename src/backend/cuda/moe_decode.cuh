// Device helpers the MoE decode kernels share (moe.cu's per-pair decode kernels and
// moe_by_expert.cu's per-expert ones): warp sums, NVFP4's global scale, activation staging for the
// CUDA-core kernels and the m16n8k16 NVFP4 products of the tensor-core ones (moe.cu's "Decode path
// on tensor cores" comment describes their fragment order and number formats).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/moe_kernels.h"
#include "backend/cuda/moe_launch.cuh"
#include "backend/cuda/nvfp4_decode.cuh"

namespace gemma4::cuda {

template <int N>
__device__ __forceinline__ float butterfly_sum(float v) {
#pragma unroll
  for (int offset = N / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// The NVFP4 group factor without the global scale (applied to the fp32 sums instead), times 2^14
// as nvfp4_factor yields it: a multiplier of 1.
struct NoGlobalScale {
  float nv_global = 1.0f;
  int nv_global_is_divisor = 0;
};

// NVFP4's global scale, as the checkpoint's convention applies it (weight-formats.md 3.3).
template <PackedFormat F>
__device__ __forceinline__ float apply_global_scale(const MoeMatrix& m, float sum) {
  if constexpr (F == PackedFormat::kNVFP4) {
    return m.nv_global_is_divisor ? sum / m.nv_global : sum * m.nv_global;
  } else {
    return sum;
  }
}

// dot_chunk without NVFP4's global scale: the decode kernels apply it once per output (its
// division per group was ~10 % of their instructions). The sums then differ from the per-group
// convention by fp32 rounding only. D: dot_chunk's.
template <PackedFormat F, NibbleDot D = NibbleDot::kBiased>
__device__ __forceinline__ float dot_chunk_unscaled(const uint4& q, uint32_t scale_bits,
                                                    const MoeMatrix& m,
                                                    const XChunk<kChunkElems<F>>& x) {
  if constexpr (F == PackedFormat::kNVFP4) {
    return dot_nvfp4(q, scale_bits, NoGlobalScale{}, x);
  } else {
    return dot_chunk<F, D>(q, scale_bits, m, x);
  }
}

// The activations of a decode block (gate/up: the token's x row; down: the token's top_k
// activation rows, contiguous) are `chunks` chunks of kElems floats, chunk c = elements
// [c · kElems, (c + 1) · kElems). Lane l works on chunk base + l, so reading the chunks from global
// memory makes every load touch 32 different 128-byte lines (~32 L1 wavefronts per instruction:
// that, not the weight stream, bounded both decode kernels). They are staged in shared memory
// once per block instead, piece-major: float4 piece i of chunk c at staged[i · chunks + c], so the
// lanes of a warp read consecutive words. The values and their use are unchanged (bit-identical
// results).
template <int kElems>
__device__ __forceinline__ void stage_activations(const float* source, int chunks, float4* staged) {
  constexpr int P = kElems / 4;
  const float4* pieces = reinterpret_cast<const float4*>(source);
  for (int i = threadIdx.x; i < chunks * P; i += blockDim.x) {
    staged[(i % P) * chunks + i / P] = __ldg(pieces + i);
  }
}

template <int kElems>
__device__ __forceinline__ void load_staged_chunk(const float4* staged, int chunks, int chunk,
                                                  XChunk<kElems>& out) {
#pragma unroll
  for (int i = 0; i < kElems / 4; ++i) {
    const float4 q = staged[i * chunks + chunk];
    out.v[4 * i] = q.x;
    out.v[4 * i + 1] = q.y;
    out.v[4 * i + 2] = q.z;
    out.v[4 * i + 3] = q.w;
  }
  finish_x_chunk(out);
}

// Asks L2 for `bytes` bytes from `begin`, one prefetch per 128-byte line, the block's threads
// taking lines in turn. Nothing is held or waited on: the decode kernels issue these for weights
// they (or the next launch) read later, so those reads hit L2 instead of waiting on DRAM
// (each line's address stays inside the range: no line outside it is touched).
__device__ __forceinline__ void prefetch_l2(const void* begin, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin);
  const uintptr_t end = first + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = (first & ~uintptr_t{127}) + 128 * threadIdx.x; line < end;
       line += 128 * blockDim.x) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(line < first ? first : line));
  }
}

// prefetch_l2 of rows [first_row, end_row) of a format-F matrix: its weights (16-byte chunks)
// and scales (row-major per chunk, as load_scale_bits reads them: NVFP4's two e4m3 bytes, a
// w4g32 group's 16- or 32-bit scale). Formats without such a layout prefetch nothing.
template <PackedFormat F>
__device__ __forceinline__ void prefetch_rows_l2(const MoeMatrix& m, int64_t first_row,
                                                 int64_t end_row) {
  if constexpr (F == PackedFormat::kNVFP4 || F == PackedFormat::kW4G32) {
    if (end_row <= first_row) return;
    const int64_t scale_bytes = F == PackedFormat::kW4G32 && m.scale_type == kScaleF32 ? 4 : 2;
    const int64_t first_chunk = first_row * m.chunks_per_row;
    const int64_t chunks = (end_row - first_row) * m.chunks_per_row;
    prefetch_l2(static_cast<const uint4*>(m.weights) + first_chunk, 16 * chunks);
    prefetch_l2(static_cast<const char*>(m.scales) + scale_bytes * first_chunk,
                scale_bytes * chunks);
  }
}

// A gate/up block's share of its pick's down matrix (`down_rows` rows, split evenly over the
// gridDim.y blocks of the pair), prefetched to L2 for the down launch: its weights depend on the
// router only, and gate/up alone leaves DRAM idle much of the time.
template <PackedFormat F>
__device__ __forceinline__ void prefetch_down_share_l2(const MoeMatrix& down, int64_t down_rows) {
  if (down_rows <= 0) return;
  const int64_t share = (down_rows + gridDim.y - 1) / gridDim.y;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * share;
  prefetch_rows_l2<F>(down, first, min(first + share, down_rows));
}

// n / d for the down kernels' pick of a chunk (n: a chunk of the token's concatenated activation
// rows, d: chunks per row) as one 64-bit multiply-high instead of a runtime division (~20
// instructions, issued once per round and per staged piece). multiplier m = ⌈2^32 / d⌉ = (2^32 +
// e) / d with 0 <= e < d, so n · m / 2^32 = n / d + n · e / (d · 2^32): with n = q · d + r the
// excess r / d + n · e / (d · 2^32) stays below 1 when n · d < 2^32 (launch_decode checks it), and
// the floor is q exactly.
struct PickDivisor {
  uint64_t multiplier;
  static PickDivisor of(int64_t d) { return {((uint64_t{1} << 32) + d - 1) / d}; }
  __device__ __forceinline__ int divide(int n) const {
    return static_cast<int>((static_cast<uint64_t>(n) * multiplier) >> 32);
  }
};

// fp16 pairs of one 32-element chunk, as the tensor-core decode kernels stage it.
constexpr int kStagedWordsPerChunk = 16;

// The exponent the decode kernels' fp16 weights carry: e2m1 · block scale · 2^-kMmaWeightShift.
constexpr int kMmaWeightShift = 7;

// A chunk's two e4m3 block scales (`bits` 0-7, 8-15) times 2^(14 − kMmaWeightShift), each as an
// fp16 pair (exact: e4m3 is a subset of fp16, and 448 · 2^7 < 65504): one conversion and one
// multiply for both.
__device__ __forceinline__ void e4m3_scale_pairs(uint32_t bits, __half2 (&pairs)[2]) {
  const __half2 both =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits & 0xFFFF), __NV_E4M3);
  const __half2 scaled = __hmul2(both, __float2half2_rn(128.0f));
  pairs[0] = __low2half2(scaled);
  pairs[1] = __high2half2(scaled);
}

// acc += the products of one round: chunk `rows[0]` of A row g and `rows[1]` of row g + 8 (their
// scale bits alongside) against the staged activation chunk: its 4-word piece i at
// `even_pieces` + 4i (i even) or `odd_pieces` + 4i (i odd), the pieces of moe_by_expert.cu's
// swizzled layout.
__device__ __forceinline__ void mma_round(float (&acc)[4], const uint4 (&rows)[2],
                                          const uint32_t (&scale_bits)[2],
                                          const uint32_t* even_pieces, const uint32_t* odd_pieces) {
  __half2 scale[2][2];
  e4m3_scale_pairs(scale_bits[0], scale[0]);
  e4m3_scale_pairs(scale_bits[1], scale[1]);
  const uint32_t words[2][4] = {{rows[0].x, rows[0].y, rows[0].z, rows[0].w},
                                {rows[1].x, rows[1].y, rows[1].z, rows[1].w}};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 x =
        *reinterpret_cast<const uint4*>((i % 2 == 0 ? even_pieces : odd_pieces) + 4 * i);
    const uint32_t b[4] = {x.x, x.y, x.z, x.w};
    uint32_t a[2][4];  // pairs (s, s + 4) of word i of A rows g and g + 8
    scaled_e2m1_half2_pairs(words[0][i], scale[0][i / 2], a[0]);
    scaled_e2m1_half2_pairs(words[1][i], scale[1][i / 2], a[1]);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int s = 2 * half;
      mma_f16(acc, a[0][s], a[1][s], a[0][s + 1], a[1][s + 1], b[s], b[s + 1]);
    }
  }
}

// The exponent p that brings `largest` (the largest staged magnitude) just below 2^15. Zero, inf
// or NaN give p = 0 (NaN and inf then propagate as on the CPU).
__device__ __forceinline__ int staging_exponent(float largest) {
  if (!(largest > 0.0f && largest <= 3.0e38f)) return 0;
  int exponent = 0;
  frexpf(largest, &exponent);  // largest = m · 2^exponent, m in [0.5, 1)
  // At most 2^100 (and 2^-86 back): no overflow for rows of tiny values.
  return min(15 - exponent, 100);
}

// staging_exponent of the largest of the staged magnitudes (`largest`, this thread's share),
// agreed by the whole block (`scratch`: one float per warp); 2^p is returned.
__device__ __forceinline__ float block_staging_scale(float largest, float* scratch, int& p) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xFFFFFFFFu, largest, offset));
  }
  const int warps = static_cast<int>(blockDim.x >> 5);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = largest;
  __syncthreads();
  largest = scratch[0];
  for (int w = 1; w < warps; ++w) largest = fmaxf(largest, scratch[w]);
  p = staging_exponent(largest);
  return ldexpf(1.0f, p);
}

// Lifts `kernel`'s dynamic shared memory limit when `bytes` exceeds the default 48 KiB (large
// hidden or top_k; not at 26B-A4B shapes). Not a stream operation: allowed during graph capture.
template <typename Kernel>
inline cudaError_t allow_shared_bytes(Kernel kernel, size_t bytes) {
  constexpr size_t kDefaultLimit = 48 * 1024;
  if (bytes <= kDefaultLimit) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

// Whether `kernel` can take `bytes` of dynamic shared memory beside its static shared memory on
// the current device. The bulk-copy decode kernels keep a block's whole weight rows there, which
// wide shapes exceed (hidden 13312: 236 KiB of gate/up rows); those take the register-loading
// kernels instead.
template <typename Kernel>
inline bool shared_bytes_fit(Kernel kernel, size_t bytes) {
  int device = 0;
  int optin = 0;
  cudaFuncAttributes attributes{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess ||
      cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    return false;
  }
  return attributes.sharedSizeBytes + bytes <= static_cast<size_t>(optin);
}

}  // namespace gemma4::cuda
