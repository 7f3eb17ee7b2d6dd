// Next-token sampling from one row of logits: greedy, temperature, top-k, top-p, min-p,
// repetition / presence / frequency penalties, logit bias, seeded randomness and log-probs.
// Deterministic: the same parameters, seed, logits and history give the same tokens on every
// machine (fixed PRNG, no std:: distributions, ties broken towards the lower token id).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
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
  // Added to the logits of the given token ids before anything else (a token listed twice gets
  // the sum of its biases).
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
  // Greedy and top-k draws (top_k < vocabulary, any top_p / min_p) and the top_logprobs need
  // only the max(top_k or 1, top_logprobs) best tokens after the bias and penalties (as edits):
  // up to engine::kMaxLogitCandidates of them are asked for; anything else takes the full row.
  engine::LogitRequest logit_request(int32_t vocab_size) override;
  // The same token, log-prob and alternatives (and the same random draw) that sample() picks
  // from the full row whose summary this is.
  SampledToken sample(const engine::LogitSummary& summary) override;

  const SamplingParams& params() const { return params_; }

 private:
  // How many candidates decide the next pick exactly (0: the full row is needed).
  int32_t candidates_needed(int32_t vocab_size) const;
  // The edit of `token`, made (neutral) on first use.
  engine::LogitEdit& edit_of(int32_t token);
  // Updates the penalties after `token` was generated.
  void record(int32_t token);
  // edits_ without tokens at or past vocab_size (edits_ holds no negative tokens).
  std::span<const engine::LogitEdit> edits_for(int32_t vocab_size);

  SamplingParams params_;
  Rng rng_;
  // The logit bias and the penalties of the next pick as edits, one per token (kept up to date
  // token by token, so a pick costs nothing per prompt token).
  std::vector<engine::LogitEdit> edits_;
  std::unordered_map<int32_t, size_t> edit_index_;  // token -> its edit in edits_
  std::unordered_map<int32_t, int> generated_counts_;
  int32_t max_edit_token_ = -1;
  std::vector<engine::LogitEdit> in_vocabulary_edits_;  // edits_for's storage when it filters
};

}  // namespace gemma4::runtime
