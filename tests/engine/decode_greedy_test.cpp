// Engine::decode_greedy on the CPU engine (Backend::enqueue_greedy's default): the chained steps
// give the tokens, lengths and KV of the host-fed reference (greedy_decode_by_steps): sequences
// stopping at different steps (the step enqueued past a stop rolled back), a full context, a ring
// that wraps; bad arguments fail cleanly with nothing run.
#include <gtest/gtest.h>

#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/gemma4_engine.h"
#include "greedy_support.h"
#include "synth_support.h"

namespace gemma4::engine {
namespace {

std::unique_ptr<Gemma4Engine> make_engine(const std::string& preset, int64_t max_context) {
  const auto& m = testing::tiny_bf16_model(preset);
  EngineOptions options;
  options.max_sequences = 3;
  options.max_context = max_context;
  options.max_pass_tokens = 16;
  options.ring_history = 4;  // window 8: a ring of 12 slots, wrapped by these sequences
  auto engine = Gemma4Engine::create(m.config, m.weights,
                                     std::make_unique<backend::cpu::CpuBackend>(), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  return std::move(*engine);
}

class DecodeGreedy : public ::testing::TestWithParam<std::string> {};

TEST_P(DecodeGreedy, StopsAtDifferentStepsMatchTheHostFedSteps) {
  auto chained = make_engine(GetParam(), 48), reference = make_engine(GetParam(), 48);
  const std::vector<std::vector<int32_t>> prompts = {
      testing::prompt_ids(5, 1), testing::prompt_ids(3, 2), testing::prompt_ids(9, 3)};
  const std::vector<int32_t> first = {11, 12, 13};
  // Sequence 0 stops at its first token (the step enqueued after it already holds it), 2 after
  // 7 (announced: no step enqueued past it), 1 after 14 (alone for its last steps, in a new
  // chain).
  const std::vector<int> limits = {1, 14, 7};
  using testing::Ending;
  const std::vector<Ending> endings = {Ending::kUnforeseen, Ending::kUnforeseen,
                                       Ending::kAnnounced};
  std::vector<SequenceId> a, b;
  const auto got = testing::decode_with_stops(*chained, prompts, first, limits, endings, true, a);
  const auto want =
      testing::decode_with_stops(*reference, prompts, first, limits, endings, false, b);
  EXPECT_EQ(got, want);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(static_cast<int>(got[i].size()), limits[i]);
    // The prompt, the first token and every token but the stopping one.
    EXPECT_EQ(chained->sequence_length(a[i]), std::ssize(prompts[i]) + limits[i]);
    EXPECT_EQ(reference->sequence_length(b[i]), chained->sequence_length(a[i]));
  }
  // The KV the sequences hold is the same: the next step's logits agree bit for bit, and again
  // after rolling each back a few tokens.
  auto [after, expected] = testing::step_both(*chained, a, *reference, b, 17);
  EXPECT_EQ(after, expected);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t length = chained->sequence_length(a[i]) - 3;
    ASSERT_TRUE(chained->truncate_sequence(a[i], length).ok());
    ASSERT_TRUE(reference->truncate_sequence(b[i], length).ok());
  }
  std::tie(after, expected) = testing::step_both(*chained, a, *reference, b, 19);
  EXPECT_EQ(after, expected);
}

TEST_P(DecodeGreedy, AFullContextStopsASequence) {
  constexpr int64_t kContext = 24;
  auto chained = make_engine(GetParam(), kContext), reference = make_engine(GetParam(), kContext);
  const std::vector<std::vector<int32_t>> prompts = {testing::prompt_ids(14, 4),
                                                     testing::prompt_ids(6, 5)};
  const std::vector<int32_t> first = {21, 22};
  const std::vector<int> never = {1000, 1000};  // on_token always asks for more
  const std::vector<testing::Ending> endings(2, testing::Ending::kUnforeseen);
  std::vector<SequenceId> a, b;
  const auto got = testing::decode_with_stops(*chained, prompts, first, never, endings, true, a);
  const auto want =
      testing::decode_with_stops(*reference, prompts, first, never, endings, false, b);
  EXPECT_EQ(got, want);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(chained->sequence_length(a[i]), kContext);
    // Every step from the first token on reports one: the last fills the context.
    EXPECT_EQ(std::ssize(got[i]), kContext - std::ssize(prompts[i]));
  }
}

// The chain's bookkeeping is the same for every model; the CUDA tests run the MoE preset too.
INSTANTIATE_TEST_SUITE_P(Tiny, DecodeGreedy, ::testing::Values("tiny"), testing::preset_test_name);

TEST(DecodeGreedyArguments, AreCheckedBeforeAnythingRuns) {
  auto engine = make_engine("tiny", 32);
  const SequenceId open = *engine->open_sequence();
  const auto never_called = [](size_t, const GreedyToken&) {
    ADD_FAILURE() << "no step may run";
    return GreedyNext::kStop;
  };
  const auto rejected = [&](std::vector<SequenceId> sequences, std::vector<int32_t> first,
                            ErrorCode code) {
    const Status status = engine->decode_greedy(sequences, first, never_called);
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.error().code, code) << status.error().to_string();
  };
  rejected({open}, {1, 2}, ErrorCode::kInvalidArgument);        // a token per sequence
  rejected({open, open}, {1, 2}, ErrorCode::kInvalidArgument);  // twice in one step
  rejected({open + 1}, {1}, ErrorCode::kInvalidArgument);       // not open
  rejected({open}, {engine->vocab_size()}, ErrorCode::kInvalidArgument);
  EXPECT_EQ(engine->sequence_length(open), 0);
}

}  // namespace
}  // namespace gemma4::engine
