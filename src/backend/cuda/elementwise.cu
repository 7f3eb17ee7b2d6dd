// Row-wise kernels (see elementwise.h): one block per row, fp32 math.
#include <algorithm>
#include <cmath>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/float_quads.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/norm_sums.cuh"
#include "backend/cuda/q8.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kNormThreads = 256;

// The block sums: every thread gets the totals. Each warp reduces its values with shuffles and
// its lanes put the warp's totals in shared memory (scratch[c][warp] for component c); then the
// second level over the warps (norm_sums.cuh). Every component of every variant is reduced over
// the same tree (an xor butterfly in the warp, then sum_of_groups' order over the warps), so a
// value gets the same bits whichever variant sums it. `scratch` (16-byte aligned, 32 floats per
// component) serves one call only (a second sum in the same kernel takes its own).

// One component: every thread adds the warps' totals itself (one barrier; straight-line code for
// the block's count of 4-warp groups, a uniform branch per smaller count).
template <int kGroups = 8>
__device__ __forceinline__ float sum_warp_totals(const float* totals, int groups) {
  if constexpr (kGroups > 1) {
    if (groups < kGroups) return sum_warp_totals<kGroups - 1>(totals, groups);
  }
  return sum_of_groups<kGroups>(totals);
}

// Pads the warps' totals of N components with zeros up to a multiple of 4 warps.
template <int N>
__device__ __forceinline__ void pad_warp_totals(float (*scratch)[32]) {
  const int warps = static_cast<int>(blockDim.x / 32);
  const int pad = (4 - warps % 4) % 4;
  if (static_cast<int>(threadIdx.x) < N * pad) {
    scratch[threadIdx.x / pad][warps + threadIdx.x % pad] = 0.0f;
  }
}

// Several components: every thread reading every warp's totals would cost a read per component
// and group in each warp (the shared-memory pipe, not latency, bounds that past ~12 warps), so
// the first warp adds them (8 lanes per component) and publishes the totals: two barriers.
// `published`: 4 floats, 16-byte aligned.
template <int N>
__device__ __forceinline__ void finish_block_sums(float (*scratch)[32], float* published,
                                                  float (&totals)[N]) {
  static_assert(N <= 4);
  pad_warp_totals<N>(scratch);
  __syncthreads();
  if (threadIdx.x < 32) {
    const int component = static_cast<int>(threadIdx.x / 8);
    const int groups = (static_cast<int>(blockDim.x / 32) + 3) / 4;
    const float total =
        butterfly_of_groups(scratch[component < N ? component : 0], component < N ? groups : 0);
    if (threadIdx.x % 8 == 0 && component < N) published[component] = total;
  }
  __syncthreads();
  if constexpr (N > 2) {
    const float4 all = *reinterpret_cast<const float4*>(published);
    const float values[4] = {all.x, all.y, all.z, all.w};
#pragma unroll
    for (int c = 0; c < N; ++c) totals[c] = values[c];
  } else {
    const float2 all = *reinterpret_cast<const float2*>(published);
    totals[0] = all.x;
    if constexpr (N == 2) totals[1] = all.y;
  }
}

// Sum of `value` over the block (a multiple of 32 threads, at most 1024).
__device__ float block_sum(float value, float (*scratch)[32]) {
  value = warp_sum(value);
  if ((threadIdx.x & 31) == 0) scratch[0][threadIdx.x / 32] = value;
  pad_warp_totals<1>(scratch);
  __syncthreads();
  return sum_warp_totals(scratch[0], (static_cast<int>(blockDim.x / 32) + 3) / 4);
}

