// What the runtime (scheduler, server, CLI) drives: a model with per-sequence KV state that
// appends tokens and returns next-token logits. Implemented over a Backend by engine/, and by a
// scripted engine in tests. No HTTP, no strings: token ids in, logits out.
#pragma once

#include <cstdint>
#include <span>

#include "core/status.h"

namespace gemma4::engine {

using SequenceId = int32_t;

struct StepInput {
  SequenceId sequence = -1;
  // Tokens appended to the sequence in this step: a prefill chunk, or one decoded token (or
  // k+1 tokens for a speculative verify). Positions continue from sequence_length().
  std::span<const int32_t> tokens;
};

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
};

}  // namespace gemma4::engine
