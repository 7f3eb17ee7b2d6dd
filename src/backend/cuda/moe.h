// Mixture-of-experts on the device (gemma4-architecture.md 3; engine::Backend::route_experts /
// run_experts semantics, the CPU backend being the reference):
//   route_experts: per token softmax over the router logits (fp32), top_k (ties: lower expert id
//     first), renormalised, times per_expert_scale; ids and weights stay in device memory.
//   run_experts: out[t] = Σ_k w[t][k] · down_e(gelu_tanh(gate_e x[t]) ⊙ up_e x[t]) for the
//     routed experts only, for any number of tokens. Below moe_grouped_min_tokens tokens (decode,
//     small batches) every (token, expert) pair runs as a GEMV (NVFP4 products on fp16 tensor
//     cores, other formats in fp32), NVFP4 from kMoeByExpertMinTokens with one block set per
//     selected expert reading its weights once for all its pairs; from there on (prefill) the pairs
//     are grouped by expert on the device and run as tensor-core tiles with bf16 inputs, each
//     selected expert's weights read once per 64 of its pairs; MoePrecision::kExactF32 runs fp32
//     GEMVs at every token count instead. Deterministic.
// Expert weights: kW4G32 (bf16/f16/f32 scales), kNVFP4 (divisor or multiplier global scale) or
// kBF16, dequantized in registers; fp32 accumulation. No host round-trip: every launch is
// graph-capturable once the layer's MoeExpertTable exists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backend/cuda/launch.h"
#include "backend/cuda/moe_kernels.h"
#include "model/weights.h"

namespace gemma4::cuda {

// Why the grouped kernels cannot run these experts (device pointers), or "" when they can: all
// experts alike (gate and up one format, down one format, each kW4G32 / kNVFP4 / kBF16), gate/up
// [inner, hidden] and down [hidden, inner] with hidden and inner multiples of 32, 16-byte
// aligned data, at most kMaxRouterExperts experts.
std::string check_experts(std::span<const model::ExpertMatrices> experts);

// One layer's expert descriptors in device memory (built once per layer, at load).
class MoeExpertTable {
 public:
  MoeExpertTable() = default;
  MoeExpertTable(MoeExpertTable&& other) noexcept;
  MoeExpertTable& operator=(MoeExpertTable&& other) noexcept;
  MoeExpertTable(const MoeExpertTable&) = delete;
  MoeExpertTable& operator=(const MoeExpertTable&) = delete;
  ~MoeExpertTable();

  // Uploads the descriptors (synchronously: not while a graph is being captured). Returns
  // cudaErrorInvalidValue when check_experts objects.
  static cudaError_t create(std::span<const model::ExpertMatrices> experts, MoeExpertTable& out);

  const MoeExpert* device() const { return device_; }
  const MoeShape& shape() const { return shape_; }
  // The descriptors as uploaded (host copy).
  const std::vector<MoeExpert>& descriptors() const { return host_; }

 private:
  MoeExpert* device_ = nullptr;
  MoeShape shape_;
  std::vector<MoeExpert> host_;
};

// Router: `tokens` rows of num_experts logits (row t at logits + t · logits_stride) → expert_ids
// and weights [tokens, top_k]. num_experts <= kMaxRouterExperts, 1 <= top_k <= min(num_experts,
// kMaxTopK). A row with NaN logits yields ids -1 (weight 0) where no expert could be ranked.
cudaError_t route_experts(const float* logits, int64_t logits_stride, int tokens, int num_experts,
                          int top_k, const float* per_expert_scale, int32_t* expert_ids,
                          float* weights, const Launch& launch);

// One token's router in one launch (decode): logits = x · router_projᵀ (bf16 weights
// [num_experts, hidden], device pointers; x fp32, rounded to bf16 first when round_x_to_bf16, as
// the GEMV's bf16-activation mode does), then route_experts' picks from them. Nothing is enqueued
// and cudaErrorInvalidValue returned when the weights are not bf16, hidden is not a multiple of 8
// or above kFusedRouterMaxHidden, w or x is not 16-byte aligned, or num_experts / top_k are
// outside route_experts' range.
cudaError_t route_token(const quant::QMatrix& router_proj, const float* x, bool round_x_to_bf16,
                        int top_k, const float* per_expert_scale, float* logits,
                        int32_t* expert_ids, float* weights, const Launch& launch);

// run_experts works through at most this many tokens per pass, bounding its workspace (58 MB at
// 26B-A4B shapes, top-8).
inline constexpr int kMoeTokensPerPass = 512;

// Device scratch run_experts needs (16-byte aligned), for `tokens` tokens.
size_t moe_workspace_bytes(const MoeExpertTable& table, int tokens, int top_k,
                           MoePrecision precision = MoePrecision::kBf16TensorCores);

// out[t] (hidden floats, row t at out + t · out_stride) = Σ_k weights[t][k] ·
// expert_{expert_ids[t][k]}(x[t]), 1 <= top_k <= min(num_experts, kMaxTopK). x rows 16-byte
// aligned (x_stride a multiple of 4); an expert id outside the table contributes nothing. Every
// out row is written; out must not overlap x. cudaErrorInvalidValue for bad arguments. `precision`
// picks each pass's path (moe_path_for); size the workspace for the same precision.
// With PDL, x must be complete by the time the launch just before run_experts' passes its wait:
// the decode gate/up kernel stages x before its own wait. route_token and route_experts, launched
// just before, ensure it for an x made before them (they trigger their dependents only after
// their wait).
cudaError_t run_experts(const MoeExpertTable& table, const float* x, int64_t x_stride, int tokens,
                        int top_k, const int32_t* expert_ids, const float* weights, float* out,
                        int64_t out_stride, void* workspace, const Launch& launch,
                        MoePrecision precision = MoePrecision::kBf16TensorCores);

// How many kernels run_experts enqueues for `tokens` tokens over experts of `shape` (launch
// accounting).
int run_experts_kernel_count(const MoeShape& shape, int tokens,
                             MoePrecision precision = MoePrecision::kBf16TensorCores);

// The table of `experts` for a caller with nowhere to keep one per layer: built on first use
// and kept for the process, rebuilt when the experts' descriptors change (a new model at the
// same address). The first call per layer uploads, so it must not happen during graph capture.
// nullptr (with *why set) when check_experts objects or the upload fails. Thread-safe.
const MoeExpertTable* cached_expert_table(std::span<const model::ExpertMatrices> experts,
                                          std::string* why);

}  // namespace gemma4::cuda
