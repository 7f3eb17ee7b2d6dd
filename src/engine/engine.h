// What the runtime (scheduler, server, CLI) drives: a model with per-sequence KV state that
// appends tokens and returns next-token logits. Implemented over a Backend by engine/, and by a
// scripted engine in tests. No HTTP, no strings: token ids in, logits out (whole rows, or just
// the few candidates a sampler needs: step_sampled).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "core/status.h"

namespace gemma4::engine {

using SequenceId = int32_t;

struct StepInput {
  SequenceId sequence = -1;
  // Tokens appended to the sequence in this step: a prefill chunk, or one decoded token (or
  // k+1 tokens for a speculative verify). Positions continue from sequence_length().
  std::span<const int32_t> tokens;
};

// One token's adjustment before ranking (runtime::Sampler's logit bias and penalties), in this
// order: logit += bias; logit = logit > 0 ? logit / repetition_penalty : logit ·
// repetition_penalty; logit -= subtract. Each at its neutral value changes nothing a sampler can
// observe. At most one edit per token of a row.
struct LogitEdit {
  int32_t token = 0;
  float bias = 0.0f;
  float repetition_penalty = 1.0f;
  float subtract = 0.0f;
};

// What step_sampled returns for one input.
struct LogitRequest {
  // 0: the input's whole row of logits, unadjusted. k > 0: a LogitSummary with the k most
  // likely tokens of the row after `edits` (at most kMaxLogitCandidates).
  int32_t candidates = 0;
  std::span<const LogitEdit> edits;
};

// Most candidates a LogitRequest may ask for (the CUDA top-k kernels' limit).
inline constexpr int32_t kMaxLogitCandidates = 64;

// A row of logits (after its edits) as far as greedy, top-k and log-prob sampling need it.
struct LogitSummary {
  float max_logit = 0.0f;
  // max_logit + log Σ exp(logit - max_logit) over the row: log-probability = logit - this.
  double log_normaliser = 0.0;
  // The `candidates` most likely (token, logit), higher logit first, equal logits: lower id
  // first (fewer when the vocabulary is smaller).
  std::vector<std::pair<int32_t, float>> top;
};

// One token of Engine::decode_greedy: a row's greedy token (top[0] of a one-candidate
// LogitSummary without edits), its logit and the row's log-normaliser (log-probability = logit -
// log_normaliser).
struct GreedyToken {
  int32_t id = 0;
  float logit = 0.0f;
  double log_normaliser = 0.0;

  bool operator==(const GreedyToken&) const = default;
};

// What decode_greedy does with a sequence's token once on_token has seen it.
enum class GreedyNext : uint8_t {
  kStop,      // not appended: the sequence stops (an end-of-sequence token, the last one wanted)
  kContinue,  // appended by the next step, whose token on_token sees next
  // Appended by the next step, whose token is the sequence's last: on_token sees it, and the
  // sequence stops there whatever on_token answers. An engine that enqueues steps ahead enqueues
  // none past a known end (kStop instead costs the sequence a step enqueued for nothing).
  kLast,
};

// decode_greedy's callback: (index into its sequences, the sequence's token of the step).
using GreedyTokenCallback = std::function<GreedyNext(size_t, const GreedyToken&)>;

// Applies `edits` to `row` in place (every edit's token must be inside the row).
void apply_logit_edits(std::span<float> row, std::span<const LogitEdit> edits);

// The host definition of a LogitSummary (the CPU engine's, and the reference of device ones):
// applies `edits` to `row` in place, then summarises it with `candidates` candidates. The
// normaliser's sum runs in id order in double precision, as runtime::Sampler's does.
void summarize_logits(std::span<float> row, std::span<const LogitEdit> edits, int32_t candidates,
                      LogitSummary& summary);

class Engine {
 public:
  virtual ~Engine() = default;

  virtual int32_t vocab_size() const = 0;
  // Longest sequence (prompt + generated tokens) one sequence may hold.
  virtual int64_t max_context() const = 0;
  // How many sequences may be open at once (KV capacity).
  virtual int32_t max_sequences() const = 0;

  virtual Expected<SequenceId> open_sequence() = 0;
  // Frees the sequence's KV at once.
  virtual void close_sequence(SequenceId sequence) = 0;
  virtual int64_t sequence_length(SequenceId sequence) const = 0;
  // Rolls a sequence back to its first `length` tokens (prefix reuse, speculative rejection).
  // Fails with kOutOfRange if the KV for that point is no longer held (e.g. a sliding ring has
  // overwritten it); the caller then re-prefills.
  virtual Status truncate_sequence(SequenceId sequence, int64_t length) = 0;

  // Appends each input's tokens to its sequence (all inputs in one batched forward) and writes
  // the final-softcapped logits of each input's LAST token to
  // logits[i * vocab_size() .. (i+1) * vocab_size()).
  virtual Status step(std::span<const StepInput> inputs, std::span<float> logits) = 0;

  // step(), returning per input only what requests[i] asks for: inputs asking for the full row
  // get it in `full_rows` (packed: the j-th such input's row at j · vocab_size()); the others
  // get summaries[i] (entries of full-row inputs are left alone). An engine whose logits live on
  // a device copies only the summaries to the host for those. Default: step() into a host
  // buffer, then summarize_logits() per summarised row.
  virtual Status step_sampled(std::span<const StepInput> inputs,
                              std::span<const LogitRequest> requests,
                              std::span<LogitSummary> summaries, std::span<float> full_rows);

  // Greedy decoding of several sequences, one token per sequence and step: the first step
  // appends first_tokens[i] to sequences[i]; each step's greedy token of sequence i (top[0] of
  // a one-candidate LogitRequest without edits, with its logit and log-normaliser) goes to
  // on_token(i, token), whose GreedyNext says whether the next step appends it. A sequence also
  // stops when its context is full after a step (on_token still sees that step's token; its
  // answer is then ignored). Returns once every sequence has stopped. on_token may close
  // sequences (close_sequence; one of this call's only once it has stopped, or as on_token
  // stops it) and call nothing else of the engine. The tokens, logits and KV are those of
  // step_sampled steps fed back the greedy tokens by the caller (the default implementation,
  // greedy_decode_by_steps); an engine whose logits live on a device keeps each token there and
  // enqueues the next step before the host sees the token (Gemma4Engine: see there for the one
  // way its rounding can differ).
  virtual Status decode_greedy(std::span<const SequenceId> sequences,
                               std::span<const int32_t> first_tokens,
                               const GreedyTokenCallback& on_token);
};

// Engine::decode_greedy's reference: a step_sampled step per token, the greedy token fed back by
// the host.
Status greedy_decode_by_steps(Engine& engine, std::span<const SequenceId> sequences,
                              std::span<const int32_t> first_tokens,
                              const GreedyTokenCallback& on_token);

// Checks step_sampled's arguments against the inputs and the vocabulary (shared by engines).
Status check_logit_requests(size_t inputs, std::span<const LogitRequest> requests,
                            std::span<const LogitSummary> summaries,
                            std::span<const float> full_rows, int32_t vocab_size);

}  // namespace gemma4::engine
