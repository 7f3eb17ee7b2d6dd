// Next-token sampling from one row of logits: greedy, temperature, top-k, top-p, min-p,
// repetition / presence / frequency penalties, logit bias, seeded randomness and log-probs.
// Deterministic: the same parameters, seed, logits and history give the same tokens on every
// machine (fixed PRNG, no std:: distributions, ties broken towards the lower token id).
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "core/status.h"
#include "runtime/token_sampler.h"

namespace gemma4::runtime {

struct SamplingParams {
  // 0 = greedy (argmax; ties go to the lower token id). Otherwise logits are divided by it.
  float temperature = 1.0f;
  int top_k = 0;       // keep the k most likely tokens; 0 = off
  float top_p = 1.0f;  // keep the smallest set whose probability reaches top_p; 1 = off
  float min_p = 0.0f;  // drop tokens with p < min_p · p_max; 0 = off
  // HF/vLLM-style: a seen token's logit is divided by the penalty if positive, multiplied if
  // negative. "Seen" = in the prompt or generated so far. 1 = off.
  float repetition_penalty = 1.0f;
  // OpenAI-style, over generated tokens only: logit -= presence·[count > 0] + frequency·count.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Added to the logits of the given token ids before anything else.
  std::vector<std::pair<int32_t, float>> logit_bias;
  uint64_t seed = 0;
  // Number of most likely alternatives to report with each token (0 = none). Reported
  // log-probabilities are log_softmax of the logits after bias and penalties, before
  // temperature and truncation.
  int top_logprobs = 0;

  // Range checks, with a message naming the bad field.
  Status validate(int32_t vocab_size) const;
};

// Fixed, portable generator (xoshiro256** seeded through splitmix64).
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next();
  // Uniform in [0, 1) with 53 random bits.
  double uniform();

 private:
  uint64_t state_[4];
};

// One sampler per generated sequence: it owns the sequence's random stream and the counts of
// the tokens it has generated (for presence/frequency penalties).
class Sampler final : public TokenSampler {
 public:
  // `params` must have passed validate().
  Sampler(SamplingParams params, std::span<const int32_t> prompt_tokens);

  // Picks the next token from `logits` (one row, vocab_size values; adjusted in place) and
  // records it as generated.
  SampledToken sample(std::span<float> logits) override;

  const SamplingParams& params() const { return params_; }

 private:
  void apply_penalties(std::span<float> logits) const;

  SamplingParams params_;
  Rng rng_;
  std::vector<int32_t> prompt_tokens_;
  std::vector<int32_t> generated_tokens_;
};

}  // namespace gemma4::runtime
