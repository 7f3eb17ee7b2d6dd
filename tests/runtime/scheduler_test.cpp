#include "runtime/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "runtime/sampler.h"
#include "runtime/scripted_engine.h"

namespace gemma4::runtime {
namespace {

using namespace std::chrono_literals;

constexpr int32_t kVocab = 64;
constexpr int32_t kEnd = 1;

// Greedy choice, so the scripted engine's replies come back exactly. It asks the engine for
// its one best candidate, as runtime::Sampler does for greedy requests.
class GreedySampler final : public TokenSampler {
 public:
  SampledToken sample(std::span<float> logits) override {
    auto best = std::max_element(logits.begin(), logits.end());
    return {static_cast<int32_t>(best - logits.begin()), 0.0f, {}};
  }
  engine::LogitRequest logit_request(int32_t) override { return {1, {}}; }
  SampledToken sample(const engine::LogitSummary& summary) override {
    return {summary.top.front().first, 0.0f, {}};
  }
};

// Records every step() call of the engine it wraps, and counts decode_greedy chains (run as the
// default's host-fed steps, which step() records).
class RecordingEngine final : public engine::Engine {
 public:
  explicit RecordingEngine(engine::Engine& inner) : inner_(inner) {}
  int32_t vocab_size() const override { return inner_.vocab_size(); }
  int64_t max_context() const override { return inner_.max_context(); }
  int32_t max_sequences() const override { return inner_.max_sequences(); }
  Expected<engine::SequenceId> open_sequence() override { return inner_.open_sequence(); }
  void close_sequence(engine::SequenceId s) override { inner_.close_sequence(s); }
  int64_t sequence_length(engine::SequenceId s) const override { return inner_.sequence_length(s); }
  Status truncate_sequence(engine::SequenceId s, int64_t length) override {
    std::lock_guard lock(mutex_);
    truncations.push_back(length);
    if (fail_truncate) return make_error(ErrorCode::kOutOfRange, "ring overwritten");
    return inner_.truncate_sequence(s, length);
  }
  Status step(std::span<const engine::StepInput> inputs, std::span<float> logits) override {
    {
      std::lock_guard lock(mutex_);
      std::vector<size_t> sizes;
      for (const auto& input : inputs) sizes.push_back(input.tokens.size());
      steps.push_back(sizes);
    }
    return inner_.step(inputs, logits);
  }
  Status decode_greedy(std::span<const engine::SequenceId> sequences,
                       std::span<const int32_t> first_tokens,
                       const engine::GreedyTokenCallback& on_token) override {
    {
      std::lock_guard lock(mutex_);
      ++chains;
    }
    return engine::greedy_decode_by_steps(*this, sequences, first_tokens, on_token);
  }

  std::mutex mutex_;
  std::vector<std::vector<size_t>> steps;  // token count of each input, per step
  std::vector<int64_t> truncations;
  int chains = 0;
  bool fail_truncate = false;

