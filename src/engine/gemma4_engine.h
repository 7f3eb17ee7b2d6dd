// The Gemma 4 text decoder (gemma4-architecture.md sections 2.2-2.7 and 3) written once over a
// Backend, as an engine::Engine: batched prefill chunks and decode steps over sequences whose
// KV caches the engine owns.
//
// KV cache, per open sequence and per layer that owns K/V (KV-shared layers store nothing and
// read their source layer's cache):
//  * full-attention layers: one slot per position of the context (max_context slots);
//  * sliding layers: a ring of window + ring_history slots; position p lives in slot p % slots
//    and each slot records the position it holds.
// The ring_history extra slots serve two purposes. A forward pass writes a chunk's K/V before
// attending, so a chunk of C tokens needs window - 1 + C live slots: prefill is therefore cut
// into passes of at most ring_history + 1 tokens per sequence. And truncate_sequence can roll a
// sequence back as long as the ring still holds the window before the new end (up to
// ring_history tokens behind the furthest point written).
#pragma once

#include <memory>
#include <vector>

#include "engine/backend.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/weights.h"

namespace gemma4::engine {

struct EngineOptions {
  int32_t max_sequences = 4;
  // Clipped to the model's max_position_embeddings.
  int64_t max_context = 4096;
  // Sliding-ring slots beyond the window (see above). At least 1.
  int ring_history = 32;
  // Most tokens one forward pass processes over all sequences (workspace size).
  int max_pass_tokens = 256;
  // Record decode steps (every input appends one token) on backends that can (Backend::record)
  // and replay them: one recording per ordered list of sequences, made on the second step with
  // that list (the first runs unrecorded so every lazily made backend resource exists).
  bool record_decode = true;
};

class Gemma4Engine final : public Engine {
 public:
  // `weights` must stay alive as long as the engine. A backend that cannot read host memory gets
  // its own copy of them (engine/resident_weights.h).
  static Expected<std::unique_ptr<Gemma4Engine>> create(const model::ModelConfig& config,
                                                        const model::ModelWeights& weights,
                                                        std::unique_ptr<Backend> backend,
                                                        const EngineOptions& options = {});
  ~Gemma4Engine() override;

  int32_t vocab_size() const override;
  int64_t max_context() const override;
  int32_t max_sequences() const override;

  Expected<SequenceId> open_sequence() override;
  void close_sequence(SequenceId sequence) override;
  int64_t sequence_length(SequenceId sequence) const override;
  Status truncate_sequence(SequenceId sequence, int64_t length) override;
  Status step(std::span<const StepInput> inputs, std::span<float> logits) override;

 private:
  struct Impl;
  explicit Gemma4Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gemma4::engine
