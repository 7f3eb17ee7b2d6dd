// The residual step in a producer kernel's tail (GemvResidualTail, gemv_kernels.h): the kernel's
// blocks store the step's input rows y, count themselves done on a device counter, and the block
// that counts last runs add_rms_norm's step on the whole rows, so that no kernel of its own (and
// no kernel boundary) follows the producer. Any kernel whose blocks together store y can call
// residual_step_tail once per thread after its last store (the register GEMV does; a split-K or
// streaming GEMV can, once its partial sums are reduced into y).
//
// Bits: the last block sums each row's squares in add_rms_norm_kernel's own layout (row_shape,
// float_quads.cuh: virtual thread t of that kernel's block holds quads t, t + threads, ...; its
// warps' totals summed by one warp), whatever the calling kernel's block size, and rounds every
// product as that kernel does, so residual, next and their companions equal its results.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/float_quads.cuh"
#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/gemv_residual_norm.cuh"
#include "backend/cuda/q8.cuh"

namespace gemma4::cuda::gemv_detail {

static_assert(kGemvTailMaxWidth == 4 * kMaxRowQuads * kMaxRowThreads,
              "the tail takes the rows add_rms_norm takes");

// The blocks of `threads` threads per SM a kernel with the tail asks for (__launch_bounds__):
// as many as the register GEMV's own 80 registers a thread allow, so that the tail, which holds a
// whole row in registers (up to 150 a thread otherwise), costs its main loop no occupancy; what
// does not fit spills to local memory in the one block that runs the tail.
constexpr int kGemvTailRegisters = 80;
constexpr int gemv_tail_min_blocks(int threads) {
  return 65536 / (threads * kGemvTailRegisters);
}

// The block total of per-virtual-thread values (add_rms_norm's block_sum): each of the row
// layout's warps summed by warp_sum into warp_totals[virtual warp], then those totals by one warp
// sum. warp_totals must not be read by a previous total's threads any more.
__device__ __forceinline__ float virtual_block_total(const float* warp_totals, int virtual_warps) {
  __syncthreads();
  const int lane = threadIdx.x & 31;
  return warp_sum(lane < virtual_warps ? warp_totals[lane] : 0.0f);
}

// (mean of squares + eps)^-1/2 as add_rms_norm_kernel evaluates it.
__device__ __forceinline__ float tail_inverse_rms(float total, int64_t width, float eps) {
  return 1.0f / sqrtf(total / static_cast<float>(width) + eps);
}

// The step on row m (t: the tail's parameters; y_row: the input row, stored by other blocks of
// this grid: read through L2). kWarps: the calling block's warps, each taking the row layout's
// virtual warps warp, warp + kWarps, ... (at most kVirtualPasses of them); the thread keeps its
// quads in registers from the first load to the last store, each pass's loads issued together.
// warp_totals: 64 floats of shared memory. The passes are not unrolled: unrolled (16 quad slots
// with their companion stores) the tail was ~12k instructions that the one block running it
// fetched cold (measured: +5.6 µs on E2B's o_proj, +12.6 µs on 31B's, session 8 MID batch).
template <int kWarps>
__device__ __forceinline__ void residual_step_row(const GemvResidualTail& t, const float* y_row,
                                                  int64_t m, int64_t width, float* warp_totals) {
  constexpr int kVirtualPasses = (kMaxRowThreads / 32 + kWarps - 1) / kWarps;
  const RowShape shape = row_shape(width);
  const auto threads = static_cast<int>(shape.threads);
  const int virtual_warps = threads / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float* residual_row = t.residual + m * t.residual_stride;
  // Element index of quad k of the thread's p-th virtual thread (in the row or not: `in_row`).
  const auto first = [&](int p, int k) {
    return 4 * ((warp + p * kWarps) * 32 + lane + k * threads);
  };
  // Quads past the row or the virtual thread's quads are zeros in add_rms_norm: they add nothing
  // to a sum and are not stored.
  const auto in_row = [&](int p, int k) {
    return warp + p * kWarps < virtual_warps && k < shape.quads_per_thread && first(p, k) < width;
  };
  // The later passes' rows (residual, norm weights) on their way to L1 while y's sum is formed:
  // one prefetch per 128-byte line (8 lanes' quads).
#pragma unroll 1
  for (int p = 0; p < kVirtualPasses; ++p) {
#pragma unroll
    for (int k = 0; k < kMaxRowQuads; ++k) {
      if (lane % 8 != 0 || !in_row(p, k)) continue;
      const float* rows[5] = {residual_row, t.weight, t.next_weight, t.router_scale,
                              t.expert_weight};
      for (const float* row : rows) {
        if (row != nullptr) prefetch_l1(row + first(p, k));
      }
    }
  }
  FloatQuad v[kVirtualPasses][kMaxRowQuads];
#pragma unroll 1
  for (int p = 0; p < kVirtualPasses; ++p) {
#pragma unroll
    for (int k = 0; k < kMaxRowQuads; ++k) {
      v[p][k] = {{0.0f, 0.0f, 0.0f, 0.0f}};
      if (in_row(p, k)) {
        const float4 f = __ldcg(reinterpret_cast<const float4*>(y_row + first(p, k)));
        v[p][k] = {{f.x, f.y, f.z, f.w}};
      }
    }
  }
  // Each virtual thread's squares summed over its quads in order, then per virtual warp.
  const auto warp_totals_of = [&](float* totals) {
#pragma unroll 1
    for (int p = 0; p < kVirtualPasses; ++p) {
      const int vw = warp + p * kWarps;
      if (vw >= virtual_warps) break;  // warp-uniform
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kMaxRowQuads; ++k)
#pragma unroll
        for (int e = 0; e < 4; ++e) sum += v[p][k].v[e] * v[p][k].v[e];
      sum = warp_sum(sum);
      if (lane == 0) totals[vw] = sum;
    }
  };
  warp_totals_of(warp_totals);
  const float y_inv =
      tail_inverse_rms(virtual_block_total(warp_totals, virtual_warps), width, t.eps);

