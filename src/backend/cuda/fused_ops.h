// The attention inputs of one layer in one launch (engine::Backend::prepare_attention): per-head
// RMSNorm and RoPE of q and k, the weightless norm of v, and the K/V store of every row into its
// sequence's cache. Plain parameter blocks, as backend_kernels.h; all pointers are device
// pointers and the launches are graph-capturable (positions are read from device memory).
#pragma once

#include <cstdint>
#include <span>

#include "backend/cuda/attention.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/launch.h"

namespace gemma4::cuda {

struct AttentionInputs {
  RowsView q;  // [rows][q_heads · head_dim], normed and rotated in place
  // [rows][kv_heads · head_dim] each; k.data == nullptr when the layer reads another layer's KV
  // (then only q is prepared). k and v are read, never written: their rows go to the caches.
  RowsView k;
  RowsView v;
  const float* q_norm = nullptr;  // [head_dim]; null: weightless
  const float* k_norm = nullptr;
  bool norm_v = false;         // v per head normed without weight (else stored as it is)
  int head_dim = 0;            // even, <= 512
  float weight_offset = 0.0f;  // the norms scale by (weight_offset + w)
  float eps = 1e-6f;
  const int32_t* positions = nullptr;  // [rows]
  const float* inv_freq = nullptr;     // [head_dim / 2]: engine::rope_inverse_frequencies
  KvType kv_type = KvType::kF32;       // of every cache stored into (rounded as attention_kv.cuh)
};

// Row r of q is normed and rotated by positions[r]; if k.data != nullptr, for every sequence s
// (caches of kv_type, kv_heads · head_dim = k.width elements per slot) and each of its rows r, the
// normed, rotated k[r] and (normed) v[r] go to slot positions[r] % s.slots of s, whose recorded
// position becomes positions[r]. A sequence's rows must fall in distinct slots (rows <= slots). One
// launch per kMaxBatchedSequences sequences stored (none when k.data == nullptr), at least one:
// prepare_attention_launches(sequences stored).
cudaError_t prepare_attention(const AttentionInputs& inputs, std::span<const SequenceKv> sequences,
                              const Launch& launch);
int prepare_attention_launches(int sequences);

}  // namespace gemma4::cuda