 private:
  engine::Engine& inner_;
};

struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  GenerationEvent finish;
};

Outcome drain(RequestStream& stream) {
  Outcome outcome;
  while (auto event = stream.next(5s)) {
    if (event->kind == GenerationEvent::Kind::kToken) {
      outcome.tokens.push_back(event->token.id);
      outcome.logprobs.push_back(event->token.logprob);
    } else {
      outcome.finish = std::move(*event);
      return outcome;
    }
  }
  ADD_FAILURE() << "no finish event within 5 s";
  return outcome;
}

GenerationRequest make_request(std::vector<int32_t> prompt, int64_t max_new_tokens = 100) {
  GenerationRequest request;
  request.prompt = std::move(prompt);
  request.max_new_tokens = max_new_tokens;
  request.stop_tokens = {kEnd};
  request.sampler = std::make_unique<GreedySampler>();
  return request;
}

ScriptedEngineOptions engine_options(int32_t sequences = 4, std::chrono::milliseconds delay = 0ms) {
  ScriptedEngineOptions options;
  options.vocab_size = kVocab;
  options.max_context = 256;
  options.max_sequences = sequences;
  options.end_token = kEnd;
  options.step_delay = delay;
  return options;
}

std::vector<ScriptedReply> scripts() {
  return {{{}, {10, 11, 12}}, {{40, 41}, {20, 21, 22, 23}}};
}

TEST(Scheduler, ReplaysScriptAndStopsAtStopToken) {
  ScriptedEngine engine(engine_options(), scripts());
  Scheduler scheduler(engine, {});
  auto stream = scheduler.submit(make_request({2, 5, 6}));
  ASSERT_TRUE(stream.ok()) << stream.error().to_string();
  Outcome outcome = drain(**stream);
  EXPECT_EQ(outcome.tokens, (std::vector<int32_t>{10, 11, 12}));
  EXPECT_EQ(outcome.finish.reason, FinishReason::kStop);
  EXPECT_EQ(outcome.finish.stop_token, kEnd);
  EXPECT_EQ(outcome.finish.metrics.prompt_tokens, 3);
  EXPECT_EQ(outcome.finish.metrics.completion_tokens, 3);
  EXPECT_EQ(outcome.finish.metrics.cached_tokens, 0);
}

TEST(Scheduler, TriggerChoosesScriptAndMaxTokensGivesLength) {
  ScriptedEngine engine(engine_options(), scripts());
  Scheduler scheduler(engine, {});
  auto stream = scheduler.submit(make_request({2, 40, 41, 7}, 2));
  ASSERT_TRUE(stream.ok());
  Outcome outcome = drain(**stream);
  EXPECT_EQ(outcome.tokens, (std::vector<int32_t>{20, 21}));
  EXPECT_EQ(outcome.finish.reason, FinishReason::kLength);
}

TEST(Scheduler, BatchesDecodesOfConcurrentRequestsInOneStep) {
  ScriptedEngine scripted(engine_options(4, 5ms), scripts());
  RecordingEngine engine(scripted);
  SchedulerOptions options;
  options.max_running = 4;
  Scheduler scheduler(engine, options);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 4; ++i) {
    auto stream = scheduler.submit(make_request({2, 40, 41, static_cast<int32_t>(50 + i)}));
    ASSERT_TRUE(stream.ok());
    streams.push_back(*stream);
  }
  for (auto& stream : streams) {
    EXPECT_EQ(drain(*stream).tokens, (std::vector<int32_t>{20, 21, 22, 23}));
  }
  std::lock_guard lock(engine.mutex_);
  const size_t widest =
      std::max_element(engine.steps.begin(), engine.steps.end(), [](auto& a, auto& b) {
        return a.size() < b.size();
      })->size();
  EXPECT_GE(widest, 2u) << "concurrent requests were never batched together";
  EXPECT_LT(engine.steps.size(), 4u * 5u) << "requests ran one after another";
}

TEST(Scheduler, LongPromptIsChunkedAndInterleavedWithDecodes) {
  ScriptedEngine scripted(engine_options(4, 2ms), {{{}, std::vector<int32_t>(30, 9)}});
  RecordingEngine engine(scripted);
  SchedulerOptions options;
  options.prefill_chunk = 16;
  options.step_token_budget = 17;
  Scheduler scheduler(engine, options);
  auto first = scheduler.submit(make_request({2, 3}, 30));
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->next(5s).has_value());  // first request is decoding
  auto second = scheduler.submit(make_request(std::vector<int32_t>(100, 7), 1));
  ASSERT_TRUE(second.ok());
  drain(**second);
  drain(**first);
  std::lock_guard lock(engine.mutex_);
  bool mixed_step = false;
  for (const auto& sizes : engine.steps) {
    for (size_t size : sizes) EXPECT_LE(size, 16u);
    mixed_step |= sizes.size() == 2 && std::count(sizes.begin(), sizes.end(), 1u) == 1 &&
                  std::max(sizes[0], sizes[1]) > 1;
  }
  EXPECT_TRUE(mixed_step) << "no step held both a decode token and a prefill chunk";
}

