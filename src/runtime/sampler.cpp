#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

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

// A temperature draw from the first `keep` tokens of a list (id_at(i), logit_at(i)), most likely
// first when top_p / min_p truncate it: the full row's path and the candidates' path share it,
// so both do the same arithmetic and consume the same random number.
template <typename IdAt, typename LogitAt>
int32_t draw(const SamplingParams& params, Rng& rng, float max_logit, int32_t keep, IdAt id_at,
             LogitAt logit_at) {
  std::vector<double> probs(keep);
  const double inv_temperature = 1.0 / params.temperature;
  double total = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    probs[i] = std::exp((static_cast<double>(logit_at(i)) - max_logit) * inv_temperature);
    total += probs[i];
  }
  int32_t kept = keep;
  if (params.top_p < 1.0f) {
    double cumulative = 0.0;
    for (int32_t i = 0; i < keep; ++i) {
      cumulative += probs[i] / total;
      if (cumulative >= params.top_p) {
        kept = i + 1;
        break;
      }
    }
  }
  if (params.min_p > 0.0f) {
    const double threshold = params.min_p * probs[0];
    int32_t i = 1;
    while (i < kept && probs[i] >= threshold) ++i;
    kept = i;
  }
  double kept_total = 0.0;
  for (int32_t i = 0; i < kept; ++i) kept_total += probs[i];
  double target = rng.uniform() * kept_total;
  for (int32_t i = 0; i < kept; ++i) {
    target -= probs[i];
    if (target < 0.0) return id_at(i);
  }
  return id_at(kept - 1);
}

float logprob(float logit, double log_normaliser) {
  return static_cast<float>(static_cast<double>(logit) - log_normaliser);
}

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
    : params_(std::move(params)), rng_(params_.seed) {
  for (const auto& [token, bias] : params_.logit_bias) edit_of(token).bias += bias;
  if (params_.repetition_penalty != 1.0f) {
    for (int32_t token : prompt_tokens) {
      if (token >= 0) edit_of(token).repetition_penalty = params_.repetition_penalty;
    }
  }
}

engine::LogitEdit& Sampler::edit_of(int32_t token) {
  const auto [found, inserted] = edit_index_.try_emplace(token, edits_.size());
  if (inserted) {
    edits_.push_back({});
    edits_.back().token = token;
    max_edit_token_ = std::max(max_edit_token_, token);
  }
  return edits_[found->second];
}

void Sampler::record(int32_t token) {
  if (params_.repetition_penalty != 1.0f)
    edit_of(token).repetition_penalty = params_.repetition_penalty;
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    const int count = ++generated_counts_[token];
    edit_of(token).subtract =
        params_.presence_penalty + params_.frequency_penalty * static_cast<float>(count);
  }
}

std::span<const engine::LogitEdit> Sampler::edits_for(int32_t vocab_size) {
  // Prompt tokens outside the engine's vocabulary have no logit to penalise.
  if (max_edit_token_ < vocab_size) return edits_;
  in_vocabulary_edits_.clear();
  for (const engine::LogitEdit& edit : edits_) {
    if (edit.token < vocab_size) in_vocabulary_edits_.push_back(edit);
  }
  return in_vocabulary_edits_;
}

int32_t Sampler::candidates_needed(int32_t vocab_size) const {
  // A top-k draw ranks only its k best (below the vocabulary size: at it, a draw without
  // top_p / min_p runs over the whole row in id order).
  const bool top_k_draw = params_.top_k > 0 && params_.top_k < vocab_size;
  const int32_t picks = params_.temperature == 0.0f ? 1 : top_k_draw ? params_.top_k : 0;
  if (picks == 0) return 0;
  const int32_t needed = std::max(picks, params_.top_logprobs);
  return needed <= engine::kMaxLogitCandidates ? needed : 0;
}

engine::LogitRequest Sampler::logit_request(int32_t vocab_size) {
  const int32_t candidates = candidates_needed(vocab_size);
  if (candidates == 0) return {};
  return {candidates, edits_for(vocab_size)};
}

SampledToken Sampler::sample(const engine::LogitSummary& summary) {
  const auto& top = summary.top;
  SampledToken result;
  int32_t chosen = 0;  // index into top
  if (params_.temperature != 0.0f) {
    chosen = draw(
        params_, rng_, summary.max_logit, params_.top_k, [](int32_t i) { return i; },
        [&](int32_t i) { return top[i].second; });
  }
  result.id = top[chosen].first;
  result.logprob = logprob(top[chosen].second, summary.log_normaliser);
  for (int i = 0; i < params_.top_logprobs; ++i)
    result.top_logprobs.emplace_back(top[i].first, logprob(top[i].second, summary.log_normaliser));
  record(result.id);
  return result;
}

SampledToken Sampler::sample(std::span<float> logits) {
  const auto vocab = static_cast<int32_t>(logits.size());
  const auto edits = edits_for(vocab);
  if (const int32_t candidates = candidates_needed(vocab); candidates > 0) {
    engine::LogitSummary summary;
    engine::summarize_logits(logits, edits, candidates, summary);
    return sample(summary);
  }
  engine::apply_logit_edits(logits, edits);

  // log_softmax of the adjusted logits, for the reported log-probabilities.
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max_logit);
  const double log_normaliser = max_logit + std::log(sum);

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
    result.id = draw(
        params_, rng_, max_logit, keep, [&](int32_t i) { return order[i]; },
        [&](int32_t i) { return logits[order[i]]; });
  }

  result.logprob = logprob(logits[result.id], log_normaliser);
  if (params_.top_logprobs > 0) {
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + params_.top_logprobs, order.end(),
                      more_likely);
    for (int i = 0; i < params_.top_logprobs; ++i)
      result.top_logprobs.emplace_back(order[i], logprob(logits[order[i]], log_normaliser));
  }
  record(result.id);
  return result;
}

}  // namespace gemma4::runtime
