// CudaBackend's chained greedy decoding (engine::Backend::enqueue_greedy / wait_greedy): per
// slot, the pinned host copy of a step's tokens and its events, and the stream that copies the
// tokens to the host off the main stream, so that the next step's graph, already enqueued behind
// the ranking, does not wait for the copy. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "backend/cuda/sample_logits.h"
#include "engine/backend.h"

namespace gemma4::cuda {

struct GreedyChain {
  struct Slot {
    PinnedStaging host;
    int32_t* host_tokens = nullptr;  // in `host`
    cudaEvent_t ranked = nullptr;    // on the main stream, after the ranking
    cudaEvent_t copied = nullptr;    // on copy_stream, after the tokens' copy
    std::span<int32_t> destination;  // where wait_greedy puts the tokens
    bool pending = false;            // enqueued, not yet waited for
  };

  GreedyChain() = default;
  GreedyChain(const GreedyChain&) = delete;
  GreedyChain& operator=(const GreedyChain&) = delete;
  ~GreedyChain();
  // Creates the stream and the events.
  cudaError_t start();

  cudaStream_t copy_stream = nullptr;
  Slot slots[engine::Backend::kGreedySlots];
};

}  // namespace gemma4::cuda
