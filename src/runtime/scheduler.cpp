#include "runtime/scheduler.h"

#include <algorithm>
#include <cstdint>
#include <exception>

namespace gemma4::runtime {

namespace {

double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

int64_t common_prefix_length(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  auto [end_a, end_b] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return end_a - a.begin();
}

}  // namespace

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kDeadline:
      return "deadline";
    case FinishReason::kError:
      return "error";
  }
  return "error";
}

void WakeSignal::notify() {
  {
    std::lock_guard lock(mutex);
    pending = true;
  }
  cv.notify_one();
}

std::optional<GenerationEvent> RequestStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  GenerationEvent event = std::move(events_.front());
  events_.pop_front();
  return event;
}

void RequestStream::cancel() {
  if (!cancelled_.exchange(true)) wake_->notify();
}

void RequestStream::push(GenerationEvent event) {
  {
    std::lock_guard lock(mutex_);
    events_.push_back(std::move(event));
  }
  cv_.notify_all();
}

// A request that holds an open sequence.
struct Scheduler::Active {
  Pending pending;
  engine::SequenceId sequence = -1;
  std::vector<int32_t> kv_tokens;  // tokens appended to the sequence so far
  size_t prompt_done = 0;          // prompt tokens already in KV
  int64_t max_new_tokens = 0;      // after clipping to the context
  int32_t next_token = -1;         // sampled, not yet appended (decode phase)
  RequestMetrics metrics;
  Clock::time_point admitted;
  Clock::time_point first_token;

  bool decoding() const { return prompt_done == pending.request.prompt.size(); }
};

Scheduler::Scheduler(engine::Engine& engine, SchedulerOptions options)
    : engine_(engine), options_(options), wake_(std::make_shared<WakeSignal>()) {
  options_.max_running = std::clamp(options_.max_running, 1, engine_.max_sequences());
  options_.max_queued = std::max(options_.max_queued, 0);
  options_.prefill_chunk = std::max(options_.prefill_chunk, 1);
  options_.step_token_budget = std::max(options_.step_token_budget, options_.max_running);
  options_.prefix_cache_entries = std::max(options_.prefix_cache_entries, 0);
  stats_.max_running = options_.max_running;
  stats_.max_sequences = engine_.max_sequences();
  stats_.max_context = engine_.max_context();
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard lock(queue_mutex_);
    stopping_ = true;
  }
  wake_->notify();
  thread_.join();
}

Expected<std::shared_ptr<RequestStream>> Scheduler::submit(GenerationRequest request) {
  if (request.prompt.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "the prompt is empty");
  }
  if (!request.sampler) return make_error(ErrorCode::kInvalidArgument, "no sampler given");
  const int64_t context = engine_.max_context();
  if (static_cast<int64_t>(request.prompt.size()) >= context) {
    return make_error(ErrorCode::kOutOfRange,
                      "This model's maximum context length is {} tokens. However, your prompt "
                      "has {} tokens, which leaves no room for output.",
                      context, request.prompt.size());
  }
  auto stream = std::make_shared<RequestStream>(wake_);
  {
    std::lock_guard lock(queue_mutex_);
    if (stopping_) return make_error(ErrorCode::kCancelled, "the server is shutting down");
    if (static_cast<int32_t>(queue_.size()) >= options_.max_queued) {
      return make_error(ErrorCode::kResourceExhausted,
                        "the request queue is full ({} waiting); retry shortly", queue_.size());
    }
    queue_.push_back(Pending{std::move(request), stream, Clock::now()});
  }
  wake_->notify();
  return stream;
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard lock(stats_mutex_);
  SchedulerStats copy = stats_;
  std::lock_guard queue_lock(queue_mutex_);
  copy.queued = static_cast<int32_t>(queue_.size());
  return copy;
}

