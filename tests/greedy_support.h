// Engine::decode_greedy against its reference (engine::greedy_decode_by_steps) on two engines of
// one model, shared by the CPU engine tests and the CUDA ones: the same prompts, the same stops,
// then the same tokens, lengths and (one step later) logits.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <ostream>
#include <vector>

#include "engine/engine.h"
#include "test_support.h"

namespace gemma4::engine {
// For gtest's messages.
inline void PrintTo(const GreedyToken& token, std::ostream* out) {
  *out << "{" << token.id << ", " << token.logit << ", " << token.log_normaliser << "}";
}
}  // namespace gemma4::engine

namespace gemma4::testing {

// One decode_greedy run: the tokens each sequence was told about, in order.
using GreedyTokens = std::vector<std::vector<engine::GreedyToken>>;

// How decode_with_stops ends a sequence at its limit: GreedyNext::kStop at its last token (an
// end the caller did not see coming: a step enqueued ahead is rolled back), or kLast at the one
// before (announced).
enum class Ending { kUnforeseen, kAnnounced };

// Opens one sequence per prompt on `engine`, prefills it (step_sampled, one candidate), then
// decodes greedily from first_tokens, sequence i stopping at its limits[i]-th token as endings[i]
// says (or at a full context). `chained`: Engine::decode_greedy, else greedy_decode_by_steps.
inline GreedyTokens decode_with_stops(engine::Engine& engine,
                                      const std::vector<std::vector<int32_t>>& prompts,
                                      const std::vector<int32_t>& first_tokens,
                                      const std::vector<int>& limits,
                                      const std::vector<Ending>& endings, bool chained,
                                      std::vector<engine::SequenceId>& sequences) {
  sequences.clear();
  for (const auto& prompt : prompts) {
    auto sequence = engine.open_sequence();
    EXPECT_TRUE(sequence.ok());
    sequences.push_back(*sequence);
    const engine::StepInput input{*sequence, prompt};
    const engine::LogitRequest request{1, {}};
    engine::LogitSummary summary;
    EXPECT_TRUE(engine.step_sampled({&input, 1}, {&request, 1}, {&summary, 1}, {}).ok());
  }
  GreedyTokens seen(prompts.size());
  const auto on_token = [&](size_t i, const engine::GreedyToken& token) {
    seen[i].push_back(token);
    const int count = static_cast<int>(seen[i].size());
    if (count >= limits[i]) return engine::GreedyNext::kStop;
    if (endings[i] == Ending::kAnnounced && count + 1 == limits[i])
      return engine::GreedyNext::kLast;
    return engine::GreedyNext::kContinue;
  };
  const Status status =
      chained ? engine.decode_greedy(sequences, first_tokens, on_token)
              : engine::greedy_decode_by_steps(engine, sequences, first_tokens, on_token);
  EXPECT_TRUE(status.ok()) << status.error().to_string();
  return seen;
}

// Appends `token` to every sequence of both engines in one step and returns both engines' full
// rows (what a KV written past a stop would corrupt).
inline std::pair<std::vector<float>, std::vector<float>> step_both(
    engine::Engine& a, const std::vector<engine::SequenceId>& a_sequences, engine::Engine& b,
    const std::vector<engine::SequenceId>& b_sequences, int32_t token) {
  const auto rows = [&](engine::Engine& engine, const std::vector<engine::SequenceId>& sequences) {
    std::vector<engine::StepInput> inputs;
    for (engine::SequenceId sequence : sequences) inputs.push_back({sequence, {&token, 1}});
    std::vector<float> logits(sequences.size() * static_cast<size_t>(engine.vocab_size()));
    const Status status = engine.step(inputs, logits);
    EXPECT_TRUE(status.ok()) << status.error().to_string();
    return logits;
  };
  return {rows(a, a_sequences), rows(b, b_sequences)};
}

}  // namespace gemma4::testing
