#include "model/presets.h"

namespace gemma4::model {
namespace {

using nlohmann::json;

struct PresetShape {
  int hidden_size;
  int num_layers;
  int full_every;  // layer i is full when (i + 1) % full_every == 0 (and the last layer is)
  int num_heads;
  int num_kv_heads;
  json num_global_kv_heads;  // null or an int
  int head_dim;
  int global_head_dim;
  bool k_eq_v;
  int intermediate_size;
  bool double_wide;
  int num_kv_shared_layers;
  int ple_dim;
  int sliding_window;
  int64_t max_position_embeddings;
  // MoE (num_experts 0 = dense)
  int num_experts;
  int top_k_experts;
  int moe_intermediate_size;
  const char* bidirectional;  // nullptr = null
};

json layer_types(int num_layers, int full_every) {
  json types = json::array();
  for (int i = 0; i < num_layers; ++i) {
    const bool full = (i + 1) % full_every == 0 || i == num_layers - 1;
    types.push_back(full ? "full_attention" : "sliding_attention");
  }
  return types;
}

json text_config(const PresetShape& shape) {
  const bool moe = shape.num_experts > 0;
  return json{
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"attention_k_eq_v", shape.k_eq_v},
      {"bos_token_id", 2},
      {"dtype", "bfloat16"},
      {"enable_moe_block", moe},
      {"eos_token_id", 1},
      {"final_logit_softcapping", 30.0},
      {"global_head_dim", shape.global_head_dim},
      {"head_dim", shape.head_dim},
      {"hidden_activation", "gelu_pytorch_tanh"},
      {"hidden_size", shape.hidden_size},
      {"hidden_size_per_layer_input", shape.ple_dim},
      {"initializer_range", 0.02},
      {"intermediate_size", shape.intermediate_size},
      {"layer_types", layer_types(shape.num_layers, shape.full_every)},
      {"max_position_embeddings", shape.max_position_embeddings},
      {"model_type", "gemma4_text"},
      {"moe_intermediate_size", moe ? json(shape.moe_intermediate_size) : json(nullptr)},
      {"num_attention_heads", shape.num_heads},
      {"num_experts", moe ? json(shape.num_experts) : json(nullptr)},
      {"num_global_key_value_heads", shape.num_global_kv_heads},
      {"num_hidden_layers", shape.num_layers},
      {"num_key_value_heads", shape.num_kv_heads},
      {"num_kv_shared_layers", shape.num_kv_shared_layers},
      {"pad_token_id", 0},
      {"rms_norm_eps", 1e-06},
      {"rope_parameters",
       {{"full_attention",
         {{"partial_rotary_factor", 0.25},
          {"rope_theta", 1000000.0},
          {"rope_type", "proportional"}}},
        {"sliding_attention", {{"rope_theta", 10000.0}, {"rope_type", "default"}}}}},
      {"sliding_window", shape.sliding_window},
      {"tie_word_embeddings", true},
      {"top_k_experts", moe ? json(shape.top_k_experts) : json(nullptr)},
      {"use_bidirectional_attention", shape.bidirectional ? json(shape.bidirectional) : json()},
      {"use_cache", true},
      {"use_double_wide_mlp", shape.double_wide},
      {"vocab_size", 262144},
      {"vocab_size_per_layer_input", 262144},
  };
}

// Real values: gemma4-architecture.md 1.1. Tiny values: see presets.h.
const std::vector<std::pair<std::string, PresetShape>>& presets() {
  static const std::vector<std::pair<std::string, PresetShape>> table = {
      {"tiny",
       {64, 5, 3, 4, 2, nullptr, 32, 64, false, 128, true, 2, 32, 8, 131072, 0, 0, 0, nullptr}},
      {"tiny-moe",
       {64, 6, 3, 4, 2, 1, 32, 64, true, 64, false, 0, 0, 8, 262144, 8, 2, 32, "vision"}},
      {"tiny-dense",
       {64, 5, 3, 4, 2, 1, 32, 64, true, 128, false, 0, 0, 8, 262144, 0, 0, 0, "vision"}},
      {"e2b",
       {1536, 35, 5, 8, 1, nullptr, 256, 512, false, 6144, true, 20, 256, 512, 131072, 0, 0, 0,
        nullptr}},
      {"e4b",
       {2560, 42, 6, 8, 2, nullptr, 256, 512, false, 10240, false, 18, 256, 512, 131072, 0, 0, 0,
        nullptr}},
      {"26b-a4b",
       {2816, 30, 6, 16, 8, 2, 256, 512, true, 2112, false, 0, 0, 1024, 262144, 128, 8, 704,
        "vision"}},
      {"31b",
       {5376, 60, 6, 32, 16, 4, 256, 512, true, 21504, false, 0, 0, 1024, 262144, 0, 0, 0,
        "vision"}},
  };
  return table;
}

}  // namespace

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& [name, shape] : presets()) out.push_back(name);
    return out;
  }();
  return names;
}

Expected<json> preset_text_config(std::string_view name) {
  for (const auto& [preset, shape] : presets()) {
    if (preset == name) return text_config(shape);
  }
  return make_error(ErrorCode::kNotFound, "unknown model config '{}' (known: {})", name,
                    fmt::join(preset_names(), ", "));
}

json hf_config_json(const json& text, ConfigLayout layout) {
  if (layout == ConfigLayout::kText) {
    json config = text;
    config["architectures"] = {"Gemma4ForCausalLM"};
    config["eos_token_id"] = {1, 106};
    config["transformers_version"] = "5.5.0.dev0";
    return config;
  }
  return json{
      {"architectures", {"Gemma4ForConditionalGeneration"}},
      {"audio_config", nullptr},
      {"audio_token_id", 258881},
      {"boa_token_id", 256000},
      {"boi_token_id", 255999},
      {"dtype", "bfloat16"},
      {"eoa_token_id", 258883},
      {"eoa_token_index", 258883},
      {"eoi_token_id", 258882},
      {"eos_token_id", {1, 106}},
      {"image_token_id", 258880},
      {"initializer_range", 0.02},
      {"model_type", "gemma4"},
      {"text_config", text},
      {"tie_word_embeddings", true},
      {"transformers_version", "5.5.0.dev0"},
      {"video_token_id", 258884},
      {"vision_config", nullptr},
      {"vision_soft_tokens_per_image", 280},
  };
}

json hf_generation_config_json() {
  return json{{"bos_token_id", 2},
              {"do_sample", true},
              {"eos_token_id", {1, 106, 50}},
              {"pad_token_id", 0},
              {"temperature", 1.0},
              {"top_k", 64},
              {"top_p", 0.95},
              {"transformers_version", "5.5.0.dev0"}};
}

}  // namespace gemma4::model
