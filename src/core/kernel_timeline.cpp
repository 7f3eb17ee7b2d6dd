#include "core/kernel_timeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace gemma4 {

int64_t TimelineStep::gpu_span_ns() const {
  int64_t end = 0;
  for (const auto& kernel : kernels) end = std::max(end, kernel.end_ns);
  return end;  // relative times start at the first kernel's start
}

int64_t TimelineStep::kernel_time_sum_ns() const {
  int64_t sum = 0;
  for (const auto& kernel : kernels) sum += kernel.end_ns - kernel.start_ns;
  return sum;
}

namespace {

// Orders one step's kernels by start (then end) and measures each against the frontier.
std::vector<PlacedLaunch> place(std::vector<KernelLaunch> launches) {
  std::sort(launches.begin(), launches.end(), [](const KernelLaunch& a, const KernelLaunch& b) {
    return a.start_ns != b.start_ns ? a.start_ns < b.start_ns : a.end_ns < b.end_ns;
  });
  std::vector<PlacedLaunch> placed;
  placed.reserve(launches.size());
  if (launches.empty()) return placed;
  const auto origin = static_cast<int64_t>(launches.front().start_ns);
  int64_t frontier = 0;  // the latest end so far, relative to origin
  for (auto& launch : launches) {
    PlacedLaunch p;
    p.start_ns = static_cast<int64_t>(launch.start_ns) - origin;
    p.end_ns = static_cast<int64_t>(launch.end_ns) - origin;
    p.gap_ns = p.start_ns - frontier;
    p.critical_ns = std::max<int64_t>(0, p.end_ns - frontier);
    frontier = std::max(frontier, p.end_ns);
    p.launch = std::move(launch);
    placed.push_back(std::move(p));
  }
  return placed;
}

}  // namespace

std::vector<TimelineStep> split_into_steps(std::vector<KernelLaunch> launches,
                                           std::span<const uint64_t> marks) {
  if (marks.size() < 2) return {};
  const size_t step_count = marks.size() - 1;
  std::vector<std::vector<KernelLaunch>> by_step(step_count);
  for (auto& launch : launches) {
    // The last mark <= start opens the kernel's step.
    const auto after = std::upper_bound(marks.begin(), marks.end(), launch.start_ns);
    if (after == marks.begin() || after == marks.end()) continue;
    by_step[static_cast<size_t>(after - marks.begin()) - 1].push_back(std::move(launch));
  }
  std::vector<TimelineStep> steps(step_count);
  for (size_t i = 0; i < step_count; ++i) {
    steps[i].host_begin_ns = marks[i];
    steps[i].host_end_ns = marks[i + 1];
    steps[i].kernels = place(std::move(by_step[i]));
  }
  return steps;
}

TimelineSummary summarize_timeline(std::span<const TimelineStep> steps) {
  TimelineSummary summary;
  summary.steps = static_cast<int64_t>(steps.size());
  if (steps.empty()) return summary;
  struct Totals {
    size_t first_seen = 0;  // keeps ties in the order kernels first appear
    int64_t launches = 0;
    double duration = 0, critical = 0, gap = 0;
  };
  std::map<std::string, Totals> by_name;
  double host = 0, latency = 0, span = 0, time_sum = 0;
  int64_t launches = 0;
  for (const auto& step : steps) {
    host += static_cast<double>(step.host_ns());
    time_sum += static_cast<double>(step.kernel_time_sum_ns());
    launches += static_cast<int64_t>(step.kernels.size());
    if (step.kernels.empty()) continue;
    latency += static_cast<double>(step.kernels.front().launch.start_ns - step.host_begin_ns);
    span += static_cast<double>(step.gpu_span_ns());
    for (const auto& kernel : step.kernels) {
      auto [it, inserted] = by_name.try_emplace(kernel.launch.name);
      if (inserted) it->second.first_seen = by_name.size();
      Totals& totals = it->second;
      ++totals.launches;
      totals.duration += static_cast<double>(kernel.end_ns - kernel.start_ns);
      totals.critical += static_cast<double>(kernel.critical_ns);
      totals.gap += static_cast<double>(kernel.gap_ns);
    }
  }
  const double n = static_cast<double>(steps.size());
  summary.launches_per_step = static_cast<double>(launches) / n;
  summary.mean_host_ns = host / n;
  summary.mean_launch_latency_ns = latency / n;
  summary.mean_gpu_span_ns = span / n;
  // A step without kernels is all tail: the parts add up to the host time.
  summary.mean_tail_ns = (host - latency - span) / n;
  summary.mean_kernel_time_sum_ns = time_sum / n;

  std::vector<std::pair<size_t, KernelNameSummary>> rows;
  for (const auto& [name, totals] : by_name) {
    const auto count = static_cast<double>(totals.launches);
    rows.push_back({totals.first_seen,
                    {name, totals.launches, count / n, totals.duration / count,
                     totals.critical / count, totals.critical / n, totals.gap / count}});
  }
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    if (a.second.critical_per_step_ns != b.second.critical_per_step_ns)
      return a.second.critical_per_step_ns > b.second.critical_per_step_ns;
    return a.first < b.first;
  });
  for (auto& row : rows) summary.kernels.push_back(std::move(row.second));
  return summary;
}

