// The scheduler's view of sampling: one TokenSampler per request turns that request's logits
// into the next token (with its log-probability and, when asked, the top alternatives). The
// sampler keeps the per-request state (seeded RNG, penalty history) itself. A sampler that can
// decide from a few candidates says so (logit_request), so the engine copies only those.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "engine/engine.h"

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
  // What the next pick needs of the engine: the full row (candidates 0: sample(logits)), or a
  // summary after edits (sample(summary)). The edits stay valid until the next sample call.
  virtual engine::LogitRequest logit_request(int32_t vocab_size) = 0;
  // Picks the next token from the summary that logit_request asked for.
  virtual SampledToken sample(const engine::LogitSummary& summary) = 0;
};

}  // namespace gemma4::runtime
