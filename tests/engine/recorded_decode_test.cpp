// The engine's decode recording (EngineOptions::record_decode) on the CPU: a backend whose
// "recording" keeps the enqueue closure and whose replay runs it again, as a CUDA graph re-runs
// its captured kernels with the arguments fixed at capture. Decoding through it must give the
// same logits as the plain CPU backend (which cannot record, so its path is the unrecorded one),
// for one sequence and for batches whose membership changes, past the sliding window; and
// across depth buckets (engine/decode_recordings.h), each recorded once for the depth its
// replays stay below.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/cpu_forwarding_backend.h"
#include "engine/gemma4_engine.h"
#include "synth_support.h"

namespace gemma4::engine {
namespace {

struct StoredClosure final : RecordedWork {
  std::function<void()> enqueue;
};

// The CPU backend plus closure "recording"; counts records and replays, and checks every
// attended row against its SequenceRows::position_bound (the CPU reads positions in place).
class ClosureRecordingBackend final : public testing::CpuForwardingBackend {
 public:
  int records = 0;
  int replays = 0;
  int rows_past_their_bound = 0;
  std::set<int64_t> replayed_bounds;  // the decode bounds attention saw in replays

  const char* name() const override { return "cpu+closures"; }
  bool can_record() const override { return true; }
  std::unique_ptr<RecordedWork> record(const std::function<void()>& enqueue) override {
    ++records;
    auto work = std::make_unique<StoredClosure>();
    work->enqueue = enqueue;  // not run now: capture enqueues nothing
    return work;
  }
  void replay(RecordedWork& work) override {
    ++replays;
    replaying_ = true;
    static_cast<StoredClosure&>(work).enqueue();
    replaying_ = false;
  }
  void attention_rows(Rows q, const int32_t* positions, std::span<const SequenceRows> sequences,
                      int window, float scale, Rows out) override {
    for (const SequenceRows& s : sequences) {
      for (int64_t r = s.first_row; r < s.first_row + s.count; ++r) {
        if (positions[r] >= s.position_bound) ++rows_past_their_bound;
      }
      if (replaying_) replayed_bounds.insert(s.position_bound);
    }
    Backend::attention_rows(q, positions, sequences, window, scale, out);
  }

 private:
  bool replaying_ = false;
};

class RecordedDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(RecordedDecode, ReplayedClosuresMatchThePlainPath) {
  const model::LoadedModel& m = testing::tiny_bf16_model(GetParam());
  EngineOptions options;
  options.max_sequences = 3;
  options.max_context = 48;
  options.ring_history = 4;
  auto recording_backend = std::make_unique<ClosureRecordingBackend>();
  const ClosureRecordingBackend& counts = *recording_backend;
  auto plain = Gemma4Engine::create(m.config, m.weights,
                                    std::make_unique<backend::cpu::CpuBackend>(), options);
  auto recorded = Gemma4Engine::create(m.config, m.weights, std::move(recording_backend), options);
  ASSERT_TRUE(plain.ok() && recorded.ok());
  const int32_t vocab = (*plain)->vocab_size();

