// Row-wise kernels (see elementwise.h): one block per row, fp32 math.
#include <algorithm>
#include <cmath>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/q8.cuh"

namespace gemma4::cuda {
namespace {

constexpr int kNormThreads = 256;

// Sum of `value` over the block; every thread gets the result. `scratch` holds one float per warp.
__device__ float block_sum(float value, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  __syncthreads();  // scratch may still be read by a previous call
  if ((threadIdx.x & 31) == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// (mean(x²) + eps)^-1/2 as transformers evaluates it (eps inside; a correctly rounded sqrt and
// division rather than the approximate rsqrt).
__device__ float inverse_rms(const float* row, int64_t width, float eps, float* scratch) {
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) sum += row[j] * row[j];
  const float mean = block_sum(sum, scratch) / static_cast<float>(width);
  return 1.0f / sqrtf(mean + eps);
}

struct NormArgs {
  RowsView x;
  const float* weight;
  float weight_offset;
  float eps;
  RowsView y;
  RopeSpec rope;
  int has_rope;
};

__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(NormArgs a) {
  pdl_trigger_dependents();
  __shared__ float scratch[kNormThreads / 32];
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
  __shared__ float scratch[kNormThreads / 32];
  pdl_wait_for_predecessors();
  const int64_t r = blockIdx.x;
  const float* x = a.x.data + r * a.x.stride;
  const float inv = inverse_rms(x, a.x.width, a.eps, scratch);
  uint8_t* row = static_cast<uint8_t*>(a.out) + r * (a.out_stride + a.out_stride / 4);
  const int lane = threadIdx.x & 31;
  for (int64_t chunk = threadIdx.x / 32; chunk < a.x.width / 32; chunk += kNormThreads / 32) {
    const int64_t j = chunk * 32 + lane;
    float v = x[j] * inv;
    if (a.weight) v *= a.weight_offset + a.weight[j];
    store_chunk_q8(v, lane, row, a.out_stride, chunk);
  }
}

struct AddNormArgs {
  RowsView x;
  RowsView residual;
  RowsView next;
  AddNormSpec spec;
};

// The products are rounded before the sum (no fma), as the separate norm and add kernels (and
// the CPU reference) round them.
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(AddNormArgs a) {
  pdl_trigger_dependents();
  __shared__ float scratch[kNormThreads / 32];
  pdl_wait_for_predecessors();
  const int64_t r = blockIdx.x;
  const float* x = a.x.data + r * a.x.stride;
  float* residual = a.residual.data + r * a.residual.stride;
  const int64_t width = a.x.width;
  const AddNormSpec& spec = a.spec;
  const float inv_x = inverse_rms(x, width, spec.eps, scratch);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    float normed = __fmul_rn(x[j], inv_x);
    if (spec.weight) normed = __fmul_rn(normed, spec.weight_offset + spec.weight[j]);
    const float updated = __fmul_rn(residual[j] + normed, spec.scalar);
    residual[j] = updated;
    sum += updated * updated;
  }
  if (a.next.data == nullptr) return;
  const float mean = block_sum(sum, scratch) / static_cast<float>(width);
  const float inv_residual = 1.0f / sqrtf(mean + spec.eps);
  float* next = a.next.data + r * a.next.stride;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    const float normed = __fmul_rn(residual[j], inv_residual);
    next[j] =
        spec.next_weight ? __fmul_rn(normed, spec.weight_offset + spec.next_weight[j]) : normed;
  }
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
                     const RowsView& y, const RopeSpec* rope, const Launch& launch) {
  if (x.rows < 1 || x.width < 1 || !valid_rows(x, x.rows, x.width) ||
      !valid_rows(y, x.rows, x.width) || x.rows > 0x7FFFFFFF) {
    return cudaErrorInvalidValue;
  }
  NormArgs args = {x, weight, weight_offset, eps, y, {}, 0};
  if (rope) {
    if (x.width % 2 != 0 || rope->positions == nullptr || rope->rows_per_position < 1 ||
        rope->rotated_pairs > x.width / 2 || rope->exponent_denominator <= 0) {
      return cudaErrorInvalidValue;
    }
    args.rope = *rope;
    args.has_rope = 1;
  }
  return launch_kernel(rms_norm_kernel, dim3(static_cast<unsigned>(x.rows)), dim3(kNormThreads), 0,
                       launch, args);
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

cudaError_t add_rms_norm(const RowsView& x, const RowsView& residual, const RowsView& next,
                         const AddNormSpec& spec, const Launch& launch) {
  if (x.rows < 1 || x.width < 1 || !valid_rows(x, x.rows, x.width) ||
      !valid_rows(residual, x.rows, x.width) ||
      (next.data != nullptr && !valid_rows(next, x.rows, x.width)) || x.rows > 0x7FFFFFFF) {
    return cudaErrorInvalidValue;
  }
  const AddNormArgs args = {x, residual, next, spec};
  return launch_kernel(add_rms_norm_kernel, dim3(static_cast<unsigned>(x.rows)), dim3(kNormThreads),
                       0, launch, args);
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
