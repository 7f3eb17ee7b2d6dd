// The engine's fused path (stacked QKV, interleaved gate/up, the fused Backend operations) run on
// the CPU: a backend that, like a device, gets its own copy of the weights (so ResidentWeights
// stacks q|k|v) and asks for interleaved gate/up matrices (matmul_gelu_pairs). Every fused
// operation keeps Backend's default or CpuBackend's bit-identical matmul_gelu_pairs, so its
// logits must equal the plain CPU engine's exactly, for batched prefill and decode past the
// sliding window. Also counts the operations one decode step issues (the CUDA backend runs each
// as one kernel).
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/cpu_forwarding_backend.h"
#include "engine/gemma4_engine.h"
#include "synth_support.h"

namespace gemma4::engine {
namespace {

using model::RopeParams;
using quant::QMatrix;

// The CPU reference with a device's weight handling, counting the operations the engine issues.
// A fused operation counts once in top_level_ops (the primitives its default runs do not), the
// primitives in primitive_ops.
class FusingCountingBackend final : public testing::CpuForwardingBackend {
 public:
  // fuse = false: the plain CPU backend's behaviour (host weights, separate gate/up).
  explicit FusingCountingBackend(bool fuse) : fuse_(fuse) {}

  int64_t top_level_ops = 0;
  int64_t primitive_ops = 0;
  int64_t gelu_pairs_calls = 0;
  int64_t embed_calls = 0;       // one per forward pass (two with per-layer embeddings)
  int64_t ple_matmul_calls = 0;  // add_rms_norm_ple_matmul: a layer's end with the next one's QKV

  const char* name() const override { return "cpu-fusing"; }
  bool reads_host_memory() const override { return !fuse_; }
  bool fuses_gate_up() const override { return fuse_; }

  void embed(const QMatrix& table, const int32_t* ids, float scale, Rows out) override {
    Op op(*this);
    ++embed_calls;
    CpuForwardingBackend::embed(table, ids, scale, out);
  }
  void matmul(const QMatrix& w, Rows x, Rows y) override {
    Op op(*this);
    CpuForwardingBackend::matmul(w, x, y);
  }
  void rms_norm(Rows x, const float* weight, float weight_offset, float eps, Rows y) override {
    Op op(*this);
    CpuForwardingBackend::rms_norm(x, weight, weight_offset, eps, y);
  }
  void rope(Rows x, int head_dim, const int32_t* positions, const RopeParams& rope) override {
    Op op(*this);
    CpuForwardingBackend::rope(x, head_dim, positions, rope);
  }
  void gelu_tanh_mul(Rows gate, Rows multiplier, Rows out) override {
    Op op(*this);
    CpuForwardingBackend::gelu_tanh_mul(gate, multiplier, out);
  }
  void add(Rows acc, Rows x) override {
    Op op(*this);
    CpuForwardingBackend::add(acc, x);
  }
  void scale(Rows x, const float* column_scale, float scalar) override {
    Op op(*this);
    CpuForwardingBackend::scale(x, column_scale, scalar);
  }
  void softcap(Rows x, float cap) override {
    Op op(*this);
    CpuForwardingBackend::softcap(x, cap);
  }
  void copy(Rows src, Rows dst) override {
    Op op(*this);
    CpuForwardingBackend::copy(src, dst);
  }
  void write_kv(const KvView& kv, Rows k, Rows v, const int32_t* positions) override {
    Op op(*this);
    CpuForwardingBackend::write_kv(kv, k, v, positions);
  }
  void attention(Rows q, const int32_t* positions, const KvView& kv, int window, float scale,
                 Rows out) override {
    Op op(*this);
    CpuForwardingBackend::attention(q, positions, kv, window, scale, out);
  }
  void route_experts(Rows logits, const RouterParams& router, int32_t* expert_ids,
                     float* weights) override {
    Op op(*this);
    CpuForwardingBackend::route_experts(logits, router, expert_ids, weights);
  }
  void run_experts(std::span<const model::ExpertMatrices> experts, Rows x,
                   const int32_t* expert_ids, const float* weights, int top_k, Rows out) override {
    Op op(*this);
    CpuForwardingBackend::run_experts(experts, x, expert_ids, weights, top_k, out);
  }