std::vector<LaunchSummary> summarize_launches(std::span<const TimelineStep> steps) {
  if (steps.empty()) return {};
  const auto& first = steps.front().kernels;
  for (const auto& step : steps) {
    if (step.kernels.size() != first.size()) return {};
    for (size_t i = 0; i < first.size(); ++i)
      if (step.kernels[i].launch.name != first[i].launch.name) return {};
  }
  const double n = static_cast<double>(steps.size());
  std::vector<LaunchSummary> launches(first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    LaunchSummary& l = launches[i];
    l.index = static_cast<int64_t>(i);
    l.name = first[i].launch.name;
    l.grid = first[i].launch.grid;
    for (const auto& step : steps) {
      const PlacedLaunch& k = step.kernels[i];
      l.mean_start_ns += static_cast<double>(k.start_ns) / n;
      l.mean_duration_ns += static_cast<double>(k.end_ns - k.start_ns) / n;
      l.mean_critical_ns += static_cast<double>(k.critical_ns) / n;
    }
  }
  return launches;
}

std::string format_costliest_launches(std::span<const LaunchSummary> launches, size_t count,
                                      size_t name_width) {
  name_width = std::max<size_t>(name_width, 8);
  std::vector<LaunchSummary> costliest(launches.begin(), launches.end());
  std::stable_sort(costliest.begin(), costliest.end(), [](const auto& a, const auto& b) {
    return a.mean_critical_ns > b.mean_critical_ns;
  });
  costliest.resize(std::min(count, costliest.size()));
  std::sort(costliest.begin(), costliest.end(),
            [](const auto& a, const auto& b) { return a.index < b.index; });
  const int width = static_cast<int>(name_width);
  std::string text = fmt::format("{:>5} {:<{}} {:>14} {:>9} {:>9} {:>9}\n", "index", "kernel",
                                 width, "grid", "start us", "mean us", "crit us");
  for (const auto& l : costliest) {
    std::string name = l.name;
    if (name.size() > name_width) name = name.substr(0, name_width - 3) + "...";
    text += fmt::format("{:>5} {:<{}} {:>14} {:>9.2f} {:>9.2f} {:>9.2f}\n", l.index, name, width,
                        fmt::format("{}x{}x{}", l.grid[0], l.grid[1], l.grid[2]),
                        l.mean_start_ns / 1e3, l.mean_duration_ns / 1e3, l.mean_critical_ns / 1e3);
  }
  return text;
}

void write_timeline_tsv(std::ostream& out, std::span<const TimelineRange> ranges) {
  out << "measurement\tstep\tindex\tname\tgrid\tblock\tstream\tstart_us\tend_us\tduration_us\t"
         "critical_us\tgap_us\n";
  const auto us = [](int64_t ns) { return static_cast<double>(ns) / 1e3; };
  const auto dims = [](const std::array<int32_t, 3>& d) {
    return fmt::format("{}x{}x{}", d[0], d[1], d[2]);
  };
  for (const auto& range : ranges) {
    for (size_t s = 0; s < range.steps.size(); ++s) {
      const auto& kernels = range.steps[s].kernels;
      for (size_t i = 0; i < kernels.size(); ++i) {
        const PlacedLaunch& k = kernels[i];
        out << fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\t{:.3f}\t{:.3f}\t{:.3f}\t{:.3f}\t{:.3f}\n",
                           range.label, s, i, k.launch.name, dims(k.launch.grid),
                           dims(k.launch.block), k.launch.stream, us(k.start_ns), us(k.end_ns),
                           us(k.end_ns - k.start_ns), us(k.critical_ns), us(k.gap_ns));
      }
    }
  }
}

std::string format_timeline_summary(const TimelineSummary& s, size_t name_width) {
  name_width = std::max<size_t>(name_width, 8);  // room for the header and a cut name's "..."
  const auto us = [](double ns) { return ns / 1e3; };
  std::string text = fmt::format("kernel timeline: {} steps, {:.1f} kernels per step\n", s.steps,
                                 s.launches_per_step);
  text += fmt::format(
      "per step (mean): host {:.1f} us = launch to first kernel {:.1f} + GPU span {:.1f} + last "
      "kernel to host {:.1f}; kernel durations add up to {:.1f} us ({:.0f}% of the span)\n",
      us(s.mean_host_ns), us(s.mean_launch_latency_ns), us(s.mean_gpu_span_ns), us(s.mean_tail_ns),
      us(s.mean_kernel_time_sum_ns),
      s.mean_gpu_span_ns > 0 ? 100 * s.mean_kernel_time_sum_ns / s.mean_gpu_span_ns : 0.0);
  text +=
      "critical: how far a kernel's end moves the step's latest end (in one chain: previous "
      "end to its end); gap: its start minus that latest end (< 0: overlap)\n";
  const int width = static_cast<int>(name_width);
  text += fmt::format("{:<{}} {:>8} {:>9} {:>9} {:>10} {:>6} {:>8}\n", "kernel", width, "n/step",
                      "mean us", "crit us", "crit/step", "%span", "gap us");
  for (const auto& k : s.kernels) {
    std::string name = k.name;
    if (name.size() > name_width) name = name.substr(0, name_width - 3) + "...";
    text += fmt::format(
        "{:<{}} {:>8.1f} {:>9.2f} {:>9.2f} {:>10.1f} {:>6.1f} {:>8.2f}\n", name, width,
        k.launches_per_step, us(k.mean_duration_ns), us(k.mean_critical_ns),
        us(k.critical_per_step_ns),
        s.mean_gpu_span_ns > 0 ? 100 * k.critical_per_step_ns / s.mean_gpu_span_ns : 0.0,
        us(k.mean_gap_ns));
  }
  return text;
}

}  // namespace gemma4
