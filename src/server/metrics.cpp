#include "server/metrics.h"

#include <fmt/format.h>

namespace gemma4::server {

void Histogram::observe(double seconds) {
  for (size_t i = 0; i < kBucketsSeconds.size(); ++i) {
    if (seconds <= kBucketsSeconds[i]) ++counts_[i];
  }
  ++count_;
  sum_ += seconds;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  for (size_t i = 0; i < kBucketsSeconds.size(); ++i) {
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, kBucketsSeconds[i], counts_[i]);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name,
                     sum_, name, count_);
}

void Metrics::record_generation(const runtime::RequestMetrics& metrics, bool client_disconnected) {
  std::lock_guard lock(mutex_);
  if (client_disconnected) ++requests_disconnected_;
  prompt_tokens_ += static_cast<uint64_t>(metrics.prompt_tokens);
  cached_prompt_tokens_ += static_cast<uint64_t>(metrics.cached_tokens);
  generated_tokens_ += static_cast<uint64_t>(metrics.completion_tokens);
  if (metrics.completion_tokens > 0) {
    time_to_first_token_.observe((metrics.queue_ms + metrics.prompt_ms) / 1000.0);
  }
  if (metrics.completion_tokens > 1) {
    time_per_output_token_.observe(metrics.decode_ms / 1000.0 /
                                   static_cast<double>(metrics.completion_tokens - 1));
  }
}

void Metrics::record_request(int http_status) {
  std::lock_guard lock(mutex_);
  if (http_status == 429)
    ++requests_rejected_;
  else if (http_status >= 500)
    ++requests_server_error_;
  else if (http_status >= 400)
    ++requests_client_error_;
  else
    ++requests_ok_;
}

std::string Metrics::render(const runtime::SchedulerStats* stats) const {
  std::string out;
  auto counter = [&](const char* name, const char* help, uint64_t value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, value);
  };
  auto gauge = [&](const char* name, const char* help, double value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{} {}\n", name, help, name, name, value);
  };
  {
    std::lock_guard lock(mutex_);
    out +=
        "# HELP gemma4_requests_total API requests answered, by outcome.\n"
        "# TYPE gemma4_requests_total counter\n";
    out += fmt::format("gemma4_requests_total{{outcome=\"ok\"}} {}\n", requests_ok_);
    out += fmt::format("gemma4_requests_total{{outcome=\"client_error\"}} {}\n",
                       requests_client_error_);
    out += fmt::format("gemma4_requests_total{{outcome=\"server_error\"}} {}\n",
                       requests_server_error_);
    out += fmt::format("gemma4_requests_total{{outcome=\"rejected\"}} {}\n", requests_rejected_);
    counter("gemma4_requests_disconnected_total",
            "Generations cancelled because the client went away.", requests_disconnected_);
    counter("gemma4_prompt_tokens_total", "Prompt tokens of finished requests.", prompt_tokens_);
    counter("gemma4_prompt_tokens_cached_total", "Prompt tokens served from the prefix cache.",
            cached_prompt_tokens_);
    counter("gemma4_generation_tokens_total", "Generated tokens.", generated_tokens_);
    time_to_first_token_.render(out, "gemma4_time_to_first_token_seconds",
                                "Submit to first generated token.");
    time_per_output_token_.render(out, "gemma4_time_per_output_token_seconds",
                                  "Mean time between generated tokens, per request.");
  }
  gauge("gemma4_model_loaded", "1 once the model serves requests.", stats ? 1 : 0);
  if (stats) {
    gauge("gemma4_requests_running", "Requests generating now.", stats->running);
    gauge("gemma4_requests_waiting", "Requests queued for a slot.", stats->queued);
    gauge("gemma4_slots_total", "Requests that may generate at once (--parallel).",
          stats->max_running);
    gauge("gemma4_sequences_cached", "Finished sequences kept for prefix reuse.",
          stats->cached_sequences);
    gauge("gemma4_kv_cache_tokens", "Tokens held in the KV cache.",
          static_cast<double>(stats->kv_tokens));
    const double capacity =
        static_cast<double>(stats->max_sequences) * static_cast<double>(stats->max_context);
    gauge("gemma4_kv_cache_usage_ratio", "KV cache tokens held / capacity.",
          capacity > 0 ? static_cast<double>(stats->kv_tokens) / capacity : 0.0);
    counter("gemma4_engine_steps_total", "Batched engine steps.", stats->steps);
  }
  return out;
}

}  // namespace gemma4::server
