// ModelWeights against synthetic checkpoints: every view has the shape and format the spec's
// tensor inventory gives (gemma4-architecture.md 1.3), and broken checkpoints fail naming the
// tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/synth.h"
#include "model/weights.h"
#include "test_support.h"

namespace gemma4::model {
namespace {

using quant::WeightFormat;

std::filesystem::path synth(const std::string& config, SynthFormat format, const std::string& tag) {
  auto dir = testing::scratch_dir("weights_" + tag);
  SynthOptions options;
  options.config = config;
  options.format = format;
  options.seed = 7;
  options.output = dir;
  Status status = synthesize_checkpoint(options);
  EXPECT_TRUE(status.ok()) << status.error().to_string();
  return dir;
}

// Rewrites `source`'s tensors into `target` (with its config.json), renaming or dropping some
// and adding extra ones: how the malformed-checkpoint cases are made.
void rewrite(const std::filesystem::path& source, const std::filesystem::path& target,
             const std::function<std::optional<std::string>(const std::string&)>& rename,
             const std::vector<io::TensorData>& extra = {}) {
  auto checkpoint = io::Checkpoint::open(source);
  ASSERT_TRUE(checkpoint.ok());
  std::vector<io::TensorData> tensors;
  for (const io::TensorView* view : checkpoint->tensors()) {
    auto name = rename(view->name);
    if (!name) continue;
    tensors.push_back({{*name, view->dtype, view->shape}, {view->data, view->nbytes}});
  }
  tensors.insert(tensors.end(), extra.begin(), extra.end());
  std::filesystem::create_directories(target);
  ASSERT_TRUE(io::write_safetensors(target / "model.safetensors", tensors).ok());
  std::filesystem::copy_file(source / "config.json", target / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
}

TEST(ModelWeights, TinyBf16HasEveryTensorInItsShape) {
  auto model = LoadedModel::open(synth("tiny", SynthFormat::kBF16, "tiny_bf16"));
  ASSERT_TRUE(model.ok()) << model.error().to_string();
  const ModelConfig& config = model->config;
  const ModelWeights& w = model->weights;
  EXPECT_EQ(model->quantization.method, QuantizationInfo::Method::kNone);
  EXPECT_EQ(w.embed_tokens.format, WeightFormat::kBF16);
  EXPECT_EQ(w.embed_tokens.rows, 262144);
  EXPECT_EQ(w.lm_head.data, w.embed_tokens.data);  // tied
  EXPECT_EQ(w.embed_tokens_per_layer.cols, config.num_layers * config.ple_dim);
  EXPECT_EQ(w.per_layer_model_projection.rows, config.num_layers * config.ple_dim);
  EXPECT_EQ(w.per_layer_projection_norm.size(), static_cast<size_t>(config.ple_dim));
  ASSERT_EQ(w.layers.size(), 5u);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& layer = w.layers[i];
    const LayerGeometry& g = config.layers[i];
    EXPECT_EQ(layer.q_proj.rows, g.q_width());
    EXPECT_EQ(layer.o_proj.cols, g.q_width());
    EXPECT_EQ(layer.q_norm.size(), static_cast<size_t>(g.head_dim));
    EXPECT_EQ(present(layer.k_proj), g.owns_kv()) << i;
    EXPECT_EQ(present(layer.v_proj), g.owns_kv()) << i;
    EXPECT_EQ(layer.k_norm.empty(), !g.owns_kv()) << i;
    EXPECT_EQ(layer.gate_proj.rows, g.ffn_width);
    EXPECT_EQ(layer.down_proj.cols, g.ffn_width);
    EXPECT_EQ(layer.per_layer_input_gate.rows, config.ple_dim);
    EXPECT_EQ(layer.per_layer_projection.cols, config.ple_dim);
    EXPECT_GE(layer.layer_scalar, 0.6f);
    EXPECT_LE(layer.layer_scalar, 1.0f);
    EXPECT_TRUE(layer.experts.empty());
  }
}

TEST(ModelWeights, TinyMoeExpertsFromFusedAndPerExpertTensors) {
  auto fused = LoadedModel::open(synth("tiny-moe", SynthFormat::kBF16, "moe_bf16"));
  ASSERT_TRUE(fused.ok()) << fused.error().to_string();
  const ModelConfig& config = fused->config;
  const int64_t width = config.moe_params.intermediate_size, hidden = config.hidden_size;
  for (size_t i = 0; i < config.layers.size(); ++i) {
    const LayerWeights& layer = fused->weights.layers[i];
    EXPECT_EQ(present(layer.v_proj), !config.layers[i].k_eq_v);
    EXPECT_EQ(layer.k_proj.rows, config.layers[i].kv_width());
    ASSERT_EQ(layer.experts.size(), 8u);
    EXPECT_EQ(layer.router_proj.rows, 8);
    EXPECT_EQ(layer.per_expert_scale.size(), 8u);
    EXPECT_EQ(layer.router_scale.size(), static_cast<size_t>(hidden));
    for (size_t e = 0; e < layer.experts.size(); ++e) {
      const auto* gate = static_cast<const std::byte*>(layer.experts[e].gate.data);
      const auto* up = static_cast<const std::byte*>(layer.experts[e].up.data);
      // gate = rows 0..I-1 and up = rows I..2I-1 of expert e's [2I, H] block.
      EXPECT_EQ(up - gate, width * hidden * 2);
      if (e > 0) {
        EXPECT_EQ(gate - static_cast<const std::byte*>(layer.experts[e - 1].gate.data),
                  2 * width * hidden * 2);
      }
      EXPECT_EQ(layer.experts[e].down.rows, hidden);
      EXPECT_EQ(layer.experts[e].down.cols, width);
    }
  }
  auto split = LoadedModel::open(synth("tiny-moe", SynthFormat::kW4A16, "moe_w4"));
  ASSERT_TRUE(split.ok()) << split.error().to_string();
  EXPECT_EQ(split->quantization.weight_format, WeightFormat::kW4G32);
  const auto& expert = split->weights.layers[0].experts[3];
  EXPECT_EQ(expert.gate.format, WeightFormat::kW4G32);
  EXPECT_EQ(expert.gate.rows, width);
  EXPECT_EQ(expert.down.cols, width);
  EXPECT_EQ(split->weights.layers[0].router_proj.format, WeightFormat::kBF16);  // router stays bf16
  EXPECT_EQ(split->weights.embed_tokens.format, WeightFormat::kBF16);
}

TEST(ModelWeights, NvFp4CompressedTensorsAndModelOptNaming) {
  auto dir = synth("tiny-moe", SynthFormat::kNVFP4, "moe_nv");
  auto ct = LoadedModel::open(dir);
  ASSERT_TRUE(ct.ok()) << ct.error().to_string();
  const quant::QMatrix& q = ct->weights.layers[1].q_proj;
  EXPECT_EQ(q.format, WeightFormat::kNVFP4);
  EXPECT_TRUE(q.nv_global.is_divisor);

  // The same tensors under ModelOpt names: weight (U8), weight_scale, weight_scale_2 = 1/global.
  auto checkpoint = io::Checkpoint::open(dir);
  ASSERT_TRUE(checkpoint.ok());
  std::vector<float> inverses;
  std::vector<std::string> names;
  for (const io::TensorView* view : checkpoint->tensors()) {
    if (!view->name.ends_with(".weight_global_scale")) continue;
    float global;
    std::memcpy(&global, view->data, 4);
    inverses.push_back(1.0f / global);  // exact: the synthetic global scales are powers of two
    names.push_back(view->name.substr(0, view->name.size() - 20) + ".weight_scale_2");
  }
  std::vector<io::TensorData> extra;
  for (size_t i = 0; i < names.size(); ++i) {
    extra.push_back(
        {{names[i], DType::kF32, {}}, {reinterpret_cast<const std::byte*>(&inverses[i]), 4}});
  }
  auto modelopt_dir = testing::scratch_dir("weights_modelopt");
  rewrite(
      dir, modelopt_dir,
      [](const std::string& name) -> std::optional<std::string> {
        if (name.ends_with(".weight_global_scale")) return std::nullopt;
        if (name.ends_with(".weight_packed")) return name.substr(0, name.size() - 7);
        return name;
      },
      extra);
  auto modelopt = LoadedModel::open(modelopt_dir);
  ASSERT_TRUE(modelopt.ok()) << modelopt.error().to_string();
  const quant::QMatrix& m = modelopt->weights.layers[1].q_proj;
  EXPECT_EQ(m.format, WeightFormat::kNVFP4);
  EXPECT_FALSE(m.nv_global.is_divisor);
  EXPECT_EQ(m.nv_global.apply(448.0f), q.nv_global.apply(448.0f));
}

TEST(ModelWeights, BrokenCheckpointsNameTheTensor) {
  auto dir = synth("tiny-moe", SynthFormat::kBF16, "moe_broken_src");
  const std::string victim = "model.layers.2.self_attn.q_proj.weight";

  auto missing_dir = testing::scratch_dir("weights_missing");
  rewrite(dir, missing_dir, [&](const std::string& name) -> std::optional<std::string> {
    if (name == victim) return std::nullopt;
    return name;
  });
  auto missing = LoadedModel::open(missing_dir);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);
  EXPECT_NE(missing.error().message.find(victim), std::string::npos) << missing.error().message;

