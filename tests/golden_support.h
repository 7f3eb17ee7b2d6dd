// An engine against a golden fixture: tests/data/golden/<name>.json, written by
// tools/reference/golden.py from transformers' float32 logits on the tiny synthetic checkpoints
// (the fixture names the config, seed and grid the checkpoint is regenerated from).
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "engine/gemma4_engine.h"

namespace gemma4::testing {

// Fixture `name` in `source_dir`/tests/data/golden (a failed expectation and null if missing).
inline nlohmann::json load_golden_fixture(const std::filesystem::path& source_dir,
                                          const std::string& name) {
  std::ifstream file(source_dir / "tests/data/golden" / (name + ".json"));
  EXPECT_TRUE(file.good()) << "missing fixture " << name;
  if (!file.good()) return nullptr;
  return nlohmann::json::parse(file);
}

inline int32_t argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

inline double logsumexp(const std::vector<float>& logits) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float l : logits) sum += std::exp(l - max);
  return max + std::log(sum);
}

// 1. Token by token over prompt + greedy[:-1] (the decode path): at every position the listed
//    logits, the logsumexp and the sampled vocabulary rows within `tolerance` of the fixture's.
// 2. The prompt in one step (chunked prefill), then greedy decoding on the engine's own argmax:
//    the fixture's greedy continuation exactly.
// Prints the largest |delta logit| under `label`.
inline void expect_matches_golden(engine::Gemma4Engine& engine, const nlohmann::json& fixture,
                                  double tolerance, const std::string& label) {
  ASSERT_TRUE(fixture.is_object()) << label;
  const auto prompt = fixture["prompt"].get<std::vector<int32_t>>();
  const auto greedy = fixture["greedy"].get<std::vector<int32_t>>();
  std::vector<float> logits(engine.vocab_size());

  std::vector<int32_t> tokens = prompt;
  tokens.insert(tokens.end(), greedy.begin(), greedy.end() - 1);
  ASSERT_EQ(fixture["positions"].size(), tokens.size());
  auto sequence = engine.open_sequence();
  ASSERT_TRUE(sequence.ok());
  double max_delta = 0.0;
  const auto stride = fixture["vocab_stride"].get<int64_t>();
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    const engine::StepInput input{*sequence, std::span<const int32_t>(&tokens[pos], 1)};
    ASSERT_TRUE(engine.step({&input, 1}, logits).ok());
    const auto& expected = fixture["positions"][pos];
    const auto ids = expected["ids"].get<std::vector<int32_t>>();
    const auto values = expected["logits"].get<std::vector<double>>();
    for (size_t i = 0; i < ids.size(); ++i) {
      max_delta = std::max(max_delta, std::abs(logits[ids[i]] - values[i]));
      EXPECT_NEAR(logits[ids[i]], values[i], tolerance) << "position " << pos << " id " << ids[i];
    }
    EXPECT_NEAR(logsumexp(logits), expected["logsumexp"].get<double>(), tolerance) << pos;
    for (const auto& sampled : fixture["sampled"]) {
      if (sampled["position"].get<size_t>() != pos) continue;
      const auto row = sampled["logits"].get<std::vector<double>>();
      for (size_t i = 0; i < row.size(); ++i) {
        max_delta = std::max(max_delta, std::abs(logits[i * stride] - row[i]));
        EXPECT_NEAR(logits[i * stride], row[i], tolerance)
            << "position " << pos << " id " << i * stride;
      }
    }
  }
  engine.close_sequence(*sequence);
  std::printf("[ golden   ] %s: max |delta logit| %.3g over %zu positions\n", label.c_str(),
              max_delta, tokens.size());

  sequence = engine.open_sequence();
  ASSERT_TRUE(sequence.ok());
  std::vector<int32_t> generated;
  std::vector<int32_t> next = prompt;
  while (generated.size() < greedy.size()) {
    const engine::StepInput input{*sequence, next};
    ASSERT_TRUE(engine.step({&input, 1}, logits).ok());
    generated.push_back(argmax(logits));
    next.assign(1, generated.back());
  }
  EXPECT_EQ(generated, greedy);
}

}  // namespace gemma4::testing
