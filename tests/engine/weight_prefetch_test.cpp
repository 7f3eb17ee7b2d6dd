// The engine's weight prefetch plan (EngineOptions::prefetch_bytes): what each layer of a decode
// pass asks Backend::prefetch_weights for. The expected ranges are written from the option's
// definition over the checkpoint's matrices (a backend that reads host memory sees them in place):
// the weights in read order from the layer's o_proj on (o_proj, gate, up, down, router, PLE
// gate and projection, the next layer's q, k, v, ..., lm_head), skip bytes dropped, then whole
// rows until the budget is met, each matrix as its data head and its scales head.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu_forwarding_backend.h"
#include "engine/gemma4_engine.h"
#include "quant/qmatrix.h"
#include "synth_support.h"

namespace gemma4::engine {
namespace {

// The CPU backend, keeping every prefetch_weights call.
class PrefetchRecordingBackend final : public testing::CpuForwardingBackend {
 public:
  std::vector<std::vector<WeightRange>> calls;

  const char* name() const override { return "cpu+prefetch-log"; }
  void prefetch_weights(std::span<const WeightRange> ranges) override {
    calls.emplace_back(ranges.begin(), ranges.end());
  }
};

// Rows [first, first + count) of m: its data range and its scales range (if it has scales).
std::vector<WeightRange> row_ranges(const quant::QMatrix& m, int64_t first, int64_t count) {
  const int64_t data_row = quant::row_data_bytes(m), scale_row = quant::row_scale_bytes(m);
  std::vector<WeightRange> ranges = {
      {static_cast<const char*>(m.data) + first * data_row, count * data_row}};
  if (scale_row > 0) {
    ranges.push_back({static_cast<const char*>(m.scales) + first * scale_row, count * scale_row});
  }
  return ranges;
}

int64_t row_bytes(const quant::QMatrix& m) {
  return quant::row_data_bytes(m) + quant::row_scale_bytes(m);
}

void expect_ranges(const std::vector<WeightRange>& got, const std::vector<WeightRange>& expected,
                   const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].data, expected[i].data) << what << ", range " << i;
    EXPECT_EQ(got[i].bytes, expected[i].bytes) << what << ", range " << i;
  }
}

struct PrefetchCalls {
  std::vector<std::vector<WeightRange>> prefill_calls;
  std::vector<std::vector<WeightRange>> decode_calls;
};

