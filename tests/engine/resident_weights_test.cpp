// ResidentWeights on a backend that cannot read host memory: every weight the engine hands to an
// operation must lie in the backend's own buffers (a device would fault on a host pointer), and
// the copied weights must give exactly the logits of the zero-copy views.
#include "engine/resident_weights.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/cpu_forwarding_backend.h"
#include "engine/gemma4_engine.h"
#include "synth_support.h"

namespace gemma4::engine {
namespace {

// The CPU reference, posing as a device: reads_host_memory() is false, and every weight pointer
// an operation receives is checked against the buffers it allocated.
class DeviceLikeBackend final : public testing::CpuForwardingBackend {
 public:
  const char* name() const override { return "device-like"; }
  bool reads_host_memory() const override { return false; }

  Buffer allocate(size_t bytes) override {
    void* data = std::calloc(std::max<size_t>(bytes, 1), 1);
    const auto* begin = static_cast<const std::byte*>(data);
    owned_[begin] = begin + bytes;
    return Buffer(data, bytes, [this](void* p) {
      owned_.erase(static_cast<const std::byte*>(p));
      std::free(p);
    });
  }

  void embed(const quant::QMatrix& table, const int32_t* ids, float scale, Rows out) override {
    require(table, "embed table");
    cpu_.embed(table, ids, scale, out);
  }
  void matmul(const quant::QMatrix& w, Rows x, Rows y) override {
    require(w, "matmul weights");
    cpu_.matmul(w, x, y);
  }
  void rms_norm(Rows x, const float* weight, float weight_offset, float eps, Rows y) override {
    require(weight, "norm weight");
    cpu_.rms_norm(x, weight, weight_offset, eps, y);
  }
  void scale(Rows x, const float* column_scale, float scalar) override {
    require(column_scale, "column scale");
    cpu_.scale(x, column_scale, scalar);
  }
  void route_experts(Rows logits, const RouterParams& router, int32_t* expert_ids,
                     float* weights) override {
    require(router.per_expert_scale, "per-expert scale");
    cpu_.route_experts(logits, router, expert_ids, weights);
  }
  void run_experts(std::span<const model::ExpertMatrices> experts, Rows x,
                   const int32_t* expert_ids, const float* weights, int top_k, Rows out) override {
    for (const model::ExpertMatrices& e : experts) {
      require(e.gate, "expert gate");
      require(e.up, "expert up");
      require(e.down, "expert down");
    }
    cpu_.run_experts(experts, x, expert_ids, weights, top_k, out);
  }

  // What was read from outside the backend's buffers.
  const std::set<std::string>& foreign_reads() const { return foreign_; }

 private:
  bool owns(const void* p) const {
    const auto* byte = static_cast<const std::byte*>(p);
    auto it = owned_.upper_bound(byte);
    if (it == owned_.begin()) return false;
    --it;
    return byte >= it->first && byte < it->second;
  }
  void require(const void* p, const char* what) {
    if (p != nullptr && !owns(p)) foreign_.insert(what);
  }
  void require(const quant::QMatrix& m, const char* what) {
    require(m.data, what);
    require(m.scales, what);
  }

  std::map<const std::byte*, const std::byte*> owned_;  // begin -> end of each live buffer
  std::set<std::string> foreign_;
};

using testing::tiny_w4a16_model;

class ResidentWeightsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ResidentWeightsTest, CopiedWeightsAreTheOnlyOnesReadAndGiveIdenticalLogits) {
  const model::LoadedModel& loaded = tiny_w4a16_model(GetParam());

  EngineOptions options;
  options.max_sequences = 1;
  options.max_context = 64;
  auto device_like = std::make_unique<DeviceLikeBackend>();
  const DeviceLikeBackend& checker = *device_like;
  auto copied =
      Gemma4Engine::create(loaded.config, loaded.weights, std::move(device_like), options);
  auto viewed = Gemma4Engine::create(loaded.config, loaded.weights,
                                     std::make_unique<backend::cpu::CpuBackend>(2), options);
  ASSERT_TRUE(copied.ok() && viewed.ok());