  void add_rms_norm(Rows acc, Rows x, const float* weight, float scalar, const float* next_weight,
                    Rows next, const NormParams& norm) override {
    Op op(*this, Op::kFused);
    Backend::add_rms_norm(acc, x, weight, scalar, next_weight, next, norm);
  }
  void prepare_attention(Rows q, Rows k, Rows v, const float* q_norm, const float* k_norm,
                         bool norm_v, int head_dim, const int32_t* positions,
                         const RopeParams& rope, std::span<const SequenceRows> sequences,
                         const NormParams& norm) override {
    Op op(*this, Op::kFused);
    Backend::prepare_attention(q, k, v, q_norm, k_norm, norm_v, head_dim, positions, rope,
                               sequences, norm);
  }
  void prepare_and_attend(Rows q, Rows k, Rows v, const float* q_norm, const float* k_norm,
                          bool norm_v, int head_dim, const int32_t* positions,
                          const RopeParams& rope, std::span<const SequenceRows> sequences,
                          const NormParams& norm, int window, float scale, Rows out) override {
    Op op(*this, Op::kFused);
    Backend::prepare_and_attend(q, k, v, q_norm, k_norm, norm_v, head_dim, positions, rope,
                                sequences, norm, window, scale, out);
  }
  void attention_rows(Rows q, const int32_t* positions, std::span<const SequenceRows> sequences,
                      int window, float scale, Rows out) override {
    Op op(*this, Op::kFused);
    Backend::attention_rows(q, positions, sequences, window, scale, out);
  }
  void matmul_gelu_mul(const QMatrix& w, Rows x, Rows multiplier, Rows y) override {
    Op op(*this, Op::kFused);
    Backend::matmul_gelu_mul(w, x, multiplier, y);
  }
  void add_rms_norm_ple_matmul(Rows acc, Rows x, const float* weight, const QMatrix& gate,
                               Rows multiplier, Rows gated, const QMatrix& projection,
                               Rows projected, const float* projected_weight, float scalar,
                               const float* next_weight, Rows next, const NormParams& norm,
                               const QMatrix& matmul_weights, Rows matmul_out) override {
    Op op(*this, Op::kFused);
    ++ple_matmul_calls;
    Backend::add_rms_norm_ple_matmul(acc, x, weight, gate, multiplier, gated, projection, projected,
                                     projected_weight, scalar, next_weight, next, norm,
                                     matmul_weights, matmul_out);
  }
  void matmul_gelu_pairs(const QMatrix& w, Rows x, Rows y) override {
    Op op(*this);
    ++gelu_pairs_calls;
    CpuForwardingBackend::matmul_gelu_pairs(w, x, y);
  }

 private:
  // Counts one operation in top_level_ops unless another one runs it, and a primitive (one that
  // runs no other operation) in primitive_ops.
  class Op {
   public:
    enum Kind { kPrimitive, kFused };
    explicit Op(FusingCountingBackend& b, Kind kind = kPrimitive) : b_(b) {
      if (b_.depth_++ == 0) ++b_.top_level_ops;
      if (kind == kPrimitive) ++b_.primitive_ops;
    }
    ~Op() { --b_.depth_; }
    Op(const Op&) = delete;
    Op& operator=(const Op&) = delete;

   private:
    FusingCountingBackend& b_;
  };

  const bool fuse_;
  int depth_ = 0;
};

// w4g32 weights, so the stacked matrices carry packed data and scales.
const model::LoadedModel& tiny_model(const std::string& config) {
  return testing::tiny_w4a16_model(config);
}

std::unique_ptr<Gemma4Engine> make_engine(const std::string& config,
                                          std::unique_ptr<Backend> backend, int ring_history = 4) {
  const auto& m = tiny_model(config);
  EngineOptions options;
  options.max_sequences = 3;
  options.max_context = 64;
  options.ring_history = ring_history;
  auto engine = Gemma4Engine::create(m.config, m.weights, std::move(backend), options);
  EXPECT_TRUE(engine.ok());
  return std::move(*engine);
}

using testing::prompt_ids;

class FusedDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(FusedDecode, FusedPathGivesThePlainCpuLogitsBitForBit) {
  auto fusing = std::make_unique<FusingCountingBackend>(/*fuse=*/true);
  const FusingCountingBackend& fused_backend = *fusing;
  auto fused = make_engine(GetParam(), std::move(fusing));
  auto plain = make_engine(GetParam(), std::make_unique<backend::cpu::CpuBackend>(2));
  const int32_t vocab = plain->vocab_size();

  // Both engines see the same steps: one batched prefill of three prompts (longer than window
  // 8 + history 4: several passes), batched decode steps, then a step of two sequences.
  const std::vector<std::vector<int32_t>> prompts{prompt_ids(13, 1), prompt_ids(5, 2),
                                                  prompt_ids(9, 3)};
  std::vector<std::vector<std::vector<int32_t>>> steps;
  steps.push_back(prompts);
  for (int t = 0; t < 4; ++t) steps.push_back({{3000 + t}, {4000 + t}, {5000 + t}});
  steps.push_back({{6000}, {}, {7000}});

