// Device side of the kQ8 activation layout (gemv_kernels.h): one warp quantizes one 32-element
// chunk. Shared by the stand-alone quantizer (gemv.cu) and the fused RMSNorm (elementwise.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gemma4::cuda {

// Lane l holds element l of chunk `chunk` of the row starting at `row_base` (a row of `stride`
// elements: values, then stride/32 fp32 scales, then stride/32 int32 sums). Writes
// q = round(value / (max|chunk| / 127)) at its permuted byte, and lane 0 the scale and Σq.
__device__ __forceinline__ void store_chunk_q8(float value, int lane, uint8_t* row_base,
                                               int64_t stride, int64_t chunk) {
  float amax = fabsf(value);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  }
  const float scale = amax / 127.0f;
  const int q = scale > 0.0f ? __float2int_rn(value / scale) : 0;
  int sum = q;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
  // Element e of a group of 8 goes to byte e/2 (even e) or 4 + e/2 (odd e) of the group.
  const int e = lane % 8;
  row_base[chunk * 32 + (lane / 8) * 8 + (e % 2 ? 4 : 0) + e / 2] =
      static_cast<uint8_t>(static_cast<int8_t>(q));
  if (lane == 0) {
    reinterpret_cast<float*>(row_base + stride)[chunk] = scale;
    reinterpret_cast<int*>(row_base + stride + stride / 8)[chunk] = sum;
  }
}

}  // namespace gemma4::cuda
