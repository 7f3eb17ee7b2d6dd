// engine::Backend::time_replays on CUDA: device events around each graph replay and at the end of
// each step, turned into engine::ReplayTimes once the host has seen the step complete. Up to
// kMaxStepsInFlight steps may be enqueued ahead of the one the host waits for (chained greedy
// decoding enqueues the next step before reading the current one's tokens). Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/backend.h"

namespace gemma4::cuda {

class ReplayTimer {
 public:
  // Steps ended (step_end) and not yet completed (step_done) at once, at most.
  static constexpr int kMaxStepsInFlight = engine::Backend::kGreedySlots;

  // Creates the events; false (nothing timed) when that fails.
  bool start();
  ~ReplayTimer();

  // Around cudaGraphLaunch on `stream`: the replay of the step being enqueued.
  void before_replay(cudaStream_t stream);
  void after_replay(cudaStream_t stream);
  // The end of the step being enqueued: its last work is enqueued on `stream` (a synchronising
  // read's copy, the greedy ranking of a chained step). The next replay belongs to the next step.
  void step_end(cudaStream_t stream);
  // The host has seen the oldest ended step complete (a synchronisation, an event wait): the
  // step is added up, with idle measured from the end of the step before it.
  void step_done();
  // After a synchronisation: every ended step completed.
  void all_steps_done();

  const engine::ReplayTimes& times() const { return times_; }

 private:
  struct StepEvents {
    cudaEvent_t replay_start = nullptr;
    cudaEvent_t replay_end = nullptr;
    cudaEvent_t end = nullptr;
    bool replayed = false;
  };
  // Step s uses ring_[s % kRing]: the steps in flight, the one being enqueued and the completed
  // one before them (idle is measured from its end).
  static constexpr int kRing = kMaxStepsInFlight + 2;
  StepEvents ring_[kRing];
  int64_t enqueuing_ = 0;  // the step being enqueued
  int64_t done_ = 0;       // steps completed (step_done) so far
  engine::ReplayTimes times_;
};

}  // namespace gemma4::cuda