  // residual = (residual + y · y_inv · scale) · scalar, into v.
#pragma unroll 1
  for (int p = 0; p < kVirtualPasses; ++p) {
#pragma unroll
    for (int k = 0; k < kMaxRowQuads; ++k) {
      if (!in_row(p, k)) continue;
      const FloatQuad scale = load_norm_scale<true>(t.weight, t.weight_offset, first(p, k), width);
      const FloatQuad residual = load_quad<true>(residual_row, first(p, k), width);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float normed = __fmul_rn(__fmul_rn(v[p][k].v[e], y_inv), scale.v[e]);
        v[p][k].v[e] = __fmul_rn(residual.v[e] + normed, t.scalar);
      }
    }
  }
  // Stored (every lane of a virtual warp: a kQ8 companion quantizes 32 elements over 8 lanes).
  const auto store_v = [&](float* row, const ActivationCompanions& companions) {
#pragma unroll 1
    for (int p = 0; p < kVirtualPasses; ++p) {
      if (warp + p * kWarps >= virtual_warps) break;  // warp-uniform
#pragma unroll
      for (int k = 0; k < kMaxRowQuads; ++k) {
        if (k >= shape.quads_per_thread) break;  // uniform
        if (in_row(p, k)) store_quad<true>(row, first(p, k), width, v[p][k]);
        store_companions<4>(companions, m, first(p, k), v[p][k].v, in_row(p, k));
      }
    }
  };
  store_v(residual_row, t.residual_companions);
  if (t.next == nullptr && t.router_in == nullptr) return;
  warp_totals_of(warp_totals + 32);
  const float residual_inv =
      tail_inverse_rms(virtual_block_total(warp_totals + 32, virtual_warps), width, t.eps);

  // The MoE inputs: router_in = (residual · residual_inv · router_scale) · router_factor,
  // expert_in = residual · residual_inv · expert scale (add_rms_norm_kernel's order).
  if (t.router_in != nullptr) {
    float* router_row = t.router_in + m * t.router_in_stride;
    float* expert_row = t.expert_in + m * t.expert_in_stride;
#pragma unroll 1
    for (int p = 0; p < kVirtualPasses; ++p) {
#pragma unroll
      for (int k = 0; k < kMaxRowQuads; ++k) {
        if (!in_row(p, k)) continue;
        const FloatQuad router_scale =
            load_norm_scale<true>(t.router_scale, 0.0f, first(p, k), width);
        const FloatQuad expert_scale =
            load_norm_scale<true>(t.expert_weight, t.weight_offset, first(p, k), width);
        FloatQuad router, expert;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float normed = __fmul_rn(v[p][k].v[e], residual_inv);
          router.v[e] = __fmul_rn(__fmul_rn(normed, router_scale.v[e]), t.router_factor);
          expert.v[e] = __fmul_rn(__fmul_rn(v[p][k].v[e], residual_inv), expert_scale.v[e]);
        }
        store_quad<true>(router_row, first(p, k), width, router);
        store_quad<true>(expert_row, first(p, k), width, expert);
      }
    }
  }
  if (t.next == nullptr) return;

    // next = residual · residual_inv · next scale.
