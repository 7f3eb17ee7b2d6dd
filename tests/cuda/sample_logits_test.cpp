// Ranking logits on the device (CudaBackend::summarize_logits, sample_logits.cu) against the host
// definition (engine::summarize_logits): the same candidates and max bit for bit, the normaliser
// to double rounding (its sum runs in another order); on rows with ties, -inf, -0, edits,
// strided rows, several rows of different candidate counts, vocabularies of one partial chunk
// and of Gemma 4's 262,144; and the engine's step_sampled on the GPU, graphs included.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "engine/gemma4_engine.h"
#include "synth_support.h"

namespace gemma4::cuda {
namespace {

// Logits in steps of 1/8 (many exact ties, also across chunks), some -inf and -0.
std::vector<float> tied_row(int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> level(-200, 200);
  std::vector<float> row(vocab);
  for (float& l : row) l = 0.125f * static_cast<float>(level(rng));
  for (int i = static_cast<int>(seed % 7); i < vocab; i += 97) row[i] = -INFINITY;
  for (int i = 3; i < vocab; i += 101) row[i] = -0.0f;
  return row;
}

void expect_summaries_match(const engine::LogitSummary& got, const engine::LogitSummary& want,
                            const std::string& what) {
  EXPECT_EQ(got.top, want.top) << what;
  EXPECT_EQ(got.max_logit, want.max_logit) << what;
  EXPECT_NEAR(got.log_normaliser, want.log_normaliser,
              1e-12 * std::abs(want.log_normaliser) + 1e-12)
      << what;
}

// rows.size() rows of `vocab` logits at a stride of vocab + 16, ranked on the GPU with the
// given candidates and edits, compared with the host definition.
void check_ranking(int vocab, const std::vector<int32_t>& candidates,
                   const std::vector<std::vector<engine::LogitEdit>>& edits,
                   const std::vector<std::vector<float>>& rows) {
  auto gpu = testing::make_gpu();
  ASSERT_TRUE(gpu);
  const int64_t stride = vocab + 16;
  std::vector<float> host(rows.size() * stride, 0.0f);
  for (size_t r = 0; r < rows.size(); ++r)
    std::copy(rows[r].begin(), rows[r].end(), host.begin() + r * stride);
  engine::Buffer device = gpu->allocate(sizeof(float) * host.size());
  gpu->upload(device.data(), host.data(), sizeof(float) * host.size());
  // Ranked in reverse order of the rows, so a request's row index matters.
  std::vector<engine::LogitRowRequest> requests;
  for (size_t r = rows.size(); r-- > 0;)
    requests.push_back({static_cast<int64_t>(r), {candidates[r], edits[r]}});
  std::vector<engine::LogitSummary> got(rows.size());
  gpu->summarize_logits({device.floats(), static_cast<int64_t>(rows.size()), vocab, stride},
                        requests, got);
  ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
  for (size_t k = 0; k < requests.size(); ++k) {
    const auto r = static_cast<size_t>(requests[k].row);
    std::vector<float> row = rows[r];
    engine::LogitSummary want;
    engine::summarize_logits(row, edits[r], candidates[r], want);
    expect_summaries_match(got[k], want,
                           "vocab " + std::to_string(vocab) + " row " + std::to_string(r));
  }
}

TEST(SampleLogits, FullVocabularyRowsWithTiesEditsAndMixedCandidates) {
  constexpr int kVocab = 262144;
  std::vector<std::vector<float>> rows;
  for (uint32_t r = 0; r < 6; ++r) rows.push_back(tied_row(kVocab, 11 + r));
  rows[4].assign(kVocab, 1.5f);  // all tied: the lowest ids win
  rows[5][kVocab - 1] = 40.0f;   // the best token in the last chunk
  const std::vector<engine::LogitEdit> edits = {{7, 30.0f, 1.0f, 0.0f},      // lifted to the top
                                                {8, 0.0f, 1.5f, 0.0f},       // repetition penalty
                                                {9, -INFINITY, 1.0f, 0.0f},  // banned
                                                {kVocab - 2, 0.0f, 1.0f, 2.0f}};
  check_ranking(kVocab, {1, 5, 64, 17, 64, 3}, {{}, edits, edits, {}, {}, edits}, rows);
}

TEST(SampleLogits, SmallAndOddVocabularies) {
  for (int vocab : {1, 50, 1000, 2049, 300000}) {  // 300000: past the kernels, the host default
    std::vector<std::vector<float>> rows = {tied_row(vocab, 3), tied_row(vocab, 4)};
    rows[0][0] = 100.0f;  // a row with -inf at 0 still needs a finite entry
    check_ranking(vocab, {64, 1}, {{}, {{0, 1.0f, 2.0f, 0.5f}}}, rows);
  }
}

std::unique_ptr<engine::Gemma4Engine> gpu_engine(const model::LoadedModel& m) {
  engine::EngineOptions options;
  options.max_sequences = 3;
  options.max_context = 64;
  auto backend = make_cuda_backend();
  EXPECT_TRUE(backend.ok()) << backend.error().to_string();
  if (!backend.ok()) return nullptr;
  auto engine = engine::Gemma4Engine::create(m.config, m.weights, std::move(*backend), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// Two GPU engines fed the same tokens (prefill, then recorded decode steps): step() rows
// summarised on the host equal step_sampled's device summaries.
TEST(SampleLogits, EngineStepSampledMatchesStepRowsSummarisedOnTheHost) {
  const model::LoadedModel& loaded = gemma4::testing::tiny_w4a16_model("tiny");
  auto plain = gpu_engine(loaded), sampled = gpu_engine(loaded);
  ASSERT_TRUE(plain && sampled);
  const int32_t vocab = plain->vocab_size();
  const std::vector<int32_t> prompts[3] = {gemma4::testing::prompt_ids(9, 1),
                                           gemma4::testing::prompt_ids(4, 2),
                                           gemma4::testing::prompt_ids(6, 3)};
  std::vector<engine::StepInput> plain_inputs, sampled_inputs;
  for (const auto& prompt : prompts) {
    plain_inputs.push_back({*plain->open_sequence(), prompt});
    sampled_inputs.push_back({*sampled->open_sequence(), prompt});
  }
  const std::vector<engine::LogitEdit> edits = {{5, 2.0f, 1.2f, 0.5f}};
  const std::vector<engine::LogitRequest> requests = {{1, {}}, {8, edits}, {0, {}}};
  std::vector<int32_t> next(3);
  for (int step = 0; step < 5; ++step) {  // steps 2+ replay recorded graphs
    std::vector<float> logits(3 * static_cast<size_t>(vocab)), full(vocab);
    std::vector<engine::LogitSummary> got(3);
    ASSERT_TRUE(plain->step(plain_inputs, logits).ok());
    const Status status = sampled->step_sampled(sampled_inputs, requests, got, full);
    ASSERT_TRUE(status.ok()) << status.error().to_string();
    for (size_t i : {0u, 1u}) {
      engine::LogitSummary want;
      engine::summarize_logits(std::span(logits).subspan(i * vocab, vocab), requests[i].edits,
                               requests[i].candidates, want);
      expect_summaries_match(got[i], want, "step " + std::to_string(step));
    }
    EXPECT_EQ(full, std::vector<float>(logits.begin() + 2 * vocab, logits.end()));
    for (size_t i = 0; i < 3; ++i) {
      next[i] = got[0].top[0].first;  // greedy from the first row, fed to every sequence
      plain_inputs[i].tokens = sampled_inputs[i].tokens = std::span(&next[i], 1);
    }
  }
}

}  // namespace
}  // namespace gemma4::cuda
