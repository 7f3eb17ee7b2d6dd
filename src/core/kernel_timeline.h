// Where a step's time goes on the GPU, from kernel start/end timestamps of a tracer (CUPTI:
// `gemma4 bench --timeline`, src/cli/cupti_timeline.h) and host marks at each step's start.
// Kernels of a PDL chain overlap (a kernel's prologue runs while its predecessor finishes), so
// neither a kernel's duration nor the sum of durations says what it costs a step: the summary
// also gives each kernel's critical-path cost, how far its end moves the step's frontier (the
// latest end so far) — in a chain of one stream, the time from the previous kernel's end to its
// own end. A step's costs add up to its GPU span (first start to last end).
#pragma once

#include <array>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <vector>

namespace gemma4 {

// One kernel execution as a tracer reports it. Timestamps in ns on the clock of the step marks.
struct KernelLaunch {
  std::string name;
  std::array<int32_t, 3> grid{1, 1, 1};
  std::array<int32_t, 3> block{1, 1, 1};
  uint32_t stream = 0;
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
};

// A kernel placed in its step: times relative to the step's first kernel start.
struct PlacedLaunch {
  KernelLaunch launch;
  int64_t start_ns = 0;     // from the step's first kernel start
  int64_t end_ns = 0;       // likewise
  int64_t critical_ns = 0;  // how far its end moves the step's frontier (>= 0)
  // Its start minus the frontier before it: negative when it starts before the kernels launched
  // ahead of it have all ended (overlap: PDL prologue, another stream), positive for idle time.
  int64_t gap_ns = 0;
};

// One step (a decode token, a prefill pass): its host window and its kernels, by start.
struct TimelineStep {
  uint64_t host_begin_ns = 0;  // the host mark at the step's start
  uint64_t host_end_ns = 0;    // the next step's mark (or the range's end)
  std::vector<PlacedLaunch> kernels;

  int64_t host_ns() const { return static_cast<int64_t>(host_end_ns - host_begin_ns); }
  // First kernel start to the last end; 0 without kernels.
  int64_t gpu_span_ns() const;
  int64_t kernel_time_sum_ns() const;  // the sum of the kernels' durations
};

// Splits `launches` into steps at the host marks: marks[i] opens step i, marks.back() closes the
// last one (steps = marks.size() - 1). A kernel belongs to the step in which it starts; kernels
// starting outside [marks.front(), marks.back()) are dropped. Marks must not decrease.
std::vector<TimelineStep> split_into_steps(std::vector<KernelLaunch> launches,
                                           std::span<const uint64_t> marks);

// Per kernel name, over all steps.
struct KernelNameSummary {
  std::string name;
  int64_t launches = 0;
  double launches_per_step = 0;
  double mean_duration_ns = 0;
  double mean_critical_ns = 0;
  double critical_per_step_ns = 0;  // its share of the mean GPU span
  double mean_gap_ns = 0;
};

struct TimelineSummary {
  int64_t steps = 0;
  double launches_per_step = 0;
  double mean_host_ns = 0;                 // host mark to host mark
  double mean_launch_latency_ns = 0;       // host mark to the first kernel's start
  double mean_gpu_span_ns = 0;             // first kernel start to last end
  double mean_tail_ns = 0;                 // last kernel end to the next host mark
  double mean_kernel_time_sum_ns = 0;      // sum of durations (over the span: kernels overlap)
  std::vector<KernelNameSummary> kernels;  // by critical_per_step_ns, largest first
};

// Steps without kernels count in steps and the host time (as idle steps).
TimelineSummary summarize_timeline(std::span<const TimelineStep> steps);

// One launch of a step that every step repeats (a replayed graph: the same kernels in the same
// order), averaged over the steps: which node of the graph costs what.
struct LaunchSummary {
  int64_t index = 0;  // in the step
  std::string name;
  std::array<int32_t, 3> grid{1, 1, 1};
  double mean_start_ns = 0;  // from the step's first kernel start
  double mean_duration_ns = 0;
  double mean_critical_ns = 0;
};

// Per launch index, when every step has the same kernel names in the same order; empty
// otherwise (or without steps).
std::vector<LaunchSummary> summarize_launches(std::span<const TimelineStep> steps);

// The `count` launches of largest mean critical cost, as a table (in step order).
std::string format_costliest_launches(std::span<const LaunchSummary> launches, size_t count,
                                      size_t name_width = 72);

// The steps of one recorded measurement ("decode depth 0", ...).
struct TimelineRange {
  std::string label;
  std::vector<TimelineStep> steps;
};

// One line per kernel, tab-separated with a header line: measurement, step, index in the step,
// name, grid, block, stream, start, end, duration, critical, gap (times in µs, relative to the
// step's first kernel start).
void write_timeline_tsv(std::ostream& out, std::span<const TimelineRange> ranges);

// The summary as a table for a terminal; names longer than `name_width` are cut.
std::string format_timeline_summary(const TimelineSummary& summary, size_t name_width = 72);

}  // namespace gemma4
