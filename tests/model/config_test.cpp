// ModelConfig / QuantizationInfo against the real config.json files in shared/data/configs and
// the per-layer tables of gemma4-architecture.md 1.1 / 1.2 (expected values come from the spec).
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/presets.h"
#include "test_support.h"

namespace gemma4::model {
namespace {

using nlohmann::json;

std::filesystem::path configs_dir() {
  return testing::shared_data_dir() / "configs";
}

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}

ModelConfig parse_preset(const std::string& name, ConfigLayout layout = ConfigLayout::kText) {
  auto text = preset_text_config(name);
  EXPECT_TRUE(text.ok());
  auto config = ModelConfig::from_hf_json(hf_config_json(*text, layout));
  EXPECT_TRUE(config.ok()) << config.error().to_string();
  return *config;
}

std::set<int> full_layers(const ModelConfig& config) {
  std::set<int> out;
  for (const auto& layer : config.layers) {
    if (layer.type == LayerType::kFull) out.insert(layer.layer_index);
  }
  return out;
}

void expect_rope(const LayerGeometry& layer) {
  if (layer.type == LayerType::kFull) {
    // proportional, theta 1e6, partial 0.25 of the full head: hd 512 -> 64 pairs, denominator 512
    EXPECT_EQ(layer.rope.theta, 1e6);
    EXPECT_EQ(layer.rope.rotated_pairs, layer.head_dim / 8);
  } else {
    EXPECT_EQ(layer.rope.theta, 1e4);
    EXPECT_EQ(layer.rope.rotated_pairs, layer.head_dim / 2);
  }
  EXPECT_EQ(layer.rope.exponent_denominator, layer.head_dim);
}

TEST(ModelConfig, Real26BA4BBase) {
  auto config = ModelConfig::from_hf_file(configs_dir() / "google--gemma-4-26B-A4B/config.json");
  ASSERT_TRUE(config.ok()) << config.error().to_string();
  EXPECT_EQ(config->hf_architecture, "Gemma4ForConditionalGeneration");
  EXPECT_EQ(config->tensor_prefix, "model.language_model.");
  EXPECT_EQ(config->hidden_size, 2816);
  EXPECT_EQ(config->num_layers, 30);
  EXPECT_EQ(config->vocab_size, 262144);
  EXPECT_EQ(full_layers(*config), (std::set<int>{5, 11, 17, 23, 29}));
  EXPECT_TRUE(config->moe);
  EXPECT_EQ(config->moe_params.num_experts, 128);
  EXPECT_EQ(config->moe_params.top_k, 8);
  EXPECT_EQ(config->moe_params.intermediate_size, 704);
  EXPECT_EQ(config->ple_dim, 0);
  EXPECT_EQ(config->num_kv_shared_layers, 0);
  EXPECT_FLOAT_EQ(config->final_logit_softcap, 30.0f);
  EXPECT_EQ(config->embedding_scale(), 53.0f);
  EXPECT_EQ(config->eos_token_ids, std::vector<int>{1});  // no top-level eos in the base config
  for (const auto& layer : config->layers) {
    const bool full = layer.type == LayerType::kFull;
    EXPECT_EQ(layer.head_dim, full ? 512 : 256);
    EXPECT_EQ(layer.num_q_heads, 16);
    EXPECT_EQ(layer.num_kv_heads, full ? 2 : 8);
    EXPECT_EQ(layer.k_eq_v, full);
    EXPECT_EQ(layer.ffn_width, 2112);
    EXPECT_EQ(layer.window, full ? 0 : 1024);
    EXPECT_TRUE(layer.owns_kv());
    expect_rope(layer);
  }
  EXPECT_EQ(config->layers[5].rope.rotated_pairs, 64);
  EXPECT_EQ(config->max_q_width(), 8192);
  EXPECT_EQ(config->max_kv_width(), 2048);
}

TEST(ModelConfig, RealNvidia26BAnd31B) {
  auto moe = ModelConfig::from_hf_file(configs_dir() / "nvidia--Gemma-4-26B-A4B-NVFP4");
  ASSERT_TRUE(moe.ok()) << moe.error().to_string();
  EXPECT_EQ(moe->eos_token_ids, (std::vector<int>{1, 106}));

  auto dense = ModelConfig::from_hf_file(configs_dir() / "nvidia--Gemma-4-31B-IT-NVFP4");
  ASSERT_TRUE(dense.ok()) << dense.error().to_string();
  EXPECT_EQ(dense->hidden_size, 5376);
  EXPECT_EQ(dense->num_layers, 60);
  EXPECT_FALSE(dense->moe);  // expert_intermediate_size null, no MoE block
  EXPECT_EQ(dense->embedding_scale(), 73.5f);
  EXPECT_EQ(full_layers(*dense).size(), 10u);
  for (const auto& layer : dense->layers) {
    const bool full = layer.type == LayerType::kFull;
    EXPECT_EQ(full, layer.layer_index % 6 == 5);
    EXPECT_EQ(layer.num_kv_heads, full ? 4 : 16);
    EXPECT_EQ(layer.k_eq_v, full);
    EXPECT_EQ(layer.ffn_width, 21504);
    EXPECT_EQ(layer.q_width(), full ? 16384 : 8192);
  }
}

TEST(ModelConfig, RealDerivedE4B) {
  auto config = ModelConfig::from_hf_file(
      configs_dir() / "derived--Jackrong-Gemopus-4-E4B-it-W4A16-autoround/config.json");
  ASSERT_TRUE(config.ok()) << config.error().to_string();
  EXPECT_EQ(config->hidden_size, 2560);
  EXPECT_EQ(config->num_layers, 42);
  EXPECT_EQ(config->ple_dim, 256);
  EXPECT_EQ(config->ple_vocab_size, 262144);
  EXPECT_EQ(config->embedding_scale(), 50.5f);
  EXPECT_EQ(config->eos_token_ids, std::vector<int>{106});  // unsloth's top-level value
  EXPECT_EQ(full_layers(*config), (std::set<int>{5, 11, 17, 23, 29, 35, 41}));
  EXPECT_EQ(config->first_kv_shared_layer(), 24);
  for (const auto& layer : config->layers) {
    const bool full = layer.type == LayerType::kFull;
    EXPECT_EQ(layer.ffn_width, 10240);  // no double-wide MLP on E4B
    EXPECT_EQ(layer.num_kv_heads, 2);
    EXPECT_FALSE(layer.k_eq_v);
    const int source = layer.layer_index < 24 ? layer.layer_index : (full ? 23 : 22);
    EXPECT_EQ(layer.kv_source_layer, source) << "layer " << layer.layer_index;
    expect_rope(layer);
  }
  // auto-round is not a format gemma4 reads: the error names the key.
  auto quant = QuantizationInfo::from_checkpoint_dir(
      configs_dir() / "derived--Jackrong-Gemopus-4-E4B-it-W4A16-autoround");
  ASSERT_FALSE(quant.ok());
  EXPECT_EQ(quant.error().code, ErrorCode::kUnsupported);
  EXPECT_NE(quant.error().message.find("quantization_config.quant_method"), std::string::npos);
}

TEST(ModelConfig, AssistantDraftersAreRejectedByName) {
  for (const char* dir :
       {"google--gemma-4-E2B-it-assistant", "google--gemma-4-26B-A4B-it-assistant",
        "google--gemma-4-31B-it-assistant", "google--gemma-4-E4B-it-assistant"}) {
    auto config = ModelConfig::from_hf_file(configs_dir() / dir / "config.partial.json");
    ASSERT_FALSE(config.ok()) << dir;
    EXPECT_EQ(config.error().code, ErrorCode::kUnsupported);
    EXPECT_NE(config.error().message.find("'architectures'"), std::string::npos)
        << config.error().message;
  }
}

TEST(ModelConfig, PresetE2BMatchesSpecTables) {
  for (auto layout : {ConfigLayout::kText, ConfigLayout::kMultimodal}) {
    ModelConfig config = parse_preset("e2b", layout);
    EXPECT_EQ(config.tensor_prefix,
              layout == ConfigLayout::kText ? "model." : "model.language_model.");
    EXPECT_EQ(config.hidden_size, 1536);
    EXPECT_EQ(config.num_layers, 35);
    EXPECT_EQ(config.embedding_scale(), 39.25f);
    EXPECT_EQ(config.ple_dim, 256);
    EXPECT_EQ(full_layers(config), (std::set<int>{4, 9, 14, 19, 24, 29, 34}));
    std::set<int> owns_full, owns_sliding;
    for (const auto& layer : config.layers) {
      const int i = layer.layer_index;
      const bool full = layer.type == LayerType::kFull;
      EXPECT_EQ(layer.ffn_width, i >= 15 ? 12288 : 6144) << i;
      EXPECT_EQ(layer.kv_source_layer, i >= 15 ? (full ? 14 : 13) : i) << i;
      EXPECT_EQ(layer.num_kv_heads, 1);
      EXPECT_EQ(layer.head_dim, full ? 512 : 256);
      if (layer.owns_kv()) (full ? owns_full : owns_sliding).insert(i);
      expect_rope(layer);
    }
    EXPECT_EQ(owns_full, (std::set<int>{4, 9, 14}));
    EXPECT_EQ(owns_sliding.size(), 12u);
    EXPECT_EQ(config.eos_token_ids, (std::vector<int>{1, 106}));
    EXPECT_EQ(config.max_ffn_width(), 12288);
  }
}

TEST(ModelConfig, PresetsE4B26B31BMatchSpec) {
  ModelConfig e4b = parse_preset("e4b");
  EXPECT_EQ(e4b.first_kv_shared_layer(), 24);
  EXPECT_EQ(e4b.layers[41].kv_source_layer, 23);
  EXPECT_EQ(e4b.layers[40].kv_source_layer, 22);
  EXPECT_EQ(e4b.max_ffn_width(), 10240);

  ModelConfig moe = parse_preset("26b-a4b");
  auto real = ModelConfig::from_hf_file(configs_dir() / "google--gemma-4-26B-A4B/config.json");
  ASSERT_TRUE(real.ok());
  ASSERT_EQ(moe.layers.size(), real->layers.size());
  for (size_t i = 0; i < moe.layers.size(); ++i) {
    EXPECT_EQ(moe.layers[i].type, real->layers[i].type);
    EXPECT_EQ(moe.layers[i].num_kv_heads, real->layers[i].num_kv_heads);
    EXPECT_EQ(moe.layers[i].k_eq_v, real->layers[i].k_eq_v);
  }
  EXPECT_EQ(moe.moe_params.num_experts, 128);

  ModelConfig dense = parse_preset("31b");
  EXPECT_EQ(dense.hidden_size, 5376);
  EXPECT_EQ(dense.layers[59].num_kv_heads, 4);
  EXPECT_EQ(dense.layers[58].num_kv_heads, 16);
}

TEST(ModelConfig, TinyPresetsKeepEveryFeature) {
  ModelConfig tiny = parse_preset("tiny");
  EXPECT_EQ(tiny.vocab_size, 262144);
  EXPECT_EQ(tiny.ple_vocab_size, 262144);
  EXPECT_GT(tiny.ple_dim, 0);
  EXPECT_GT(tiny.num_kv_shared_layers, 0);
  EXPECT_LT(tiny.sliding_window, 40);
  bool shared_sliding = false, shared_full = false;
  for (const auto& layer : tiny.layers) {
    if (layer.type == LayerType::kFull) {
      EXPECT_EQ(layer.head_dim, 2 * tiny.layers[0].head_dim);
      EXPECT_LT(layer.rope.rotated_pairs, layer.head_dim / 2);  // proportional, partial
    }
    if (!layer.owns_kv()) {
      EXPECT_EQ(layer.ffn_width, 2 * tiny.layers[0].ffn_width);  // double-wide
      (layer.type == LayerType::kFull ? shared_full : shared_sliding) = true;
      // Source: last non-shared layer of the same type, not layer 0.
      EXPECT_EQ(tiny.layers[layer.kv_source_layer].type, layer.type);
      EXPECT_NE(layer.kv_source_layer, 0);
    }
    EXPECT_EQ(tiny.hidden_size % 32, 0);
    EXPECT_EQ(layer.q_width() % 32, 0);
    EXPECT_EQ(layer.ffn_width % 32, 0);
  }
  EXPECT_TRUE(shared_sliding && shared_full);

  ModelConfig moe = parse_preset("tiny-moe");
  EXPECT_TRUE(moe.moe);
  EXPECT_GT(moe.moe_params.top_k, 1);
  EXPECT_EQ(moe.moe_params.intermediate_size % 32, 0);
  EXPECT_EQ(moe.ple_dim, 0);
  for (const auto& layer : moe.layers) {
    EXPECT_EQ(layer.k_eq_v, layer.type == LayerType::kFull);
    EXPECT_EQ(layer.num_kv_heads, layer.type == LayerType::kFull ? 1 : 2);  // global kv heads
  }
}

TEST(ModelConfig, BadConfigsNameTheKey) {
  json text = *preset_text_config("tiny");
  struct Case {
    std::function<void(json&)> edit;
    std::string key;
  };
  const std::vector<Case> cases = {
      {[](json& c) { c.erase("hidden_size"); }, "'hidden_size'"},
      {[](json& c) { c["hidden_size"] = "64"; }, "'hidden_size'"},
      {[](json& c) { c["num_hidden_layers"] = -3; }, "'num_hidden_layers'"},
      {[](json& c) { c["layer_types"].erase(0); }, "'layer_types'"},
      {[](json& c) { c["layer_types"][0] = "chunked_attention"; }, "'layer_types'"},
      {[](json& c) { c["hidden_activation"] = "silu"; }, "'hidden_activation'"},
      {[](json& c) { c["rope_parameters"]["full_attention"]["rope_type"] = "yarn"; },
       "'rope_parameters.full_attention.rope_type'"},
      {[](json& c) { c["rope_parameters"]["sliding_attention"]["factor"] = 8.0; },
       "'rope_parameters.sliding_attention.factor'"},
      {[](json& c) { c["rope_parameters"].erase("full_attention"); },
       "'rope_parameters.full_attention'"},
      {[](json& c) { c["num_kv_shared_layers"] = 5; }, "'num_kv_shared_layers'"},
      {[](json& c) { c["num_key_value_heads"] = 3; }, "'num_key_value_heads'"},
      {[](json& c) {
         c["attention_k_eq_v"] = true;
         c["num_global_key_value_heads"] = 3;
       },
       "'num_global_key_value_heads'"},
      {[](json& c) {
         // The only sliding layer is KV-shared: it has no earlier sliding layer to read.
         for (json& type : c["layer_types"]) type = "full_attention";
         c["layer_types"][c["layer_types"].size() - 2] = "sliding_attention";
         c["num_kv_shared_layers"] = 2;
       },
       "'num_kv_shared_layers'"},
      {[](json& c) { c["enable_moe_block"] = true; }, "'num_experts'"},
      {[](json& c) { c["architectures"] = {"LlamaForCausalLM"}; }, "'architectures'"},
      {[](json& c) { c["use_bidirectional_attention"] = "all"; }, "'use_bidirectional_attention'"},
  };
  for (const auto& test_case : cases) {
    json config = hf_config_json(text, ConfigLayout::kText);
    test_case.edit(config);
    auto parsed = ModelConfig::from_hf_json(config);
    ASSERT_FALSE(parsed.ok()) << test_case.key;
    EXPECT_NE(parsed.error().message.find(test_case.key), std::string::npos)
        << parsed.error().message;
  }
  // Multimodal paths carry the text_config prefix.
  json multimodal = hf_config_json(text, ConfigLayout::kMultimodal);
  multimodal["text_config"].erase("num_attention_heads");
  auto parsed = ModelConfig::from_hf_json(multimodal);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.error().message.find("'text_config.num_attention_heads'"), std::string::npos);
  multimodal.erase("text_config");
  EXPECT_FALSE(ModelConfig::from_hf_json(multimodal).ok());
  EXPECT_FALSE(ModelConfig::from_hf_json(json::array()).ok());
}

