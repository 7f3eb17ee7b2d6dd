// The single-row w8 GEMV on tensor cores (gemv_w8_mma.cu), for the 8-bit logits matrix of
// `--lm-head q8` (262144 x 2816): the register GEMV (gemv_kernel.cuh) spends three fp32
// instructions per weight (byte permute, bias subtract, FMA) and measured 242 µs at that shape at
// best (76 % of the read ceiling, session 9). Plain header, like gemv_kernels.h.
// Not a default: as first written it measured SLOWER, 327 µs (H200, kernel_bench, session 9 MID;
// register tiling 1: 239) and is opt-in (tiling kGemvW8MmaTiling) for kernel_bench until tuned.
// Suspects: 4 KB of loads in flight per warp then a pause for the products, one block's
// activation staging before any weight load, 72 registers (7 blocks of 4 warps per SM).
//
// Method. A warp owns one 16-row tile and all of K, in steps of 4 chunks (16 int8 each): lane
// (g, t) loads chunk 4s + t of rows g and g + 8 (16 bytes each, straight from global memory), turns
// each pair of int8 into an exact fp16 pair (one byte permute into 1024 + (q + 128), one packed
// subtract of 1152), and feeds them to 4 mma.sync m16n8k16 (fp16, fp32 accumulation) as its A
// slots; its B slots hold its own chunk's activations (fp16, staged once per block) when g == t
// and zeros otherwise, so column n of the product is row's chunk 4s + n alone (the scheme of
// gemv_stream_kernels.h). Lanes t = 0, 1 then scale columns 2t, 2t + 1 (one w8 group of 32) in
// fp32 and accumulate. Activations are rounded to fp16 (11 significant bits, more than bf16's 8;
// the engine's activations stay far inside fp16's range), products are exact, sums fp32.
#pragma once

#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda {

// The tiling index gemv() takes for this kernel (beside the register, streaming and split-K
// ones).
inline constexpr int kGemvW8MmaTiling = 300;

// Enqueues it; gemv() has checked what it takes (gemv.cpp w8_mma_takes): kW8 group 32 with fp16
// scales (quant/quantize_w8.h's, GGUF Q8_0's), K a multiple of 256 (whole batches of 4 steps),
// one activation row of kBF16 or kF32 rounded, no epilogue, companions or residual step.
cudaError_t launch_gemv_w8_mma(ActType x_type, const GemvArgs& args, const Launch& launch);

}  // namespace gemma4::cuda
