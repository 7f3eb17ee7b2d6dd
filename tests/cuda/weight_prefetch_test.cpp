// L2 weight prefetch on CUDA (EngineOptions::prefetch_bytes, CudaBackend::prefetch_weights): the
// prefetch kernel writes nothing and keeps the PDL chain's ordering, so decode steps replayed from
// graphs with prefetches give logits bit-identical to the same engine without them; and the
// backend takes any ranges (more than one launch holds, unaligned, empty).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "engine/gemma4_engine.h"
#include "model/synth.h"
#include "model/weights.h"
#include "synth_support.h"

namespace gemma4::cuda {
namespace {

struct PrefetchSetting {
  int64_t bytes = 0;
  bool at_qkv = false;
};

std::unique_ptr<engine::Gemma4Engine> cuda_engine(const model::LoadedModel& m,
                                                  const PrefetchSetting& prefetch) {
  engine::EngineOptions options;
  options.max_sequences = 2;
  options.max_context = 64;
  options.ring_history = 8;
  options.prefetch_bytes = prefetch.bytes;
  options.prefetch_at_qkv = prefetch.at_qkv;
  auto backend = make_cuda_backend();
  EXPECT_TRUE(backend.ok()) << backend.error().to_string();
  if (!backend.ok()) return nullptr;
  auto engine = engine::Gemma4Engine::create(m.config, m.weights, std::move(*backend), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  return engine.ok() ? std::move(*engine) : nullptr;
}

class WeightPrefetchDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(WeightPrefetchDecode, LogitsMatchDecodingWithoutPrefetchBitForBit) {
  const model::LoadedModel& loaded = gemma4::testing::tiny_w4a16_model(GetParam());
  // Everything ahead (the whole window of a tiny model), a cut inside the first matrix, and the
  // other issue point.
  const std::vector<PrefetchSetting> settings = {{1 << 24, false}, {100, false}, {1 << 24, true}};
  auto plain = cuda_engine(loaded, {});
  ASSERT_TRUE(plain);
  std::vector<std::unique_ptr<engine::Gemma4Engine>> prefetching;
  for (const PrefetchSetting& s : settings) {
    prefetching.push_back(cuda_engine(loaded, s));
    ASSERT_TRUE(prefetching.back());
  }
  const int32_t vocab = plain->vocab_size();
  auto sequence = plain->open_sequence();
  ASSERT_TRUE(sequence.ok());
  for (auto& engine : prefetching) ASSERT_EQ(*engine->open_sequence(), *sequence);

  std::vector<int32_t> tokens = {2, 1017, 4099, 733, 90211};
  // A prefill, then 20 decode steps (recorded from the second on; window 8: the ring wraps).
  for (int step = 0; step <= 20; ++step) {
    const std::vector<engine::StepInput> inputs = {{*sequence, tokens}};
    std::vector<float> expected(vocab), got(vocab);
    ASSERT_TRUE(plain->step(inputs, expected).ok());
    for (size_t i = 0; i < prefetching.size(); ++i) {
      ASSERT_TRUE(prefetching[i]->step(inputs, got).ok());
      EXPECT_EQ(std::memcmp(expected.data(), got.data(), sizeof(float) * vocab), 0)
          << "step " << step << ", setting " << i;
    }
    tokens = {static_cast<int32_t>(std::max_element(expected.begin(), expected.end()) -
                                   expected.begin())};
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, WeightPrefetchDecode,
                         ::testing::Values("tiny", "tiny-moe", "tiny-dense"),
                         gemma4::testing::preset_test_name);

TEST(WeightPrefetchBackend, TakesManyUnalignedAndEmptyRanges) {
  auto made = make_cuda_backend();
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  engine::Backend& backend = **made;
  engine::Buffer weights = backend.allocate(1 << 20);
  const char* base = static_cast<const char*>(weights.data());
  // 40 ranges (two launches of 32 and 8): odd starts and lengths, one empty, one under 16 bytes.
  std::vector<engine::WeightRange> ranges;
  for (int i = 0; i < 40; ++i) {
    ranges.push_back({base + 1 + i * 25'000, i == 7 ? 0 : i == 9 ? 9 : 20'000 + 3 * i});
  }
  const int64_t before = backend.kernels_launched().value_or(0);
  backend.prefetch_weights(ranges);
  backend.prefetch_weights({});
  EXPECT_EQ(backend.kernels_launched().value_or(0) - before, 2);
  // The buffer still reads back as allocated (zero-filled): the prefetch wrote nothing.
  std::vector<char> host(1 << 20, 1);
  backend.download(host.data(), weights.data(), host.size());
  EXPECT_TRUE(std::all_of(host.begin(), host.end(), [](char c) { return c == 0; }));
  EXPECT_TRUE(backend.status().ok()) << backend.status().error().to_string();
}

}  // namespace
}  // namespace gemma4::cuda