// A 4-token prefill, then one decode step, through an engine with these prefetch options.
PrefetchCalls run_engine(const model::LoadedModel& m, int64_t bytes, int64_t skip_bytes) {
  EngineOptions options;
  options.max_sequences = 1;
  options.max_context = 32;
  options.prefetch_bytes = bytes;
  options.prefetch_skip_bytes = skip_bytes;
  auto owned = std::make_unique<PrefetchRecordingBackend>();
  PrefetchRecordingBackend& backend = *owned;
  auto engine = Gemma4Engine::create(m.config, m.weights, std::move(owned), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  if (!engine.ok()) return {};
  auto sequence = (*engine)->open_sequence();
  EXPECT_TRUE(sequence.ok());
  std::vector<float> logits(m.config.vocab_size);
  const std::vector<int32_t> prompt = {2, 17, 40, 9};
  EXPECT_TRUE((*engine)->step({{StepInput{*sequence, prompt}}}, logits).ok());
  PrefetchCalls run;
  run.prefill_calls = backend.calls;
  backend.calls.clear();
  const std::vector<int32_t> next = {5};
  EXPECT_TRUE((*engine)->step({{StepInput{*sequence, next}}}, logits).ok());
  run.decode_calls = backend.calls;
  return run;
}

class WeightPrefetch : public ::testing::TestWithParam<std::string> {};

TEST_P(WeightPrefetch, DecodeLayersAskForTheWeightsAheadOfTheirReads) {
  const model::LoadedModel& m = testing::tiny_w4a16_model(GetParam());
  const auto& layers = m.weights.layers;
  const int num_layers = m.config.num_layers;
  // The smallest o_proj and a few rows of the gate: the layers with that o_proj get it whole and
  // the gate's head, those with a larger one (other attention shapes) the head of their o_proj.
  int64_t smallest_o_proj = layers[0].o_proj.bytes();
  for (const model::LayerWeights& w : layers) {
    smallest_o_proj = std::min(smallest_o_proj, w.o_proj.bytes());
  }
  const int64_t budget = smallest_o_proj + 2 * row_bytes(layers[0].gate_proj) + 1;
  const PrefetchCalls run = run_engine(m, budget, 0);
  EXPECT_TRUE(run.prefill_calls.empty()) << "prefill passes prefetch nothing";
  ASSERT_EQ(std::ssize(run.decode_calls), num_layers) << "one call per decode layer";
  int cut_in_o_proj = 0;
  for (int l = 0; l < num_layers; ++l) {
    const model::LayerWeights& w = layers[l];
    const auto rows_for = [](int64_t bytes, const quant::QMatrix& m) {
      return (bytes + row_bytes(m) - 1) / row_bytes(m);
    };
    std::vector<WeightRange> expected;
    if (budget <= w.o_proj.bytes()) {
      expected = row_ranges(w.o_proj, 0, rows_for(budget, w.o_proj));
      ++cut_in_o_proj;
    } else {
      expected = row_ranges(w.o_proj, 0, w.o_proj.rows);
      const int64_t gate_rows = rows_for(budget - w.o_proj.bytes(), w.gate_proj);
      ASSERT_LE(gate_rows, w.gate_proj.rows);
      for (const WeightRange& r : row_ranges(w.gate_proj, 0, gate_rows)) expected.push_back(r);
    }
    expect_ranges(run.decode_calls[l], expected, "layer " + std::to_string(l));
  }
  EXPECT_GT(cut_in_o_proj, 0);
  EXPECT_LT(cut_in_o_proj, num_layers);
}

TEST_P(WeightPrefetch, SkippedBytesMoveTheWindowDownTheReadOrder) {
  const model::LoadedModel& m = testing::tiny_w4a16_model(GetParam());
  const auto& layers = m.weights.layers;
  const int num_layers = m.config.num_layers;
  const auto ffn_bytes = [&](int l) {
    const model::LayerWeights& w = layers[l];
    return w.o_proj.bytes() + w.gate_proj.bytes() + w.up_proj.bytes() + w.down_proj.bytes();
  };
  // What follows down in these presets: the router (MoE), else the PLE gate.
  ASSERT_TRUE(m.config.moe || m.config.ple_dim > 0);
  const auto following = [&](int l) -> const quant::QMatrix& {
    return m.config.moe ? layers[l].router_proj : layers[l].per_layer_input_gate;
  };
  // Skip layer 0's o_proj, gate, up and down and one row of what comes next; take one row.
  const int64_t skip = ffn_bytes(0) + row_bytes(following(0));
  const PrefetchCalls run = run_engine(m, 1, skip);
  ASSERT_EQ(std::ssize(run.decode_calls), num_layers);
  int checked = 0;
  for (int l = 0; l < num_layers; ++l) {
    if (ffn_bytes(l) != ffn_bytes(0)) continue;  // another attention shape: another window
    expect_ranges(run.decode_calls[l], row_ranges(following(l), 1, 1),
                  "layer " + std::to_string(l));
    ++checked;
  }
  EXPECT_GE(checked, 2);
}

TEST_P(WeightPrefetch, OffByDefault) {
  const model::LoadedModel& m = testing::tiny_w4a16_model(GetParam());
  const PrefetchCalls run = run_engine(m, EngineOptions{}.prefetch_bytes, 0);
  EXPECT_TRUE(run.decode_calls.empty());
}

INSTANTIATE_TEST_SUITE_P(Tiny, WeightPrefetch, ::testing::Values("tiny", "tiny-moe"),
                         testing::preset_test_name);

TEST(WeightPrefetchOptions, NegativeBytesAreRefused) {
  const model::LoadedModel& m = testing::tiny_w4a16_model("tiny");
  EngineOptions options;
  options.prefetch_skip_bytes = -1;
  auto engine = Gemma4Engine::create(m.config, m.weights,
                                     std::make_unique<testing::CpuForwardingBackend>(), options);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.error().to_string().find("prefetch"), std::string::npos);
}

}  // namespace
}  // namespace gemma4::engine