  std::vector<int32_t> prompt{2};
  for (int i = 1; i < 12; ++i) prompt.push_back(1000 + i * 7919);
  std::vector<float> a((*copied)->vocab_size()), b((*viewed)->vocab_size());
  for (auto* engine : {copied->get(), viewed->get()}) {
    auto sequence = engine->open_sequence();
    ASSERT_TRUE(sequence.ok());
    const StepInput input{*sequence, prompt};
    ASSERT_TRUE(engine->step({&input, 1}, engine == copied->get() ? a : b).ok());
  }
  EXPECT_EQ(a, b);
  EXPECT_TRUE(checker.foreign_reads().empty())
      << "read from host memory: " << *checker.foreign_reads().begin();
}

// The w4a16 synth's bf16 tables lie on the int4 grid: a device keeps the embedding (one copy,
// also the tied lm_head) and the per-layer table in 4 bits; the CPU reads the bf16 mapping.
TEST(ResidentWeights, TablesOnTheInt4GridArePackedOnceOnADevice) {
  const model::LoadedModel& loaded = tiny_w4a16_model("tiny");
  ASSERT_GT(loaded.config.ple_dim, 0);

  DeviceLikeBackend device;
  auto placed = ResidentWeights::create(loaded.weights, device);
  ASSERT_TRUE(placed.ok()) << placed.error().to_string();
  for (const quant::QMatrix* table : {&placed->embed_tokens, &placed->embed_tokens_per_layer}) {
    EXPECT_EQ(table->format, quant::WeightFormat::kW4G32);
    EXPECT_EQ(table->scale_type, quant::ScaleType::kBF16);
  }
  EXPECT_EQ(placed->lm_head.data, placed->embed_tokens.data);
  EXPECT_EQ(placed->lm_head.format, quant::WeightFormat::kW4G32);

  backend::cpu::CpuBackend cpu(1);
  auto viewed = ResidentWeights::create(loaded.weights, cpu);
  ASSERT_TRUE(viewed.ok());
  EXPECT_EQ(viewed->embed_tokens.format, quant::WeightFormat::kBF16);
  EXPECT_EQ(viewed->embed_tokens.data, loaded.weights.embed_tokens.data);
}

// The logits of the last token of `prompts` (one sequence each) from `engine`, row after row.
std::vector<float> last_logits(Gemma4Engine& engine,
                               const std::vector<std::vector<int32_t>>& prompts) {
  const size_t vocab = static_cast<size_t>(engine.vocab_size());
  std::vector<float> logits(prompts.size() * vocab);
  for (size_t p = 0; p < prompts.size(); ++p) {
    auto sequence = engine.open_sequence();
    EXPECT_TRUE(sequence.ok());
    const StepInput input{*sequence, prompts[p]};
    EXPECT_TRUE(engine.step({&input, 1}, std::span(logits).subspan(p * vocab, vocab)).ok());
    engine.close_sequence(*sequence);
  }
  return logits;
}

// --lm-head q8 on the plain bf16 synth (its tied embedding is off the int4 grid): the engine
// reads an 8-bit logits matrix (quant/quantize_w8.h) — the same one on a device as on the CPU,
// which reads it from host memory — while embedding lookups keep the exact bf16 table. Against
// the exact matrix, only the logits move: logit v by sum_k e_vk · h_k over the final normed
// hidden state h, with independent errors |e_vk| <= s / 2 (s ~ amax / 127 of the row's group),
// so each change is about normal with sigma ~ s / sqrt(12) · |h|; the largest of 6 x 262144
// logits lands near 5 sigma: 0.078 measured (logits of std ~3), asserted below 0.2.
TEST(ResidentWeights, Q8LogitsMatrixIsTheSameOnEveryBackendAndCloseToExact) {
  const model::LoadedModel& loaded = testing::tiny_bf16_model("tiny");
  ASSERT_TRUE(lm_head_quantizes(loaded.weights.lm_head, LmHeadFormat::kQ8));
  ASSERT_FALSE(lm_head_quantizes(loaded.weights.lm_head, LmHeadFormat::kExact));

  DeviceLikeBackend device;
  auto placed = ResidentWeights::create(loaded.weights, device, LmHeadFormat::kQ8);
  ASSERT_TRUE(placed.ok()) << placed.error().to_string();
  EXPECT_EQ(placed->lm_head.format, quant::WeightFormat::kW8);
  EXPECT_EQ(placed->embed_tokens.format, loaded.weights.embed_tokens.format);
  backend::cpu::CpuBackend cpu(1);
  auto viewed = ResidentWeights::create(loaded.weights, cpu, LmHeadFormat::kQ8);
  ASSERT_TRUE(viewed.ok());
  EXPECT_EQ(viewed->lm_head.format, quant::WeightFormat::kW8);
  EXPECT_EQ(viewed->embed_tokens.data, loaded.weights.embed_tokens.data);

  EngineOptions options;
  options.max_sequences = 1;
  options.max_context = 64;
  EngineOptions q8 = options;
  q8.lm_head = LmHeadFormat::kQ8;
  auto device_like = std::make_unique<DeviceLikeBackend>();
  const DeviceLikeBackend& checker = *device_like;
  auto on_device = Gemma4Engine::create(loaded.config, loaded.weights, std::move(device_like), q8);
  auto on_cpu = Gemma4Engine::create(loaded.config, loaded.weights,
                                     std::make_unique<backend::cpu::CpuBackend>(2), q8);
  auto exact = Gemma4Engine::create(loaded.config, loaded.weights,
                                    std::make_unique<backend::cpu::CpuBackend>(2), options);
  ASSERT_TRUE(on_device.ok() && on_cpu.ok() && exact.ok());
  std::vector<std::vector<int32_t>> prompts;
  for (int salt = 0; salt < 6; ++salt) prompts.push_back(testing::prompt_ids(5 + salt, salt));
  const std::vector<float> device_logits = last_logits(**on_device, prompts);
  const std::vector<float> q8_logits = last_logits(**on_cpu, prompts);
  const std::vector<float> exact_logits = last_logits(**exact, prompts);
  EXPECT_EQ(device_logits, q8_logits);
  EXPECT_TRUE(checker.foreign_reads().empty())
      << "read from host memory: " << *checker.foreign_reads().begin();

  // Top-1 must agree wherever the exact logits' top-2 gap exceeds twice the largest change.
  const size_t vocab = static_cast<size_t>((*exact)->vocab_size());
  float max_change = 0.0f;
  for (size_t i = 0; i < exact_logits.size(); ++i)
    max_change = std::max(max_change, std::fabs(q8_logits[i] - exact_logits[i]));
  EXPECT_GT(max_change, 0.0f);  // the matrix did change
  EXPECT_LT(max_change, 0.2f);
  int agree = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const auto row = [&](const std::vector<float>& l) { return l.begin() + p * vocab; };
    const auto top = [&](const std::vector<float>& l) {
      return std::max_element(row(l), row(l) + vocab) - row(l);
    };
    std::vector<float> sorted(row(exact_logits), row(exact_logits) + vocab);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    agree += top(exact_logits) == top(q8_logits);
    if (sorted[0] - sorted[1] > 2 * max_change) {
      EXPECT_EQ(top(exact_logits), top(q8_logits)) << p;
    }
  }
  std::printf("lm_head q8 vs exact: max |dlogit| %.4g, top-1 agreement %d/%zu\n", max_change, agree,
              prompts.size());
}

