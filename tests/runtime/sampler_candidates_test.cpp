// The candidates path (Sampler::logit_request, engine::summarize_logits, Sampler::sample(summary))
// against the full-row path and against the sampler as it was before candidates existed
// (ReferenceSampler: that algorithm verbatim, the semantics both paths must keep bit for bit).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "runtime/sampler.h"

namespace gemma4::runtime {
namespace {

// runtime::Sampler::sample before the candidates path (commit a478798).
class ReferenceSampler {
 public:
  ReferenceSampler(SamplingParams params, std::vector<int32_t> prompt)
      : params_(std::move(params)), rng_(params_.seed), prompt_(std::move(prompt)) {}

  SampledToken sample(std::span<float> logits) {
    const auto vocab = static_cast<int32_t>(logits.size());
    for (const auto& [token, bias] : params_.logit_bias) {
      if (token < vocab) logits[token] += bias;
    }
    if (params_.repetition_penalty != 1.0f) {
      std::unordered_set<int32_t> seen(prompt_.begin(), prompt_.end());
      seen.insert(generated_.begin(), generated_.end());
      for (int32_t token : seen) {
        if (token < 0 || token >= vocab) continue;
        float& logit = logits[token];
        logit = logit > 0 ? logit / params_.repetition_penalty : logit * params_.repetition_penalty;
      }
    }
    if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
      std::unordered_map<int32_t, int> counts;
      for (int32_t token : generated_) ++counts[token];
      for (const auto& [token, count] : counts) {
        if (token < 0 || token >= vocab) continue;
        logits[token] -=
            params_.presence_penalty + params_.frequency_penalty * static_cast<float>(count);
      }
    }
    const float max_logit = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (float l : logits) sum += std::exp(static_cast<double>(l) - max_logit);
    const double log_normaliser = max_logit + std::log(sum);
    auto logprob_of = [&](int32_t token) {
      return static_cast<float>(static_cast<double>(logits[token]) - log_normaliser);
    };
    SampledToken result;
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    const auto more_likely = [&](int32_t a, int32_t b) {
      return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
    };
    if (params_.temperature == 0.0f) {
      result.id = *std::min_element(order.begin(), order.end(), more_likely);
    } else {
      const int32_t keep = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
      const bool needs_order = keep < vocab || params_.top_p < 1.0f || params_.min_p > 0.0f;
      if (needs_order)
        std::partial_sort(order.begin(), order.begin() + keep, order.end(), more_likely);
      std::vector<double> probs(keep);
      const double inv_temperature = 1.0 / params_.temperature;
      double total = 0.0;
      for (int32_t i = 0; i < keep; ++i) {
        probs[i] = std::exp((static_cast<double>(logits[order[i]]) - max_logit) * inv_temperature);
        total += probs[i];
      }
      int32_t kept = keep;
      if (params_.top_p < 1.0f) {
        double cumulative = 0.0;
        for (int32_t i = 0; i < keep; ++i) {
          cumulative += probs[i] / total;
          if (cumulative >= params_.top_p) {
            kept = i + 1;
            break;
          }
        }
      }
      if (params_.min_p > 0.0f) {
        const double threshold = params_.min_p * probs[0];
        int32_t i = 1;
        while (i < kept && probs[i] >= threshold) ++i;
        kept = i;
      }
      double kept_total = 0.0;
      for (int32_t i = 0; i < kept; ++i) kept_total += probs[i];
      double target = rng_.uniform() * kept_total;
      result.id = order[kept - 1];
      for (int32_t i = 0; i < kept; ++i) {
        target -= probs[i];
        if (target < 0.0) {
          result.id = order[i];
          break;
        }
      }
    }
    result.logprob = logprob_of(result.id);
    if (params_.top_logprobs > 0) {
      std::vector<int32_t> top(vocab);
      std::iota(top.begin(), top.end(), 0);
      std::partial_sort(top.begin(), top.begin() + params_.top_logprobs, top.end(), more_likely);
      for (int i = 0; i < params_.top_logprobs; ++i)
        result.top_logprobs.emplace_back(top[i], logprob_of(top[i]));
    }
    generated_.push_back(result.id);
    return result;
  }

