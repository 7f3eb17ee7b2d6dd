#include "runtime/scripted_engine.h"

#include <algorithm>
#include <thread>

namespace gemma4::runtime {

namespace {
constexpr float kChosenLogit = 30.0f;
}

ScriptedEngine::ScriptedEngine(ScriptedEngineOptions options, std::vector<ScriptedReply> scripts)
    : options_(options), scripts_(std::move(scripts)) {}

Expected<engine::SequenceId> ScriptedEngine::open_sequence() {
  std::lock_guard lock(mutex_);
  if (static_cast<int32_t>(sequences_.size()) >= options_.max_sequences) {
    return make_error(ErrorCode::kResourceExhausted, "all {} sequences are in use",
                      options_.max_sequences);
  }
  const engine::SequenceId id = next_id_++;
  sequences_[id] = Sequence{};
  return id;
}

void ScriptedEngine::close_sequence(engine::SequenceId sequence) {
  std::lock_guard lock(mutex_);
  sequences_.erase(sequence);
}

int64_t ScriptedEngine::sequence_length(engine::SequenceId sequence) const {
  std::lock_guard lock(mutex_);
  auto it = sequences_.find(sequence);
  return it == sequences_.end() ? 0 : static_cast<int64_t>(it->second.tokens.size());
}

Status ScriptedEngine::truncate_sequence(engine::SequenceId sequence, int64_t length) {
  std::lock_guard lock(mutex_);
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) {
    return make_error(ErrorCode::kNotFound, "sequence {} is not open", sequence);
  }
  if (length < 0 || length > static_cast<int64_t>(it->second.tokens.size())) {
    return make_error(ErrorCode::kOutOfRange, "cannot truncate sequence {} of {} tokens to {}",
                      sequence, it->second.tokens.size(), length);
  }
  it->second.tokens.resize(static_cast<size_t>(length));
  return {};
}

int32_t ScriptedEngine::open_sequences() const {
  std::lock_guard lock(mutex_);
  return static_cast<int32_t>(sequences_.size());
}

const ScriptedReply* ScriptedEngine::pick_script(const std::vector<int32_t>& history) const {
  const ScriptedReply* best = nullptr;
  std::ptrdiff_t best_position = -1;
  for (const auto& script : scripts_) {
    std::ptrdiff_t position = -1;  // an empty trigger matches "before everything"
    if (!script.trigger.empty()) {
      auto found = std::find_end(history.begin(), history.end(), script.trigger.begin(),
                                 script.trigger.end());
      if (found == history.end()) continue;
      position = found - history.begin();
    }
    if (!best || position > best_position) {
      best = &script;
      best_position = position;
    }
  }
  return best;
}

Status ScriptedEngine::step(std::span<const engine::StepInput> inputs, std::span<float> logits) {
  const size_t vocab = static_cast<size_t>(options_.vocab_size);
  if (logits.size() < inputs.size() * vocab) {
    return make_error(ErrorCode::kInvalidArgument, "logits buffer holds {} floats, need {}",
                      logits.size(), inputs.size() * vocab);
  }
  if (options_.step_delay.count() > 0) std::this_thread::sleep_for(options_.step_delay);
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto it = sequences_.find(inputs[i].sequence);
    if (it == sequences_.end()) {
      return make_error(ErrorCode::kInvalidArgument, "sequence {} is not open", inputs[i].sequence);
    }
    Sequence& sequence = it->second;
    if (sequence.tokens.size() + inputs[i].tokens.size() >
        static_cast<size_t>(options_.max_context)) {
      return make_error(ErrorCode::kOutOfRange, "sequence {} would exceed {} tokens",
                        inputs[i].sequence, options_.max_context);
    }
    for (int32_t token : inputs[i].tokens) {
      if (token < 0 || token >= options_.vocab_size) {
        return make_error(ErrorCode::kInvalidArgument, "token id {} outside the vocabulary", token);
      }
    }
    sequence.tokens.insert(sequence.tokens.end(), inputs[i].tokens.begin(), inputs[i].tokens.end());
    // One token equal to the expected reply token continues the reply; anything else is new
    // prompt text, which restarts the choice of script.
    const bool continues_reply =
        sequence.script && inputs[i].tokens.size() == 1 &&
        sequence.reply_position < sequence.script->reply.size() &&
        inputs[i].tokens[0] == sequence.script->reply[sequence.reply_position];
    if (continues_reply) {
      ++sequence.reply_position;
    } else {
      sequence.script = pick_script(sequence.tokens);
      sequence.reply_position = 0;
    }
    int32_t chosen = options_.end_token;
    if (sequence.script && sequence.reply_position < sequence.script->reply.size()) {
      chosen = sequence.script->reply[sequence.reply_position];
    }
    if (chosen < 0 || chosen >= options_.vocab_size) {
      return make_error(ErrorCode::kInvalidArgument, "scripted token id {} outside the vocabulary",
                        chosen);
    }
    auto row = logits.subspan(i * vocab, vocab);
    std::fill(row.begin(), row.end(), 0.0f);
    row[static_cast<size_t>(chosen)] = kChosenLogit;
  }
  return {};
}

}  // namespace gemma4::runtime