  for (Engine* engine : {static_cast<Engine*>(fused.get()), static_cast<Engine*>(plain.get())}) {
    for (int i = 0; i < 3; ++i) ASSERT_EQ(*engine->open_sequence(), i);
  }
  for (size_t step = 0; step < steps.size(); ++step) {
    std::vector<StepInput> inputs;
    for (int i = 0; i < 3; ++i) {
      if (!steps[step][i].empty()) inputs.push_back({i, steps[step][i]});
    }
    std::vector<float> fused_logits(inputs.size() * vocab), plain_logits(inputs.size() * vocab);
    ASSERT_TRUE(fused->step(inputs, fused_logits).ok());
    ASSERT_TRUE(plain->step(inputs, plain_logits).ok());
    EXPECT_TRUE(fused_logits == plain_logits) << "step " << step;
  }
  EXPECT_GT(fused_backend.gelu_pairs_calls, 0);  // the interleaved gate/up path ran
}

TEST_P(FusedDecode, OperationsPerDecodeStep) {
  const model::ModelConfig& config = tiny_model(GetParam()).config;
  std::map<bool, int64_t> top_level, primitives, ple_matmuls;
  for (bool fuse : {false, true}) {
    auto backend = std::make_unique<FusingCountingBackend>(fuse);
    FusingCountingBackend& counter = *backend;
    auto engine = make_engine(GetParam(), std::move(backend));
    const SequenceId s = *engine->open_sequence();
    std::vector<float> logits(engine->vocab_size());
    const auto prompt = prompt_ids(6, 4);
    const StepInput prefill{s, prompt};
    ASSERT_TRUE(engine->step({&prefill, 1}, logits).ok());
    counter.top_level_ops = counter.primitive_ops = counter.ple_matmul_calls = 0;
    const int32_t next = 1234;
    const StepInput decode{s, std::span(&next, 1)};
    ASSERT_TRUE(engine->step({&decode, 1}, logits).ok());
    top_level[fuse] = counter.top_level_ops;
    primitives[fuse] = counter.primitive_ops;
    ple_matmuls[fuse] = counter.ple_matmul_calls;
  }
  // With per-layer inputs every layer but the last ends with the next one's first matmul.
  const int64_t ple_ends = config.ple_dim > 0 ? config.num_layers - 1 : 0;
  EXPECT_EQ(ple_matmuls[false], ple_ends);
  EXPECT_EQ(ple_matmuls[true], ple_ends);
  // The primitives the fused path runs on the CPU are the unfused ones, less the matmuls that
  // stacking saves: k (and v) with q, and gate + up + gelu_tanh_mul as one matmul_gelu_pairs.
  int64_t saved = 0;
  for (const model::LayerGeometry& g : config.layers) {
    saved += 2 + (g.owns_kv() ? (g.k_eq_v ? 1 : 2) : 0);
  }
  EXPECT_EQ(primitives[false], primitives[true] + saved);
  // Unfused, the engine's operations expand to what it issued before the fused ones existed.
  const double layers = config.num_layers;
  std::printf(
      "%s decode step, %d layers: %lld operations before fusion (%.1f per layer), %lld "
      "fused (%.1f per layer)\n",
      GetParam().c_str(), config.num_layers, static_cast<long long>(primitives[false]),
      static_cast<double>(primitives[false]) / layers, static_cast<long long>(top_level[true]),
      static_cast<double>(top_level[true]) / layers);
  EXPECT_LT(top_level[true], primitives[false]);
}

// Prefill passes: tiny has KV-shared sliding layers, so a pass must fit the rings (window 8 +
// history); tiny-moe has none, so its sliding layers attend a long chunk piece by piece and a
// whole prompt goes in one pass whatever the history.
TEST(PrefillPasses, ALongPromptTakesOnePassUnlessSharedLayersNeedTheRing) {
  EngineOptions defaults;
  EXPECT_EQ(ring_history_for(tiny_model("tiny").config, defaults), defaults.max_pass_tokens - 1);
  EXPECT_EQ(ring_history_for(tiny_model("tiny-moe").config, defaults), 32);

  const auto prompt = prompt_ids(30, 5);
  const struct {
    const char* config;
    int ring_history;
    int64_t passes;
  } cases[] = {{"tiny", 4, 6}, {"tiny", 0, 1}, {"tiny-moe", 4, 1}};
  for (const auto& c : cases) {
    auto backend = std::make_unique<FusingCountingBackend>(/*fuse=*/false);
    FusingCountingBackend& counter = *backend;
    auto engine = make_engine(c.config, std::move(backend), c.ring_history);
    std::vector<float> logits(engine->vocab_size());
    const StepInput input{*engine->open_sequence(), prompt};
    ASSERT_TRUE(engine->step({&input, 1}, logits).ok());
    const int64_t embeds_per_pass = tiny_model(c.config).config.ple_dim > 0 ? 2 : 1;
    EXPECT_EQ(counter.embed_calls, c.passes * embeds_per_pass)
        << c.config << " ring_history " << c.ring_history;
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, FusedDecode, ::testing::Values("tiny", "tiny-moe", "tiny-dense"),
                         testing::preset_test_name);

}  // namespace
}  // namespace gemma4::engine