TEST(Scheduler, QueueFullIsRefused) {
  ScriptedEngine engine(engine_options(1, 20ms), {{{}, std::vector<int32_t>(50, 9)}});
  SchedulerOptions options;
  options.max_running = 1;
  options.max_queued = 2;
  Scheduler scheduler(engine, options);
  std::vector<std::shared_ptr<RequestStream>> streams;
  auto running = scheduler.submit(make_request({2, 3}));
  ASSERT_TRUE(running.ok());
  ASSERT_TRUE((*running)->next(5s).has_value());  // admitted: the queue is empty again
  for (int i = 0; i < 2; ++i) {
    auto queued = scheduler.submit(make_request({2, 3}));
    ASSERT_TRUE(queued.ok());
    streams.push_back(*queued);
  }
  auto refused = scheduler.submit(make_request({2, 3}));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kResourceExhausted);
  EXPECT_EQ(scheduler.stats().queued, 2);
  (*running)->cancel();
  for (auto& stream : streams) stream->cancel();
}

TEST(Scheduler, CancelClosesSequenceAtOnce) {
  ScriptedEngine engine(engine_options(2, 5ms), {{{}, std::vector<int32_t>(200, 9)}});
  Scheduler scheduler(engine, {});
  auto stream = scheduler.submit(make_request({2, 3}, 200));
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->next(5s).has_value());
  EXPECT_EQ(engine.open_sequences(), 1);
  (*stream)->cancel();
  Outcome outcome = drain(**stream);
  EXPECT_EQ(outcome.finish.reason, FinishReason::kCancelled);
  EXPECT_EQ(engine.open_sequences(), 0) << "a cancelled sequence must not be kept for reuse";
  EXPECT_EQ(scheduler.stats().running, 0);
}

TEST(Scheduler, DeadlineEndsRunningAndQueuedRequests) {
  ScriptedEngine engine(engine_options(1, 5ms), {{{}, std::vector<int32_t>(200, 9)}});
  SchedulerOptions options;
  options.max_running = 1;
  Scheduler scheduler(engine, options);
  auto running_request = make_request({2, 3}, 200);
  running_request.deadline = Clock::now() + 50ms;
  auto queued_request = make_request({2, 4}, 200);
  queued_request.deadline = Clock::now() + 20ms;
  auto running = scheduler.submit(std::move(running_request));
  auto queued = scheduler.submit(std::move(queued_request));
  ASSERT_TRUE(running.ok() && queued.ok());
  EXPECT_EQ(drain(**queued).finish.reason, FinishReason::kDeadline);
  Outcome outcome = drain(**running);
  EXPECT_EQ(outcome.finish.reason, FinishReason::kDeadline);
  EXPECT_GT(outcome.tokens.size(), 0u);
  EXPECT_LT(outcome.tokens.size(), 200u);
  EXPECT_EQ(engine.open_sequences(), 0);
}

TEST(Scheduler, PromptThatFillsContextIsRefused) {
  ScriptedEngine engine(engine_options(), scripts());
  Scheduler scheduler(engine, {});
  auto refused = scheduler.submit(make_request(std::vector<int32_t>(256, 3)));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kOutOfRange);
  EXPECT_NE(refused.error().message.find("maximum context length is 256 tokens"),
            std::string::npos);
  EXPECT_FALSE(scheduler.submit(make_request({})).ok());
}

TEST(Scheduler, OutputIsClippedToContext) {
  ScriptedEngine engine(engine_options(), {{{}, std::vector<int32_t>(300, 9)}});
  Scheduler scheduler(engine, {});
  auto stream = scheduler.submit(make_request(std::vector<int32_t>(250, 3), 1000));
  ASSERT_TRUE(stream.ok());
  Outcome outcome = drain(**stream);
  EXPECT_EQ(outcome.tokens.size(), 6u);
  EXPECT_EQ(outcome.finish.reason, FinishReason::kLength);
}

