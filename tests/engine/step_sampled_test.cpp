// Engine::step_sampled on the CPU engine: per input either the full row (packed) or the summary
// of its row after its edits, equal to step()'s rows summarised on the host; and bad requests fail
// cleanly.
#include <gtest/gtest.h>

#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/gemma4_engine.h"
#include "synth_support.h"

namespace gemma4::engine {
namespace {

std::unique_ptr<Gemma4Engine> make_engine(int max_pass_tokens = 512) {
  const auto& m = testing::tiny_bf16_model("tiny");
  EngineOptions options;
  options.max_sequences = 3;
  options.max_context = 64;
  options.max_pass_tokens = max_pass_tokens;
  auto engine = Gemma4Engine::create(m.config, m.weights,
                                     std::make_unique<backend::cpu::CpuBackend>(), options);
  EXPECT_TRUE(engine.ok());
  return std::move(*engine);
}

void expect_equal(const LogitSummary& got, const LogitSummary& want) {
  EXPECT_EQ(got.max_logit, want.max_logit);
  EXPECT_EQ(got.log_normaliser, want.log_normaliser);
  EXPECT_EQ(got.top, want.top);
}

// Three sequences fed the same tokens through step() and step_sampled(): a summary with edits,
// a full row and a greedy summary, in passes of 8 rows (the 12-token prompt spans two).
TEST(StepSampled, SummariesAndFullRowsEqualStepThenHostSummary) {
  const std::vector<int32_t> prompts[3] = {testing::prompt_ids(12, 1), testing::prompt_ids(5, 2),
                                           testing::prompt_ids(3, 3)};
  const std::vector<LogitEdit> edits = {{4, 1.5f, 1.0f, 0.0f}, {9, 0.0f, 1.3f, 0.25f}};
  auto plain = make_engine(8), sampled = make_engine(8);
  const int32_t vocab = plain->vocab_size();
  std::vector<StepInput> plain_inputs, sampled_inputs;
  for (const auto& prompt : prompts) {
    plain_inputs.push_back({*plain->open_sequence(), prompt});
    sampled_inputs.push_back({*sampled->open_sequence(), prompt});
  }
  const std::vector<LogitRequest> requests = {{5, edits}, {0, {}}, {1, {}}};
  for (int step = 0; step < 3; ++step) {
    std::vector<float> logits(3 * static_cast<size_t>(vocab));
    ASSERT_TRUE(plain->step(plain_inputs, logits).ok());
    std::vector<LogitSummary> summaries(3);
    std::vector<float> full(vocab);
    ASSERT_TRUE(sampled->step_sampled(sampled_inputs, requests, summaries, full).ok());
    for (size_t i : {0u, 2u}) {
      LogitSummary want;
      summarize_logits(std::span(logits).subspan(i * vocab, vocab), requests[i].edits,
                       requests[i].candidates, want);
      expect_equal(summaries[i], want);
    }
    EXPECT_EQ(full, std::vector<float>(logits.begin() + vocab, logits.begin() + 2 * vocab));
    static const int32_t next[3] = {7, 8, 9};  // one decode token each from now on
    for (size_t i = 0; i < 3; ++i) {
      plain_inputs[i].tokens = sampled_inputs[i].tokens = std::span(&next[i], 1);
    }
  }
}

TEST(StepSampled, RejectsBadRequests) {
  auto engine = make_engine();
  const auto prompt = testing::prompt_ids(3, 1);
  const StepInput input{*engine->open_sequence(), prompt};
  std::vector<LogitSummary> summaries(1);
  const auto rejected = [&](LogitRequest request) {
    const Status status = engine->step_sampled({&input, 1}, {&request, 1}, summaries, {});
    return !status.ok() && status.error().code == ErrorCode::kInvalidArgument;
  };
  EXPECT_TRUE(rejected({kMaxLogitCandidates + 1, {}}));
  EXPECT_TRUE(rejected({0, {}}));  // no room for the full row
  const LogitEdit outside{engine->vocab_size(), 1.0f, 1.0f, 0.0f};
  EXPECT_TRUE(rejected({1, std::span(&outside, 1)}));
  EXPECT_EQ(engine->sequence_length(input.sequence), 0);  // nothing ran
  const LogitRequest greedy{1, {}};
  EXPECT_TRUE(engine->step_sampled({&input, 1}, {&greedy, 1}, summaries, {}).ok());
  EXPECT_EQ(summaries[0].top.size(), 1u);
}

}  // namespace
}  // namespace gemma4::engine
