// `gemma4 bench --timeline FILE`: what each kernel of a step really takes inside the replayed
// CUDA graph (PDL chain included), from CUPTI's activity records (kernels — each node of a graph
// replay is one record, with its start and end on the GPU — memcpys and memsets), split into
// steps at host marks (core/kernel_timeline.h does the arithmetic).
//
// libcupti is loaded with dlopen when a timeline is asked for, so the binary starts without it:
// GEMMA4_CUPTI=PATH names the library, else libcupti.so.13 / libcupti.so are looked for on the
// loader's path, beside the executable and in /usr/local/cuda.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/kernel_timeline.h"
#include "core/status.h"

namespace gemma4::cli {

class CuptiTimeline {
 public:
  // Loads libcupti and enables its kernel, memcpy and memset activity. Call before the CUDA
  // graphs are captured (before the engine is created): CUPTI attached after capture may see
  // no graph nodes. One at a time per process (CUPTI's buffer callbacks are global).
  static Expected<std::unique_ptr<CuptiTimeline>> start();
  ~CuptiTimeline();
  CuptiTimeline(const CuptiTimeline&) = delete;
  CuptiTimeline& operator=(const CuptiTimeline&) = delete;

  // A range: begin_range after the GPU finished earlier work (records before it are dropped),
  // mark_step as each step is enqueued, end_range once the GPU finished the last step.
  void begin_range();
  void mark_step();
  void end_range(std::string label);

  const std::vector<TimelineRange>& ranges() const { return ranges_; }
  // The first CUPTI call that failed in a range, if any.
  const Status& status() const { return status_; }
  // Records CUPTI could not store (no buffer): the timeline misses that many.
  size_t dropped_records() const;

 private:
  struct Library;  // the dlopen'ed entry points
  explicit CuptiTimeline(std::unique_ptr<Library> library);
  Status flush();

  std::unique_ptr<Library> library_;
  std::vector<uint64_t> marks_;
  std::vector<TimelineRange> ranges_;
  Status status_;
};

}  // namespace gemma4::cli
