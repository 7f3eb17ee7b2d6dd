#include "runtime/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

namespace gemma4::runtime {
namespace {

std::vector<float> softmax(const std::vector<float>& logits) {
  double max = logits[0];
  for (float l : logits) max = std::max<double>(max, l);
  double sum = 0;
  for (float l : logits) sum += std::exp(l - max);
  std::vector<float> p;
  for (float l : logits) p.push_back(static_cast<float>(std::exp(l - max) / sum));
  return p;
}

// The sampler adjusts the logits in place: every draw gets its own copy.
SampledToken draw(Sampler& sampler, std::vector<float> logits) {
  return sampler.sample(logits);
}

std::map<int32_t, int> histogram(SamplingParams params, const std::vector<float>& logits,
                                 int draws) {
  Sampler sampler(params, {});
  std::map<int32_t, int> counts;
  for (int i = 0; i < draws; ++i) ++counts[draw(sampler, logits).id];
  return counts;
}

TEST(Sampler, GreedyTakesArgmaxAndLowerIdOnTies) {
  SamplingParams params;
  params.temperature = 0;
  Sampler sampler(params, {});
  EXPECT_EQ(draw(sampler, std::vector<float>{0.5f, 2.0f, -1.0f, 2.0f}).id, 1);
  EXPECT_EQ(draw(sampler, std::vector<float>{3.0f, 2.0f}).id, 0);
}

TEST(Sampler, ReportsLogSoftmaxLogprobs) {
  SamplingParams params;
  params.temperature = 0;
  params.top_logprobs = 2;
  Sampler sampler(params, {});
  const std::vector<float> logits{1.0f, 3.0f, 2.0f};
  const auto p = softmax(logits);
  const auto result = draw(sampler, logits);
  EXPECT_EQ(result.id, 1);
  EXPECT_NEAR(result.logprob, std::log(p[1]), 1e-6);
  ASSERT_EQ(result.top_logprobs.size(), 2u);
  EXPECT_EQ(result.top_logprobs[0].first, 1);
  EXPECT_EQ(result.top_logprobs[1].first, 2);
  EXPECT_NEAR(result.top_logprobs[1].second, std::log(p[2]), 1e-6);
}

TEST(Sampler, SameSeedSameTokensDifferentSeedDiffers) {
  const std::vector<float> logits(64, 0.0f);  // uniform: every draw is pure randomness
  SamplingParams params;
  params.seed = 42;
  Sampler a(params, {}), b(params, {});
  params.seed = 43;
  Sampler c(params, {});
  std::vector<int32_t> ta, tb, tc;
  for (int i = 0; i < 32; ++i) {
    ta.push_back(draw(a, logits).id);
    tb.push_back(draw(b, logits).id);
    tc.push_back(draw(c, logits).id);
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
}

TEST(Sampler, TemperatureSamplingFollowsSoftmax) {
  const std::vector<float> logits{0.0f, 1.0f, 2.0f};
  SamplingParams params;
  params.temperature = 2.0f;
  params.seed = 7;
  const int draws = 40000;
  const auto counts = histogram(params, logits, draws);
  const auto p = softmax({0.0f, 0.5f, 1.0f});  // logits / temperature
  for (int32_t t = 0; t < 3; ++t)
    EXPECT_NEAR(counts.count(t) ? counts.at(t) / double(draws) : 0.0, p[t], 0.01) << t;
}

TEST(Sampler, TopKTopPMinPRestrictTheCandidates) {
  const std::vector<float> logits{std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams params;
  params.seed = 3;
  params.top_k = 2;
  auto counts = histogram(params, logits, 2000);
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_NEAR(counts[0] / 2000.0, 0.5 / 0.8, 0.04);

  params.top_k = 0;
  params.top_p = 0.7f;  // 0.5 is short of 0.7, 0.5 + 0.3 reaches it: {0, 1}
  counts = histogram(params, logits, 2000);
  EXPECT_EQ(counts.size(), 2u);

  params.top_p = 1.0f;
  params.min_p = 0.25f;  // threshold 0.125: {0, 1, 2}
  counts = histogram(params, logits, 4000);
  EXPECT_EQ(counts.size(), 3u);
  EXPECT_EQ(counts.count(3), 0u);
}

TEST(Sampler, LogitBiasAndPenalties) {
  SamplingParams params;
  params.temperature = 0;
  params.logit_bias = {{2, 10.0f}};
  Sampler biased(params, {});
  EXPECT_EQ(draw(biased, std::vector<float>{1.0f, 2.0f, 0.0f}).id, 2);

  // Repetition penalty: positive logits divided, negative multiplied (prompt counts as seen).
  params = {};
  params.temperature = 0;
  params.repetition_penalty = 2.0f;
  params.top_logprobs = 3;
  const std::vector<int32_t> prompt{1};
  Sampler repeated(params, prompt);
  auto r = draw(repeated, std::vector<float>{1.5f, 2.0f, -1.0f});
  EXPECT_EQ(r.id, 0);  // 2.0 / 2 = 1.0 < 1.5
  const auto p = softmax({1.5f, 1.0f, -1.0f});
  EXPECT_NEAR(r.logprob, std::log(p[0]), 1e-6);

  // Presence + frequency: generated token 0 once -> logit - (0.5 + 0.25 * 1).
  params = {};
  params.temperature = 0;
  params.presence_penalty = 0.5f;
  params.frequency_penalty = 0.25f;
  Sampler penalised(params, {});
  EXPECT_EQ(draw(penalised, std::vector<float>{1.0f, 0.5f}).id, 0);
  EXPECT_EQ(draw(penalised, std::vector<float>{1.0f, 0.5f}).id, 1);  // 1 - 0.75 < 0.5
}

TEST(Sampler, ValidateRejectsBadParameters) {
  SamplingParams params;
  params.top_p = 0.0f;
  EXPECT_FALSE(params.validate(10).ok());
  params = {};
  params.temperature = -1.0f;
  EXPECT_FALSE(params.validate(10).ok());
  params = {};
  params.logit_bias = {{10, 1.0f}};
  EXPECT_FALSE(params.validate(10).ok());
  params = {};
  EXPECT_TRUE(params.validate(10).ok());
}

}  // namespace
}  // namespace gemma4::runtime