// Two (or four) block sums at once (published: 4 floats, 16-byte aligned, for the totals). The
// warp's reduction is transposed: each shuffle
// moves one value, and the lanes end with different components' totals (a value sent is one the
// sending lane gives up): 5 shuffles for two values, 6 for four, where a butterfly per value
// takes 10 or 20 (one shuffle instruction a cycle per SM: the four values' shuffles of a full
// block would outlast the butterfly's latency).
__device__ float2 block_sum2(float2 value, float (*scratch)[32], float* published) {
  const int lane = threadIdx.x & 31;
  const bool upper = lane & 16;  // keeps component 1
  float mine = upper ? value.y : value.x;
  mine += __shfl_xor_sync(0xFFFFFFFFu, upper ? value.x : value.y, 16);
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) mine += __shfl_xor_sync(0xFFFFFFFFu, mine, offset);
  if (lane % 16 == 0) scratch[lane / 16][threadIdx.x / 32] = mine;
  float totals[2];
  finish_block_sums(scratch, published, totals);
  return {totals[0], totals[1]};
}

__device__ float4 block_sum4(float4 value, float (*scratch)[32], float* published) {
  const int lane = threadIdx.x & 31;
  const bool upper = lane & 16;  // keeps components 2, 3
  float kept0 = upper ? value.z : value.x, kept1 = upper ? value.w : value.y;
  kept0 += __shfl_xor_sync(0xFFFFFFFFu, upper ? value.x : value.z, 16);
  kept1 += __shfl_xor_sync(0xFFFFFFFFu, upper ? value.y : value.w, 16);
  const bool odd = lane & 8;  // keeps the second of the two
  float mine = odd ? kept1 : kept0;
  mine += __shfl_xor_sync(0xFFFFFFFFu, odd ? kept0 : kept1, 8);
#pragma unroll
  for (int offset = 4; offset > 0; offset /= 2) mine += __shfl_xor_sync(0xFFFFFFFFu, mine, offset);
  if (lane % 8 == 0) scratch[lane / 8][threadIdx.x / 32] = mine;  // component lane / 8
  float totals[4];
  finish_block_sums(scratch, published, totals);
  return {totals[0], totals[1], totals[2], totals[3]};
}

// (mean(x²) + eps)^-1/2 as transformers evaluates it (eps inside; a correctly rounded sqrt and
// division rather than the approximate rsqrt).
__device__ float inverse_rms_of_sum(float block_sum_of_squares, int64_t width, float eps) {
  return 1.0f / sqrtf(block_sum_of_squares / static_cast<float>(width) + eps);
}

__device__ float inverse_rms(float sum_of_squares, int64_t width, float eps, float (*scratch)[32]) {
  return inverse_rms_of_sum(block_sum(sum_of_squares, scratch), width, eps);
}

__device__ float inverse_rms(const float* row, int64_t width, float eps, float (*scratch)[32]) {
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) sum += row[j] * row[j];
  return inverse_rms(sum, width, eps, scratch);
}

struct NormArgs {
  RowsView x;
  const float* weight;
  float weight_offset;
  float eps;
  RowsView y;
  RopeSpec rope;
  int has_rope;
  ActivationCompanions y_companions;  // rms_norm_row_kernel only
};

// rms_norm with RoPE, or of rows too wide for rms_norm_row_kernel: strided loops over the row.
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(NormArgs a) {
  pdl_trigger_dependents();
  __shared__ __align__(16) float scratch[1][32];
  pdl_wait_for_predecessors();
  const int64_t r = blockIdx.x;
  const float* x = a.x.data + r * a.x.stride;
  float* y = a.y.data + r * a.y.stride;
  const float inv = inverse_rms(x, a.x.width, a.eps, scratch);
  auto normed = [&](int64_t j) {
    const float v = x[j] * inv;
    return a.weight ? v * (a.weight_offset + a.weight[j]) : v;
  };
  if (!a.has_rope) {
    for (int64_t j = threadIdx.x; j < a.x.width; j += blockDim.x) y[j] = normed(j);
    return;
  }
  // Each thread owns whole pairs (i, i + half), so y may alias x.
  const int64_t half = a.x.width / 2;
  const float position = static_cast<float>(a.rope.positions[r / a.rope.rows_per_position]);
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float first = normed(i);
    const float second = normed(i + half);
    if (i < a.rope.rotated_pairs) {
      // inv_freq correctly rounded to fp32 (double pow), angle = fp32(pos) · inv_freq in fp32,
      // as transformers evaluates it; a few pow calls per row cost nothing here.
      const float inv_freq =
          static_cast<float>(1.0 / pow(static_cast<double>(a.rope.theta),
                                       static_cast<double>(2 * i) / a.rope.exponent_denominator));
      float sin_angle, cos_angle;
      sincosf(position * inv_freq, &sin_angle, &cos_angle);
      y[i] = first * cos_angle - second * sin_angle;
      y[i + half] = second * cos_angle + first * sin_angle;
    } else {
      y[i] = first;
      y[i + half] = second;
    }
  }
}