void Scheduler::run() {
  while (true) {
    {
      std::lock_guard lock(queue_mutex_);
      if (stopping_) break;
    }
    try {
      drop_cancelled_and_expired();
      admit_pending();
      publish_and_deliver();
      if (!running_.empty()) {
        step_once();
        publish_and_deliver();
        continue;
      }
    } catch (const std::exception& e) {
      // Nothing below throws on purpose; this keeps the server alive on e.g. bad_alloc.
      for (auto& active : running_) {
        finish(*active, FinishReason::kError, -1,
               make_error(ErrorCode::kInternal, "engine loop failed: {}", e.what()));
      }
      running_.clear();
      publish_and_deliver();
      continue;
    }
    std::unique_lock lock(wake_->mutex);
    wake_->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return wake_->pending; });
    wake_->pending = false;
  }
  for (auto& active : running_) finish(*active, FinishReason::kCancelled, -1, std::nullopt);
  running_.clear();
  for (auto& cached : prefix_cache_) engine_.close_sequence(cached.sequence);
  prefix_cache_.clear();
  publish_and_deliver();
  std::lock_guard lock(queue_mutex_);
  for (auto& pending : queue_) {
    GenerationEvent event;
    event.kind = GenerationEvent::Kind::kFinished;
    event.reason = FinishReason::kCancelled;
    pending.stream->push(std::move(event));
  }
  queue_.clear();
}

void Scheduler::drop_cancelled_and_expired() {
  const auto now = Clock::now();
  auto expired = [&](const GenerationRequest& request) {
    return request.deadline && now >= *request.deadline;
  };
  std::erase_if(running_, [&](const std::unique_ptr<Active>& active) {
    if (active->pending.stream->cancelled()) {
      finish(*active, FinishReason::kCancelled, -1, std::nullopt);
      return true;
    }
    if (expired(active->pending.request)) {
      finish(*active, FinishReason::kDeadline, -1, std::nullopt);
      return true;
    }
    return false;
  });
  std::lock_guard lock(queue_mutex_);
  std::erase_if(queue_, [&](Pending& pending) {
    const bool cancelled = pending.stream->cancelled();
    if (!cancelled && !expired(pending.request)) return false;
    GenerationEvent event;
    event.kind = GenerationEvent::Kind::kFinished;
    event.reason = cancelled ? FinishReason::kCancelled : FinishReason::kDeadline;
    event.metrics.prompt_tokens = static_cast<int64_t>(pending.request.prompt.size());
    event.metrics.queue_ms = ms_between(pending.submitted, now);
    pending.stream->push(std::move(event));
    return true;
  });
}

void Scheduler::admit_pending() {
  while (static_cast<int32_t>(running_.size()) < options_.max_running) {
    Pending pending;
    {
      std::lock_guard lock(queue_mutex_);
      if (queue_.empty()) return;
      pending = std::move(queue_.front());
      queue_.pop_front();
    }
    if (!start(std::move(pending))) return;
  }
}

Expected<engine::SequenceId> Scheduler::open_sequence() {
  while (true) {
    auto sequence = engine_.open_sequence();
    if (sequence.ok() || prefix_cache_.empty()) return sequence;
    // KV is full: give up the least recently used cached prefix and try again.
    engine_.close_sequence(prefix_cache_.front().sequence);
    prefix_cache_.pop_front();
  }
}

