// The tensor-core batched GEMV (gemv_mma_kernels.h): y = epilogue(W x) for 1..64 activation rows
// over packed w4g32 or NVFP4 weights, dequantized in registers to bf16 (w4g32: rounded, as
// transformers' bf16 dequantization; NVFP4: exact) and multiplied on bf16 tensor cores with fp32
// accumulation. gemv() sends the calls this takes to it (batched decode, speculative
// verification); the benchmark calls it directly to compare tilings.
#pragma once

#include "backend/cuda/gemv.h"
#include "backend/cuda/gemv_mma_kernels.h"

namespace gemma4::cuda {

// Whether gemv() sends these operands to the tensor-core kernel: 2..64 rows of bf16 activations or
// fp32 ones rounded to bf16 (the products a bf16 model computes; exact fp32 activations stay on
// the CUDA-core GEMV) with w4g32 (any scale type) or NVFP4 weights, or kQ8 ones with w4g32; K
// small enough that 1/kMmaGemvMaxSplits of it fits shared memory (up to 12,288 at 64 rows);
// NVFP4 block scales 2-byte aligned.
bool gemv_mma_takes(const quant::QMatrix& w, const GemvInput& x);

// The tiling used when none is given, from the weight shape and the row count.
MmaGemvTiling default_mma_gemv_tiling(int64_t rows, int64_t cols, int m, ActType x_type);

// Enqueues y = epilogue(W x) on tensor cores with `tiling` (warps 0: the default, the streamed
// kernel at the NVFP4 shapes and row counts it was measured faster at, else
// default_mma_gemv_tiling's). The operands follow gemv()'s contract (gemv.h), companions included
// (kQ8 ones with kGeluPairs, from any tiling: a block's outputs are whole chunks). Returns
// cudaErrorInvalidValue, before enqueuing anything, for operands gemv_mma_takes refuses (but one
// row), a shape or pointer gemv() would refuse, or a tiling outside the kernel's options (a layout
// of kMmaGemvWarpLayouts, splits 1..kMmaGemvMaxSplits and at most K / 32, row_blocks >=
// kMmaGemvResidentRowBlocks, activation_blocks 1..8, shared memory within
// kMmaGemvMaxSharedBytes; streamed: MmaGemvTiling::streamed's conditions, even K / 32, 4-byte
// aligned NVFP4 scales); else the launch status.
cudaError_t gemv_mma(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y,
                     const Launch& launch, MmaGemvTiling tiling = {0, 0});

}  // namespace gemma4::cuda