TEST(ModelConfig, FromFileReadsGenerationConfigAndReportsBadJson) {
  auto dir = testing::scratch_dir("config_generation");
  {
    std::ofstream(dir / "config.json")
        << hf_config_json(*preset_text_config("tiny"), ConfigLayout::kText).dump();
    std::ofstream(dir / "generation_config.json") << hf_generation_config_json().dump();
  }
  auto config = ModelConfig::from_hf_file(dir);
  ASSERT_TRUE(config.ok()) << config.error().to_string();
  EXPECT_EQ(config->eos_token_ids, (std::vector<int>{1, 106, 50}));

  std::ofstream(dir / "config.json") << "{\"architectures\": [";
  auto bad = ModelConfig::from_hf_file(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("not valid JSON"), std::string::npos);
  EXPECT_EQ(ModelConfig::from_hf_file(dir / "missing").error().code, ErrorCode::kNotFound);
}

TEST(QuantizationInfo, RealModelOptConfigs) {
  for (const char* dir : {"nvidia--Gemma-4-26B-A4B-NVFP4", "nvidia--Gemma-4-31B-IT-NVFP4"}) {
    auto info = QuantizationInfo::from_checkpoint_dir(configs_dir() / dir);
    ASSERT_TRUE(info.ok()) << dir << ": " << info.error().to_string();
    EXPECT_EQ(info->method, QuantizationInfo::Method::kModelOpt);
    EXPECT_EQ(info->weight_format, quant::WeightFormat::kNVFP4);
    EXPECT_EQ(info->group_size, 16);
    EXPECT_NE(std::find(info->ignore.begin(), info->ignore.end(), "lm_head"), info->ignore.end());
    // hf_quant_config.json alone says the same.
    json hf_quant = read_json(configs_dir() / dir / "hf_quant_config.json");
    auto from_file = QuantizationInfo::from_hf_json(json::object(), &hf_quant);
    ASSERT_TRUE(from_file.ok()) << from_file.error().to_string();
    EXPECT_EQ(from_file->weight_format, quant::WeightFormat::kNVFP4);
    EXPECT_EQ(from_file->ignore, info->ignore);
  }
  auto bf16 = QuantizationInfo::from_checkpoint_dir(configs_dir() / "google--gemma-4-26B-A4B");
  ASSERT_TRUE(bf16.ok());
  EXPECT_EQ(bf16->method, QuantizationInfo::Method::kNone);
}

