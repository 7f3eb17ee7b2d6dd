// The scheduler's view of sampling: one TokenSampler per request turns that request's logits
// into the next token (with its log-probability and, when asked, the top alternatives). The
// sampler keeps the per-request state (seeded RNG, penalty history) itself.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace gemma4::runtime {

struct SampledToken {
  int32_t id = -1;
  // Log-probability of `id` under the distribution the sampler drew from (before truncation).
  float logprob = 0.0f;
  // The most likely alternatives (id, logprob), best first; empty unless requested.
  std::vector<std::pair<int32_t, float>> top_logprobs;
};

class TokenSampler {
 public:
  virtual ~TokenSampler() = default;
  // Picks the next token from `logits` (vocab_size floats). May modify `logits` in place.
  virtual SampledToken sample(std::span<float> logits) = 0;
};

}  // namespace gemma4::runtime