TEST(Scheduler, SecondTurnReusesPrefixOfFirst) {
  ScriptedEngine scripted(engine_options(), scripts());
  RecordingEngine engine(scripted);
  Scheduler scheduler(engine, {});
  std::vector<int32_t> turn1 = {2, 5, 6, 7, 8};
  auto first = scheduler.submit(make_request(turn1));
  ASSERT_TRUE(first.ok());
  Outcome one = drain(**first);
  ASSERT_EQ(one.tokens, (std::vector<int32_t>{10, 11, 12}));
  // Turn 2 = turn 1 + the reply + a new user message.
  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), {10, 11, 12, 30, 31});
  auto second = scheduler.submit(make_request(turn2));
  ASSERT_TRUE(second.ok());
  Outcome two = drain(**second);
  EXPECT_EQ(two.tokens, (std::vector<int32_t>{10, 11, 12}));
  // KV held turn 1 + the whole reply (only the stop token is never appended).
  EXPECT_EQ(two.finish.metrics.cached_tokens, 8);
  EXPECT_EQ(two.finish.metrics.prompt_tokens, 10);
  std::lock_guard lock(engine.mutex_);
  EXPECT_EQ(engine.truncations, (std::vector<int64_t>{8}));
}

TEST(Scheduler, FailedTruncateFallsBackToFullPrefill) {
  ScriptedEngine scripted(engine_options(), scripts());
  RecordingEngine engine(scripted);
  engine.fail_truncate = true;
  Scheduler scheduler(engine, {});
  auto first = scheduler.submit(make_request({2, 5, 6, 7}));
  ASSERT_TRUE(first.ok());
  drain(**first);
  auto second = scheduler.submit(make_request({2, 5, 6, 9, 9}));
  ASSERT_TRUE(second.ok());
  Outcome two = drain(**second);
  EXPECT_EQ(two.tokens, (std::vector<int32_t>{10, 11, 12}));
  EXPECT_EQ(two.finish.metrics.cached_tokens, 0);
  EXPECT_EQ(scripted.open_sequences(), 1);
}

TEST(Scheduler, FullKvEvictsCachedPrefixes) {
  ScriptedEngine engine(engine_options(2), scripts());
  SchedulerOptions options;
  options.max_running = 2;
  Scheduler scheduler(engine, options);
  for (int32_t i = 0; i < 6; ++i) {
    auto stream = scheduler.submit(make_request({static_cast<int32_t>(20 + i), 3}));
    ASSERT_TRUE(stream.ok());
    EXPECT_EQ(drain(**stream).tokens.size(), 3u);
  }
  EXPECT_LE(engine.open_sequences(), 2);
}

TEST(Scheduler, EngineErrorFailsOnlyTheRequestAndKeepsServing) {
  ScriptedEngine engine(engine_options(), {{{}, {10, 63, 99}}});  // 99 is outside the vocabulary
  Scheduler scheduler(engine, {});
  auto stream = scheduler.submit(make_request({2, 3}));
  ASSERT_TRUE(stream.ok());
  Outcome outcome = drain(**stream);
  EXPECT_EQ(outcome.finish.reason, FinishReason::kError);
  ASSERT_TRUE(outcome.finish.error.has_value());
  auto next = scheduler.submit(make_request({4, 5}));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(drain(**next).finish.reason, FinishReason::kError);  // same script, same failure
  EXPECT_EQ(engine.open_sequences(), 0);
}

// A request whose sampler needs only the best token decodes in a chain (Engine::decode_greedy):
// the same tokens and one step per token, as the one-step-per-iteration path gives.
TEST(Scheduler, GreedyDecodesChainOnTheEngine) {
  ScriptedEngine scripted(engine_options(), {{{}, std::vector<int32_t>(20, 9)}});
  RecordingEngine engine(scripted);
  Scheduler scheduler(engine, {});
  auto stream = scheduler.submit(make_request({2, 3}));
  ASSERT_TRUE(stream.ok());
  const Outcome outcome = drain(**stream);
  EXPECT_EQ(outcome.tokens, std::vector<int32_t>(20, 9));
  EXPECT_EQ(outcome.finish.reason, FinishReason::kStop);
  EXPECT_EQ(outcome.finish.metrics.completion_tokens, 20);
  std::lock_guard lock(engine.mutex_);
  EXPECT_EQ(engine.chains, 1);
  // The prompt's step, then one per token after the first and one for the stop token.
  EXPECT_EQ(engine.steps.size(), 21u);
}

