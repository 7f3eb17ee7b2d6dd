// Warp-level tensor-core building blocks shared by the attention kernels (decode: attention.cu,
// prefill: prefill_attention.cu), the tensor-core GEMVs (gemv_mma, gemv_stream) and the grouped
// MoE kernels: ldmatrix loads of 8×8 b16 matrices from shared memory and the m16n8k16 bf16 mma.
// Fragment order (PTX ISA): lane l = 4g + t holds row g, elements 2t and 2t + 1 of each 8×8 matrix.
#pragma once

#include <cstdint>

#include "backend/cuda/cp_async.cuh"

namespace gemma4::cuda {

// Four 8×8 b16 matrices from shared memory, lane l giving the address of row l % 8 of matrix l / 8;
// lane (g, t) receives row g, elements 2t and 2t + 1 of each (transposed first with kTranspose).
// volatile, with a memory clobber: it reads what cp.async and other lanes wrote before a barrier.
template <bool kTranspose>
__device__ __forceinline__ void load_matrices(uint32_t (&r)[4], const void* p) {
  if constexpr (kTranspose) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p))
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p))
                 : "memory");
  }
}

// d += a · b for a 16×16 bf16 A (row major) and a 16×8 bf16 B (column major), fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += A · B over one m16n8k16 step, fp16 operands, fp32 accumulation.
__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace gemma4::cuda