  // A wrong shape: a copy of layer 0's k_proj stored under the q_proj name of layer 2.
  auto source = io::Checkpoint::open(dir);
  ASSERT_TRUE(source.ok());
  const io::TensorView* k_proj = source->find("model.layers.0.self_attn.k_proj.weight");
  ASSERT_NE(k_proj, nullptr);
  auto shape_dir = testing::scratch_dir("weights_shape");
  rewrite(dir, shape_dir,
          [&](const std::string& name) -> std::optional<std::string> {
            if (name == victim) return std::nullopt;
            return name;
          },
          {{{victim, k_proj->dtype, k_proj->shape}, {k_proj->data, k_proj->nbytes}}});
  auto shape = LoadedModel::open(shape_dir);
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.error().message.find("model.layers.2.self_attn.q_proj"), std::string::npos)
      << shape.error().message;
  EXPECT_NE(shape.error().message.find("shape"), std::string::npos);

  // A missing expert tensor of the fused layout.
  auto expert_dir = testing::scratch_dir("weights_expert");
  rewrite(dir, expert_dir, [](const std::string& name) -> std::optional<std::string> {
    if (name == "model.layers.4.experts.down_proj") return std::nullopt;
    return name;
  });
  auto expert = LoadedModel::open(expert_dir);
  ASSERT_FALSE(expert.ok());
  EXPECT_NE(expert.error().message.find("model.layers.4.experts.down_proj"), std::string::npos);
}

