// ScriptedEngine: an Engine that replays scripted replies instead of running a model, so tests
// (and `gemma4 serve --scripted-engine FILE`) can force exact outputs such as tool calls or
// thinking blocks through the real scheduler, parser and HTTP layers.
//
// Each script is (trigger, reply) in token ids. When a sequence receives new prompt tokens, the
// script whose trigger occurs LAST in the sequence's history is chosen (an empty trigger is the
// fallback), and the logits then make `reply` the greedy continuation, one token per step,
// followed by `end_token` forever. The logits are one-hot (+30 on the chosen token), so
// temperature sampling still picks it.
#pragma once

#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>

#include "engine/engine.h"

namespace gemma4::runtime {

struct ScriptedReply {
  std::vector<int32_t> trigger;
  std::vector<int32_t> reply;
};

struct ScriptedEngineOptions {
  int32_t vocab_size = 262144;
  int64_t max_context = 4096;
  int32_t max_sequences = 4;
  int32_t end_token = 1;
  // Sleep per step() call, so tests can observe running requests, queueing and cancellation.
  std::chrono::milliseconds step_delay{0};
};

class ScriptedEngine final : public engine::Engine {
 public:
  ScriptedEngine(ScriptedEngineOptions options, std::vector<ScriptedReply> scripts);

  int32_t vocab_size() const override { return options_.vocab_size; }
  int64_t max_context() const override { return options_.max_context; }
  int32_t max_sequences() const override { return options_.max_sequences; }

  Expected<engine::SequenceId> open_sequence() override;
  void close_sequence(engine::SequenceId sequence) override;
  int64_t sequence_length(engine::SequenceId sequence) const override;
  Status truncate_sequence(engine::SequenceId sequence, int64_t length) override;
  Status step(std::span<const engine::StepInput> inputs, std::span<float> logits) override;

  int32_t open_sequences() const;

 private:
  struct Sequence {
    std::vector<int32_t> tokens;
    const ScriptedReply* script = nullptr;
    size_t reply_position = 0;  // reply tokens already appended
  };
  const ScriptedReply* pick_script(const std::vector<int32_t>& history) const;

  ScriptedEngineOptions options_;
  std::vector<ScriptedReply> scripts_;
  mutable std::mutex mutex_;
  std::map<engine::SequenceId, Sequence> sequences_;
  engine::SequenceId next_id_ = 0;
};

}  // namespace gemma4::runtime