bool Scheduler::start(Pending pending) {
  auto active = std::make_unique<Active>();
  active->admitted = Clock::now();
  const auto& prompt = pending.request.prompt;

  // Prefix reuse: the cached sequence sharing the longest prefix with this prompt. At least one
  // prompt token is always prefilled, because its logits choose the first output token.
  auto best = prefix_cache_.end();
  int64_t best_length = 0;
  for (auto it = prefix_cache_.begin(); it != prefix_cache_.end(); ++it) {
    const int64_t length =
        std::min(common_prefix_length(it->tokens, prompt), static_cast<int64_t>(prompt.size()) - 1);
    if (length > best_length) {
      best = it;
      best_length = length;
    }
  }
  if (best != prefix_cache_.end()) {
    CachedSequence cached = std::move(*best);
    prefix_cache_.erase(best);
    if (engine_.truncate_sequence(cached.sequence, best_length).ok()) {
      active->sequence = cached.sequence;
      active->kv_tokens.assign(prompt.begin(), prompt.begin() + best_length);
      active->prompt_done = static_cast<size_t>(best_length);
    } else {
      engine_.close_sequence(cached.sequence);  // its KV for that point is gone: re-prefill
    }
  }
  if (active->sequence < 0) {
    auto sequence = open_sequence();
    if (!sequence.ok()) {
      if (running_.empty()) {
        // Nothing will free capacity: this request cannot run at all.
        GenerationEvent event;
        event.kind = GenerationEvent::Kind::kFinished;
        event.reason = FinishReason::kError;
        event.error = sequence.error();
        pending.stream->push(std::move(event));
        return true;
      }
      // Wait for a running request to finish, keeping this one first in line.
      std::lock_guard lock(queue_mutex_);
      queue_.push_front(std::move(pending));
      return false;
    }
    active->sequence = *sequence;
  }

  active->metrics.prompt_tokens = static_cast<int64_t>(prompt.size());
  active->metrics.cached_tokens = static_cast<int64_t>(active->prompt_done);
  active->metrics.queue_ms = ms_between(pending.submitted, active->admitted);
  active->max_new_tokens = std::min(pending.request.max_new_tokens,
                                    engine_.max_context() - static_cast<int64_t>(prompt.size()));
  active->pending = std::move(pending);
  if (active->max_new_tokens <= 0) {
    finish(*active, FinishReason::kLength, -1, std::nullopt);
    return true;
  }
  running_.push_back(std::move(active));
  return true;
}

void Scheduler::step_once() {
  if (can_chain()) {
    decode_chained();
    return;
  }
  std::vector<engine::StepInput> inputs;
  std::vector<Active*> owners;
  std::vector<bool> samples;  // whether input i ends its sequence's prompt (or is a decode)
  inputs.reserve(running_.size());
  int32_t budget = options_.step_token_budget;

  for (auto& active : running_) {
    if (!active->decoding()) continue;
    inputs.push_back({active->sequence, std::span<const int32_t>(&active->next_token, 1)});
    owners.push_back(active.get());
    samples.push_back(true);
    --budget;
  }
  for (auto& active : running_) {
    if (active->decoding()) continue;
    const auto& prompt = active->pending.request.prompt;
    const size_t remaining = prompt.size() - active->prompt_done;
    // The first prefill always gets room, so a full batch of decodes never starves prompts.
    const int32_t room = inputs.empty() || budget > 0 ? std::max(budget, 1) : 0;
    if (room == 0) break;
    const size_t chunk = std::min(
        {remaining, static_cast<size_t>(options_.prefill_chunk), static_cast<size_t>(room)});
    inputs.push_back(
        {active->sequence, std::span<const int32_t>(prompt.data() + active->prompt_done, chunk)});
    owners.push_back(active.get());
    samples.push_back(chunk == remaining);
    budget -= static_cast<int32_t>(chunk);
  }
  if (inputs.empty()) return;

  // Each sampler says what it needs of its row; a prompt chunk that samples nothing asks for
  // the cheapest summary.
  const size_t vocab = static_cast<size_t>(engine_.vocab_size());
  std::vector<engine::LogitRequest> requests(inputs.size(), engine::LogitRequest{1, {}});
  std::vector<size_t> full_row(inputs.size(), 0);  // index into full_logits_ of input i's row
  size_t full_rows = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!samples[i]) continue;
    requests[i] = owners[i]->pending.request.sampler->logit_request(engine_.vocab_size());
    if (requests[i].candidates == 0) full_row[i] = full_rows++;
  }
  summaries_.resize(inputs.size());
  full_logits_.resize(full_rows * vocab);
  const Status status = engine_.step_sampled(inputs, requests, summaries_, full_logits_);
  {
    std::lock_guard lock(stats_mutex_);
    ++stats_.steps;
  }
  if (!status.ok()) {
    for (Active* owner : owners) {
      finish(*owner, FinishReason::kError, -1, status.error().with_context("engine step failed"));
    }
    std::erase_if(running_, [&](const std::unique_ptr<Active>& active) {
      return std::find(owners.begin(), owners.end(), active.get()) != owners.end();
    });
    return;
  }

  std::vector<Active*> done;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Active& active = *owners[i];
    active.kv_tokens.insert(active.kv_tokens.end(), inputs[i].tokens.begin(),
                            inputs[i].tokens.end());
    if (!active.decoding()) active.prompt_done += inputs[i].tokens.size();
    if (!samples[i]) continue;

    TokenSampler& sampler = *active.pending.request.sampler;
    SampledToken token =
        requests[i].candidates == 0
            ? sampler.sample(std::span<float>(full_logits_).subspan(full_row[i] * vocab, vocab))
            : sampler.sample(summaries_[i]);
    if (const auto ending = take_token(active, std::move(token))) {
      finish(active, ending->reason, ending->stop_token, std::nullopt);
      done.push_back(&active);
    }
  }
  std::erase_if(running_, [&](const std::unique_ptr<Active>& active) {
    return std::find(done.begin(), done.end(), active.get()) != done.end();
  });
}

