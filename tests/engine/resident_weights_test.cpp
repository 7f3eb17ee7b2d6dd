// ResidentWeights on a backend that cannot read host memory: every weight the engine hands to an
// operation must lie in the backend's own buffers (a device would fault on a host pointer), and
// the copied weights must give exactly the logits of the zero-copy views.
#include "engine/resident_weights.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
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

INSTANTIATE_TEST_SUITE_P(Tiny, ResidentWeightsTest, ::testing::Values("tiny", "tiny-moe"),
                         testing::preset_test_name);

}  // namespace
}  // namespace gemma4::engine
