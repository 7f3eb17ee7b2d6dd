// Server metrics in the Prometheus text format: request and token counters, TTFT and
// per-output-token latency histograms; the scheduler's gauges (running, queued, KV use) are
// read at scrape time.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "runtime/scheduler.h"

namespace gemma4::server {

class Histogram {
 public:
  static constexpr std::array<double, 12> kBucketsSeconds = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25,
                                                             0.5,   1.0,  2.5,   5.0,  10.0, 30.0};
  void observe(double seconds);
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  std::array<uint64_t, kBucketsSeconds.size()> counts_{};
  uint64_t count_ = 0;
  double sum_ = 0;
};

class Metrics {
 public:
  // One finished generation request; `client_disconnected`: it was cancelled because its
  // client went away.
  void record_generation(const runtime::RequestMetrics& metrics, bool client_disconnected);
  // One HTTP request answered on an API route, by status class.
  void record_request(int http_status);

  // The whole exposition; `stats` null while the model is loading.
  std::string render(const runtime::SchedulerStats* stats) const;

 private:
  mutable std::mutex mutex_;
  uint64_t requests_ok_ = 0;
  uint64_t requests_client_error_ = 0;
  uint64_t requests_server_error_ = 0;
  uint64_t requests_rejected_ = 0;  // 429
  uint64_t requests_disconnected_ = 0;
  uint64_t prompt_tokens_ = 0;
  uint64_t cached_prompt_tokens_ = 0;
  uint64_t generated_tokens_ = 0;
  Histogram time_to_first_token_;
  Histogram time_per_output_token_;
};

}  // namespace gemma4::server
