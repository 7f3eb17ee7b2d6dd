#include "backend/cuda/replay_timer.h"

#include <cuda_runtime.h>

namespace gemma4::cuda {

bool ReplayTimer::start() {
  for (StepEvents& step : ring_) {
    for (cudaEvent_t* event : {&step.replay_start, &step.replay_end, &step.end}) {
      if (cudaEventCreate(event) != cudaSuccess) {
        *event = nullptr;
        cudaGetLastError();
        return false;
      }
    }
  }
  return true;
}

ReplayTimer::~ReplayTimer() {
  for (StepEvents& step : ring_) {
    for (cudaEvent_t event : {step.replay_start, step.replay_end, step.end}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }
}

void ReplayTimer::before_replay(cudaStream_t stream) {
  cudaEventRecord(ring_[enqueuing_ % kRing].replay_start, stream);
}

void ReplayTimer::after_replay(cudaStream_t stream) {
  StepEvents& step = ring_[enqueuing_ % kRing];
  cudaEventRecord(step.replay_end, stream);
  step.replayed = true;
}

void ReplayTimer::step_end(cudaStream_t stream) {
  // More steps in flight than the ring holds (not something the engine does): the oldest ones go
  // uncounted rather than read from re-recorded events.
  while (enqueuing_ + 1 - done_ > kMaxStepsInFlight) ++done_;
  cudaEventRecord(ring_[enqueuing_ % kRing].end, stream);
  ++enqueuing_;
  ring_[enqueuing_ % kRing].replayed = false;
}

void ReplayTimer::step_done() {
  if (done_ == enqueuing_) return;  // no step ended since the last one completed
  const auto elapsed_us = [](cudaEvent_t from, cudaEvent_t to) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, from, to) == cudaSuccess) return 1e3 * ms;
    cudaGetLastError();  // a failed query only loses a step's figures
    return 0.0;
  };
  const StepEvents& step = ring_[done_ % kRing];
  if (done_ > 0 && step.replayed) {
    const StepEvents& before = ring_[(done_ - 1) % kRing];
    times_.idle_us += elapsed_us(before.end, step.replay_start);
    times_.replay_us += elapsed_us(step.replay_start, step.replay_end);
    times_.tail_us += elapsed_us(step.replay_end, step.end);
    ++times_.replays;
  }
  ++done_;
}

void ReplayTimer::all_steps_done() {
  while (done_ < enqueuing_) step_done();
}

}  // namespace gemma4::cuda