 private:
  SamplingParams params_;
  Rng rng_;
  std::vector<int32_t> prompt_, generated_;
};

// Logits with many exact ties (multiples of 1/4 in a narrow range), a few -inf and a few zeros
// of either sign: what breaks rankings that are not a strict total order.
std::vector<float> tied_logits(int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> level(-12, 12);
  std::vector<float> logits(vocab);
  for (float& l : logits) l = 0.25f * static_cast<float>(level(rng));
  for (int i = 0; i < vocab; i += 37) logits[i] = -INFINITY;
  for (int i = 5; i < vocab; i += 41) logits[i] = -0.0f;
  return logits;
}

void expect_same(const SampledToken& got, const SampledToken& want, const std::string& what) {
  EXPECT_EQ(got.id, want.id) << what;
  EXPECT_EQ(got.logprob, want.logprob) << what;
  EXPECT_EQ(got.top_logprobs, want.top_logprobs) << what;
}

SamplingParams params_case(int c) {
  SamplingParams p;
  p.seed = 1000 + c;
  switch (c % 8) {
    case 0:
      p.temperature = 0;
      break;
    case 1:
      p.temperature = 0;
      p.top_logprobs = 5;
      p.logit_bias = {{3, 2.5f}, {7, -100.0f}};
      break;
    case 2:
      p.temperature = 0.7f;
      p.top_k = 8;
      break;
    case 3:
      p.temperature = 1.3f;
      p.top_k = 40;
      p.top_p = 0.8f;
      p.min_p = 0.05f;
      p.top_logprobs = 3;
      break;
    case 4:
      p.temperature = 0;
      p.repetition_penalty = 1.3f;
      p.presence_penalty = 0.4f;
      p.frequency_penalty = 0.3f;
      break;
    case 5:
      p.temperature = 0.9f;
      p.top_k = 5;
      p.repetition_penalty = 0.8f;
      p.frequency_penalty = -0.5f;
      p.logit_bias = {{11, 1.0f}};
      break;
    case 6:
      p.temperature = 1.0f;
      p.top_p = 0.9f;
      break;  // full row: no top_k
    default:
      p.temperature = 0.5f;
      p.top_k = 64;
      p.top_logprobs = 64;
      p.presence_penalty = 1.0f;
      break;
  }
  return p;
}

TEST(SamplerCandidates, BothPathsMatchTheReferenceBitForBit) {
  constexpr int kVocab = 300;
  for (int c = 0; c < 16; ++c) {
    const SamplingParams params = params_case(c);
    ASSERT_TRUE(params.validate(kVocab).ok());
    // 400 and -1: outside the vocabulary.
    const std::vector<int32_t> prompt = {1, 3, 3, 7, 250, 299, 400, -1};
    ReferenceSampler reference(params, prompt);
    Sampler full(params, prompt), candidates(params, prompt);
    for (int step = 0; step < 12; ++step) {
      const auto logits = tied_logits(kVocab, static_cast<uint32_t>(100 * c + step));
      auto for_reference = logits, for_full = logits, for_engine = logits;
      const SampledToken want = reference.sample(for_reference);
      const std::string what = "case " + std::to_string(c) + " step " + std::to_string(step);
      expect_same(full.sample(for_full), want, what + " (full row)");
      const engine::LogitRequest request = candidates.logit_request(kVocab);
      if (request.candidates == 0) {
        EXPECT_EQ(c % 8, 6) << what << ": only top_p without top_k needs the full row";
        expect_same(candidates.sample(for_engine), want, what + " (full row requested)");
        continue;
      }
      engine::LogitSummary summary;
      engine::summarize_logits(for_engine, request.edits, request.candidates, summary);
      EXPECT_EQ(summary.top.size(), static_cast<size_t>(request.candidates));
      expect_same(candidates.sample(summary), want, what + " (candidates)");
    }
  }
}

TEST(SamplerCandidates, AsksForFewestCandidatesThatDecide) {
  const auto needed = [](SamplingParams p, int32_t vocab = 1000) {
    return Sampler(p, {}).logit_request(vocab).candidates;
  };
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(needed(p), 1);
  p.top_logprobs = 7;
  EXPECT_EQ(needed(p), 7);
  p.top_logprobs = engine::kMaxLogitCandidates + 1;
  EXPECT_EQ(needed(p), 0);
  p = {};
  EXPECT_EQ(needed(p), 0);  // plain temperature draws over the whole row
  p.top_k = 20;
  p.top_p = 0.5f;
  EXPECT_EQ(needed(p), 20);
  EXPECT_EQ(needed(p, 20), 0);  // top_k = vocabulary: an id-order draw over the row
  p.top_k = 0;
  p.min_p = 0.1f;
  EXPECT_EQ(needed(p), 0);
}

TEST(SamplerCandidates, EditsCarryBiasAndPenaltiesOncePerToken) {
  SamplingParams p;
  p.temperature = 0;
  p.logit_bias = {{4, 1.0f}, {4, 2.0f}, {9, -1.0f}};
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  Sampler sampler(p, std::vector<int32_t>{9, 9, 2, 5000});
  std::vector<float> logits(16, 0.0f);
  logits[2] = 8.0f;
  EXPECT_EQ(sampler.sample(logits).id, 2);  // 8 / 2 still beats token 4: 0 + 1 + 2
  const auto request = sampler.logit_request(16);
  std::map<int32_t, engine::LogitEdit> by_token;
  for (const auto& edit : request.edits) EXPECT_TRUE(by_token.emplace(edit.token, edit).second);
  ASSERT_EQ(by_token.size(), 3u);  // 4, 9, 2; 5000 is outside the vocabulary
  EXPECT_EQ(by_token[4].bias, 3.0f);
  EXPECT_EQ(by_token[4].repetition_penalty, 1.0f);
  EXPECT_EQ(by_token[9].bias, -1.0f);
  EXPECT_EQ(by_token[9].repetition_penalty, 2.0f);
  EXPECT_EQ(by_token[2].subtract, 0.5f);
  EXPECT_EQ(by_token[2].repetition_penalty, 2.0f);
}

}  // namespace
}  // namespace gemma4::runtime
