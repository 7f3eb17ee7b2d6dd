// Backend::time_replays on CUDA (`gemma4 bench --step-times`): every timed decode step replayed
// from a graph and ended by a synchronising read is counted once, with positive device times, and
// timing changes no logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "engine/gemma4_engine.h"
#include "model/weights.h"
#include "synth_support.h"

namespace gemma4::cuda {
namespace {

struct TimedEngine {
  const engine::Backend* backend = nullptr;
  std::unique_ptr<engine::Gemma4Engine> engine;
};

TimedEngine cuda_engine(const model::LoadedModel& m, bool record) {
  engine::EngineOptions options;
  options.max_sequences = 1;
  options.max_context = 64;
  options.record_decode = record;
  auto backend = make_cuda_backend();
  EXPECT_TRUE(backend.ok()) << backend.error().to_string();
  if (!backend.ok()) return {};
  TimedEngine out;
  out.backend = backend->get();
  auto engine = engine::Gemma4Engine::create(m.config, m.weights, std::move(*backend), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  if (engine.ok()) out.engine = std::move(*engine);
  return out;
}

// A prompt, then `decode_steps` steps (timed from step `timed_from` on), each step's full logits
// downloaded. Returns every step's logits.
std::vector<std::vector<float>> run(TimedEngine& e, int decode_steps, int timed_from) {
  auto sequence = e.engine->open_sequence();
  EXPECT_TRUE(sequence.ok());
  const int32_t vocab = e.engine->vocab_size();
  std::vector<std::vector<float>> all;
  std::vector<int32_t> tokens = {2, 1017, 4099};
  for (int step = 0; step <= decode_steps; ++step) {
    if (step == timed_from) e.backend->time_replays(true);
    std::vector<float> logits(vocab);
    EXPECT_TRUE(e.engine->step({{engine::StepInput{*sequence, tokens}}}, logits).ok());
    tokens = {
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin())};
    all.push_back(std::move(logits));
  }
  e.backend->time_replays(false);
  return all;
}

TEST(ReplayTimer, CountsEveryTimedReplayedStepOnce) {
  const model::LoadedModel& m = gemma4::testing::tiny_w4a16_model("tiny");
  TimedEngine timed = cuda_engine(m, true);
  TimedEngine untimed = cuda_engine(m, true);
  ASSERT_TRUE(timed.engine && untimed.engine);
  EXPECT_FALSE(timed.backend->replay_times().has_value()) << "nothing timed yet";
  // Decode steps 1 and 2 run unrecorded and record the graph; 3..8 replay it, all timed.
  const auto with_timing = run(timed, 8, 3);
  const auto without = run(untimed, 8, 99);
  for (size_t i = 0; i < without.size(); ++i) {
    EXPECT_EQ(
        std::memcmp(with_timing[i].data(), without[i].data(), sizeof(float) * without[i].size()), 0)
        << "step " << i;
  }
  const auto times = timed.backend->replay_times();
  ASSERT_TRUE(times.has_value());
  // The first timed replay has no timed read before it: 5 of the 6 count.
  EXPECT_EQ(times->replays, 5);
  EXPECT_GT(times->replay_us, 0.0);
  EXPECT_GT(times->tail_us, 0.0);
  EXPECT_GE(times->idle_us, 0.0);
}

TEST(ReplayTimer, UnrecordedStepsCountNothing) {
  const model::LoadedModel& m = gemma4::testing::tiny_w4a16_model("tiny");
  TimedEngine plain = cuda_engine(m, false);
  ASSERT_TRUE(plain.engine);
  run(plain, 4, 1);
  const auto times = plain.backend->replay_times();
  ASSERT_TRUE(times.has_value());
  EXPECT_EQ(times->replays, 0);
}

}  // namespace
}  // namespace gemma4::cuda
