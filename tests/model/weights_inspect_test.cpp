// gemma4 inspect's numbers: the KV estimate against gemma4-architecture.md 4.1, and the report
// of a synthetic checkpoint (formats and byte totals from the tensors' own sizes).
#include <gtest/gtest.h>

#include "model/inspect.h"
#include "model/presets.h"
#include "model/synth.h"
#include "test_support.h"

namespace gemma4::model {
namespace {

ModelConfig preset(const std::string& name) {
  auto config = ModelConfig::from_hf_json(
      hf_config_json(*preset_text_config(name), ConfigLayout::kMultimodal));
  EXPECT_TRUE(config.ok());
  return *config;
}

TEST(Inspect, KvCacheMatchesSpecTable) {
  struct Row {
    const char* config;
    int64_t context;
    int full_layers, sliding_layers;
    int64_t full_bytes, sliding_bytes;
  };
  // Section 4.1: full-cache bytes per token x context, and W-token sliding rings.
  const Row rows[] = {
      {"e2b", 131072, 3, 12, int64_t{6144} * 131072, 6291456},
      {"e4b", 131072, 4, 20, int64_t{16384} * 131072, int64_t{20} << 20},
      {"26b-a4b", 262144, 5, 25, int64_t{20480} * 262144, int64_t{200} << 20},
      {"31b", 131072, 10, 50, int64_t{81920} * 131072, int64_t{800} << 20},
  };
  for (const Row& row : rows) {
    const KvCacheEstimate kv = estimate_kv_cache(preset(row.config), row.context);
    EXPECT_EQ(kv.full_layers, row.full_layers) << row.config;
    EXPECT_EQ(kv.sliding_layers, row.sliding_layers) << row.config;
    EXPECT_EQ(kv.full_bytes, row.full_bytes) << row.config;
    EXPECT_EQ(kv.sliding_bytes, row.sliding_bytes) << row.config;
  }
  // E2B at 128K: 774 MiB in the spec's table.
  EXPECT_EQ(estimate_kv_cache(preset("e2b"), 131072).total(), int64_t{774} << 20);
  // Shorter than the window: the rings only hold the context.
  const KvCacheEstimate short_kv = estimate_kv_cache(preset("e2b"), 100);
  EXPECT_EQ(short_kv.sliding_bytes, 12 * 1024 * 100);
}

TEST(Inspect, ReportListsFormatsAndTotals) {
  SynthOptions options;
  options.config = "tiny";
  options.format = SynthFormat::kW4A16;
  options.output = testing::scratch_dir("inspect_w4");
  ASSERT_TRUE(synthesize_checkpoint(options).ok());
  auto model = LoadedModel::open(options.output);
  ASSERT_TRUE(model.ok()) << model.error().to_string();
  InspectOptions inspect;
  inspect.context = 1000;
  const std::string report = inspect_report(*model, inspect);
  auto has = [&](const std::string& text) { return report.find(text) != std::string::npos; };
  EXPECT_TRUE(has("Gemma4ForCausalLM"));
  EXPECT_TRUE(has("pack-quantized -> w4g32"));
  EXPECT_TRUE(has("model.layers.0.self_attn.q_proj.weight_packed  I32  [128, 8]  w4g32  4096"));
  EXPECT_TRUE(
      has("model.layers.0.self_attn.q_proj.weight_scale  BF16  [128, 2]  w4g32 scales  512"));
  EXPECT_TRUE(has("model.layers.0.self_attn.q_proj.weight_shape  I64  [2]  quant meta  16"));
  EXPECT_TRUE(has("model.embed_tokens.weight  BF16  [262144, 64]  bf16  33554432"));
  EXPECT_TRUE(has("model.layers.4.layer_scalar  BF16  [1]  vector  2"));
  // Layer 4 reads layer 2's KV: one full cache, K and V of 2 heads x 64 in bf16 x 1000 tokens.
  EXPECT_TRUE(has("1 full layers 500.00 KiB"));
  EXPECT_TRUE(has("2 sliding rings 4.00 KiB"));  // layers 0, 1: 2 * 2 * 32 * 2 B * 8 tokens each
  const uint64_t total = model->weights.checkpoint->total_bytes();
  EXPECT_TRUE(has(fmt::format("{:>14} bytes", total)));
}

}  // namespace
}  // namespace gemma4::model
