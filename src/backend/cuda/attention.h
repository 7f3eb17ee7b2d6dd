// Decode attention: one query token per sequence against that sequence's KV cache, GQA (each
// cached K/V row is read once for all q heads of its group), split across the cache with an
// online-softmax merge (a second, small kernel when splits > 1). head_dim 256 or 512.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/cuda/launch.h"

namespace gemma4::cuda {

enum class KvType : uint8_t { kF32, kBF16 };

// A layer's KV cache for `batch` sequences (engine::KvView layout): per sequence `slots` entries of
// [kv_heads, head_dim] for K and for V, and the absolute position each slot holds (-1 = empty).
// Sequence b's arrays start at keys/values + b · sequence_stride elements and slot_positions +
// b · slots.
struct KvCacheView {
  const void* keys = nullptr;
  const void* values = nullptr;
  const int32_t* slot_positions = nullptr;
  KvType type = KvType::kBF16;
  int64_t slots = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int64_t sequence_stride = 0;
};

// Device scratch for the split partials (needed when splits > 1): at least
// attention_partials_floats(batch, q_heads, head_dim, max_splits) floats.
struct AttentionWorkspace {
  float* partials = nullptr;
  int max_splits = 0;
};

size_t attention_partials_floats(int batch, int q_heads, int head_dim, int max_splits);

struct AttentionQuery {
  const float* q = nullptr;  // [batch][q_heads · head_dim], row b at q + b · stride
  int64_t stride = 0;
  int q_heads = 0;
  const int32_t* positions = nullptr;  // [batch] query positions (device memory)
  int batch = 1;
};

// out[b][h] = Σ_j softmax_j(scale · q[b][h] · k_j) · v_j over the slots j whose position p
// satisfies p <= P and (window == 0 or P − p < window), P = positions[b]; q head h reads kv head
// h / (q_heads / kv_heads). Only slots [0, min(slots, P + 1)) are scanned (position p lives in
// slot p % slots). `splits` (1..4096) blocks share each (sequence, kv head): choose it by the depth
// the graph is captured for (it must not exceed workspace.max_splits).
cudaError_t decode_attention(const AttentionQuery& query, const KvCacheView& kv, int window,
                             float scale, float* out, int64_t out_stride,
                             const AttentionWorkspace& workspace, int splits, const Launch& launch);

}  // namespace gemma4::cuda