std::optional<Scheduler::Ending> Scheduler::take_token(Active& active, SampledToken token) {
  const auto now = Clock::now();
  if (active.metrics.completion_tokens == 0) active.first_token = now;
  const auto& stops = active.pending.request.stop_tokens;
  if (std::find(stops.begin(), stops.end(), token.id) != stops.end())
    return Ending{FinishReason::kStop, token.id};
  ++active.metrics.completion_tokens;
  active.next_token = token.id;
  GenerationEvent event;
  event.token = std::move(token);
  active.pending.stream->push(std::move(event));
  if (active.metrics.completion_tokens >= active.max_new_tokens)
    return Ending{FinishReason::kLength, -1};
  return std::nullopt;
}

namespace {

// Whether `sampler` picks its next token from the row's best one alone, unedited (what
// Engine::decode_greedy reports).
bool takes_greedy_token(TokenSampler& sampler, int32_t vocab_size) {
  const engine::LogitRequest request = sampler.logit_request(vocab_size);
  return request.candidates == 1 && request.edits.empty();
}

}  // namespace

bool Scheduler::admission_waits() {
  std::lock_guard lock(queue_mutex_);
  return !queue_.empty() && static_cast<int32_t>(running_.size()) < options_.max_running;
}

bool Scheduler::can_chain() {
  if (running_.empty() || admission_waits()) return false;
  return std::all_of(running_.begin(), running_.end(), [&](const std::unique_ptr<Active>& active) {
    return active->decoding() &&
           takes_greedy_token(*active->pending.request.sampler, engine_.vocab_size());
  });
}

bool Scheduler::chain_must_yield(Active& active) {
  const GenerationRequest& request = active.pending.request;
  if (active.pending.stream->cancelled()) return true;
  if (request.deadline && Clock::now() >= *request.deadline) return true;
  if (!takes_greedy_token(*request.sampler, engine_.vocab_size())) return true;
  return admission_waits();
}

