// EngineOptions::router_trace on tiny-moe (CPU backend): one call per MoE layer and pass with the
// pass's positions, picks that are the top_k of the traced logits as the architecture spec's
// router defines them (softmax, top_k with lower id first among equals, renormalised, times
// per_expert_scale: recomputed here from the logits in double), and logits unchanged by tracing.
// Through a backend that records, a traced decode step is not recorded (the trace downloads).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/cpu_forwarding_backend.h"
#include "engine/gemma4_engine.h"
#include "model/synth.h"
#include "model/weights.h"
#include "test_support.h"

namespace gemma4::engine {
namespace {

struct TracedCall {
  int layer = 0;
  std::vector<int32_t> positions, ids;
  std::vector<float> logits, weights;
};

class RouterTraceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model::SynthOptions synth;
    synth.config = "tiny-moe";
    synth.seed = 3;
    synth.grid = model::SynthGrid::kNone;
    synth.output = testing::scratch_dir("router_trace_tiny_moe");
    ASSERT_TRUE(model::synthesize_checkpoint(synth).ok());
    auto loaded = model::LoadedModel::open(synth.output);
    ASSERT_TRUE(loaded.ok()) << loaded.error().to_string();
    model_ = new model::LoadedModel(std::move(*loaded));
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }

  static std::unique_ptr<Gemma4Engine> engine(std::unique_ptr<Backend> backend,
                                              std::vector<TracedCall>* calls) {
    EngineOptions options;
    options.max_sequences = 1;
    options.max_context = 64;
    if (calls != nullptr) {
      options.router_trace = [calls](const RouterTrace& t) {
        calls->push_back({t.layer,
                          {t.positions.begin(), t.positions.end()},
                          {t.expert_ids.begin(), t.expert_ids.end()},
                          {t.logits.begin(), t.logits.end()},
                          {t.weights.begin(), t.weights.end()}});
      };
    }
    auto made = Gemma4Engine::create(model_->config, model_->weights, std::move(backend), options);
    EXPECT_TRUE(made.ok());
    return std::move(*made);
  }

  // The prompt in one step, then one decoded token; the logits of both steps.
  static std::vector<float> run(Gemma4Engine& e) {
    const std::vector<int32_t> prompt = {2, 1200, 5000, 77, 31000, 9};
    const int32_t next = 4242;
    auto sequence = e.open_sequence();
    EXPECT_TRUE(sequence.ok());
    std::vector<float> logits(2 * e.vocab_size());
    const StepInput first{*sequence, prompt};
    EXPECT_TRUE(e.step({&first, 1}, std::span(logits).first(e.vocab_size())).ok());
    const StepInput second{*sequence, {&next, 1}};
    EXPECT_TRUE(e.step({&second, 1}, std::span(logits).last(e.vocab_size())).ok());
    return logits;
  }

  static model::LoadedModel* model_;
};

model::LoadedModel* RouterTraceTest::model_ = nullptr;

TEST_F(RouterTraceTest, PicksAreTheSpecRouterOfTheTracedLogits) {
  const auto& config = model_->config;
  ASSERT_TRUE(config.moe);
  const int experts = config.moe_params.num_experts;
  const int top_k = config.moe_params.top_k;
  std::vector<TracedCall> calls;
  const auto traced = run(*engine(std::make_unique<backend::cpu::CpuBackend>(), &calls));
  const auto plain = run(*engine(std::make_unique<backend::cpu::CpuBackend>(), nullptr));
  EXPECT_EQ(traced, plain);

  // Two passes (6 prompt rows, then 1), each calling once per layer in order.
  ASSERT_EQ(calls.size(), 2u * config.num_layers);
  for (size_t c = 0; c < calls.size(); ++c) {
    const TracedCall& call = calls[c];
    const bool prompt_pass = c < static_cast<size_t>(config.num_layers);
    EXPECT_EQ(call.layer, static_cast<int>(c % config.num_layers));
    const std::vector<int32_t> expected =
        prompt_pass ? std::vector<int32_t>{0, 1, 2, 3, 4, 5} : std::vector<int32_t>{6};
    ASSERT_EQ(call.positions, expected);
    const auto rows = static_cast<int64_t>(expected.size());
    ASSERT_EQ(std::ssize(call.logits), rows * experts);
    ASSERT_EQ(std::ssize(call.ids), rows * top_k);
    const std::vector<float>& scale = model_->weights.layers[call.layer].per_expert_scale;
    for (int64_t r = 0; r < rows; ++r) {
      const float* z = call.logits.data() + r * experts;
      std::vector<int32_t> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
      const double top = z[order[0]];
      double kept = 0;
      for (int k = 0; k < top_k; ++k) kept += std::exp(double{z[order[k]]} - top);
      for (int k = 0; k < top_k; ++k) {
        const int32_t id = order[k];
        ASSERT_EQ(call.ids[r * top_k + k], id) << "layer " << call.layer << " row " << r;
        const double weight = std::exp(double{z[id]} - top) / kept * scale[id];
        EXPECT_NEAR(call.weights[r * top_k + k], weight, 1e-5 * std::abs(weight) + 1e-7);
      }
    }
  }
}

// The CPU backend plus a "recording" that only counts: a traced engine must never record.
class CountingRecorder final : public testing::CpuForwardingBackend {
 public:
  explicit CountingRecorder(int* records) : records_(records) {}
  const char* name() const override { return "cpu+count"; }
  bool can_record() const override { return true; }
  std::unique_ptr<RecordedWork> record(const std::function<void()>& enqueue) override {
    ++*records_;
    (void)enqueue;
    return nullptr;
  }

 private:
  int* records_;
};

TEST_F(RouterTraceTest, TracedDecodeIsNotRecorded) {
  int records = 0;
  std::vector<TracedCall> calls;
  auto e = engine(std::make_unique<CountingRecorder>(&records), &calls);
  auto sequence = e->open_sequence();
  ASSERT_TRUE(sequence.ok());
  std::vector<float> logits(e->vocab_size());
  for (const int32_t token : {2, 7, 8, 9}) {  // the third step would be recorded untraced
    const StepInput input{*sequence, {&token, 1}};
    ASSERT_TRUE(e->step({&input, 1}, logits).ok());
  }
  EXPECT_EQ(records, 0);
  EXPECT_EQ(calls.size(), 4u * model_->config.num_layers);
}

}  // namespace
}  // namespace gemma4::engine
