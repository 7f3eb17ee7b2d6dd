// Decode steps replayed from recorded CUDA graphs (EngineOptions::record_decode) give logits
// bit-identical to the same steps launched kernel by kernel: one sequence, and three sequences
// decoded in batches whose membership changes (3, then 2, then 3 again), past the sliding window;
// and one sequence decoded across depth buckets with heads the split-K attention kernel takes,
// also against the CPU engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "engine/gemma4_engine.h"
#include "model/synth.h"
#include "model/weights.h"
#include "synth_support.h"

namespace gemma4::cuda {
namespace {

std::unique_ptr<engine::Gemma4Engine> cuda_engine(
    const model::LoadedModel& m, const engine::EngineOptions& options,
    ActivationMode activations = kDefaultActivationMode) {
  auto backend = make_cuda_backend(0, {true, activations});
  EXPECT_TRUE(backend.ok()) << backend.error().to_string();
  if (!backend.ok()) return nullptr;
  auto engine = engine::Gemma4Engine::create(m.config, m.weights, std::move(*backend), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  return engine.ok() ? std::move(*engine) : nullptr;
}

std::unique_ptr<engine::Gemma4Engine> cuda_engine(const model::LoadedModel& m, bool record) {
  engine::EngineOptions options;
  options.max_sequences = 3;
  options.max_context = 64;
  options.ring_history = 8;
  options.record_decode = record;
  return cuda_engine(m, options);
}

class GraphDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(GraphDecode, ReplayedStepsMatchPlainLaunchesBitForBit) {
  const model::LoadedModel& loaded = gemma4::testing::tiny_w4a16_model(GetParam());
  auto plain = cuda_engine(loaded, false);
  auto recorded = cuda_engine(loaded, true);
  ASSERT_TRUE(plain && recorded);
  const int32_t vocab = plain->vocab_size();

  // Steps both engines; the logits must be equal bit for bit. Returns each input's argmax.
  auto step_both =
      [&](const std::vector<std::pair<engine::SequenceId, std::vector<int32_t>>>& tokens,
          const std::string& what) {
        std::vector<engine::StepInput> inputs;
        for (const auto& [sequence, ids] : tokens) inputs.push_back({sequence, ids});
        std::vector<float> expected(inputs.size() * vocab), got(inputs.size() * vocab);
        const Status a = plain->step(inputs, expected);
        const Status b = recorded->step(inputs, got);
        EXPECT_TRUE(a.ok()) << a.error().to_string();
        EXPECT_TRUE(b.ok()) << b.error().to_string();
        EXPECT_EQ(std::memcmp(expected.data(), got.data(), sizeof(float) * got.size()), 0) << what;
        std::vector<int32_t> next;
        for (size_t i = 0; i < inputs.size(); ++i) {
          const auto row = expected.begin() + static_cast<int64_t>(i) * vocab;
          next.push_back(static_cast<int32_t>(std::max_element(row, row + vocab) - row));
        }
        return next;
      };
  std::vector<engine::SequenceId> sequences;
  for (int i = 0; i < 3; ++i) {
    auto a = plain->open_sequence();
    auto b = recorded->open_sequence();
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(*a, *b);
    sequences.push_back(*a);
  }
  const std::vector<int32_t> prompt = {2, 1017, 4099, 733, 90211};

  // One sequence: 24 decode steps (window 8: the ring wraps twice).
  auto next = step_both({{sequences[0], prompt}}, "prefill");
  for (int s = 0; s < 24; ++s) {
    next = step_both({{sequences[0], std::vector<int32_t>(1, next[0])}},
                     "single decode " + std::to_string(s));
  }

  // Three sequences, batches of 3, then 2 (the middle one paused), then 3 again.
  auto first = step_both({{sequences[1], prompt}, {sequences[2], {2, 5}}}, "prefill 2");
  std::vector<int32_t> last = {next[0], first[0], first[1]};
  for (int s = 0; s < 24; ++s) {
    const int phase = s / 8;  // 0: all three, 1: 0 and 2, 2: all three
    std::vector<std::pair<engine::SequenceId, std::vector<int32_t>>> batch;
    std::vector<int> members = phase == 1 ? std::vector<int>{0, 2} : std::vector<int>{0, 1, 2};
    for (int i : members) batch.emplace_back(sequences[i], std::vector<int32_t>(1, last[i]));
    const auto out = step_both(batch, "batched decode " + std::to_string(s));
    for (size_t j = 0; j < members.size(); ++j) last[members[j]] = out[j];
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, GraphDecode, ::testing::Values("tiny", "tiny-moe", "tiny-dense"),
                         gemma4::testing::preset_test_name);

class GraphDecodeAcrossBuckets : public ::testing::TestWithParam<engine::KvType> {};

// One sequence decoded at positions 58..69 (one split used of the bucket's 16) and, after a
// prefill to 505, 505..516: the buckets of 512 and of the context, 640 (full layers 16 splits,
// merged in the tensor-core kernel, then 20, merged by the merge kernel; sliding ones 3 of their
// window of 96), each recorded for its depth. Replays match plain launches (which run the same
// bucket's splits) bit for bit; an f32 cache (with f32 activations, as --fp32) also the CPU
// engine's logits within 1e-3.
TEST_P(GraphDecodeAcrossBuckets, ReplaysMatchPlainLaunchesAndTheCpuEngine) {
  const model::LoadedModel& loaded = gemma4::testing::tiny_wide_heads_w4a16_model();
  engine::EngineOptions options;
  options.max_sequences = 1;
  options.max_context = 640;
  options.ring_history = 72;
  options.kv_type = GetParam();
  const bool exact = GetParam() == engine::KvType::kF32;
  const ActivationMode activations = exact ? ActivationMode::kF32 : kDefaultActivationMode;
  auto recorded = cuda_engine(loaded, options, activations);
  options.record_decode = false;
  auto plain = cuda_engine(loaded, options, activations);
  ASSERT_TRUE(recorded && plain);
  std::unique_ptr<engine::Gemma4Engine> cpu;  // the reference keeps f32 caches only
  if (exact) {
    auto made = engine::Gemma4Engine::create(loaded.config, loaded.weights,
                                             std::make_unique<backend::cpu::CpuBackend>(), options);
    ASSERT_TRUE(made.ok()) << made.error().to_string();
    cpu = std::move(*made);
    ASSERT_TRUE(cpu->open_sequence().ok());
  }
  const int32_t vocab = plain->vocab_size();
  auto a = recorded->open_sequence();
  auto b = plain->open_sequence();
  ASSERT_TRUE(a.ok() && b.ok());
  const engine::SequenceId sequence = *a;

  const auto step_all = [&](const std::vector<int32_t>& tokens, const std::string& what) {
    const engine::StepInput input{sequence, tokens};
    std::vector<float> got(vocab), expected(vocab);
    const Status recorded_status = recorded->step({&input, 1}, got);
    const Status plain_status = plain->step({&input, 1}, expected);
    ASSERT_TRUE(recorded_status.ok()) << recorded_status.error().to_string();
    ASSERT_TRUE(plain_status.ok()) << plain_status.error().to_string();
    EXPECT_EQ(std::memcmp(expected.data(), got.data(), sizeof(float) * vocab), 0) << what;
    EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float l) { return std::isfinite(l); }))
        << what;
    if (!cpu) return;
    std::vector<float> reference(vocab);
    ASSERT_TRUE(cpu->step({&input, 1}, reference).ok());
    float largest = 0.0f;
    for (int32_t v = 0; v < vocab; ++v)
      largest = std::max(largest, std::abs(got[v] - reference[v]));
    EXPECT_LT(largest, 1e-3f) << what;
  };
  step_all(gemma4::testing::prompt_ids(58, 1), "prompt");
  for (int s = 0; s < 12; ++s) step_all({1000 + s}, "decode at " + std::to_string(58 + s));
  step_all(gemma4::testing::prompt_ids(435, 2), "prefill to 505");
  for (int s = 0; s < 12; ++s) step_all({2000 + s}, "decode at " + std::to_string(505 + s));
}

INSTANTIATE_TEST_SUITE_P(Caches, GraphDecodeAcrossBuckets,
                         ::testing::Values(engine::KvType::kF32, engine::KvType::kBF16),
                         [](const auto& info) {
                           return std::string(engine::kv_type_name(info.param));
                         });

}  // namespace
}  // namespace gemma4::cuda