struct NormQ8Args {
  RowsView x;
  const float* weight;
  float weight_offset;
  float eps;
  void* out;
  int64_t out_stride;
};

// Block per row; warp w quantizes chunks w, w + 8, ... of the normalized row.
__global__ void __launch_bounds__(kNormThreads) rms_norm_q8_kernel(NormQ8Args a) {
  pdl_trigger_dependents();
  __shared__ __align__(16) float scratch[1][32];
  pdl_wait_for_predecessors();
  const int64_t r = blockIdx.x;
  const float* x = a.x.data + r * a.x.stride;
  const float inv = inverse_rms(x, a.x.width, a.eps, scratch);
  uint8_t* row = static_cast<uint8_t*>(a.out) + r * (a.out_stride + a.out_stride / 4);
  const int lane = threadIdx.x & 31;
  for (int64_t chunk = threadIdx.x / 32; chunk < a.x.width / 32; chunk += kNormThreads / 32) {
    const int64_t j = chunk * 32 + lane;
    float v[1] = {x[j] * inv};
    if (a.weight) v[0] *= a.weight_offset + a.weight[j];
    store_chunk_q8<1>(v, lane, row, a.out_stride, chunk);
  }
}

// The register-resident row kernels (add_rms_norm, rms_norm without RoPE): thread t holds quads
// t, t + blockDim, ... (kQuads of them: row_shape, float_quads.cuh), every global load is issued
// before the first reduction and every store happens once.

__device__ __forceinline__ int64_t quad_first(int k) {
  return 4 * (threadIdx.x + int64_t{k} * blockDim.x);
}

__device__ __forceinline__ bool quad_in_row(int k, int64_t width) {
  return quad_first(k) < width;
}

// The thread's quads of `row` (zeros past the row).
template <int kQuads, bool kAligned>
__device__ __forceinline__ void load_row(const float* row, int64_t width,
                                         FloatQuad (&out)[kQuads]) {
#pragma unroll
  for (int k = 0; k < kQuads; ++k) {
    out[k] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (quad_in_row(k, width)) out[k] = load_quad<kAligned>(row, quad_first(k), width);
  }
}

// The thread's quads of the norm scale (weight_offset + weight); ones for a null weight.
template <int kQuads, bool kAligned>
__device__ __forceinline__ void load_row_scale(const float* weight, float weight_offset,
                                               int64_t width, FloatQuad (&out)[kQuads]) {
#pragma unroll
  for (int k = 0; k < kQuads; ++k) {
    out[k] = {{1.0f, 1.0f, 1.0f, 1.0f}};
    if (quad_in_row(k, width))
      out[k] = load_norm_scale<kAligned>(weight, weight_offset, quad_first(k), width);
  }
}

template <int kQuads, bool kAligned>
__device__ __forceinline__ void store_row(float* row, int64_t width,
                                          const FloatQuad (&quads)[kQuads]) {
#pragma unroll
  for (int k = 0; k < kQuads; ++k)
    if (quad_in_row(k, width)) store_quad<kAligned>(row, quad_first(k), width, quads[k]);
}

