// The timeline arithmetic of `gemma4 bench --timeline` on hand-made kernel records: expected
// values follow from the definitions in core/kernel_timeline.h (step = the kernels starting
// between two host marks; critical = how far a kernel's end moves the latest end so far; gap =
// its start minus that latest end), worked out by hand below.
#include <gtest/gtest.h>

#include <sstream>

#include "core/kernel_timeline.h"

namespace gemma4 {
namespace {

KernelLaunch kernel(std::string name, uint64_t start, uint64_t end, uint32_t stream = 7) {
  KernelLaunch k;
  k.name = std::move(name);
  k.grid = {16, 2, 1};
  k.block = {256, 1, 1};
  k.stream = stream;
  k.start_ns = start;
  k.end_ns = end;
  return k;
}

TEST(KernelTimeline, SplitsAtHostMarksAndDropsKernelsOutside) {
  const std::vector<uint64_t> marks = {1000, 2000, 3000};
  // Out of order on purpose: each step's kernels come back ordered by start.
  std::vector<KernelLaunch> launches = {
      kernel("b", 1500, 1600),     kernel("a", 1100, 1400),
      kernel("before", 900, 1050), kernel("c", 2000, 2100),  // starts on step 1's mark: step 1
      kernel("after", 3000, 3100), kernel("d", 2500, 2900)};
  const auto steps = split_into_steps(std::move(launches), marks);
  ASSERT_EQ(steps.size(), 2u);
  ASSERT_EQ(steps[0].kernels.size(), 2u);
  EXPECT_EQ(steps[0].kernels[0].launch.name, "a");
  EXPECT_EQ(steps[0].kernels[1].launch.name, "b");
  EXPECT_EQ(steps[0].host_begin_ns, 1000u);
  EXPECT_EQ(steps[0].host_end_ns, 2000u);
  ASSERT_EQ(steps[1].kernels.size(), 2u);
  EXPECT_EQ(steps[1].kernels[0].launch.name, "c");
  EXPECT_EQ(steps[1].kernels[1].launch.name, "d");
  // Relative to the step's first kernel start.
  EXPECT_EQ(steps[1].kernels[1].start_ns, 500);
  EXPECT_EQ(steps[1].kernels[1].end_ns, 900);
  EXPECT_TRUE(split_into_steps({kernel("a", 1, 2)}, std::vector<uint64_t>{5}).empty());
}

TEST(KernelTimeline, CriticalCostOfAPdlChain) {
  // a [0,10]; b starts 2 before a ends (PDL prologue) and ends at 15; c starts 5 after b ends.
  const std::vector<uint64_t> marks = {0, 1000};
  const auto steps = split_into_steps(
      {kernel("a", 100, 110), kernel("b", 108, 115), kernel("c", 120, 130)}, marks);
  ASSERT_EQ(steps.size(), 1u);
  const auto& k = steps[0].kernels;
  ASSERT_EQ(k.size(), 3u);
  EXPECT_EQ(k[0].critical_ns, 10);  // the first kernel: its duration
  EXPECT_EQ(k[0].gap_ns, 0);
  EXPECT_EQ(k[1].critical_ns, 5);   // 15 - 10
  EXPECT_EQ(k[1].gap_ns, -2);       // 8 - 10
  EXPECT_EQ(k[2].critical_ns, 15);  // 30 - 15
  EXPECT_EQ(k[2].gap_ns, 5);        // 20 - 15
  EXPECT_EQ(steps[0].gpu_span_ns(), 30);
  EXPECT_EQ(steps[0].kernel_time_sum_ns(), 10 + 7 + 10);
  EXPECT_EQ(k[0].critical_ns + k[1].critical_ns + k[2].critical_ns, steps[0].gpu_span_ns());
}

TEST(KernelTimeline, KernelHiddenBehindAnotherStreamCostsNothing) {
  // side [2,6] on another stream runs inside a [0,10]; c [12,20] follows a.
  const std::vector<uint64_t> marks = {0, 100};
  const auto steps = split_into_steps(
      {kernel("a", 10, 20), kernel("side", 12, 16, 9), kernel("c", 22, 30)}, marks);
  const auto& k = steps[0].kernels;
  ASSERT_EQ(k.size(), 3u);
  EXPECT_EQ(k[1].launch.name, "side");
  EXPECT_EQ(k[1].critical_ns, 0);
  EXPECT_EQ(k[1].gap_ns, -8);       // 2 - 10
  EXPECT_EQ(k[2].critical_ns, 10);  // 20 - 10: measured against a's end, not side's
  EXPECT_EQ(k[2].gap_ns, 2);
  EXPECT_EQ(steps[0].gpu_span_ns(), 20);
}

TEST(KernelTimeline, SummaryPerNameAndPerStep) {
  // Step 0 (host 0..100): gemv [10,40], norm [38,45], gemv [45,60].
  // Step 1 (host 100..200): gemv [120,150], norm [150,160], gemv [160,170].
  // Step 2 (host 200..250): no kernels.
  const std::vector<uint64_t> marks = {0, 100, 200, 250};
  const auto steps = split_into_steps(
      {kernel("gemv", 10, 40), kernel("norm", 38, 45), kernel("gemv", 45, 60),
       kernel("gemv", 120, 150), kernel("norm", 150, 160), kernel("gemv", 160, 170)},
      marks);
  const TimelineSummary s = summarize_timeline(steps);
  EXPECT_EQ(s.steps, 3);
  EXPECT_DOUBLE_EQ(s.launches_per_step, 6.0 / 3);
  EXPECT_DOUBLE_EQ(s.mean_host_ns, 250.0 / 3);
  EXPECT_DOUBLE_EQ(s.mean_launch_latency_ns, (10.0 + 20.0) / 3);
  EXPECT_DOUBLE_EQ(s.mean_gpu_span_ns, (50.0 + 50.0) / 3);
  // Last end to the next mark: 100 - 60, 200 - 170, and the empty step's 50.
  EXPECT_DOUBLE_EQ(s.mean_tail_ns, (40.0 + 30.0 + 50.0) / 3);
  EXPECT_DOUBLE_EQ(s.mean_kernel_time_sum_ns, (30.0 + 7 + 15 + 30 + 10 + 10) / 3);
  ASSERT_EQ(s.kernels.size(), 2u);
  const KernelNameSummary& gemv = s.kernels[0];  // the larger critical cost first
  EXPECT_EQ(gemv.name, "gemv");
  EXPECT_EQ(gemv.launches, 4);
  EXPECT_DOUBLE_EQ(gemv.launches_per_step, 4.0 / 3);
  EXPECT_DOUBLE_EQ(gemv.mean_duration_ns, (30.0 + 15 + 30 + 10) / 4);
  // Critical: 30, 60-45=15 (after norm ended at 45), 30, 10.
  EXPECT_DOUBLE_EQ(gemv.mean_critical_ns, (30.0 + 15 + 30 + 10) / 4);
  EXPECT_DOUBLE_EQ(gemv.critical_per_step_ns, (30.0 + 15 + 30 + 10) / 3);
  EXPECT_DOUBLE_EQ(gemv.mean_gap_ns, (0.0 + 0 + 0 + 0) / 4);
  const KernelNameSummary& norm = s.kernels[1];
  EXPECT_EQ(norm.launches, 2);
  EXPECT_DOUBLE_EQ(norm.mean_critical_ns, (5.0 + 10) / 2);  // 45-40, 160-150
  EXPECT_DOUBLE_EQ(norm.mean_gap_ns, (-2.0 + 0) / 2);
  // The critical costs add up to the span.
  EXPECT_DOUBLE_EQ(gemv.critical_per_step_ns + norm.critical_per_step_ns, s.mean_gpu_span_ns);
  EXPECT_EQ(summarize_timeline({}).steps, 0);
}

TEST(KernelTimeline, LaunchesAveragedByPositionWhenEveryStepRepeatsTheGraph) {
  // Two steps of the same three kernels: a [0,10] b [8,15] c [20,30], then a [0,20] b [25,30]
  // c [30,40] (relative to each step's first start).
  const std::vector<uint64_t> marks = {0, 100, 200};
  const auto steps =
      split_into_steps({kernel("a", 10, 20), kernel("b", 18, 25), kernel("c", 30, 40),
                        kernel("a", 110, 130), kernel("b", 135, 140), kernel("c", 140, 150)},
                       marks);
  const auto launches = summarize_launches(steps);
  ASSERT_EQ(launches.size(), 3u);
  EXPECT_EQ(launches[1].index, 1);
  EXPECT_EQ(launches[1].name, "b");
  EXPECT_EQ(launches[1].grid, (std::array<int32_t, 3>{16, 2, 1}));
  EXPECT_DOUBLE_EQ(launches[1].mean_start_ns, (8.0 + 25) / 2);
  EXPECT_DOUBLE_EQ(launches[1].mean_duration_ns, (7.0 + 5) / 2);
  EXPECT_DOUBLE_EQ(launches[1].mean_critical_ns, (5.0 + 10) / 2);   // 15-10, 30-20
  EXPECT_DOUBLE_EQ(launches[2].mean_critical_ns, (15.0 + 10) / 2);  // 30-15, 40-30
  // The two costliest (a: 15, c: 12.5), in step order.
  const std::string table = format_costliest_launches(launches, 2, 10);
  EXPECT_NE(table.find("    0 a"), std::string::npos) << table;
  EXPECT_NE(table.find("    2 c"), std::string::npos) << table;
  EXPECT_EQ(table.find("    1 b"), std::string::npos) << table;
  // Steps that ran different kernels have no common positions.
  const auto different = split_into_steps({kernel("a", 10, 20), kernel("b", 110, 120)}, marks);
  EXPECT_TRUE(summarize_launches(different).empty());
}

TEST(KernelTimeline, WritesOneTsvLinePerKernelAndATable) {
  const std::vector<uint64_t> marks = {0, 10000};
  const auto steps =
      split_into_steps({kernel("first", 1000, 3500), kernel("second", 3000, 4300)}, marks);
  std::ostringstream tsv;
  const std::vector<TimelineRange> ranges = {{"decode depth 0", steps}};
  write_timeline_tsv(tsv, ranges);
  EXPECT_EQ(tsv.str(),
            "measurement\tstep\tindex\tname\tgrid\tblock\tstream\tstart_us\tend_us\tduration_us\t"
            "critical_us\tgap_us\n"
            "decode depth 0\t0\t0\tfirst\t16x2x1\t256x1x1\t7\t0.000\t2.500\t2.500\t2.500\t0.000\n"
            "decode depth 0\t0\t1\tsecond\t16x2x1\t256x1x1\t7\t2.000\t3.300\t1.300\t0.800\t"
            "-0.500\n");
  const std::string table = format_timeline_summary(summarize_timeline(steps), /*name_width=*/10);
  EXPECT_NE(table.find("1 steps, 2.0 kernels per step"), std::string::npos) << table;
  EXPECT_NE(table.find("GPU span 3.3"), std::string::npos) << table;
  // A name over the width is cut, not allowed to break the columns.
  const auto long_steps = split_into_steps({kernel(std::string(40, 'x'), 1000, 2000)}, marks);
  const std::string cut = format_timeline_summary(summarize_timeline(long_steps), 10);
  EXPECT_NE(cut.find("xxxxxxx..."), std::string::npos) << cut;
  EXPECT_EQ(cut.find(std::string(11, 'x')), std::string::npos) << cut;
}

}  // namespace
}  // namespace gemma4
