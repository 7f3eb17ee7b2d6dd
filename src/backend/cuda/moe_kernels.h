// The MoE kernels' own interface: plain parameter blocks, no checkpoint types, so moe.cu needs no
// project headers beyond launch.h and gemv_kernels.h (nvcc cannot parse fmt, which
// quant/qmatrix.h pulls in). moe.h is the API the engine uses; moe.cpp validates and translates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/launch.h"

namespace gemma4::cuda {

// Largest router width and top-k the router kernel handles (one warp per token: 8 logits per
// lane; the k-th kept expert is held by lane k).
inline constexpr int kMaxRouterExperts = 256;
inline constexpr int kMaxTopK = 32;

// One expert matrix as the kernels read it (device pointers). The member names are the ones
// device_math.cuh's helpers read.
struct MoeMatrix {
  const void* weights = nullptr;  // 16-byte chunks, row n at chunk n · chunks_per_row
  const void* scales = nullptr;
  int64_t chunks_per_row = 0;
  int scale_type = 0;  // quant::ScaleType value (kW4G32)
  float nv_global = 1.0f;
  int nv_global_is_divisor = 0;
};

// Expert e computes down · (gelu_tanh(gate · x) ⊙ (up · x)).
struct MoeExpert {
  MoeMatrix gate;  // [inner, hidden]
  MoeMatrix up;    // [inner, hidden]
  MoeMatrix down;  // [hidden, inner]
};

// What every expert of a layer shares: the kernels are compiled per format.
struct MoeShape {
  PackedFormat gate_up_format = PackedFormat::kW4G32;
  PackedFormat down_format = PackedFormat::kW4G32;
  int num_experts = 0;
  int64_t hidden = 0;
  int64_t inner = 0;
};

struct RouterArgs {
  const float* logits;  // [tokens, num_experts], row t at logits + t · logits_stride
  int64_t logits_stride;
  int tokens;
  int num_experts;
  int top_k;
  const float* per_expert_scale;  // [num_experts]
  int32_t* expert_ids;            // [tokens, top_k]
  float* weights;                 // [tokens, top_k]
};
cudaError_t launch_router(const RouterArgs& args, const Launch& launch);

// One token's router logits from bf16 router weights, then launch_router's picks, in one launch.
struct FusedRouterArgs {
  const void* w;        // bf16 [num_experts, hidden], 16-byte aligned rows
  const float* x;       // [hidden], 16-byte aligned
  int64_t hidden;       // a multiple of 8
  int round_x_to_bf16;  // x rounded to bf16 before the products (as the GEMV's bf16 mode)
  int num_experts;
  int top_k;
  const float* per_expert_scale;
  float* logits;        // [num_experts]
  int32_t* expert_ids;  // [top_k]
  float* weights;       // [top_k]
};
cudaError_t launch_fused_router(const FusedRouterArgs& args, const Launch& launch);
// The widest x the fused router stages in shared memory (192 KB of fp32); route_token refuses
// wider ones (the caller then runs the GEMV and the router apart).
inline constexpr int64_t kFusedRouterMaxHidden = 48 * 1024;

// The ways launch_moe runs the experts (moe.cu describes them).
enum class MoePath : uint8_t {
  kDecode,  // every (token, expert) pair as a GEMV, fp32 throughout: two kernels
  // kDecode's GEMVs with NVFP4 products on tensor cores (fp16 inputs, the activations rounded to
  // fp16 under a power-of-two scale; fp32 sums); other formats as kDecode. Two kernels.
  kDecodeTensorCores,
  // kDecodeTensorCores' per-pair math for NVFP4 experts (moe_by_expert_formats), but one block
  // set per selected expert reads its weights once for all the pairs that picked it
  // (moe_by_expert.cu): three kernels.
  kDecodeByExpert,
  kGrouped,  // pairs grouped by expert, tensor-core tiles with bf16 inputs: four kernels
};

// Tokens from which run_experts takes the grouped path for experts other than NVFP4 (NVFP4:
// kMoeByExpertGroupedMinTokens): below, the decode paths read each expert once per token that
// picked it (L2 absorbs the repeats). moe_bench on the H200 (26B-A4B NVFP4,
// µs per layer, decode on tensor cores / grouped): T=8 113 / 246, T=32 415 / 447, T=128
// 1,610 / 530: ~12.5 µs per token against a near-flat ~450-530, crossing near 36 tokens.
inline constexpr int kMoeGroupedMinTokens = 40;

// What run_experts may trade for speed: kBf16TensorCores lets small batches take
// kDecodeTensorCores and passes of moe_grouped_min_tokens tokens or more the grouped path (bf16
// products); kExactF32 keeps every product in fp32 (kDecode at any token count, as the backend's
// --fp32 mode needs), at the cost of reading each expert once per pair that picked it.
enum class MoePrecision : uint8_t { kBf16TensorCores, kExactF32 };

// Tokens from which run_experts reads each selected NVFP4 expert once (kDecodeByExpert) instead
// of once per pair. moe_bench on the H200 (26B-A4B NVFP4, PDL µs per layer, session 8 end, decode
// on tensor cores / by expert): T=1 20.1 / 42.0, T=8 106.1 / 107.9, T=12 148.8 / 100.8, T=16
// 193.4 / 142.4: equal at 8 tokens, by expert well ahead from 12; below 8 the per-pair kernels'
// finer grid wins (few pairs share an expert anyway).
inline constexpr int kMoeByExpertMinTokens = 9;

// Whether kDecodeByExpert runs these experts: its kernels are NVFP4 tensor-core ones.
constexpr bool moe_by_expert_formats(const MoeShape& shape) {
  return shape.gate_up_format == PackedFormat::kNVFP4 && shape.down_format == PackedFormat::kNVFP4;
}

// Tokens from which run_experts takes the grouped path for NVFP4 experts: kDecodeByExpert reads
// each picked expert once, as the grouped path does, and stays ahead much longer than the
// per-pair kernels. moe_bench on the H200 (26B-A4B NVFP4, PDL µs per layer, session 11, by expert /
// grouped): T=64 244.1 / 295.4, T=96 294.1 / 299.6, T=112 327.5 / ~300, T=128 365.7 / 301.4:
// crossing near 99 tokens (engine, 26B 64 streams: 4,979 -> 5,040 tok/s against grouped from 40).
inline constexpr int kMoeByExpertGroupedMinTokens = 100;

// Tokens from which run_experts takes the grouped path for experts of `shape`.
constexpr int moe_grouped_min_tokens(const MoeShape& shape) {
  return moe_by_expert_formats(shape) ? kMoeByExpertGroupedMinTokens : kMoeGroupedMinTokens;
}

// The path run_experts takes for a pass of `tokens` tokens over experts of `shape`: other formats
// than NVFP4 take kDecodeTensorCores' per-pair kernels instead of kDecodeByExpert (their fp32
// GEMVs are bound by arithmetic, not by reading the weights).
constexpr MoePath moe_path_for(const MoeShape& shape, int tokens, MoePrecision precision) {
  if (precision == MoePrecision::kExactF32) return MoePath::kDecode;
  if (tokens >= moe_grouped_min_tokens(shape)) return MoePath::kGrouped;
  return tokens >= kMoeByExpertMinTokens && moe_by_expert_formats(shape)
             ? MoePath::kDecodeByExpert
             : MoePath::kDecodeTensorCores;
}

struct MoeRunArgs {
  const MoeExpert* experts;  // device array [shape.num_experts]
  MoeShape shape;
  const float* x;  // [tokens, hidden], 16-byte aligned rows
  int64_t x_stride;
  int tokens;
  int top_k;
  const int32_t* expert_ids;  // [tokens, top_k]; an id outside [0, num_experts) contributes 0
  const float* weights;       // [tokens, top_k]
  float* out;                 // [tokens, hidden]
  int64_t out_stride;
  void* workspace;  // moe_workspace_layout(...).bytes, 16-byte aligned
  MoePath path;
};

// Where launch_moe keeps its intermediates inside the caller's workspace (byte offsets):
// activations [pairs, inner] (fp32 on the decode paths, bf16 on the grouped one), expert outputs
// [pairs, hidden] f32 (grouped and by expert) and, grouped only, the expert grouping. On
// kDecodeTensorCores with NVFP4 gate/up and down the activations region holds moe.cu's
// ActivationHandoff instead: fp16 pairs in mma order at `activations` (16 words per 32-element
// chunk: word 16c + 4i + j = elements 8i + j, 8i + j + 4 of chunk c), each 16-element block
// times its pick's routing weight, its down matrix's NVFP4 global scale and 2^q, and at
// `handoff_scales` the blocks' 2^-q (float, 2 per chunk).
struct MoeWorkspaceLayout {
  size_t activations = 0;
  size_t handoff_scales = 0;
  size_t expert_outputs = 0;
  size_t plan = 0;
  size_t bytes = 0;
};
MoeWorkspaceLayout moe_workspace_layout(const MoeShape& shape, int tokens, int top_k, MoePath path);

// Enqueues args.path for at most kMoeTokensPerPass tokens (moe.h); arguments already validated.
cudaError_t launch_moe(const MoeRunArgs& args, const Launch& launch);

// MoePath::kDecodeByExpert's three launches (moe_by_expert.cu), intermediates in `activations`
// [pairs, inner] and `expert_outputs` [pairs, hidden] (moe_workspace_layout's).
// cudaErrorInvalidValue for experts moe_by_expert_formats refuses.
cudaError_t launch_decode_by_expert(const MoeRunArgs& args, float* activations,
                                    float* expert_outputs, const Launch& launch);

}  // namespace gemma4::cuda
