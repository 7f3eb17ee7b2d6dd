// Engine mechanics on the tiny synthetic checkpoints: every way of feeding the same tokens
// (one chunk, token by token, several sequences in one batch, after a roll-back) must give the
// same logits, and bad requests must fail cleanly. Agreement with transformers itself is
// tests/model/golden_test.cpp.
#include "engine/gemma4_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "synth_support.h"

namespace gemma4::engine {
namespace {

const model::LoadedModel& tiny_model(const std::string& config) {
  return testing::tiny_bf16_model(config);
}

std::unique_ptr<Gemma4Engine> make_engine(const std::string& config, int ring_history = 4) {
  const auto& m = tiny_model(config);
  EngineOptions options;
  options.max_sequences = 3;
  options.max_context = 128;
  options.ring_history = ring_history;
  auto engine = Gemma4Engine::create(m.config, m.weights,
                                     std::make_unique<backend::cpu::CpuBackend>(), options);
  EXPECT_TRUE(engine.ok());
  return std::move(*engine);
}

using testing::prompt_ids;

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, double{std::abs(a[i] - b[i])});
  return d;
}

std::vector<float> run(Engine& engine, SequenceId sequence, std::span<const int32_t> tokens) {
  std::vector<float> logits(engine.vocab_size());
  const StepInput input{sequence, tokens};
  EXPECT_TRUE(engine.step({&input, 1}, logits).ok());
  return logits;
}

class EngineTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineTest, ChunkedPrefillEqualsTokenByToken) {
  auto engine = make_engine(GetParam());
  const auto prompt = prompt_ids(30, 1);  // > window 8 + history 4: several passes, ring wraps
  const auto chunked = run(*engine, *engine->open_sequence(), prompt);
  const SequenceId s = *engine->open_sequence();
  std::vector<float> stepped;
  for (int32_t token : prompt) stepped = run(*engine, s, std::span<const int32_t>(&token, 1));
  EXPECT_LT(max_abs_diff(chunked, stepped), 1e-4);
  EXPECT_EQ(engine->sequence_length(s), 30);
}

TEST_P(EngineTest, BatchedSequencesEqualSeparateOnes) {
  auto engine = make_engine(GetParam());
  const auto a = prompt_ids(20, 2), b = prompt_ids(11, 3);
  const auto alone_a = run(*engine, *engine->open_sequence(), a);
  const auto alone_b = run(*engine, *engine->open_sequence(), b);

  auto batched = make_engine(GetParam());
  const SequenceId sa = *batched->open_sequence(), sb = *batched->open_sequence();
  const StepInput inputs[] = {{sb, b}, {sa, a}};
  std::vector<float> logits(2 * batched->vocab_size());
  ASSERT_TRUE(batched->step(inputs, logits).ok());
  const auto v = batched->vocab_size();
  EXPECT_LT(max_abs_diff(std::vector<float>(logits.begin(), logits.begin() + v), alone_b), 1e-4);
  EXPECT_LT(max_abs_diff(std::vector<float>(logits.begin() + v, logits.end()), alone_a), 1e-4);
}

TEST_P(EngineTest, TruncateRollsBackWithinTheRingHistory) {
  auto engine = make_engine(GetParam());
  const auto prompt = prompt_ids(24, 4);
  const SequenceId s = *engine->open_sequence();
  run(*engine, s, std::span(prompt).first(20));
  run(*engine, s, std::span(prompt).subspan(20));  // 4 more tokens, then roll them back
  ASSERT_TRUE(engine->truncate_sequence(s, 20).ok());
  EXPECT_EQ(engine->sequence_length(s), 20);
  const int32_t next = 5000;
  const auto after_rollback = run(*engine, s, std::span(&next, 1));

  const SequenceId fresh = *engine->open_sequence();
  run(*engine, fresh, std::span(prompt).first(20));
  EXPECT_LT(max_abs_diff(after_rollback, run(*engine, fresh, std::span(&next, 1))), 1e-4);

  // 10 tokens back is beyond window + history of the sliding rings.
  EXPECT_EQ(engine->truncate_sequence(s, 11).error().code, ErrorCode::kOutOfRange);
  EXPECT_EQ(engine->sequence_length(s), 21);
  ASSERT_TRUE(engine->truncate_sequence(s, 0).ok());
}

TEST_P(EngineTest, BadRequestsFailWithoutSideEffects) {
  auto engine = make_engine(GetParam());
  std::vector<float> logits(engine->vocab_size());
  const int32_t bad_token = engine->vocab_size();
  const SequenceId s = *engine->open_sequence();
  StepInput input{s, std::span(&bad_token, 1)};
  EXPECT_EQ(engine->step({&input, 1}, logits).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(engine->sequence_length(s), 0);

  const auto ids = prompt_ids(3, 5);
  input = {2, ids};  // never opened
  EXPECT_EQ(engine->step({&input, 1}, logits).error().code, ErrorCode::kInvalidArgument);

  const auto too_long = prompt_ids(129, 6);
  input = {s, too_long};
  EXPECT_EQ(engine->step({&input, 1}, logits).error().code, ErrorCode::kResourceExhausted);

  std::vector<float> small(10);
  input = {s, ids};
  EXPECT_EQ(engine->step({&input, 1}, small).error().code, ErrorCode::kInvalidArgument);

  EXPECT_TRUE(engine->open_sequence().ok());
  EXPECT_TRUE(engine->open_sequence().ok());
  EXPECT_EQ(engine->open_sequence().error().code, ErrorCode::kResourceExhausted);
  engine->close_sequence(s);
  EXPECT_TRUE(engine->open_sequence().ok());
}

INSTANTIATE_TEST_SUITE_P(Tiny, EngineTest, ::testing::Values("tiny", "tiny-moe"),
                         testing::preset_test_name);

// The CPU reference keeps fp32 K/V only: asking it for another cache type is a clear error at
// creation, not a wrong answer later.
TEST(EngineKvType, CpuBackendRefusesNarrowCaches) {
  const auto& m = tiny_model("tiny");
  for (KvType type : {KvType::kBF16, KvType::kFP8}) {
    EngineOptions options;
    options.kv_type = type;
    auto engine = Gemma4Engine::create(m.config, m.weights,
                                       std::make_unique<backend::cpu::CpuBackend>(), options);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.error().code, ErrorCode::kUnsupported);
    EXPECT_NE(engine.error().message.find(kv_type_name(type)), std::string::npos)
        << engine.error().message;
  }
}

TEST(EngineKvType, NamesRoundTrip) {
  for (KvType type : {KvType::kF32, KvType::kBF16, KvType::kFP8}) {
    auto parsed = parse_kv_type(kv_type_name(type));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, type);
  }
  auto bad = parse_kv_type("fp16");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("expected f32, bf16 or fp8"), std::string::npos);
}

}  // namespace
}  // namespace gemma4::engine