#pragma unroll 1
  for (int p = 0; p < kVirtualPasses; ++p) {
#pragma unroll
    for (int k = 0; k < kMaxRowQuads; ++k) {
      if (!in_row(p, k)) continue;
      const FloatQuad scale =
          load_norm_scale<true>(t.next_weight, t.weight_offset, first(p, k), width);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        v[p][k].v[e] = __fmul_rn(__fmul_rn(v[p][k].v[e], residual_inv), scale.v[e]);
    }
  }
  store_v(t.next + m * t.next_stride, t.next_companions);
}

// The lines of the step's norm weights (nothing a predecessor writes) into L2, one per block
// (block b its b-th line of each), before a caller's PDL wait: the last block then finds them
// there.
__device__ __forceinline__ void prefetch_tail_weights(const GemvResidualTail& t, int64_t width) {
  if (t.residual == nullptr || threadIdx.x != 0) return;
  const int64_t line = 32 * int64_t{blockIdx.x};  // 32 floats, 128 bytes
  if (line >= width) return;
  const float* weights[2] = {t.weight, t.next == nullptr ? nullptr : t.next_weight};
  for (const float* weight : weights) {
    if (weight != nullptr) asm volatile("prefetch.global.L2 [%0];" ::"l"(weight + line));
  }
}

// Called once by every thread of every block of the grid after its last store of y (rows
// y + m · y_stride, m < rows, of `width` values): the last block to get here runs the step on
// every row, then sets the counter back to zero for the next launch (graph replays included).
// warp_totals: 64 floats of shared memory nothing else uses from here on.
template <int kWarps>
__device__ __forceinline__ void residual_step_tail(const GemvResidualTail& t, const float* y,
                                                   int64_t y_stride, int rows, int64_t width,
                                                   float* warp_totals) {
  // The block's stores of y, ordered before thread 0's by the barrier, are released with its
  // count (cumulatively, as in a cooperative grid sync); the count that finds every other block
  // done acquires theirs, and the barrier hands them to the block's threads. A release-acquire
  // atomic rather than __threadfence (a sequentially consistent fence) in every block.
  __syncthreads();
  bool counted_last = false;
  if (threadIdx.x == 0) {
    unsigned int before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(before)
                 : "l"(t.done_counter)
                 : "memory");
    counted_last = before == gridDim.x * gridDim.y * gridDim.z - 1;
  }
  if (!__syncthreads_or(counted_last)) return;
  for (int m = 0; m < rows; ++m) {
    // warp_totals serves one row at a time.
    if (m > 0) __syncthreads();
    residual_step_row<kWarps>(t, y + m * y_stride, m, width, warp_totals);
  }
  if (threadIdx.x == 0) *t.done_counter = 0u;
}

}  // namespace gemma4::cuda::gemv_detail
