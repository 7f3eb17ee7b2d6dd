// Model acceptance: the float32 CPU reference engine against transformers' Gemma4ForCausalLM
// (eager, float32) on the tiny synthetic checkpoints. The fixtures under tests/data/golden were
// written by tools/reference/golden.py from the bf16 checkpoint of each (config, seed, grid); the
// checkpoints are regenerated here with the synth library. A quantized twin (W4A16, NVFP4) is
// the same function as the bf16 file of its grid, so it is held to the same fixture through its
// packed format.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/gemma4_engine.h"
#include "model/synth.h"
#include "model/weights.h"
#include "synth_support.h"

namespace gemma4 {
namespace {

constexpr double kTolerance = 1e-3;

struct GoldenCase {
  std::string fixture;  // tests/data/golden/<fixture>.json; names the config, seed and grid
  model::SynthFormat format;
};

std::string case_name(const GoldenCase& c) {
  static const char* kFormats[] = {"bf16", "w4a16", "nvfp4"};
  return c.fixture + "_" + kFormats[static_cast<int>(c.format)];
}

nlohmann::json load_fixture(const std::string& name) {
  std::ifstream file(std::filesystem::path(GEMMA4_SOURCE_DIR) / "tests/data/golden" /
                     (name + ".json"));
  EXPECT_TRUE(file.good()) << "missing fixture " << name;
  return nlohmann::json::parse(file);
}

double logsumexp(const std::vector<float>& logits) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float l : logits) sum += std::exp(l - max);
  return max + std::log(sum);
}

int32_t argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

class Golden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(Golden, MatchesTransformers) {
  const GoldenCase& c = GetParam();
  const auto fixture = load_fixture(c.fixture);
  const auto prompt = fixture["prompt"].get<std::vector<int32_t>>();
  const auto greedy = fixture["greedy"].get<std::vector<int32_t>>();

  model::SynthOptions synth;
  synth.config = fixture["config"].get<std::string>();
  synth.seed = fixture["seed"].get<uint64_t>();
  synth.format = c.format;
  const auto grid = model::parse_synth_grid(fixture.value("grid", "none"));
  ASSERT_TRUE(grid.ok());
  synth.grid = *grid;
  synth.output = testing::scratch_dir("golden_" + case_name(c));
  // Removes the checkpoint (about 120 MB: the real vocabulary); declared before the mapping.
  const testing::RemoveOnExit cleanup{synth.output};
  ASSERT_TRUE(model::synthesize_checkpoint(synth).ok());
  auto loaded = model::LoadedModel::open(synth.output);
  ASSERT_TRUE(loaded.ok()) << loaded.error().to_string();

  engine::EngineOptions options;
  options.max_sequences = 2;
  options.max_context = 256;
  options.ring_history = 4;  // several prefill passes per prompt, as a small ring would need
  auto created = engine::Gemma4Engine::create(
      loaded->config, loaded->weights, std::make_unique<backend::cpu::CpuBackend>(), options);
  ASSERT_TRUE(created.ok()) << created.error().to_string();
  auto& engine = **created;
  const int32_t vocab = engine.vocab_size();
  std::vector<float> logits(vocab);

  // 1. Token by token over prompt + greedy[:-1] (the decode path): logits at every position.
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
      EXPECT_NEAR(logits[ids[i]], values[i], kTolerance) << "position " << pos << " id " << ids[i];
    }
    EXPECT_NEAR(logsumexp(logits), expected["logsumexp"].get<double>(), kTolerance) << pos;
    for (const auto& sampled : fixture["sampled"]) {
      if (sampled["position"].get<size_t>() != pos) continue;
      const auto row = sampled["logits"].get<std::vector<double>>();
      for (size_t i = 0; i < row.size(); ++i) {
        max_delta = std::max(max_delta, std::abs(logits[i * stride] - row[i]));
        EXPECT_NEAR(logits[i * stride], row[i], kTolerance)
            << "position " << pos << " id " << i * stride;
      }
    }
  }
  engine.close_sequence(*sequence);
  std::printf("[ golden   ] %s: max |delta logit| %.3g over %zu positions\n", case_name(c).c_str(),
              max_delta, tokens.size());

  // 2. The prompt in one step (chunked prefill), then 32 greedy decode steps on our own argmax.
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

// Every fixture is regenerated by (GRID: none, w4g32, nvfp4):
//   gemma4 synth --config CONFIG --format bf16 --grid GRID --seed S -o DIR
//   /opt/refenv/bin/python tools/reference/golden.py --checkpoint DIR --config CONFIG
//       --grid GRID --seed S --out tests/data/golden/FIXTURE.json
INSTANTIATE_TEST_SUITE_P(Tiny, Golden,
                         ::testing::Values(GoldenCase{"tiny", model::SynthFormat::kBF16},
                                           GoldenCase{"tiny_moe", model::SynthFormat::kBF16},
                                           GoldenCase{"tiny_w4g32", model::SynthFormat::kW4A16},
                                           GoldenCase{"tiny_nvfp4", model::SynthFormat::kNVFP4},
                                           GoldenCase{"tiny_moe_w4g32", model::SynthFormat::kW4A16},
                                           GoldenCase{"tiny_moe_nvfp4",
                                                      model::SynthFormat::kNVFP4}),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace gemma4