// The companions of row r (gemv_kernels.h) from the thread's quads; every thread of the block
// calls (warp shuffles), with the row width a multiple of 32.
template <int kQuads>
__device__ __forceinline__ void store_row_companions(const ActivationCompanions& c, int64_t r,
                                                     int64_t width,
                                                     const FloatQuad (&quads)[kQuads]) {
  if (c.bf16 == nullptr && c.q8 == nullptr) return;
#pragma unroll
  for (int k = 0; k < kQuads; ++k)
    store_companions<4>(c, r, quad_first(k), quads[k].v, quad_in_row(k, width));
}

template <int kQuads>
__device__ __forceinline__ float sum_of_squares(const FloatQuad (&quads)[kQuads]) {
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kQuads; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e) sum += quads[k].v[e] * quads[k].v[e];
  return sum;
}

// quads[k] · inv · scale[k], each product rounded (no fma), as the CPU reference rounds them.
template <int kQuads>
__device__ __forceinline__ void scale_row(FloatQuad (&quads)[kQuads], float inv,
                                          const FloatQuad (&scale)[kQuads]) {
#pragma unroll
  for (int k = 0; k < kQuads; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      quads[k].v[e] = __fmul_rn(__fmul_rn(quads[k].v[e], inv), scale[k].v[e]);
}

// The thread's share of the sums a residual step reduces (add_rms_norm_kernel): Σx², and for
// expanded_sum_of_squares Σ residual², Σ residual · x·scale, Σ (x·scale)².
template <int kQuads>
__device__ __forceinline__ float4 residual_step_terms(const FloatQuad (&x)[kQuads],
                                                      const FloatQuad (&residual)[kQuads],
                                                      const FloatQuad (&scale)[kQuads]) {
  float4 terms = make_float4(sum_of_squares(x), sum_of_squares(residual), 0.0f, 0.0f);
#pragma unroll
  for (int k = 0; k < kQuads; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float scaled = __fmul_rn(x[k].v[e], scale[k].v[e]);
      terms.z += residual[k].v[e] * scaled;
      terms.w += scaled * scaled;
    }
  return terms;
}

// rms_norm without RoPE (y may alias x: the row is in registers before the first store).
template <int kQuads, bool kAligned>
__global__ void __launch_bounds__(kMaxRowThreads) rms_norm_row_kernel(NormArgs a) {
  pdl_trigger_dependents();
  __shared__ __align__(16) float sums[1][32];
  const int64_t width = a.x.width;
  // The norm weight is not written by a predecessor: loaded before the wait.
  FloatQuad scale[kQuads], x[kQuads];
  load_row_scale<kQuads, kAligned>(a.weight, a.weight_offset, width, scale);
  pdl_wait_for_predecessors();
  const int64_t r = blockIdx.x;
  load_row<kQuads, kAligned>(a.x.data + r * a.x.stride, width, x);
  scale_row(x, inverse_rms(sum_of_squares(x), width, a.eps, sums), scale);
  store_row<kQuads, kAligned>(a.y.data + r * a.y.stride, width, x);
  store_row_companions(a.y_companions, r, width, x);
}

// What add_rms_norm_kernel does before the residual step proper.
enum class AddNormStep : uint8_t {
  kPlain,
  kBranch,    // x = branch + rms_norm(x; extra_weight) first (add_rms_norm_branch)
  kDeferred,  // residual += rms_norm(extra; extra_weight) first (add_rms_norm_deferred)
};

struct AddNormArgs {
  RowsView x;
  RowsView residual;
  RowsView next;
  AddNormSpec spec;
  RowsView extra;  // kBranch: the branch; kDeferred: the deferred step's input
  const float* extra_weight;
  MoeInputsSpec moe;  // kPlain: router_in.data != nullptr for add_rms_norm_moe
};

template <int kQuads, bool kAligned, AddNormStep kStep>
__global__ void __launch_bounds__(kMaxRowThreads) add_rms_norm_kernel(AddNormArgs a) {
  pdl_trigger_dependents();
  __shared__ __align__(16) float x_sums[1][32], branch_sums[1][32], deferred_sums[2][32],
      expansion_sums[4][32], residual_sums[1][32], published_sums[2][4];
  const int64_t width = a.x.width;
  const AddNormSpec& spec = a.spec;
  const bool has_next = a.next.data != nullptr;
  const bool has_moe = kStep == AddNormStep::kPlain && a.moe.router_in.data != nullptr;
  // The norm weights are not written by a predecessor: loaded before the wait.
  FloatQuad scale[kQuads], next_scale[kQuads], extra_scale[kQuads];
  load_row_scale<kQuads, kAligned>(spec.weight, spec.weight_offset, width, scale);
  if constexpr (kStep != AddNormStep::kPlain)
    load_row_scale<kQuads, kAligned>(a.extra_weight, spec.weight_offset, width, extra_scale);
  // kPlain has no extra step: extra_scale holds the experts' norm scale instead.
  FloatQuad router_scale[kQuads];
  if (has_moe) {
    load_row_scale<kQuads, kAligned>(a.moe.router_scale, 0.0f, width, router_scale);
    load_row_scale<kQuads, kAligned>(a.moe.expert_weight, spec.weight_offset, width, extra_scale);
  }
  if (has_next)
    load_row_scale<kQuads, kAligned>(spec.next_weight, spec.weight_offset, width, next_scale);
  pdl_wait_for_predecessors();
  const int64_t r = blockIdx.x;
  float* residual_row = a.residual.data + r * a.residual.stride;
  FloatQuad x[kQuads], residual[kQuads], extra[kQuads];
  load_row<kQuads, kAligned>(a.x.data + r * a.x.stride, width, x);
  load_row<kQuads, kAligned>(residual_row, width, residual);
  if constexpr (kStep != AddNormStep::kPlain)
    load_row<kQuads, kAligned>(a.extra.data + r * a.extra.stride, width, extra);
  if constexpr (kStep == AddNormStep::kBranch) {
    scale_row(x, inverse_rms(sum_of_squares(x), width, spec.eps, branch_sums), extra_scale);
#pragma unroll
    for (int k = 0; k < kQuads; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[k].v[e] = extra[k].v[e] + x[k].v[e];
  }

  // The new residual's norm (next, the MoE inputs) needs Σ residual², which the sums of the old
  // residual and x give without a second reduction (expanded_sum_of_squares, float_quads.cuh):
  // reduced with x's own. kDeferred's residual is known only after its first reduction: a second
  // one there, of the same sums.
  const bool needs_residual_norm = has_next || has_moe;
  float x_inv, residual_sum_of_squares = 0.0f;
  if constexpr (kStep == AddNormStep::kDeferred) {
    // Neither norm depends on the other: one reduction for both. The deferred step rounds as the
    // add_rms_norm that would have run it (scalar 1).
    const float2 sums = block_sum2(make_float2(sum_of_squares(extra), sum_of_squares(x)),
                                   deferred_sums, published_sums[0]);
    scale_row(extra, inverse_rms_of_sum(sums.x, width, spec.eps), extra_scale);
#pragma unroll
    for (int k = 0; k < kQuads; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) residual[k].v[e] = residual[k].v[e] + extra[k].v[e];
    x_inv = inverse_rms_of_sum(sums.y, width, spec.eps);
    if (needs_residual_norm) {
      const float4 terms =
          block_sum4(residual_step_terms(x, residual, scale), expansion_sums, published_sums[1]);
      residual_sum_of_squares =
          expanded_sum_of_squares(terms.y, terms.z, terms.w, x_inv, spec.scalar);
    }
  } else if (needs_residual_norm) {
    const float4 terms =
        block_sum4(residual_step_terms(x, residual, scale), expansion_sums, published_sums[1]);
    x_inv = inverse_rms_of_sum(terms.x, width, spec.eps);
    residual_sum_of_squares =
        expanded_sum_of_squares(terms.y, terms.z, terms.w, x_inv, spec.scalar);
  } else {
    x_inv = inverse_rms(sum_of_squares(x), width, spec.eps, x_sums);
  }
  scale_row(x, x_inv, scale);
#pragma unroll
  for (int k = 0; k < kQuads; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      residual[k].v[e] = __fmul_rn(residual[k].v[e] + x[k].v[e], spec.scalar);
  store_row<kQuads, kAligned>(residual_row, width, residual);
  store_row_companions(spec.residual_companions, r, width, residual);
  if (!needs_residual_norm) return;
  // The expansion cancelled (the same in every thread): the new residual's own sum.
  if (residual_sum_of_squares < 0.0f) {
    residual_sum_of_squares = block_sum(sum_of_squares(residual), residual_sums);
  }
  // next and the MoE inputs are norms of the same residual.
  const float residual_inv = inverse_rms_of_sum(residual_sum_of_squares, width, spec.eps);
  if (has_moe) {
    FloatQuad moe_row[kQuads];
#pragma unroll
    for (int k = 0; k < kQuads; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float normed = __fmul_rn(residual[k].v[e], residual_inv);
        moe_row[k].v[e] = __fmul_rn(__fmul_rn(normed, router_scale[k].v[e]), a.moe.router_factor);
      }
    store_row<kQuads, kAligned>(a.moe.router_in.data + r * a.moe.router_in.stride, width, moe_row);
#pragma unroll
    for (int k = 0; k < kQuads; ++k) moe_row[k] = residual[k];
    scale_row(moe_row, residual_inv, extra_scale);
    store_row<kQuads, kAligned>(a.moe.expert_in.data + r * a.moe.expert_in.stride, width, moe_row);
  }
  if (!has_next) return;
  scale_row(residual, residual_inv, next_scale);
  store_row<kQuads, kAligned>(a.next.data + r * a.next.stride, width, residual);
  store_row_companions(spec.next_companions, r, width, residual);
}

bool fits_registers(int64_t width) {
  return width <= 4 * int64_t{kMaxRowQuads} * kMaxRowThreads;
}

struct GeluArgs {
  RowsView gate;
  RowsView multiplier;
  RowsView out;
};

__global__ void gelu_tanh_mul_kernel(GeluArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t r = blockIdx.y;
  const float* gate = a.gate.data + r * a.gate.stride;
  const float* multiplier = a.multiplier.data + r * a.multiplier.stride;
  float* out = a.out.data + r * a.out.stride;
  for (int64_t j = blockIdx.x * blockDim.x + threadIdx.x; j < a.gate.width;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[j] = gelu_tanh(gate[j]) * multiplier[j];
  }
}

bool valid_rows(const RowsView& v, int64_t rows, int64_t width) {
  return v.data != nullptr && v.rows == rows && v.width == width && v.stride >= width;
}

}  // namespace

cudaError_t rms_norm(const RowsView& x, const float* weight, float weight_offset, float eps,
                     const RowsView& y, const RopeSpec* rope, const Launch& launch,
                     const ActivationCompanions& y_companions) {
  if (x.rows < 1 || x.width < 1 || !valid_rows(x, x.rows, x.width) ||
      !valid_rows(y, x.rows, x.width) || x.rows > 0x7FFFFFFF ||
      !companions_fit(y_companions, x.width) ||
      (has_companions(y_companions) && (rope != nullptr || !fits_registers(x.width)))) {
    return cudaErrorInvalidValue;
  }
  NormArgs args = {x, weight, weight_offset, eps, y, {}, 0, y_companions};
  if (rope) {
    if (x.width % 2 != 0 || rope->positions == nullptr || rope->rows_per_position < 1 ||
        rope->rotated_pairs > x.width / 2 || rope->exponent_denominator <= 0) {
      return cudaErrorInvalidValue;
    }
    args.rope = *rope;
    args.has_rope = 1;
  }
  if (rope != nullptr || !fits_registers(x.width)) {
    return launch_kernel(rms_norm_kernel, dim3(static_cast<unsigned>(x.rows)), dim3(kNormThreads),
                         0, launch, args);
  }
  // [quads per thread − 1][16-byte accesses]
  constexpr decltype(&rms_norm_row_kernel<1, true>) kRowKernels[2][2] = {
      {rms_norm_row_kernel<1, false>, rms_norm_row_kernel<1, true>},
      {rms_norm_row_kernel<2, false>, rms_norm_row_kernel<2, true>}};
  const bool aligned = x.width % 4 == 0 && aligned_rows(x) && aligned_rows(y) && aligned_16(weight);
  const RowShape shape = row_shape(x.width);
  return launch_kernel(kRowKernels[shape.quads_per_thread - 1][aligned],
                       dim3(static_cast<unsigned>(x.rows)), dim3(shape.threads), 0, launch, args);
}

cudaError_t rms_norm_q8(const RowsView& x, const float* weight, float weight_offset, float eps,
                        void* out, int64_t out_stride, const Launch& launch) {
  if (x.rows < 1 || x.width < 32 || x.width % 32 != 0 || !valid_rows(x, x.rows, x.width) ||
      out == nullptr || (reinterpret_cast<uintptr_t>(out) & 15) != 0 || out_stride < x.width ||
      out_stride % 32 != 0 || x.rows > 0x7FFFFFFF) {
    return cudaErrorInvalidValue;
  }
  const NormQ8Args args = {x, weight, weight_offset, eps, out, out_stride};
  return launch_kernel(rms_norm_q8_kernel, dim3(static_cast<unsigned>(x.rows)), dim3(kNormThreads),
                       0, launch, args);
}

namespace {

// add_rms_norm after `step` (kBranch, kDeferred: extra and extra_weight are that step's), and
// for kPlain with moe.router_in.data != nullptr the MoE inputs after it.
cudaError_t launch_add_rms_norm(AddNormStep step, const RowsView& x, const RowsView& extra,
                                const float* extra_weight, const RowsView& residual,
                                const RowsView& next, const AddNormSpec& spec, const Launch& launch,
                                const MoeInputsSpec& moe = {}) {
  const bool has_extra = step != AddNormStep::kPlain;
  const bool has_moe = moe.router_in.data != nullptr;
  if (x.rows < 1 || x.width < 1 || !fits_registers(x.width) || !valid_rows(x, x.rows, x.width) ||
      !valid_rows(residual, x.rows, x.width) ||
      (next.data != nullptr && !valid_rows(next, x.rows, x.width)) ||
      (has_extra && !valid_rows(extra, x.rows, x.width)) ||
      (has_moe && (has_extra || !valid_rows(moe.router_in, x.rows, x.width) ||
                   !valid_rows(moe.expert_in, x.rows, x.width))) ||
      x.rows > 0x7FFFFFFF || !companions_fit(spec.residual_companions, x.width) ||
      !companions_fit(spec.next_companions, x.width) ||
      (next.data == nullptr && has_companions(spec.next_companions))) {
    return cudaErrorInvalidValue;
  }
  using Kernel = decltype(&add_rms_norm_kernel<1, true, AddNormStep::kPlain>);
  // [quads per thread − 1][16-byte accesses]
  constexpr Kernel kPlainKernels[2][2] = {{add_rms_norm_kernel<1, false, AddNormStep::kPlain>,
                                           add_rms_norm_kernel<1, true, AddNormStep::kPlain>},
                                          {add_rms_norm_kernel<2, false, AddNormStep::kPlain>,
                                           add_rms_norm_kernel<2, true, AddNormStep::kPlain>}};
  constexpr Kernel kBranchKernels[2][2] = {{add_rms_norm_kernel<1, false, AddNormStep::kBranch>,
                                            add_rms_norm_kernel<1, true, AddNormStep::kBranch>},
                                           {add_rms_norm_kernel<2, false, AddNormStep::kBranch>,
                                            add_rms_norm_kernel<2, true, AddNormStep::kBranch>}};
  constexpr Kernel kDeferredKernels[2][2] = {
      {add_rms_norm_kernel<1, false, AddNormStep::kDeferred>,
       add_rms_norm_kernel<1, true, AddNormStep::kDeferred>},
      {add_rms_norm_kernel<2, false, AddNormStep::kDeferred>,
       add_rms_norm_kernel<2, true, AddNormStep::kDeferred>}};
  const auto& kernels = step == AddNormStep::kPlain    ? kPlainKernels
                        : step == AddNormStep::kBranch ? kBranchKernels
                                                       : kDeferredKernels;
  const bool aligned = x.width % 4 == 0 && aligned_rows(x) && aligned_rows(residual) &&
                       aligned_rows(next) && aligned_rows(extra) && aligned_16(spec.weight) &&
                       aligned_16(spec.next_weight) && aligned_16(extra_weight) &&
                       aligned_rows(moe.router_in) && aligned_rows(moe.expert_in) &&
                       aligned_16(moe.router_scale) && aligned_16(moe.expert_weight);
  const RowShape shape = row_shape(x.width);
  const AddNormArgs args = {x, residual, next, spec, extra, extra_weight, moe};
  return launch_kernel(kernels[shape.quads_per_thread - 1][aligned],
                       dim3(static_cast<unsigned>(x.rows)), dim3(shape.threads), 0, launch, args);
}

}  // namespace

cudaError_t add_rms_norm(const RowsView& x, const RowsView& residual, const RowsView& next,
                         const AddNormSpec& spec, const Launch& launch) {
  return launch_add_rms_norm(AddNormStep::kPlain, x, RowsView{}, nullptr, residual, next, spec,
                             launch);
}

cudaError_t add_rms_norm_branch(const RowsView& x, const RowsView& branch,
                                const float* branch_weight, const RowsView& residual,
                                const RowsView& next, const AddNormSpec& spec,
                                const Launch& launch) {
  if (branch.data == nullptr) return cudaErrorInvalidValue;
  return launch_add_rms_norm(AddNormStep::kBranch, x, branch, branch_weight, residual, next, spec,
                             launch);
}

cudaError_t add_rms_norm_deferred(const RowsView& x, const RowsView& deferred,
                                  const float* deferred_weight, const RowsView& residual,
                                  const RowsView& next, const AddNormSpec& spec,
                                  const Launch& launch) {
  if (deferred.data == nullptr) return cudaErrorInvalidValue;
  return launch_add_rms_norm(AddNormStep::kDeferred, x, deferred, deferred_weight, residual, next,
                             spec, launch);
}

cudaError_t add_rms_norm_moe(const RowsView& x, const RowsView& residual, const RowsView& next,
                             const AddNormSpec& spec, const MoeInputsSpec& moe,
                             const Launch& launch) {
  if (moe.router_in.data == nullptr || moe.expert_in.data == nullptr) return cudaErrorInvalidValue;
  return launch_add_rms_norm(AddNormStep::kPlain, x, RowsView{}, nullptr, residual, next, spec,
                             launch, moe);
}

cudaError_t gelu_tanh_mul(const RowsView& gate, const RowsView& multiplier, const RowsView& out,
                          const Launch& launch) {
  if (gate.rows < 1 || gate.width < 1 || !valid_rows(gate, gate.rows, gate.width) ||
      !valid_rows(multiplier, gate.rows, gate.width) || !valid_rows(out, gate.rows, gate.width) ||
      gate.rows > 65535) {
    return cudaErrorInvalidValue;
  }
  constexpr int kThreads = 256;
  const int64_t blocks_x = std::min<int64_t>((gate.width + kThreads - 1) / kThreads, 1024);
  const GeluArgs args = {gate, multiplier, out};
  return launch_kernel(gelu_tanh_mul_kernel,
                       dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(gate.rows)),
                       dim3(kThreads), 0, launch, args);
}

}  // namespace gemma4::cuda
