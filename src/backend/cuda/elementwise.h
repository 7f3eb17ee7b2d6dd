// Row-wise decode kernels around the GEMVs: RMSNorm (optionally fused with the residual add and
// the next norm, or with RoPE), and GELU-tanh gating. Activations are fp32 rows ("one row per
// token", or per head: a [T, heads·hd] matrix is rows·heads rows of hd with stride hd); norm
// weights are fp32 vectors. All pointers are device pointers; positions live in device memory.
#pragma once

#include <cstdint>

#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/launch.h"

namespace gemma4::cuda {

struct RowsView {
  float* data = nullptr;
  int64_t rows = 0;
  int64_t width = 0;
  int64_t stride = 0;
};

// Half-split ("rotate_half") RoPE of one head of width head_dim: pair (i, i + head_dim/2) rotates
// by positions[token] · theta^(-2i / exponent_denominator) for i < rotated_pairs and not at all
// for the rest (proportional rope: rotated_pairs 64 of 256 pairs, denominator 512).
struct RopeSpec {
  const int32_t* positions = nullptr;  // [tokens]
  int rows_per_position = 1;           // heads per token: row r uses positions[r / this]
  float theta = 10000.0f;
  int rotated_pairs = 0;
  int exponent_denominator = 0;
};

// y[r] = x[r] · (mean_j x[r][j]² + eps)^-1/2 · (weight_offset + weight[j]) (no weight factor when
// weight is null), then RoPE over the whole row when rope is non-null (row width = head_dim).
// y may alias x. y_companions (gemv_kernels.h): bf16 / kQ8 copies of y written by the same
// kernel; only without RoPE, for a width that is a multiple of 32 and at most 8192.
cudaError_t rms_norm(const RowsView& x, const float* weight, float weight_offset, float eps,
                     const RowsView& y, const RopeSpec* rope, const Launch& launch,
                     const ActivationCompanions& y_companions = {});

// rms_norm (no RoPE) whose output goes straight into the kQ8 activation layout of the dp4a GEMV
// (gemv_kernels.h): row r at out + r · q8_row_bytes(out_stride). width a multiple of 32,
// out_stride >= width and a multiple of 32, out 16-byte aligned.
cudaError_t rms_norm_q8(const RowsView& x, const float* weight, float weight_offset, float eps,
                        void* out, int64_t out_stride, const Launch& launch);

// The Gemma residual step fused with the next pre-norm (engine::Backend::add_rms_norm):
//   residual[r] = (residual[r] + rms_norm(x[r]; weight)) · scalar
//   next[r] = rms_norm(residual[r]; next_weight)      (only when next.data != nullptr)
// Both norms scale by (weight_offset + w), or not at all for a null weight. next may alias x.
// One block per row holds the row in registers: width <= 8192. The companions (gemv_kernels.h;
// a width that is a multiple of 32) are copies of the residual and of next written by the same
// kernel.
struct AddNormSpec {
  const float* weight = nullptr;
  const float* next_weight = nullptr;
  float weight_offset = 0.0f;
  float eps = 1e-6f;
  float scalar = 1.0f;
  ActivationCompanions residual_companions = {};
  ActivationCompanions next_companions = {};
};
cudaError_t add_rms_norm(const RowsView& x, const RowsView& residual, const RowsView& next,
                         const AddNormSpec& spec, const Launch& launch);

// add_rms_norm after a branch step (engine::Backend::add_rms_norm_branch: a MoE block's end):
//   branch[r] + rms_norm(x[r]; branch_weight) takes x[r]'s place (neither is written back), then
//   add_rms_norm as above. branch has x's shape; branch_weight as spec's weights.
cudaError_t add_rms_norm_branch(const RowsView& x, const RowsView& branch,
                                const float* branch_weight, const RowsView& residual,
                                const RowsView& next, const AddNormSpec& spec,
                                const Launch& launch);

// add_rms_norm after a residual step that a GEMV folded into its input and did not write (the PLE
// gate, GemvResidualNorm in gemv_kernels.h):
//   residual[r] += rms_norm(deferred[r]; deferred_weight)   (rounded as add_rms_norm, scalar 1)
//   then add_rms_norm as above.
// Both norms are reduced together, each exactly as add_rms_norm reduces its own, so the residual
// equals what add_rms_norm(deferred → residual) followed by add_rms_norm(x → residual) store.
// deferred has x's shape; deferred_weight as spec's weights.
cudaError_t add_rms_norm_deferred(const RowsView& x, const RowsView& deferred,
                                  const float* deferred_weight, const RowsView& residual,
                                  const RowsView& next, const AddNormSpec& spec,
                                  const Launch& launch);

// add_rms_norm, then the inputs of a MoE layer's router and experts from the new residual
// (engine::Backend::add_rms_norm_moe), in the same launch:
//   router_in[r][j] = (rms_norm(residual[r]) · router_scale[j]) · router_factor  (weightless norm)
//   expert_in[r] = rms_norm(residual[r]; expert_weight)
// each product rounded as the rms_norm and scale kernels round it. router_in may be x; otherwise
// router_in and expert_in overlap nothing. A null router_scale or expert_weight is a factor of
// one; expert_weight as spec's weights (weight_offset).
struct MoeInputsSpec {
  const float* router_scale = nullptr;
  float router_factor = 1.0f;
  const float* expert_weight = nullptr;
  RowsView router_in;
  RowsView expert_in;
};
cudaError_t add_rms_norm_moe(const RowsView& x, const RowsView& residual, const RowsView& next,
                             const AddNormSpec& spec, const MoeInputsSpec& moe,
                             const Launch& launch);

// out[r][j] = gelu_tanh(gate[r][j]) · multiplier[r][j]; out may alias either input.
cudaError_t gelu_tanh_mul(const RowsView& gate, const RowsView& multiplier, const RowsView& out,
                          const Launch& launch);

}  // namespace gemma4::cuda
