// Decode GEMV on packed weights: y[m][n] = Σ_k W[n][k] · x[m][k] for m < M (M = 1 for a single
// token, 2..64 for batched decode / speculative verify; the weights are read once for all M),
// optionally through an epilogue (GELU gating, below) before the store.
//
// Weights stay in their packed checkpoint layout (quant::QMatrix, device pointers): kW4G32 with
// bf16/fp16/fp32 group scales, kNVFP4 with e4m3 group-16 scales and the fp32 global factor (both
// the divisor and the multiplier convention), kBF16, and the GGUF repacks kW4G32A (fp32 scale +
// min per 32), kW8 (group 16 or 32, fp16/fp32 scales) and kF16. They are dequantized in
// registers and accumulated in fp32. y is fp32.
#pragma once

#include <cstdint>
#include <span>

#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/gemv_splitk_kernels.h"
#include "backend/cuda/gemv_stream_kernels.h"
#include "backend/cuda/launch.h"
#include "quant/qmatrix.h"

namespace gemma4::cuda {

// Activations: `rows` (= M) rows of K elements, row m at data + m · stride elements. data and
// stride·element size must be 16-byte aligned.
// round_to_bf16 (kF32 only): each activation is rounded to bf16 (ties to even) before the
// products, as a bf16 model multiplies (fp32 sums either way); false multiplies the exact fp32
// values (slower: fp32 loads per weight chunk).
struct GemvInput {
  const void* data = nullptr;
  ActType type = ActType::kF32;
  int rows = 1;
  int64_t stride = 0;
  bool round_to_bf16 = false;
  // A residual step folded in (gemv_kernels.h): the GEMV multiplies residual + rms_norm(x) (kF32
  // rows rounded to bf16, staged; residual rows and the weight 16-byte aligned), writing neither.
  GemvResidualNorm residual_norm = {};
};

// y: M rows at data + m · stride, of N floats (kGeluPairs: N / 2). The epilogue maps the dot
// products acc[m][n] (gelu_tanh exactly as the elementwise gelu_tanh_mul computes it):
//   kNone:      y[m][n] = acc[m][n]
//   kGeluMul:   y[m][n] = gelu_tanh(acc[m][n]) · multiplier[m · multiplier_stride + n]
//               (multiplier may be data itself with the same stride, not a partial overlap)
//   kGeluPairs: y[m][i] = gelu_tanh(acc[m][2i]) · acc[m][2i + 1]: W's rows alternate gate row i,
//               up row i (N even)
//
// companions: bf16 and/or kQ8 copies of what is stored in y (gemv_kernels.h; stride >= the
// output width). A kQ8 companion needs kGeluPairs, an output width (N / 2) that is a multiple
// of 32 and a gemv_tiling_emits_q8_pairs tiling (tiling < 0 picks kGemvQ8PairsTiling).
struct GemvOutput {
  float* data = nullptr;
  int64_t stride = 0;
  GemvEpilogue epilogue = GemvEpilogue::kNone;
  const float* multiplier = nullptr;
  int64_t multiplier_stride = 0;
  ActivationCompanions companions = {};
};

// The packed kernels' layout of a weight format (out), false for one they cannot read (fp32,
// w8a). Shared by the GEMV and the MoE kernels (moe.cpp), which read a subset.
bool packed_format(quant::WeightFormat format, PackedFormat& out);
// Whether w's scales are what its format's kernels read: kW4G32A fp32 {scale, min} pairs, kW8 a
// group of 16 or 32 with 16/32-bit scales (the kernels read bf16 too, quant::validate admits
// fp16/fp32), present for every scaled format.
bool packed_scales_ok(const quant::QMatrix& w);

// Bytes of one kQ8 activation row of `stride` elements (stride a multiple of 32).
inline int64_t q8_row_bytes(int64_t stride) {
  return stride + stride / 4;
}

// Quantizes `rows` fp32 rows of `cols` (a multiple of 32) into the kQ8 layout (gemv_kernels.h):
// per 32 elements scale = max|x| / 127, q = round(x / scale). out_stride >= cols, a multiple of
// 32; out 16-byte aligned.
cudaError_t quantize_activations_q8(const float* x, int rows, int64_t cols, int64_t x_stride,
                                    void* out, int64_t out_stride, const Launch& launch);

// Writes the companions of `rows` fp32 rows of `cols` (a multiple of 32; companions.stride >=
// cols, a multiple of 32; at least one companion pointer, 16-byte aligned): one kernel.
cudaError_t write_activation_companions(const float* x, int rows, int64_t cols, int64_t x_stride,
                                        const ActivationCompanions& companions,
                                        const Launch& launch);

// Every tiling of the register kernel; an index into this list selects one explicitly (the
// benchmark does). Only those with gemv_tiling_compiled(index) have kernels in this build
// (gemv_kernels.h). Indices kGemvStreamTilingBase + i select the streaming kernel's
// kGemvStreamTilings[i] (gemv_stream_kernels.h: one activation row of w4g32 weights with 16-bit
// scales, bf16 products; those with gemv_stream_tiling_compiled(index)). Indices
// kGemvSplitKTilingBase + i select the split-K kernel's kGemvSplitKTilings[i]
// (gemv_splitk_kernels.h: one activation row of w4g32 weights, bf16 products; those with
// gemv_splitk_tiling_compiled(index)).
std::span<const GemvTiling> gemv_tilings();

// The tiling used when none is given: chosen per weight shape by measurement (bench/RESULTS.md).
// A streaming tiling is chosen only for what that kernel takes given the shape, the format and the
// activation type; gemv() falls back to the register kernel where the call's other details
// (exact fp32 products, a residual step, a kQ8 companion) rule it out.
int default_gemv_tiling(const quant::QMatrix& w, int m, ActType x_type);

// Enqueues y = epilogue(W x). Returns cudaErrorInvalidValue, before enqueuing anything, for an
// unsupported format (fp32; kW4G32A / kW8 / kF16 with other than fp32 activations) or a shape the
// kernels do not handle (K must be a multiple of 32, M in 1..64, aligned pointers, N even for
// kGeluPairs, round_to_bf16 with kF32 only; a streaming tiling for what it does not take), else
// the launch status. tiling < 0 picks default_gemv_tiling.
cudaError_t gemv(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y,
                 const Launch& launch, int tiling = -1);

// The epilogue of `y` alone, applied to products computed elsewhere (the generic matmul's, for
// weights the GEMV does not take): products[m · products_stride + n] for m < rows, n < cols, as
// acc[m][n] above. rows in 1..65535. Companions: bf16 only.
cudaError_t gemv_epilogue(const float* products, int64_t rows, int64_t cols,
                          int64_t products_stride, const GemvOutput& y, const Launch& launch);

}  // namespace gemma4::cuda
