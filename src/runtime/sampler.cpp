#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

namespace gemma4::runtime {

namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

// Higher logit first; equal logits: lower token id first.
struct MoreLikely {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  }
};

}  // namespace

Rng::Rng(uint64_t seed) {
  for (auto& word : state_) word = splitmix64(seed);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}

double Rng::uniform() {
  return static_cast<double>(next() >> 11) * 0x1.0p-53;
}

Status SamplingParams::validate(int32_t vocab_size) const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    return make_error(ErrorCode::kInvalidArgument, "temperature must be >= 0, got {}", temperature);
  if (top_k < 0)
    return make_error(ErrorCode::kInvalidArgument, "top_k must be >= 0, got {}", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f))
    return make_error(ErrorCode::kInvalidArgument, "top_p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f))
    return make_error(ErrorCode::kInvalidArgument, "min_p must be in [0, 1], got {}", min_p);
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty))
    return make_error(ErrorCode::kInvalidArgument, "repetition_penalty must be > 0, got {}",
                      repetition_penalty);
  if (!std::isfinite(presence_penalty) || !std::isfinite(frequency_penalty))
    return make_error(ErrorCode::kInvalidArgument, "presence/frequency penalties must be finite");
  if (top_logprobs < 0 || top_logprobs > vocab_size)
    return make_error(ErrorCode::kInvalidArgument, "top_logprobs must be in [0, {}], got {}",
                      vocab_size, top_logprobs);
  for (const auto& [token, bias] : logit_bias) {
    if (token < 0 || token >= vocab_size)
      return make_error(ErrorCode::kInvalidArgument,
                        "logit_bias token {} is outside the vocabulary [0, {})", token, vocab_size);
    if (std::isnan(bias))
      return make_error(ErrorCode::kInvalidArgument, "logit_bias for token {} is NaN", token);
  }
  return Status::ok_status();
}

Sampler::Sampler(SamplingParams params, std::span<const int32_t> prompt_tokens)
    : params_(std::move(params)),
      rng_(params_.seed),
      prompt_tokens_(prompt_tokens.begin(), prompt_tokens.end()) {}

void Sampler::apply_penalties(std::span<float> logits) const {
  const auto vocab = static_cast<int32_t>(logits.size());
  if (params_.repetition_penalty != 1.0f) {
    std::unordered_set<int32_t> seen(prompt_tokens_.begin(), prompt_tokens_.end());
    seen.insert(generated_tokens_.begin(), generated_tokens_.end());
    for (int32_t token : seen) {
      if (token < 0 || token >= vocab) continue;
      float& logit = logits[token];
      logit = logit > 0 ? logit / params_.repetition_penalty : logit * params_.repetition_penalty;
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    for (int32_t token : generated_tokens_) ++counts[token];
    for (const auto& [token, count] : counts) {
      if (token < 0 || token >= vocab) continue;
      logits[token] -=
          params_.presence_penalty + params_.frequency_penalty * static_cast<float>(count);
    }
  }
}

SampledToken Sampler::sample(std::span<float> logits) {
  const auto vocab = static_cast<int32_t>(logits.size());
  for (const auto& [token, bias] : params_.logit_bias) {
    if (token < vocab) logits[token] += bias;
  }
  apply_penalties(logits);

  // log_softmax of the adjusted logits, for the reported log-probabilities.
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
  const MoreLikely more_likely{logits.data()};

  if (params_.temperature == 0.0f) {
    result.id = *std::min_element(order.begin(), order.end(), more_likely);
  } else {
    // Candidates, most likely first when a filter needs the order (only as many as top_k
    // keeps); plain temperature sampling draws over the vocabulary in id order.
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
  generated_tokens_.push_back(result.id);
  return result;
}

}  // namespace gemma4::runtime
