// Engine::decode_greedy against its reference (engine::greedy_decode_by_steps) on two engines of
// one model, shared by the CPU engine tests and the CUDA ones: the same prompts, the same stops,
// then the same tokens, lengths and (one step later) logits.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "engine/engine.h"
#include "test_support.h"

namespace gemma4::testing {

// One decode_greedy run: the tokens each sequence was told about, in order.
using GreedyTokens = std::vector<std::vector<int32_t>>;

// Opens one sequence per prompt on `engine`, prefills it (step_sampled, one candidate), then
// decodes greedily from first_tokens, sequence i stopping at its limits[i]-th token (or at a
// full context). `chained`: Engine::decode_greedy, else greedy_decode_by_steps.
inline GreedyTokens decode_with_stops(engine::Engine& engine,
                                      const std::vector<std::vector<int32_t>>& prompts,
                                      const std::vector<int32_t>& first_tokens,
                                      const std::vector<int>& limits, bool chained,
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
  const auto on_token = [&](size_t i, int32_t token) {
    seen[i].push_back(token);
    return static_cast<int>(seen[i].size()) < limits[i];
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