  std::vector<SequenceId> sequences;
  for (int i = 0; i < 3; ++i) {
    auto a = (*plain)->open_sequence();
    auto b = (*recorded)->open_sequence();
    ASSERT_TRUE(a.ok() && b.ok());
    sequences.push_back(*a);
  }
  // Every sequence decodes its own token stream; members of each step by phase: all three,
  // then 0 and 2, then all three (12 steps each: the window of 8 is crossed).
  const std::vector<int32_t> prompt = {2, 1017, 4099};
  std::vector<int32_t> next(3, 0);
  for (int i = 0; i < 3; ++i) {
    std::vector<float> a(vocab), b(vocab);
    const StepInput input{sequences[i], prompt};
    ASSERT_TRUE((*plain)->step({&input, 1}, a).ok());
    ASSERT_TRUE((*recorded)->step({&input, 1}, b).ok());
    ASSERT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * vocab), 0);
  }
  for (int s = 0; s < 36; ++s) {
    const std::vector<int> members =
        s / 12 == 1 ? std::vector<int>{0, 2} : std::vector<int>{0, 1, 2};
    std::vector<std::vector<int32_t>> tokens;
    for (int i : members) tokens.push_back(std::vector<int32_t>(1, 1000 + 37 * s + i));
    std::vector<StepInput> inputs;
    for (size_t j = 0; j < members.size(); ++j)
      inputs.push_back({sequences[members[j]], tokens[j]});
    std::vector<float> a(inputs.size() * vocab), b(inputs.size() * vocab);
    ASSERT_TRUE((*plain)->step(inputs, a).ok());
    ASSERT_TRUE((*recorded)->step(inputs, b).ok());
    ASSERT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * a.size()), 0) << "step " << s;
  }
  // Two orders (3 and 2 sequences), each recorded on its second step and replayed from then on.
  EXPECT_EQ(counts.records, 2);
  EXPECT_EQ(counts.replays, (24 - 1) + (12 - 1));
}

// One sequence decoded across the buckets of 512 and 4096 (prefill passes in between): each
// bucket recorded once, the first straight after the sequence list's unrecorded first pass and the
// deeper ones at once, every replay's rows below its bound, and the logits equal to the plain
// path's.
TEST_P(RecordedDecode, EachDepthBucketIsRecordedOnceForItsDepth) {
  const model::LoadedModel& m = testing::tiny_bf16_model(GetParam());
  EngineOptions options;
  options.max_sequences = 1;
  options.max_context = 4200;
  options.ring_history = 512;  // prefill passes of up to 513 rows (tiny's KV-shared ring)
  auto recording_backend = std::make_unique<ClosureRecordingBackend>();
  const ClosureRecordingBackend& seen = *recording_backend;
  auto plain = Gemma4Engine::create(m.config, m.weights,
                                    std::make_unique<backend::cpu::CpuBackend>(), options);
  auto recorded = Gemma4Engine::create(m.config, m.weights, std::move(recording_backend), options);
  ASSERT_TRUE(plain.ok() && recorded.ok());
  const int32_t vocab = (*plain)->vocab_size();
  auto a = (*plain)->open_sequence();
  auto b = (*recorded)->open_sequence();
  ASSERT_TRUE(a.ok() && b.ok());
  const SequenceId sequence = *a;
  const auto step_both = [&](const std::vector<int32_t>& tokens, const std::string& what) {
    std::vector<float> expected(vocab), got(vocab);
    const StepInput input{sequence, tokens};
    ASSERT_TRUE((*plain)->step({&input, 1}, expected).ok());
    ASSERT_TRUE((*recorded)->step({&input, 1}, got).ok());
    ASSERT_EQ(std::memcmp(expected.data(), got.data(), sizeof(float) * vocab), 0) << what;
  };
  // Decode steps at positions 505..516 (the first bucket ends at 512), at 4090..4101 (the second
  // ends at 4096, the third at the context, 4200).
  step_both(testing::prompt_ids(505, 1), "prompt");
  for (int s = 0; s < 12; ++s) step_both({1000 + s}, "decode " + std::to_string(505 + s));
  step_both(testing::prompt_ids(3573, 2), "prefill to 4090");
  for (int s = 0; s < 12; ++s) step_both({2000 + s}, "decode " + std::to_string(4090 + s));
  EXPECT_EQ(seen.rows_past_their_bound, 0);
  EXPECT_EQ(seen.records, 3);
  // Every decode step but the list's first (unrecorded) replays.
  EXPECT_EQ(seen.replays, 24 - 1);
  EXPECT_EQ(seen.replayed_bounds, (std::set<int64_t>{512, 4096, 4200}));
}

INSTANTIATE_TEST_SUITE_P(Tiny, RecordedDecode, ::testing::Values("tiny", "tiny-moe"),
                         testing::preset_test_name);

}  // namespace
}  // namespace gemma4::engine