// weight-formats.md 2.1 and 3.5 examples.
json compressed_tensors(const std::string& format, json weights) {
  return json{{"quantization_config",
               {{"quant_method", "compressed-tensors"},
                {"format", format},
                {"config_groups", {{"group_0", {{"targets", {"Linear"}}, {"weights", weights}}}}},
                {"ignore", {"lm_head"}}}}};
}

TEST(QuantizationInfo, CompressedTensorsSchemes) {
  json w4 = {{"num_bits", 4},       {"type", "int"},    {"symmetric", true},
             {"strategy", "group"}, {"group_size", 32}, {"actorder", nullptr}};
  auto info = QuantizationInfo::from_hf_json(compressed_tensors("pack-quantized", w4), nullptr);
  ASSERT_TRUE(info.ok()) << info.error().to_string();
  EXPECT_EQ(info->method, QuantizationInfo::Method::kCompressedTensors);
  EXPECT_EQ(info->weight_format, quant::WeightFormat::kW4G32);
  EXPECT_EQ(info->num_bits, 4);
  EXPECT_EQ(info->group_size, 32);
  EXPECT_TRUE(info->symmetric);
  EXPECT_EQ(info->ignore, std::vector<std::string>{"lm_head"});

  json nv = {{"num_bits", 4},
             {"type", "float"},
             {"symmetric", true},
             {"strategy", "tensor_group"},
             {"group_size", 16}};
  info = QuantizationInfo::from_hf_json(compressed_tensors("nvfp4-pack-quantized", nv), nullptr);
  ASSERT_TRUE(info.ok()) << info.error().to_string();
  EXPECT_EQ(info->weight_format, quant::WeightFormat::kNVFP4);

  json asymmetric = w4;
  asymmetric["symmetric"] = false;
  info = QuantizationInfo::from_hf_json(compressed_tensors("pack-quantized", asymmetric), nullptr);
  ASSERT_FALSE(info.ok());
  EXPECT_NE(info.error().message.find("weights.symmetric"), std::string::npos);

  json g128 = w4;
  g128["group_size"] = 128;
  info = QuantizationInfo::from_hf_json(compressed_tensors("pack-quantized", g128), nullptr);
  ASSERT_FALSE(info.ok());
  EXPECT_NE(info.error().message.find("group_size"), std::string::npos);

  info = QuantizationInfo::from_hf_json(compressed_tensors("float-quantized", w4), nullptr);
  ASSERT_FALSE(info.ok());
  EXPECT_NE(info.error().message.find("format"), std::string::npos);
}

}  // namespace
}  // namespace gemma4::model
