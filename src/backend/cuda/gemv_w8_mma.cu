// The single-row w8 GEMV on tensor cores (gemv_w8_mma.h describes the method).
#include <cuda_fp16.h>

#include "backend/cuda/device_math.cuh"  // load_weights_nc
#include "backend/cuda/gemv_w8_mma.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kWarps = 4;       // per block, one 16-row tile each
constexpr int kBatchSteps = 4;  // steps whose weights a lane loads before multiplying them

// Bytes 2h, 2h + 1 of a word of four int8, as an exact fp16 pair (the low byte in the low half):
// q + 128 goes into the low mantissa byte of fp16 1024 (0x64XX = 1024 + XX), and 1152 comes off.
__device__ __forceinline__ uint32_t int8_pair_as_f16(uint32_t biased_word, int h) {
  const uint32_t pair = __byte_perm(biased_word, 0x64646464u, h == 0 ? 0x4140 : 0x4342);
  const __half2 value = __hsub2(*reinterpret_cast<const __half2*>(&pair),
                                __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480)));
  return *reinterpret_cast<const uint32_t*>(&value);
}

// Activations 8p .. 8p + 7 as fp16 (round to nearest), in order.
template <ActType XT>
__device__ __forceinline__ uint4 f16_piece(const void* x, int64_t p) {
  float v[8];
  if constexpr (XT == ActType::kBF16) {
    const uint4 bits = __ldg(reinterpret_cast<const uint4*>(x) + p);
    const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(words[i] << 16);
      v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
  } else {
    const float4* source = reinterpret_cast<const float4*>(x) + 2 * p;
    const float4 lo = __ldg(source), hi = __ldg(source + 1);
    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
    v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
  }
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 pair = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    out[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

template <ActType XT>
__global__ void __launch_bounds__(kWarps * 32) gemv_w8_mma_kernel(GemvArgs a) {
  pdl_trigger_dependents();
  extern __shared__ uint4 staged_x[];  // K fp16 activations: two uint4 per chunk
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t cpr = a.chunks_per_row;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * 16;
  // Rows past the matrix read its last row (never stored).
  const int64_t row_g = min(row0 + g, a.rows - 1), row_g8 = min(row0 + g + 8, a.rows - 1);
  // Lane t's chunk of each step, and the fp16 scale of the group lanes t = 0, 1 apply: columns
  // 2t, 2t + 1 are chunks 4s + 2t, 4s + 2t + 1, group 2s + t (lanes 2, 3 load one unused).
  const uint4* w_g = static_cast<const uint4*>(a.weights) + row_g * cpr + t;
  const uint4* w_g8 = static_cast<const uint4*>(a.weights) + row_g8 * cpr + t;
  const uint16_t* s_g = static_cast<const uint16_t*>(a.scales) + row_g * (cpr / 2) + (t & 1);
  const uint16_t* s_g8 = static_cast<const uint16_t*>(a.scales) + row_g8 * (cpr / 2) + (t & 1);

  pdl_wait_for_predecessors();
  for (int64_t p = threadIdx.x; p < 2 * cpr; p += kWarps * 32) staged_x[p] = f16_piece<XT>(a.x, p);
  __syncthreads();
  if (row0 >= a.rows) return;

  float acc_g = 0.0f, acc_g8 = 0.0f;
  const int steps = static_cast<int>(cpr / 4);  // a multiple of kBatchSteps (gemv.cpp)
  for (int first = 0; first < steps; first += kBatchSteps) {
    uint4 weights_g[kBatchSteps], weights_g8[kBatchSteps];
    uint16_t scale_g[kBatchSteps], scale_g8[kBatchSteps];
#pragma unroll
    for (int i = 0; i < kBatchSteps; ++i) {
      weights_g[i] = load_weights_nc(w_g + 4 * (first + i));
      weights_g8[i] = load_weights_nc(w_g8 + 4 * (first + i));
      scale_g[i] = __ldg(s_g + 2 * (first + i));
      scale_g8[i] = __ldg(s_g8 + 2 * (first + i));
    }
#pragma unroll
    for (int i = 0; i < kBatchSteps; ++i) {
      const int chunk = 4 * (first + i) + t;
      uint4 x_lo = make_uint4(0, 0, 0, 0), x_hi = x_lo;
      if (g == t) {
        x_lo = staged_x[2 * chunk];
        x_hi = staged_x[2 * chunk + 1];
      }
      const uint32_t xw[8] = {x_lo.x, x_lo.y, x_lo.z, x_lo.w, x_hi.x, x_hi.y, x_hi.z, x_hi.w};
      const uint32_t rg[4] = {weights_g[i].x ^ 0x80808080u, weights_g[i].y ^ 0x80808080u,
                              weights_g[i].z ^ 0x80808080u, weights_g[i].w ^ 0x80808080u};
      const uint32_t rg8[4] = {weights_g8[i].x ^ 0x80808080u, weights_g8[i].y ^ 0x80808080u,
                               weights_g8[i].z ^ 0x80808080u, weights_g8[i].w ^ 0x80808080u};
      // Two accumulator chains (elements 0-7, 8-15) halve the dependent mma latency.
      float c[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // elements 4j .. 4j + 3 of the lane's chunk
        mma_f16(c[j / 2], int8_pair_as_f16(rg[j], 0), int8_pair_as_f16(rg8[j], 0),
                int8_pair_as_f16(rg[j], 1), int8_pair_as_f16(rg8[j], 1), xw[2 * j], xw[2 * j + 1]);
      }
      acc_g = fmaf(__half2float(__ushort_as_half(scale_g[i])),
                   (c[0][0] + c[1][0]) + (c[0][1] + c[1][1]), acc_g);
      acc_g8 = fmaf(__half2float(__ushort_as_half(scale_g8[i])),
                    (c[0][2] + c[1][2]) + (c[0][3] + c[1][3]), acc_g8);
    }
  }
  // Lanes t = 0, 1 hold the row sums' two halves (t = 2, 3: the zero columns 4..7).
  acc_g += __shfl_xor_sync(0xFFFFFFFFu, acc_g, 1);
  acc_g8 += __shfl_xor_sync(0xFFFFFFFFu, acc_g8, 1);
  if (t == 0) {
    if (row0 + g < a.rows) a.y[row0 + g] = acc_g;
    if (row0 + g + 8 < a.rows) a.y[row0 + g + 8] = acc_g8;
  }
}

}  // namespace

cudaError_t launch_gemv_w8_mma(ActType x_type, const GemvArgs& args, const Launch& launch) {
  const int64_t tiles = (args.rows + 15) / 16;
  const dim3 grid(static_cast<unsigned>((tiles + kWarps - 1) / kWarps));
  const size_t shared = static_cast<size_t>(args.chunks_per_row) * 2 * sizeof(uint4);
  if (x_type == ActType::kBF16)
    return launch_kernel(gemv_w8_mma_kernel<ActType::kBF16>, grid, dim3(kWarps * 32), shared,
                         launch, args);
  if (x_type == ActType::kF32)
    return launch_kernel(gemv_w8_mma_kernel<ActType::kF32>, grid, dim3(kWarps * 32), shared, launch,
                         args);
  return cudaErrorInvalidValue;
}

}  // namespace gemma4::cuda
