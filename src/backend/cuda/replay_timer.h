// engine::Backend::time_replays on CUDA: device events around each graph replay and at each
// synchronising read, turned into engine::ReplayTimes once both ends of a step are complete.
// Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include "engine/backend.h"

namespace gemma4::cuda {

class ReplayTimer {
 public:
  // Creates the events; false (nothing timed) when that fails.
  bool start();
  ~ReplayTimer();

  // Around cudaGraphLaunch on `stream`.
  void before_replay(cudaStream_t stream);
  void after_replay(cudaStream_t stream);
  // Right before a synchronising read waits for `stream`, after its last copy was enqueued.
  void before_sync(cudaStream_t stream);
  // After that wait: every event of the step is complete, so the step is added up.
  void after_sync();

  const engine::ReplayTimes& times() const { return times_; }

 private:
  // The last two synchronising reads' events (alternating), the replay's start and end.
  cudaEvent_t reads_[2] = {};
  cudaEvent_t replay_start_ = nullptr;
  cudaEvent_t replay_end_ = nullptr;
  int current_read_ = 0;
  bool read_before_ = false;  // reads_[1 - current_read_] holds the previous read
  bool replayed_ = false;     // a replay since that read
  engine::ReplayTimes times_;
};

}  // namespace gemma4::cuda