void Scheduler::decode_chained() {
  std::vector<Active*> owners;
  std::vector<engine::SequenceId> sequences;
  std::vector<int32_t> first_tokens;
  for (auto& active : running_) {
    owners.push_back(active.get());
    sequences.push_back(active->sequence);
    first_tokens.push_back(active->next_token);
  }
  // Requests finished in the chain: out of running_ (so the stats no longer count them when
  // their finish event goes out), kept alive until the chain ends.
  std::vector<std::unique_ptr<Active>> finished;
  // Requests whose next step is their last (GreedyNext::kLast).
  std::vector<bool> last(owners.size(), false);
  // Once set, every request ends the chain at its next token (kept as its next_token: step_once
  // appends it), so the engine thread can do what the chain kept waiting.
  bool yield = false;
  size_t previous = SIZE_MAX;  // the last token's index: a step's first index is not above it
  const auto on_token = [&](size_t i, const engine::GreedyToken& greedy) {
    if (i <= previous) {
      std::lock_guard lock(stats_mutex_);
      ++stats_.steps;
    }
    previous = i;
    Active& active = *owners[i];
    active.kv_tokens.push_back(active.next_token);  // what this step appended
    // The summary step_sampled returns for the sampler's one-candidate request.
    engine::LogitSummary summary;
    summary.max_logit = greedy.logit;
    summary.log_normaliser = greedy.log_normaliser;
    summary.top = {{greedy.id, greedy.logit}};
    if (const auto ending = take_token(active, active.pending.request.sampler->sample(summary))) {
      finish(active, ending->reason, ending->stop_token, std::nullopt);
      const auto owned = std::find_if(running_.begin(), running_.end(), [&](const auto& running) {
        return running.get() == &active;
      });
      finished.push_back(std::move(*owned));
      running_.erase(owned);
      publish_and_deliver();
      yield = yield || admission_waits();  // its slot is free now
      return engine::GreedyNext::kStop;
    }
    if (last[i]) return engine::GreedyNext::kStop;  // the engine stops it here anyway
    yield = yield || chain_must_yield(active);
    // The next token is its last: the chain yields, or that token reaches the length limit.
    last[i] = yield || active.metrics.completion_tokens + 1 >= active.max_new_tokens;
    return last[i] ? engine::GreedyNext::kLast : engine::GreedyNext::kContinue;
  };
  const Status status = engine_.decode_greedy(sequences, first_tokens, on_token);
  if (status.ok()) return;
  std::erase_if(running_, [&](const std::unique_ptr<Active>& active) {
    if (std::find(owners.begin(), owners.end(), active.get()) == owners.end()) return false;
    finish(*active, FinishReason::kError, -1, status.error().with_context("engine step failed"));
    return true;
  });
}

void Scheduler::finish(Active& active, FinishReason reason, int32_t stop_token,
                       std::optional<Error> error) {
  const auto now = Clock::now();
  RequestMetrics& metrics = active.metrics;
  if (metrics.completion_tokens > 0 || reason == FinishReason::kStop) {
    if (metrics.completion_tokens == 0) active.first_token = now;
    metrics.prompt_ms = ms_between(active.admitted, active.first_token);
    metrics.decode_ms = ms_between(active.first_token, now);
  } else {
    metrics.prompt_ms = ms_between(active.admitted, now);
  }

  // Keep a cleanly finished sequence for prefix reuse; anything else frees its KV now.
  const bool reusable = (reason == FinishReason::kStop || reason == FinishReason::kLength) &&
                        options_.prefix_cache_entries > 0;
  if (reusable) {
    prefix_cache_.push_back({active.sequence, std::move(active.kv_tokens)});
    while (static_cast<int32_t>(prefix_cache_.size()) > options_.prefix_cache_entries) {
      engine_.close_sequence(prefix_cache_.front().sequence);
      prefix_cache_.pop_front();
    }
  } else {
    engine_.close_sequence(active.sequence);
  }
  active.sequence = -1;

  GenerationEvent event;
  event.kind = GenerationEvent::Kind::kFinished;
  event.reason = reason;
  event.stop_token = stop_token;
  event.error = std::move(error);
  event.metrics = metrics;
  finished_.emplace_back(active.pending.stream, std::move(event));
}

void Scheduler::publish_and_deliver() {
  int64_t kv_tokens = 0;
  for (const auto& active : running_) kv_tokens += static_cast<int64_t>(active->kv_tokens.size());
  for (const auto& cached : prefix_cache_) kv_tokens += static_cast<int64_t>(cached.tokens.size());
  std::unique_lock lock(stats_mutex_);
  stats_.running = static_cast<int32_t>(running_.size());
  stats_.cached_sequences = static_cast<int32_t>(prefix_cache_.size());
  stats_.kv_tokens = kv_tokens;
  lock.unlock();
  for (auto& [stream, event] : finished_) stream->push(std::move(event));
  finished_.clear();
}

}  // namespace gemma4::runtime
