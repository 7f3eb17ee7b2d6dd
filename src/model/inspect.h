// What `gemma4 inspect` prints about a checkpoint: the resolved config, the per-layer geometry,
// every tensor with the internal format the loader reads it as, byte totals and the KV cache a
// context needs. Works on mapped checkpoints only (nothing is dequantised or copied).
#pragma once

#include <cstdint>
#include <string>

#include "model/config.h"
#include "model/weights.h"

namespace gemma4::model {

// KV cache bytes of one sequence holding `context` tokens (gemma4-architecture.md 4.1): K and V
// per layer that owns a cache, min(context, window) tokens on sliding layers, `element_bytes`
// per value (2 for bf16).
struct KvCacheEstimate {
  int64_t full_bytes = 0;     // full-attention layers (grow with the context)
  int64_t sliding_bytes = 0;  // sliding rings
  int full_layers = 0;        // layers owning a full cache
  int sliding_layers = 0;     // layers owning a ring
  int64_t total() const { return full_bytes + sliding_bytes; }
};
KvCacheEstimate estimate_kv_cache(const ModelConfig& config, int64_t context,
                                  int element_bytes = 2);

struct InspectOptions {
  int64_t context = 0;       // 0 = the model's max_position_embeddings
  bool list_tensors = true;  // one line per tensor
};

std::string inspect_report(const LoadedModel& model, const InspectOptions& options);

}  // namespace gemma4::model