// runtime::Sampler's greedy requests: chained without log-prob alternatives (one candidate), not
// chained with two; the tokens and their log-probs are the same either way.
TEST(Scheduler, ChainedTokensCarryTheLogProbsOfSteppedOnes) {
  ScriptedEngine scripted(engine_options(), scripts());
  RecordingEngine engine(scripted);
  Scheduler scheduler(engine, {});
  const auto run = [&](int top_logprobs) {
    GenerationRequest request = make_request({2, 40, 41, 7});
    SamplingParams params;
    params.temperature = 0.0f;
    params.top_logprobs = top_logprobs;
    request.sampler = std::make_unique<Sampler>(params, request.prompt);
    auto stream = scheduler.submit(std::move(request));
    EXPECT_TRUE(stream.ok());
    const Outcome outcome = drain(**stream);
    std::lock_guard lock(engine.mutex_);
    return std::pair(outcome, engine.chains);
  };
  const auto [chained, chains_after_first] = run(0);
  const auto [stepped, chains_after_second] = run(2);
  EXPECT_EQ(chains_after_first, 1);
  EXPECT_EQ(chains_after_second, 1) << "two candidates do not chain";
  EXPECT_EQ(chained.tokens, (std::vector<int32_t>{20, 21, 22, 23}));
  EXPECT_EQ(stepped.tokens, chained.tokens);
  EXPECT_EQ(stepped.logprobs, chained.logprobs);
}

// A request that ends inside a chain is finished at once (its finish event out, the stats without
// it) while the other goes on.
TEST(Scheduler, ARequestEndingInAChainFinishesAtOnce) {
  ScriptedEngine scripted(engine_options(4, 5ms),
                          {{{40}, {10, 11}}, {{}, std::vector<int32_t>(30, 9)}});
  RecordingEngine engine(scripted);
  Scheduler scheduler(engine, {});
  auto short_stream = scheduler.submit(make_request({2, 40}));
  auto long_stream = scheduler.submit(make_request({2, 3}));
  ASSERT_TRUE(short_stream.ok() && long_stream.ok());
  const Outcome short_outcome = drain(**short_stream);
  EXPECT_EQ(short_outcome.tokens, (std::vector<int32_t>{10, 11}));
  EXPECT_EQ(short_outcome.finish.reason, FinishReason::kStop);
  EXPECT_EQ(scheduler.stats().running, 1) << "the long request still runs (~28 steps of 5 ms)";
  EXPECT_EQ(drain(**long_stream).tokens, std::vector<int32_t>(30, 9));
  std::lock_guard lock(engine.mutex_);
  EXPECT_GE(engine.chains, 1);
}

// A request submitted while a chain runs ends the chain (a free slot waits) and is served while
// the chained request goes on.
TEST(Scheduler, ASubmissionEndsTheChainForItsAdmission) {
  ScriptedEngine scripted(engine_options(4, 5ms),
                          {{{40}, {10, 11}}, {{}, std::vector<int32_t>(100, 9)}});
  RecordingEngine engine(scripted);
  Scheduler scheduler(engine, {});
  auto long_stream = scheduler.submit(make_request({2, 3}, 200));
  ASSERT_TRUE(long_stream.ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*long_stream)->next(5s).has_value());
  auto short_stream = scheduler.submit(make_request({2, 40}));
  ASSERT_TRUE(short_stream.ok());
  EXPECT_EQ(drain(**short_stream).tokens, (std::vector<int32_t>{10, 11}));
  EXPECT_EQ(scheduler.stats().running, 1) << "the long request still runs (~90 steps of 5 ms)";
  const Outcome rest = drain(**long_stream);
  EXPECT_EQ(rest.tokens, std::vector<int32_t>(95, 9));
  EXPECT_EQ(rest.finish.reason, FinishReason::kStop);
  std::lock_guard lock(engine.mutex_);
  EXPECT_GE(engine.chains, 2) << "one chain before the submission, one after";
}

}  // namespace
}  // namespace gemma4::runtime
