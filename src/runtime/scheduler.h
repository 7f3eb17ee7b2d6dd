// Scheduler: the one engine thread that owns the Engine and runs every request through it.
//
// HTTP threads call submit() and read the returned RequestStream; they never touch the engine.
// Each loop iteration builds ONE step() batch from (a) one decode token for every running
// sequence that has finished its prompt and (b) prefill chunks of newly admitted prompts, up to a
// token budget, so long prompts never stall running decodes (continuous batching).
//
// While every running request decodes with a sampler that needs only its row's best token
// (greedy, no edits) and no queued request could be admitted, the steps chain on the engine
// (Engine::decode_greedy: each token stays on the device as the next step's input and the next
// step is enqueued before the host sees the token). Requests finish inside the chain as they
// would outside it; the chain ends once every request has finished or something else needs the
// engine thread (a request to admit, a cancellation, a deadline, a sampler that now wants more).
//
// Finished sequences are kept open in a small LRU (the prefix cache): a new prompt that shares a
// token prefix with one of them truncates that sequence to the common prefix and prefills only
// the rest, which makes multi-turn chats cheap. Cancelled or expired requests close their
// sequence at once, so their KV is free for the next request.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/status.h"
#include "engine/engine.h"
#include "runtime/token_sampler.h"

namespace gemma4::runtime {

using Clock = std::chrono::steady_clock;

struct SchedulerOptions {
  // Requests generating at once (llama-server's --parallel). Capped by engine.max_sequences().
  int32_t max_running = 4;
  // Requests waiting for a running slot; one more is refused with kResourceExhausted.
  int32_t max_queued = 64;
  // Largest prefill chunk one sequence appends per step.
  int32_t prefill_chunk = 256;
  // Most tokens (decode + prefill) in one step() call; decodes always fit.
  int32_t step_token_budget = 512;
  // Finished sequences kept for prefix reuse (0 disables reuse). Also bounded by the engine's
  // free sequence capacity.
  int32_t prefix_cache_entries = 4;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  // Tokens to generate at most; clipped so that prompt + output fits the context.
  int64_t max_new_tokens = 0;
  // Generation ends (reason kStop) when one of these is sampled; the stop token is reported in
  // the finish event, not as an output token.
  std::vector<int32_t> stop_tokens;
  std::unique_ptr<TokenSampler> sampler;
  std::optional<Clock::time_point> deadline;
};

enum class FinishReason { kStop, kLength, kCancelled, kDeadline, kError };
const char* finish_reason_name(FinishReason reason);

struct RequestMetrics {
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens whose KV came from the prefix cache
  int64_t completion_tokens = 0;
  double queue_ms = 0;   // submit → admitted
  double prompt_ms = 0;  // admitted → first output token (prefill)
  double decode_ms = 0;  // first output token → finish
};

struct GenerationEvent {
  enum class Kind { kToken, kFinished };
  Kind kind = Kind::kToken;
  SampledToken token;  // kToken
  // kFinished:
  FinishReason reason = FinishReason::kStop;
  int32_t stop_token = -1;     // the stop token sampled, for kStop
  std::optional<Error> error;  // for kError
  RequestMetrics metrics;
};

// Wakes the engine thread (shared so a stream may outlive the scheduler safely).
struct WakeSignal {
  std::mutex mutex;
  std::condition_variable cv;
  bool pending = false;
  void notify();
};

// One request's output channel: the engine thread pushes events, the submitting thread reads
// them. cancel() may be called from any thread at any time.
class RequestStream {
 public:
  explicit RequestStream(std::shared_ptr<WakeSignal> wake) : wake_(std::move(wake)) {}

  // The next event, or nullopt if none arrived within `timeout`.
  std::optional<GenerationEvent> next(std::chrono::milliseconds timeout);
  // Stops generation; the engine thread closes the sequence on its next iteration and pushes a
  // kFinished event with reason kCancelled.
  void cancel();
  bool cancelled() const { return cancelled_.load(); }

  void push(GenerationEvent event);  // engine thread only

 private:
  std::shared_ptr<WakeSignal> wake_;
  std::atomic<bool> cancelled_{false};
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<GenerationEvent> events_;
};

struct SchedulerStats {
  int32_t running = 0;
  int32_t queued = 0;
  int32_t cached_sequences = 0;  // finished sequences kept for prefix reuse
  int32_t max_running = 0;
  int32_t max_sequences = 0;
  int64_t kv_tokens = 0;  // tokens held in KV by running + cached sequences
  int64_t max_context = 0;
  uint64_t steps = 0;
};

class Scheduler {
 public:
  Scheduler(engine::Engine& engine, SchedulerOptions options);
  ~Scheduler();  // stops the engine thread; pending requests finish with kCancelled
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. Errors: kInvalidArgument (empty prompt, no sampler), kOutOfRange (the
  // prompt does not fit the context; message says "maximum context length is N tokens"),
  // kResourceExhausted (queue full).
  Expected<std::shared_ptr<RequestStream>> submit(GenerationRequest request);

  SchedulerStats stats() const;
  int64_t max_context() const { return engine_.max_context(); }
  int32_t vocab_size() const { return engine_.vocab_size(); }

 private:
  struct Active;
  struct CachedSequence {
    engine::SequenceId sequence;
    std::vector<int32_t> tokens;  // what the sequence's KV holds
  };
  struct Pending {
    GenerationRequest request;
    std::shared_ptr<RequestStream> stream;
    Clock::time_point submitted;
  };

  void run();
  void admit_pending();
  bool start(Pending pending);
  Expected<engine::SequenceId> open_sequence();
  void drop_cancelled_and_expired();
  void step_once();
  // step_once's chained form (see the top of this file): whether it applies now, and the chain.
  bool can_chain();
  void decode_chained();
  // How a request ends (finish()'s reason and stop token).
  struct Ending {
    FinishReason reason = FinishReason::kStop;
    int32_t stop_token = -1;
  };
  // After `token` was sampled for `active` (its input of the step appended): hands the token to
  // the request's stream unless it is a stop token. Returns how the request ends if the token
  // ends it (a stop token, the length limit), for the caller to finish() it.
  std::optional<Ending> take_token(Active& active, SampledToken token);
  // Whether a chain must end for the engine thread to do something else (see the top).
  bool chain_must_yield(Active& active);
  // Whether a queued request waits for a running slot that is free.
  bool admission_waits();
  void finish(Active& active, FinishReason reason, int32_t stop_token, std::optional<Error> error);
  // Refreshes stats_, then hands out the finish events collected by finish(): a client that
  // sees its request finished also sees it gone from the stats.
  void publish_and_deliver();

  engine::Engine& engine_;
  SchedulerOptions options_;
  std::shared_ptr<WakeSignal> wake_;

  mutable std::mutex queue_mutex_;
  std::deque<Pending> queue_;  // guarded by queue_mutex_
  bool stopping_ = false;      // guarded by queue_mutex_

  // Engine thread only.
  std::vector<std::unique_ptr<Active>> running_;
  std::deque<CachedSequence> prefix_cache_;      // most recently finished at the back
  std::vector<engine::LogitSummary> summaries_;  // per input of a step
  std::vector<float> full_logits_;               // the rows of inputs whose sampler needs them
  std::vector<std::pair<std::shared_ptr<RequestStream>, GenerationEvent>> finished_;

  mutable std::mutex stats_mutex_;
  SchedulerStats stats_;  // guarded by stats_mutex_, refreshed by the engine thread

  std::thread thread_;
};

}  // namespace gemma4::runtime
