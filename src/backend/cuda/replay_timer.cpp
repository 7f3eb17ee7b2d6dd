#include "backend/cuda/replay_timer.h"

#include <cuda_runtime.h>

namespace gemma4::cuda {

bool ReplayTimer::start() {
  for (cudaEvent_t* event : {&reads_[0], &reads_[1], &replay_start_, &replay_end_}) {
    if (cudaEventCreate(event) != cudaSuccess) {
      *event = nullptr;
      cudaGetLastError();
      return false;
    }
  }
  return true;
}

ReplayTimer::~ReplayTimer() {
  for (cudaEvent_t event : {reads_[0], reads_[1], replay_start_, replay_end_}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
}

void ReplayTimer::before_replay(cudaStream_t stream) {
  cudaEventRecord(replay_start_, stream);
}

void ReplayTimer::after_replay(cudaStream_t stream) {
  cudaEventRecord(replay_end_, stream);
  replayed_ = true;
}

void ReplayTimer::before_sync(cudaStream_t stream) {
  cudaEventRecord(reads_[current_read_], stream);
}

void ReplayTimer::after_sync() {
  const auto elapsed_us = [](cudaEvent_t from, cudaEvent_t to) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, from, to) == cudaSuccess) return 1e3 * ms;
    cudaGetLastError();  // a failed query only loses a step's figures
    return 0.0;
  };
  if (read_before_ && replayed_) {
    times_.idle_us += elapsed_us(reads_[1 - current_read_], replay_start_);
    times_.replay_us += elapsed_us(replay_start_, replay_end_);
    times_.tail_us += elapsed_us(replay_end_, reads_[current_read_]);
    ++times_.replays;
  }
  read_before_ = true;
  replayed_ = false;
  current_read_ = 1 - current_read_;
}

}  // namespace gemma4::cuda
