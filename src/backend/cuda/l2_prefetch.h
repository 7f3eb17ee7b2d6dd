// Fire-and-forget L2 prefetches of weight ranges (engine::Backend::prefetch_weights): one small
// kernel whose threads issue cp.async.bulk.prefetch.L2 for pieces of the ranges and then wait for
// their predecessors like every kernel, so the PDL chain's memory ordering stays transitive (a
// kernel that did not wait would let its dependents start before its predecessors' writes landed).
// Host-only header.
#pragma once

#include <cstdint>

#include "backend/cuda/launch.h"

namespace gemma4::cuda {

struct L2PrefetchRanges {
  static constexpr int kMaxRanges = 32;
  const void* begin[kMaxRanges] = {};
  uint64_t bytes[kMaxRanges] = {};
  int count = 0;
  // Mark the prefetched lines evict_last (kept over normally loaded lines) instead of normal.
  bool evict_last = false;
};

// Prefetches every range's 16-byte-aligned part into L2 from `blocks` blocks (spread over the SMs,
// so the requests leave from both halves of the L2). Writes nothing.
cudaError_t prefetch_l2(const L2PrefetchRanges& ranges, int blocks, const Launch& launch);

}  // namespace gemma4::cuda
