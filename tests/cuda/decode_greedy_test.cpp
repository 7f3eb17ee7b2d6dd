// Chained greedy decoding on the GPU: CudaBackend::enqueue_greedy (the ranking's GreedyFeed, the
// tokens' copy on a stream of its own) against the host's greedy pick on rows with ties, two
// slots in flight; Engine::decode_greedy on CUDA engines with decode graphs against the host-fed
// steps (greedy_decode_by_steps) on another: the same tokens and lengths, and bit-identical
// logits one step later (the step enqueued past a stop leaves no trace), also for a chain that
// crosses a depth bucket; and --step-times' timer counting every chained step once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "engine/gemma4_engine.h"
#include "greedy_support.h"
#include "synth_support.h"

namespace gemma4::cuda {
namespace {

TEST(EnqueueGreedy, WritesTheHostsGreedyTokensAndAdvancesPositions) {
  auto gpu = testing::make_gpu();
  ASSERT_TRUE(gpu);
  constexpr int kVocab = 262144, kRows = 3;
  constexpr int64_t kStride = kVocab + 16;
  // Logits in steps of 1/8: many exact ties, the greedy pick is the lowest id among them.
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> level(-64, 64);
  std::vector<std::vector<float>> slot_logits(engine::Backend::kGreedySlots);
  for (auto& logits : slot_logits) {
    logits.assign(kRows * kStride, 0.0f);
    for (float& l : logits) l = 0.125f * static_cast<float>(level(rng));
  }
  engine::Buffer ids = gpu->allocate(sizeof(int32_t) * kRows);
  engine::Buffer positions = gpu->allocate(sizeof(int32_t) * kRows);
  const std::vector<int32_t> start_positions = {0, 17, 4095};
  gpu->upload(positions.data(), start_positions.data(), sizeof(int32_t) * kRows);
  std::vector<engine::Buffer> device_logits;
  std::vector<std::vector<engine::GreedyToken>> tokens(engine::Backend::kGreedySlots,
                                                       std::vector<engine::GreedyToken>(kRows));
  // Both slots in flight before either is waited for.
  for (int slot = 0; slot < engine::Backend::kGreedySlots; ++slot) {
    const auto& logits = slot_logits[slot];
    device_logits.push_back(gpu->allocate(sizeof(float) * logits.size()));
    gpu->upload(device_logits.back().data(), logits.data(), sizeof(float) * logits.size());
    gpu->enqueue_greedy({device_logits.back().floats(), kRows, kVocab, kStride}, ids.ints(),
                        positions.ints(), tokens[slot], slot);
  }
  for (int slot = 0; slot < engine::Backend::kGreedySlots; ++slot) gpu->wait_greedy(slot);
  ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
  for (int slot = 0; slot < engine::Backend::kGreedySlots; ++slot) {
    for (int r = 0; r < kRows; ++r) {
      std::vector<float> row(slot_logits[slot].begin() + r * kStride,
                             slot_logits[slot].begin() + r * kStride + kVocab);
      engine::LogitSummary want;
      engine::summarize_logits(row, {}, 1, want);
      const engine::GreedyToken& got = tokens[slot][r];
      EXPECT_EQ(got.id, want.top.front().first) << "slot " << slot << " row " << r;
      EXPECT_EQ(got.logit, want.top.front().second);
      // The normaliser's sum runs in another order on the device.
      EXPECT_NEAR(got.log_normaliser, want.log_normaliser, 1e-12 * std::abs(want.log_normaliser));
    }
  }
  // The ids hold the last slot's tokens; every position advanced once per slot.
  std::vector<int32_t> got_ids(kRows), got_positions(kRows);
  gpu->download(got_ids.data(), ids.data(), sizeof(int32_t) * kRows);
  gpu->download(got_positions.data(), positions.data(), sizeof(int32_t) * kRows);
  for (int r = 0; r < kRows; ++r) EXPECT_EQ(got_ids[r], tokens.back()[r].id);
  for (int r = 0; r < kRows; ++r)
    EXPECT_EQ(got_positions[r], start_positions[r] + engine::Backend::kGreedySlots);
}

struct CudaEngine {
  const engine::Backend* backend = nullptr;
  std::unique_ptr<engine::Gemma4Engine> engine;
};

CudaEngine cuda_engine(const model::LoadedModel& m, int64_t max_context = 64) {
  engine::EngineOptions options;
  options.max_sequences = 3;
  options.max_context = max_context;
  options.ring_history = 8;
  auto backend = make_cuda_backend();
  EXPECT_TRUE(backend.ok()) << backend.error().to_string();
  if (!backend.ok()) return {};
  CudaEngine out;
  out.backend = backend->get();
  auto engine = engine::Gemma4Engine::create(m.config, m.weights, std::move(*backend), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  if (engine.ok()) out.engine = std::move(*engine);
  return out;
}

// How closely decode_greedy must match the host-fed steps.
enum class Match {
  // Bit for bit: tokens, logits, normalisers, and the logits of a step after the chain.
  kExact,
  // The same token ids and lengths; the logits after the chain to rounding. When a sequence
  // stops unforeseen in a batch, the step enqueued past its stop still holds its row, so the
  // others' rows of that step come from a batch one row larger than the host-fed step's, which
  // batch-size-dependent kernels (the MoE ones) round differently.
  kRounding,
};

// Three sequences decoded greedily, chained on one CUDA engine and host-fed on another, each
// stopping at its limits[i]-th token as endings[i] says (sequence 1 runs past the ring of 16
// slots), then one more step of all three on both.
void expect_chain_matches_host_fed_steps(const std::string& preset, const std::vector<int>& limits,
                                         const std::vector<gemma4::testing::Ending>& endings,
                                         Match match) {
  const model::LoadedModel& m = gemma4::testing::tiny_w4a16_model(preset);
  CudaEngine chained = cuda_engine(m), reference = cuda_engine(m);
  ASSERT_TRUE(chained.engine && reference.engine);
  const std::vector<std::vector<int32_t>> prompts = {gemma4::testing::prompt_ids(5, 1),
                                                     gemma4::testing::prompt_ids(3, 2),
                                                     gemma4::testing::prompt_ids(9, 3)};
  const std::vector<int32_t> first = {11, 12, 13};
  std::vector<engine::SequenceId> a, b;
  const auto got =
      gemma4::testing::decode_with_stops(*chained.engine, prompts, first, limits, endings, true, a);
  const auto want = gemma4::testing::decode_with_stops(*reference.engine, prompts, first, limits,
                                                       endings, false, b);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (match == Match::kExact) {
      EXPECT_EQ(got[i], want[i]) << "sequence " << i;
    } else {
      ASSERT_EQ(got[i].size(), want[i].size());
      for (size_t t = 0; t < got[i].size(); ++t)
        EXPECT_EQ(got[i][t].id, want[i][t].id) << "sequence " << i << " token " << t;
    }
    EXPECT_EQ(static_cast<int>(got[i].size()), limits[i]);
    EXPECT_EQ(chained.engine->sequence_length(a[i]), std::ssize(prompts[i]) + limits[i]);
  }
  const auto [after, expected] =
      gemma4::testing::step_both(*chained.engine, a, *reference.engine, b, 17);
  ASSERT_EQ(after.size(), expected.size());
  const size_t vocab = after.size() / prompts.size();
  for (size_t i = 0; i < prompts.size(); ++i) {
    float largest = 0.0f;
    for (size_t v = i * vocab; v < (i + 1) * vocab; ++v)
      largest = std::max(largest, std::abs(after[v] - expected[v]));
    if (match == Match::kExact) {
      EXPECT_EQ(
          std::memcmp(after.data() + i * vocab, expected.data() + i * vocab, sizeof(float) * vocab),
          0)
          << "sequence " << i << ": logits after the chain differ, max |d| " << largest;
    } else {
      EXPECT_LT(largest, 1e-2f) << "sequence " << i;  // logits of magnitude ~10 (softcap 30)
    }
  }
}

class DecodeGreedyCuda : public ::testing::TestWithParam<std::string> {};

// Every sequence stops unforeseen at its 24th token (sequences 1 and 2 past the ring): the step
// enqueued past the stops holds only their rows, all rolled back.
TEST_P(DecodeGreedyCuda, UnforeseenEndsOfAllMatchHostFedStepsBitForBit) {
  expect_chain_matches_host_fed_steps(GetParam(), {24, 24, 24},
                                      std::vector(3, gemma4::testing::Ending::kUnforeseen),
                                      Match::kExact);
}

// Every end announced, at different steps: the chain enqueues exactly the host-fed steps.
TEST_P(DecodeGreedyCuda, AnnouncedEndsMatchHostFedStepsBitForBit) {
  expect_chain_matches_host_fed_steps(
      GetParam(), {2, 24, 9}, std::vector(3, gemma4::testing::Ending::kAnnounced), Match::kExact);
}

// Sequence 0 stops unforeseen at its first token and 1 after 24, while the others go on; 2 after
// 9, announced.
TEST_P(DecodeGreedyCuda, StaggeredUnforeseenEndsMatchHostFedTokens) {
  using gemma4::testing::Ending;
  expect_chain_matches_host_fed_steps(
      GetParam(), {1, 24, 9}, {Ending::kUnforeseen, Ending::kUnforeseen, Ending::kAnnounced},
      Match::kRounding);
}

INSTANTIATE_TEST_SUITE_P(Tiny, DecodeGreedyCuda, ::testing::Values("tiny", "tiny-moe"),
                         gemma4::testing::preset_test_name);

// Two sequences chained from positions 500 and 490 past the first depth bucket (512 keys) into the
// next (the split-K kernel's heads: tiny_wide_heads_w4a16_model): the crossing step is recorded
// while the one before it runs, and tokens, lengths and the logits one step later match the
// host-fed steps bit for bit.
TEST(DecodeGreedyCudaBuckets, AChainAcrossADepthBucketMatchesHostFedStepsBitForBit) {
  const model::LoadedModel& m = gemma4::testing::tiny_wide_heads_w4a16_model();
  CudaEngine chained = cuda_engine(m, 640), reference = cuda_engine(m, 640);
  ASSERT_TRUE(chained.engine && reference.engine);
  const std::vector<std::vector<int32_t>> prompts = {gemma4::testing::prompt_ids(500, 1),
                                                     gemma4::testing::prompt_ids(490, 2)};
  const std::vector<int32_t> first = {11, 12};
  const std::vector<int> limits = {30, 30};
  const std::vector endings(2, gemma4::testing::Ending::kUnforeseen);
  std::vector<engine::SequenceId> a, b;
  const auto got =
      gemma4::testing::decode_with_stops(*chained.engine, prompts, first, limits, endings, true, a);
  const auto want = gemma4::testing::decode_with_stops(*reference.engine, prompts, first, limits,
                                                       endings, false, b);
  EXPECT_EQ(got, want);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(chained.engine->sequence_length(a[i]), std::ssize(prompts[i]) + limits[i]);
  }
  const auto [after, expected] =
      gemma4::testing::step_both(*chained.engine, a, *reference.engine, b, 17);
  ASSERT_EQ(after.size(), expected.size());
  EXPECT_EQ(std::memcmp(after.data(), expected.data(), sizeof(float) * after.size()), 0);
}

TEST(DecodeGreedyCudaTimes, EveryChainedReplayIsCountedOnce) {
  CudaEngine e = cuda_engine(gemma4::testing::tiny_w4a16_model("tiny"));
  ASSERT_TRUE(e.engine);
  const auto prompt = gemma4::testing::prompt_ids(4, 6);
  std::vector<engine::SequenceId> sequences;
  // Records the graph (step 1 unrecorded, step 2 recorded).
  const auto warm = gemma4::testing::decode_with_stops(
      *e.engine, {prompt}, {7}, {3}, {gemma4::testing::Ending::kUnforeseen}, true, sequences);
  ASSERT_EQ(warm.front().size(), 3u);
  constexpr int kSteps = 12;
  e.backend->time_replays(true);
  int seen = 0;
  const Status status = e.engine->decode_greedy(
      sequences, std::vector<int32_t>{8}, [&](size_t, const engine::GreedyToken&) {
        ++seen;
        return seen == kSteps - 1 ? engine::GreedyNext::kLast : engine::GreedyNext::kContinue;
      });
  e.backend->time_replays(false);
  ASSERT_TRUE(status.ok()) << status.error().to_string();
  EXPECT_EQ(seen, kSteps);
  const auto times = e.backend->replay_times();
  ASSERT_TRUE(times.has_value());
  // kSteps steps (none past the announced end), all replayed; the first has no step before it
  // to measure idle from.
  EXPECT_EQ(times->replays, kSteps - 1);
  EXPECT_GT(times->replay_us, 0.0);
  EXPECT_GT(times->tail_us, 0.0);
  EXPECT_GE(times->idle_us, 0.0);
}

}  // namespace
}  // namespace gemma4::cuda