TEST(ModelWeights, KvTensorsOnSharedLayersAreIgnored) {
  auto dir = synth("tiny", SynthFormat::kBF16, "tiny_shared_src");
  // Layer 3 shares layer 1's KV; an (even ill-shaped) k_proj/v_proj there must not matter.
  const uint16_t junk[4] = {0x3F80, 0x3F80, 0x3F80, 0x3F80};
  const auto* bytes = reinterpret_cast<const std::byte*>(junk);
  std::vector<io::TensorData> extra = {
      {{"model.layers.3.self_attn.k_proj.weight", DType::kBF16, {2, 2}}, {bytes, 8}},
      {{"model.layers.3.self_attn.v_proj.weight", DType::kBF16, {2, 2}}, {bytes, 8}},
      {{"model.layers.3.self_attn.k_norm.weight", DType::kBF16, {4}}, {bytes, 8}},
  };
  auto target = testing::scratch_dir("weights_shared");
  rewrite(
      dir, target, [](const std::string& name) { return std::optional<std::string>(name); }, extra);
  auto model = LoadedModel::open(target);
  ASSERT_TRUE(model.ok()) << model.error().to_string();
  EXPECT_FALSE(present(model->weights.layers[3].k_proj));
  EXPECT_TRUE(model->weights.layers[3].k_norm.empty());
}

}  // namespace
}  // namespace gemma4::model
