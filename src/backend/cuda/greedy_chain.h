// CudaBackend's chained greedy decoding (engine::Backend::enqueue_greedy / wait_greedy): per
// slot, the pinned host copy of a step's ranking (each row's best key and log-normaliser) and its
// events, and the stream that copies the ranking to the host off the main stream, so that the
// next step's graph, already enqueued behind the ranking, does not wait for the copy. Host-only
// header.
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
    const uint64_t* keys = nullptr;              // in `host`: [rows]
    const double* log_normalisers = nullptr;     // in `host`: [rows]
    cudaEvent_t ranked = nullptr;                // on the main stream, after the ranking
    cudaEvent_t copied = nullptr;                // on copy_stream, after the ranking's copy
    std::span<engine::GreedyToken> destination;  // where wait_greedy puts the tokens
    bool pending = false;                        // enqueued, not yet waited for
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
