// One decode row's end of a layer with per-layer inputs (engine::Backend::add_rms_norm_ple, arch
// spec 2.4 steps 6–7) in one launch, where CudaBackend otherwise runs three kernels (the PLE gate
// GEMV with the residual step folded into its staging, the projection GEMV, the closing norms):
//   v = acc + rms_norm(x; step_weight)                              (the feed-forward residual
//   step) gated = gelu_tanh(bf16(v) · gateᵀ) ⊙ multiplier projected = bf16(gated) · projectionᵀ acc
//   = (v + rms_norm(projected; spec.weight)) · spec.scalar next = rms_norm(acc; spec.next_weight)
//   (when next.data != nullptr)
// with the companions of acc (spec.residual_companions) or of next (spec.next_companions). gated
// and projected are written too (scratch for the caller). A cluster of blocks shares the
// intermediate vectors through distributed shared memory: every weight load is issued before the
// PDL wait, and no intermediate goes through global memory between kernels.
#pragma once

#include "backend/cuda/backend_kernels.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/launch.h"

namespace gemma4::cuda {

struct PleStepArgs {
  RowsView acc;              // one row of the hidden width, updated in place
  RowsView x;                // the feed-forward output (the residual step's input)
  const float* step_weight;  // the residual step's norm weight (null: factor one)
  MatrixView gate;           // w4g32, [ple width, hidden]
  const float* multiplier;   // the layer's per-layer input, ple width values
  float* gated;              // ple width values
  MatrixView projection;     // w4g32, [hidden, ple width]
  float* projected;          // hidden values
  RowsView next;             // one row, or data null
  AddNormSpec spec;          // weight: the projection's norm; next_weight, scalar, companions
};

// The GEMV that follows the step in ple_step_matmul: y = bf16(next) · weightsᵀ, the next layer's
// first matmul (its q, or stacked q/k/v, projection).
struct PleStepMatmul {
  MatrixView weights;     // w4g32, [rows, hidden]
  float* y;               // rows values
  unsigned* acc_readers;  // device counter, zero between launches (the kernel leaves it zero)
};

// The cluster sizes compiled: 8 blocks of 16 warps (portable) or 16 of 8 (non-portable: half the
// per-block work and registers). On the H200 (session 7) 16 blocks won in kernel_bench's chains
// (4.2 against 4.7-5.2 µs a step) but lost in `gemma4 bench` E2B b1 (554 against 575 tok/s), so
// CudaBackend launches 8.
constexpr int kPleStepDefaultClusterBlocks = 8;

// Enqueues the step on a cluster of `cluster_blocks` blocks (8 or 16). cudaErrorInvalidValue,
// with nothing enqueued, for what the kernel does not take: other than one row, a shape other
// than E2B's (hidden 1536, ple width 256), other weight formats, unaligned rows or weights (16
// bytes), companions that do not fit, another cluster size.
cudaError_t ple_step(const PleStepArgs& args, const Launch& launch,
                     int cluster_blocks = kPleStepDefaultClusterBlocks);

// ple_step, then the GEMV `matmul` from next, in one launch: every one of several 8-block
// clusters runs the step (each needs next whole, which it shares through distributed shared
// memory: one more exchange), cluster 0 alone stores the step's outputs, and each block
// multiplies its 32 or 64 rows of the GEMV (a half warp a row, its weights loaded before the PDL
// wait). One kernel boundary less on the decode chain: the GEMV's own launch, its wait and its
// read of next. Cluster 0 stores the new acc once every other cluster's blocks have read the old
// one (a device counter: all clusters must fit on the GPU at once, checked at the first launch).
// Rows at most 2 · 256 · kMaxPleMatmulClusters (E2B: q 2048 / 4096, q+k+v 2560 / 5120).
// cudaErrorInvalidValue, with nothing enqueued, for what ple_step refuses, no next, a matrix
// other than w4g32 [rows, hidden] within that bound, or more clusters than fit.
// H200, session 10 (gemma4 bench E2B b1, 64 tokens, main / this alternating): depth 0 807.7 /
// 813.4, 807.0 / 814.8 tok/s (+0.8 %, 265 -> 231 kernels a token); depth 32K 676.7 / 674.5,
// 675.9 / 673.5 (-0.4 %).
constexpr int kMaxPleMatmulClusters = 10;
cudaError_t ple_step_matmul(const PleStepArgs& args, const PleStepMatmul& matmul,
                            const Launch& launch);

}  // namespace gemma4::cuda