// Passes of more than kLmHeadQ8MaxRows logits rows read the exact tied table: a q8 engine's
// logits then equal the exact engine's, bit for bit.
TEST(ResidentWeights, Q8LogitsOfLargeBatchesComeFromTheExactTiedTable) {
  const model::LoadedModel& loaded = testing::tiny_bf16_model("tiny");
  backend::cpu::CpuBackend cpu(1);
  auto placed = ResidentWeights::create(loaded.weights, cpu, LmHeadFormat::kQ8);
  ASSERT_TRUE(placed.ok());
  EXPECT_EQ(placed->lm_head.format, quant::WeightFormat::kW8);
  EXPECT_EQ(placed->lm_head_batched.data, loaded.weights.embed_tokens.data);

  const int streams = static_cast<int>(kLmHeadQ8MaxRows) + 1;
  EngineOptions options;
  options.max_sequences = streams;
  options.max_context = 16;
  EngineOptions q8 = options;
  q8.lm_head = LmHeadFormat::kQ8;
  std::vector<std::vector<float>> logits;
  for (const EngineOptions& o : {options, q8}) {
    auto engine = Gemma4Engine::create(loaded.config, loaded.weights,
                                       std::make_unique<backend::cpu::CpuBackend>(2), o);
    ASSERT_TRUE(engine.ok());
    std::vector<std::vector<int32_t>> tokens;
    std::vector<StepInput> inputs;
    for (int i = 0; i < streams; ++i) tokens.push_back(testing::prompt_ids(2, i));
    for (int i = 0; i < streams; ++i) {
      auto sequence = (*engine)->open_sequence();
      ASSERT_TRUE(sequence.ok());
      inputs.push_back({*sequence, tokens[i]});
    }
    logits.emplace_back(static_cast<size_t>(streams) * (*engine)->vocab_size());
    ASSERT_TRUE((*engine)->step(inputs, logits.back()).ok());
  }
  EXPECT_EQ(logits[0], logits[1]);
}

INSTANTIATE_TEST_SUITE_P(Tiny, ResidentWeightsTest, ::testing::Values("tiny", "tiny-moe"),
                         testing::preset_test_name);

}  // namespace
}  // namespace gemma4::engine
