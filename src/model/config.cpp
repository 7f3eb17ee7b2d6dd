#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/numeric.h"

namespace gemma4::model {
namespace {

using nlohmann::json;

// Reads keys of one JSON object; every error names the key with its path ("text_config.x").
class KeyReader {
 public:
  KeyReader(const json& object, std::string path) : object_(object), path_(std::move(path)) {}

  std::string key_path(std::string_view key) const {
    return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
  }
  // The value of `key`, or null when absent (an explicit null reads the same as absent, as in
  // transformers where null means "use the default").
  const json* find(std::string_view key) const {
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  Expected<std::optional<int64_t>> optional_int(std::string_view key) const {
    const json* value = find(key);
    if (!value) return std::optional<int64_t>{};
    if (!value->is_number_integer()) return type_error(key, "an integer", *value);
    return std::optional<int64_t>{value->get<int64_t>()};
  }
  Expected<int64_t> integer(std::string_view key, std::optional<int64_t> fallback) const {
    GEMMA4_ASSIGN_OR_RETURN(auto value, optional_int(key));
    if (value) return *value;
    if (fallback) return *fallback;
    return missing(key);
  }
  // A positive integer that fits an int.
  Expected<int> size(std::string_view key, std::optional<int64_t> fallback) const {
    GEMMA4_ASSIGN_OR_RETURN(int64_t value, integer(key, fallback));
    if (value <= 0 || value > (int64_t{1} << 30)) {
      return make_error(ErrorCode::kInvalidArgument, "config.json: '{}' = {} is not a valid size",
                        key_path(key), value);
    }
    return static_cast<int>(value);
  }
  Expected<double> number(std::string_view key, std::optional<double> fallback) const {
    const json* value = find(key);
    if (!value) {
      if (fallback) return *fallback;
      return missing(key);
    }
    if (!value->is_number()) return type_error(key, "a number", *value);
    return value->get<double>();
  }
  Expected<bool> boolean(std::string_view key, bool fallback) const {
    const json* value = find(key);
    if (!value) return fallback;
    if (!value->is_boolean()) return type_error(key, "true or false", *value);
    return value->get<bool>();
  }
  Expected<std::optional<std::string>> optional_string(std::string_view key) const {
    const json* value = find(key);
    if (!value) return std::optional<std::string>{};
    if (!value->is_string()) return type_error(key, "a string", *value);
    return std::optional<std::string>{value->get<std::string>()};
  }
  // An int or a list of ints (eos_token_id); empty when absent.
  Expected<std::vector<int>> int_list(std::string_view key) const {
    const json* value = find(key);
    std::vector<int> out;
    if (!value) return out;
    if (value->is_number_integer()) {
      out.push_back(value->get<int>());
      return out;
    }
    if (!value->is_array()) return type_error(key, "an integer or a list of integers", *value);
    for (const json& item : *value) {
      if (!item.is_number_integer()) return type_error(key, "a list of integers", *value);
      out.push_back(item.get<int>());
    }
    return out;
  }

  Error missing(std::string_view key) const {
    return make_error(ErrorCode::kInvalidArgument, "config.json: missing required key '{}'",
                      key_path(key));
  }
  Error type_error(std::string_view key, std::string_view expected, const json& value) const {
    return make_error(ErrorCode::kInvalidArgument, "config.json: '{}' must be {}, got {}",
                      key_path(key), expected, value.dump());
  }
  Error unsupported(std::string_view key, const json& value, std::string_view why) const {
    return make_error(ErrorCode::kUnsupported, "config.json: unsupported '{}' = {}: {}",
                      key_path(key), value.dump(), why);
  }

 private:
  const json& object_;
  std::string path_;
};

constexpr std::string_view kMultimodalArchitecture = "Gemma4ForConditionalGeneration";
constexpr std::string_view kTextArchitecture = "Gemma4ForCausalLM";

// Which of the two supported layouts `config` is, from `architectures` (when given) and
// `model_type`.
Expected<std::string> resolve_architecture(const json& config) {
  KeyReader top(config, "");
  if (const json* architectures = top.find("architectures")) {
    if (!architectures->is_array() || architectures->size() != 1 ||
        !(*architectures)[0].is_string()) {
      return top.type_error("architectures", "a list with one class name", *architectures);
    }
    std::string name = (*architectures)[0].get<std::string>();
    if (name != kMultimodalArchitecture && name != kTextArchitecture) {
      return top.unsupported("architectures", *architectures,
                             "gemma4 runs Gemma4ForConditionalGeneration and Gemma4ForCausalLM");
    }
    return name;
  }
  GEMMA4_ASSIGN_OR_RETURN(auto model_type, top.optional_string("model_type"));
  if (!model_type) return top.missing("architectures");
  if (*model_type == "gemma4") return std::string(kMultimodalArchitecture);
  if (*model_type == "gemma4_text") return std::string(kTextArchitecture);
  return top.unsupported("model_type", config["model_type"], "expected gemma4 or gemma4_text");
}

Expected<RopeParams> parse_rope(const KeyReader& text, const json& rope_parameters,
                                std::string_view layer_type_key, int head_dim) {
  const std::string path = text.key_path(fmt::format("rope_parameters.{}", layer_type_key));
  if (!rope_parameters.contains(layer_type_key) || !rope_parameters[layer_type_key].is_object()) {
    return make_error(ErrorCode::kInvalidArgument, "config.json: missing required key '{}'", path);
  }
  const json& object = rope_parameters[layer_type_key];
  KeyReader rope(object, path);
  RopeParams params;
  GEMMA4_ASSIGN_OR_RETURN(params.theta, rope.number("rope_theta", 10000.0));
  GEMMA4_ASSIGN_OR_RETURN(auto type, rope.optional_string("rope_type"));
  GEMMA4_ASSIGN_OR_RETURN(double factor, rope.number("factor", 1.0));
  if (factor != 1.0) return rope.unsupported("factor", object["factor"], "rope scaling");
  params.exponent_denominator = head_dim;
  if (!type || *type == "default") {
    // Gemma 4's default rope rotates the whole head (partial_rotary_factor is not read).
    params.rotated_pairs = head_dim / 2;
  } else if (*type == "proportional") {
    GEMMA4_ASSIGN_OR_RETURN(double partial, rope.number("partial_rotary_factor", 1.0));
    if (partial <= 0.0 || partial > 1.0) {
      return rope.unsupported("partial_rotary_factor", object["partial_rotary_factor"],
                              "must be in (0, 1]");
    }
    // transformers: int(partial_rotary_factor * head_dim // 2) (float floor division).
    params.rotated_pairs = static_cast<int>(std::floor(partial * head_dim / 2.0));
  } else {
    return rope.unsupported("rope_type", object["rope_type"], "expected default or proportional");
  }
  return params;
}

Expected<std::vector<LayerType>> parse_layer_types(const KeyReader& text, int num_layers) {
  std::vector<LayerType> types;
  const json* list = text.find("layer_types");
  if (!list) {
    // transformers default: every 6th layer is full.
    for (int i = 0; i < num_layers; ++i) {
      types.push_back((i + 1) % 6 ? LayerType::kSliding : LayerType::kFull);
    }
  } else {
    if (!list->is_array()) return text.type_error("layer_types", "a list", *list);
    if (static_cast<int>(list->size()) != num_layers) {
      return make_error(ErrorCode::kInvalidArgument,
                        "config.json: '{}' has {} entries but num_hidden_layers is {}",
                        text.key_path("layer_types"), list->size(), num_layers);
    }
    for (const json& item : *list) {
      if (item == "sliding_attention") {
        types.push_back(LayerType::kSliding);
      } else if (item == "full_attention") {
        types.push_back(LayerType::kFull);
      } else {
        return text.unsupported("layer_types", item,
                                "expected sliding_attention or full_attention");
      }
    }
  }
  // transformers forces the last layer to full attention (Gemma4TextConfig.__post_init__).
  types.back() = LayerType::kFull;
  return types;
}

// The text-model part of the config: everything in arch spec 1.1, resolved per layer.
Status parse_text_config(const KeyReader& text, ModelConfig& config) {
  // Features gemma4 does not implement fail loudly instead of computing something else.
  GEMMA4_ASSIGN_OR_RETURN(auto activation, text.optional_string("hidden_activation"));
  if (activation && *activation != "gelu_pytorch_tanh") {
    return text.unsupported("hidden_activation", json(*activation),
                            "Gemma 4 uses gelu_pytorch_tanh");
  }
  GEMMA4_ASSIGN_OR_RETURN(bool attention_bias, text.boolean("attention_bias", false));
  if (attention_bias) return text.unsupported("attention_bias", json(true), "no biases in Gemma 4");
  GEMMA4_ASSIGN_OR_RETURN(auto bidirectional, text.optional_string("use_bidirectional_attention"));
  if (bidirectional && *bidirectional != "vision") {
    return text.unsupported("use_bidirectional_attention", json(*bidirectional),
                            "only causal text attention is implemented");
  }

  GEMMA4_ASSIGN_OR_RETURN(config.hidden_size, text.size("hidden_size", std::nullopt));
  GEMMA4_ASSIGN_OR_RETURN(config.num_layers, text.size("num_hidden_layers", std::nullopt));
  GEMMA4_ASSIGN_OR_RETURN(config.vocab_size, text.size("vocab_size", 262144));
  GEMMA4_ASSIGN_OR_RETURN(int num_heads, text.size("num_attention_heads", std::nullopt));
  GEMMA4_ASSIGN_OR_RETURN(int num_kv_heads, text.size("num_key_value_heads", std::nullopt));
  GEMMA4_ASSIGN_OR_RETURN(int sliding_head_dim, text.size("head_dim", 256));
  GEMMA4_ASSIGN_OR_RETURN(int full_head_dim, text.size("global_head_dim", 512));
  GEMMA4_ASSIGN_OR_RETURN(auto global_kv_heads, text.optional_int("num_global_key_value_heads"));
  GEMMA4_ASSIGN_OR_RETURN(int intermediate, text.size("intermediate_size", std::nullopt));
  GEMMA4_ASSIGN_OR_RETURN(bool double_wide, text.boolean("use_double_wide_mlp", false));
  GEMMA4_ASSIGN_OR_RETURN(bool k_eq_v, text.boolean("attention_k_eq_v", false));
  GEMMA4_ASSIGN_OR_RETURN(config.sliding_window, text.size("sliding_window", 512));
  GEMMA4_ASSIGN_OR_RETURN(int64_t kv_shared, text.integer("num_kv_shared_layers", 0));
  GEMMA4_ASSIGN_OR_RETURN(config.max_position_embeddings,
                          text.integer("max_position_embeddings", 131072));
  GEMMA4_ASSIGN_OR_RETURN(double eps, text.number("rms_norm_eps", 1e-6));
  config.rms_norm_eps = static_cast<float>(eps);
  GEMMA4_ASSIGN_OR_RETURN(double softcap, text.number("final_logit_softcapping", 0.0));
  config.final_logit_softcap = static_cast<float>(softcap);
  GEMMA4_ASSIGN_OR_RETURN(config.tie_word_embeddings, text.boolean("tie_word_embeddings", true));
  GEMMA4_ASSIGN_OR_RETURN(int64_t bos, text.integer("bos_token_id", 2));
  GEMMA4_ASSIGN_OR_RETURN(int64_t pad, text.integer("pad_token_id", 0));
  config.bos_token_id = static_cast<int>(bos);
  config.pad_token_id = static_cast<int>(pad);
  GEMMA4_ASSIGN_OR_RETURN(config.eos_token_ids, text.int_list("eos_token_id"));
  if (config.eos_token_ids.empty()) config.eos_token_ids = {1};

  GEMMA4_ASSIGN_OR_RETURN(int64_t ple_dim, text.integer("hidden_size_per_layer_input", 256));
  if (ple_dim < 0) {
    return text.unsupported("hidden_size_per_layer_input", json(ple_dim), "negative");
  }
  config.ple_dim = static_cast<int>(ple_dim);
  if (config.ple_dim > 0) {
    GEMMA4_ASSIGN_OR_RETURN(config.ple_vocab_size, text.size("vocab_size_per_layer_input", 262144));
  }

  GEMMA4_ASSIGN_OR_RETURN(config.moe, text.boolean("enable_moe_block", false));
  if (config.moe) {
    GEMMA4_ASSIGN_OR_RETURN(config.moe_params.num_experts, text.size("num_experts", std::nullopt));
    GEMMA4_ASSIGN_OR_RETURN(config.moe_params.top_k, text.size("top_k_experts", std::nullopt));
    // Older exports name the expert width expert_intermediate_size.
    GEMMA4_ASSIGN_OR_RETURN(auto moe_width, text.optional_int("moe_intermediate_size"));
    GEMMA4_ASSIGN_OR_RETURN(auto expert_width, text.optional_int("expert_intermediate_size"));
    const char* width_key =
        !moe_width && expert_width ? "expert_intermediate_size" : "moe_intermediate_size";
    GEMMA4_ASSIGN_OR_RETURN(config.moe_params.intermediate_size,
                            text.size(width_key, std::nullopt));
    if (config.moe_params.top_k > config.moe_params.num_experts) {
      return text.unsupported("top_k_experts", json(config.moe_params.top_k),
                              "more than num_experts");
    }
  }

  if (num_heads % num_kv_heads != 0) {
    return text.unsupported("num_key_value_heads", json(num_kv_heads),
                            "must divide num_attention_heads");
  }
  if (kv_shared < 0 || kv_shared >= config.num_layers) {
    return text.unsupported("num_kv_shared_layers", json(kv_shared),
                            "at least the first layer must compute its own KV");
  }
  config.num_kv_shared_layers = static_cast<int>(kv_shared);

  LayerShapes shapes;
  GEMMA4_ASSIGN_OR_RETURN(shapes.types, parse_layer_types(text, config.num_layers));
  const int first_shared = config.first_kv_shared_layer();
  if (const int layer = ModelConfig::first_layer_without_kv_source(shapes.types, first_shared);
      layer >= 0) {
    const char* type = layer_type_name(shapes.types[layer]);
    return text.unsupported(
        "num_kv_shared_layers", json(config.num_kv_shared_layers),
        fmt::format("shared {} layer {} has no earlier {} layer to read", type, layer, type));
  }
  // transformers reads num_global_key_value_heads only for k_eq_v full layers (the last layer is
  // always full).
  const int full_kv_heads =
      k_eq_v && global_kv_heads ? static_cast<int>(*global_kv_heads) : num_kv_heads;
  if (full_kv_heads <= 0 || num_heads % full_kv_heads != 0) {
    return text.unsupported("num_global_key_value_heads", json(full_kv_heads),
                            "must divide num_attention_heads");
  }

  json default_rope = {
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
      {"full_attention",
       {{"rope_type", "proportional"}, {"partial_rotary_factor", 0.25}, {"rope_theta", 1e6}}}};
  const json* rope_parameters = text.find("rope_parameters");
  if (!rope_parameters) rope_parameters = &default_rope;
  if (!rope_parameters->is_object()) {
    return text.type_error("rope_parameters", "an object", *rope_parameters);
  }
  if (std::ranges::count(shapes.types, LayerType::kSliding) > 0) {
    GEMMA4_ASSIGN_OR_RETURN(shapes.sliding_rope, parse_rope(text, *rope_parameters,
                                                            "sliding_attention", sliding_head_dim));
  }
  GEMMA4_ASSIGN_OR_RETURN(shapes.full_rope,
                          parse_rope(text, *rope_parameters, "full_attention", full_head_dim));

  shapes.num_q_heads = num_heads;
  shapes.sliding_head_dim = sliding_head_dim;
  shapes.full_head_dim = full_head_dim;
  for (int i = 0; i < config.num_layers; ++i) {
    const bool full = shapes.types[i] == LayerType::kFull;
    shapes.num_kv_heads.push_back(full ? full_kv_heads : num_kv_heads);
    shapes.ffn_widths.push_back(intermediate * (double_wide && i >= first_shared ? 2 : 1));
  }
  config.resolve_layers(shapes);
  for (LayerGeometry& layer : config.layers)
    layer.k_eq_v = layer.type == LayerType::kFull && k_eq_v;
  return Status::ok_status();
}

Expected<json> read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(ErrorCode::kNotFound, "cannot open {}", path.string());
  json parsed = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return make_error(ErrorCode::kInvalidArgument, "{} is not valid JSON", path.string());
  }
  return parsed;
}

}  // namespace

const char* layer_type_name(LayerType type) {
  return type == LayerType::kFull ? "full" : "sliding";
}

int ModelConfig::kv_source_layer(const std::vector<LayerType>& types, int first_shared, int layer) {
  for (int j = first_shared - 1; j >= 0; --j) {
    if (types[j] == types[layer]) return j;
  }
  return -1;
}

int ModelConfig::first_layer_without_kv_source(const std::vector<LayerType>& types,
                                               int first_shared) {
  for (int layer = first_shared; layer < static_cast<int>(types.size()); ++layer) {
    if (kv_source_layer(types, first_shared, layer) < 0) return layer;
  }
  return -1;
}

void ModelConfig::resolve_layers(const LayerShapes& shapes) {
  const int first_shared = first_kv_shared_layer();
  layers.assign(num_layers, LayerGeometry{});
  for (int i = 0; i < num_layers; ++i) {
    LayerGeometry& layer = layers[i];
    layer.layer_index = i;
    layer.type = shapes.types[i];
    const bool full = layer.type == LayerType::kFull;
    layer.head_dim = full ? shapes.full_head_dim : shapes.sliding_head_dim;
    layer.num_q_heads = shapes.num_q_heads;
    layer.num_kv_heads = shapes.num_kv_heads[i];
    layer.ffn_width = shapes.ffn_widths[i];
    layer.window = full ? 0 : sliding_window;
    layer.rope = full ? shapes.full_rope : shapes.sliding_rope;
    layer.kv_source_layer = i >= first_shared ? kv_source_layer(shapes.types, first_shared, i) : i;
  }
}

float ModelConfig::embedding_scale() const {
  return round_bf16(static_cast<float>(std::sqrt(static_cast<double>(hidden_size))));
}

int ModelConfig::max_q_width() const {
  int width = 0;
  for (const auto& layer : layers) width = std::max(width, layer.q_width());
  return width;
}

int ModelConfig::max_kv_width() const {
  int width = 0;
  for (const auto& layer : layers) width = std::max(width, layer.kv_width());
  return width;
}

int ModelConfig::max_ffn_width() const {
  int width = 0;
  for (const auto& layer : layers) width = std::max(width, layer.ffn_width);
  return width;
}

Expected<ModelConfig> ModelConfig::from_hf_json(const json& config) {
  if (!config.is_object()) {
    return make_error(ErrorCode::kInvalidArgument, "config.json: top level must be an object");
  }
  ModelConfig out;
  GEMMA4_ASSIGN_OR_RETURN(out.hf_architecture, resolve_architecture(config));
  KeyReader top(config, "");
  if (out.hf_architecture == kMultimodalArchitecture) {
    const json* text = top.find("text_config");
    if (!text) return top.missing("text_config");
    if (!text->is_object()) return top.type_error("text_config", "an object", *text);
    out.tensor_prefix = "model.language_model.";
    GEMMA4_RETURN_IF_ERROR(parse_text_config(KeyReader(*text, "text_config"), out));
    // The top level carries the chat stop tokens ([1, 106]) where the text config has only 1.
    GEMMA4_ASSIGN_OR_RETURN(auto top_eos, top.int_list("eos_token_id"));
    if (!top_eos.empty()) out.eos_token_ids = top_eos;
    GEMMA4_ASSIGN_OR_RETURN(out.tie_word_embeddings, top.boolean("tie_word_embeddings", true));
  } else {
    out.tensor_prefix = "model.";
    GEMMA4_RETURN_IF_ERROR(parse_text_config(top, out));
  }
  return out;
}

Expected<ModelConfig> ModelConfig::from_hf_file(const std::filesystem::path& config_json) {
  std::filesystem::path path = config_json;
  if (std::filesystem::is_directory(path)) path /= "config.json";
  GEMMA4_ASSIGN_OR_RETURN(json parsed, read_json_file(path));
  auto config = from_hf_json(parsed);
  if (!config) return config.error().with_context(path.string());
  const auto generation_path = path.parent_path() / "generation_config.json";
  if (std::filesystem::exists(generation_path)) {
    GEMMA4_ASSIGN_OR_RETURN(json generation, read_json_file(generation_path));
    if (generation.is_object()) {
      auto eos = KeyReader(generation, "").int_list("eos_token_id");
      if (!eos) return eos.error().with_context(generation_path.string());
      if (!eos->empty()) config->eos_token_ids = *eos;
    }
  }
  return config;
}

const char* quant_method_name(QuantizationInfo::Method method) {
  switch (method) {
    case QuantizationInfo::Method::kNone:
      return "none";
    case QuantizationInfo::Method::kCompressedTensors:
      return "compressed-tensors";
    case QuantizationInfo::Method::kModelOpt:
      return "modelopt";
    case QuantizationInfo::Method::kGguf:
      return "gguf";
  }
  return "?";
}

namespace {

Expected<std::vector<std::string>> string_list(const KeyReader& reader, std::string_view key) {
  std::vector<std::string> out;
  const json* value = reader.find(key);
  if (!value) return out;
  if (!value->is_array()) return reader.type_error(key, "a list of strings", *value);
  for (const json& item : *value) {
    if (!item.is_string()) return reader.type_error(key, "a list of strings", *value);
    out.push_back(item.get<std::string>());
  }
  return out;
}

// ModelOpt: {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules" | "ignore": [...]}.
Expected<QuantizationInfo> parse_modelopt(const KeyReader& reader, const json& object) {
  QuantizationInfo info;
  info.method = QuantizationInfo::Method::kModelOpt;
  GEMMA4_ASSIGN_OR_RETURN(auto algo, reader.optional_string("quant_algo"));
  if (!algo) return reader.missing("quant_algo");
  if (*algo != "NVFP4") {
    return reader.unsupported("quant_algo", object["quant_algo"], "gemma4 reads ModelOpt NVFP4");
  }
  info.format = *algo;
  info.weight_format = quant::WeightFormat::kNVFP4;
  info.num_bits = 4;
  GEMMA4_ASSIGN_OR_RETURN(info.group_size, reader.size("group_size", 16));
  if (info.group_size != 16) {
    return reader.unsupported("group_size", object["group_size"], "NVFP4 blocks are 16 wide");
  }
  GEMMA4_ASSIGN_OR_RETURN(info.ignore, string_list(reader, "exclude_modules"));
  if (info.ignore.empty()) {
    GEMMA4_ASSIGN_OR_RETURN(info.ignore, string_list(reader, "ignore"));
  }
  return info;
}

// compressed-tensors: every config group must use the same weight scheme (int4 g32 symmetric
// pack-quantized, or nvfp4-pack-quantized).
Expected<QuantizationInfo> parse_compressed_tensors(const KeyReader& reader) {
  QuantizationInfo info;
  info.method = QuantizationInfo::Method::kCompressedTensors;
  GEMMA4_ASSIGN_OR_RETURN(auto global_format, reader.optional_string("format"));
  GEMMA4_ASSIGN_OR_RETURN(info.ignore, string_list(reader, "ignore"));
  const json* groups = reader.find("config_groups");
  if (!groups) return reader.missing("config_groups");
  if (!groups->is_object() || groups->empty()) {
    return reader.type_error("config_groups", "a non-empty object", *groups);
  }
  bool first = true;
  for (const auto& [name, group] : groups->items()) {
    const std::string group_path = reader.key_path(fmt::format("config_groups.{}", name));
    if (!group.is_object()) {
      return make_error(ErrorCode::kInvalidArgument, "config.json: '{}' must be an object",
                        group_path);
    }
    KeyReader group_reader(group, group_path);
    GEMMA4_ASSIGN_OR_RETURN(auto group_format, group_reader.optional_string("format"));
    std::string format = group_format ? *group_format : global_format.value_or("");
    const json* weights = group_reader.find("weights");
    if (!weights || !weights->is_object()) return group_reader.missing("weights");
    KeyReader args(*weights, group_path + ".weights");
    QuantizationInfo scheme;
    scheme.format = format;
    GEMMA4_ASSIGN_OR_RETURN(scheme.num_bits, args.size("num_bits", std::nullopt));
    GEMMA4_ASSIGN_OR_RETURN(scheme.symmetric, args.boolean("symmetric", true));
    GEMMA4_ASSIGN_OR_RETURN(auto type, args.optional_string("type"));
    GEMMA4_ASSIGN_OR_RETURN(auto group_size, args.optional_int("group_size"));
    GEMMA4_ASSIGN_OR_RETURN(auto actorder, args.optional_string("actorder"));
    scheme.group_size = group_size ? static_cast<int>(*group_size) : 0;
    if (format == "pack-quantized") {
      if (scheme.num_bits != 4) {
        return args.unsupported("num_bits", json(scheme.num_bits), "only int4 is implemented");
      }
      if (type && *type != "int") return args.unsupported("type", json(*type), "expected int");
      if (!scheme.symmetric) {
        return args.unsupported("symmetric", json(false), "only symmetric int4 is implemented");
      }
      if (scheme.group_size != 32) {
        return args.unsupported("group_size", json(scheme.group_size),
                                "the w4g32 format needs group_size 32");
      }
      if (actorder && *actorder != "weight") {
        return args.unsupported("actorder", json(*actorder), "g_idx reordering");
      }
      scheme.weight_format = quant::WeightFormat::kW4G32;
    } else if (format == "nvfp4-pack-quantized") {
      if (scheme.num_bits != 4 || (type && *type != "float") || scheme.group_size != 16) {
        return args.unsupported("group_size", json(scheme.group_size),
                                "NVFP4 is 4-bit float with group_size 16");
      }
      scheme.weight_format = quant::WeightFormat::kNVFP4;
    } else {
      return group_reader.unsupported("format", json(format),
                                      "expected pack-quantized or nvfp4-pack-quantized");
    }
    if (!first &&
        (scheme.weight_format != info.weight_format || scheme.group_size != info.group_size)) {
      return group_reader.unsupported("format", json(format),
                                      "config groups with different weight schemes");
    }
    first = false;
    info.weight_format = scheme.weight_format;
    info.format = scheme.format;
    info.num_bits = scheme.num_bits;
    info.group_size = scheme.group_size;
    info.symmetric = scheme.symmetric;
  }
  return info;
}

}  // namespace

Expected<QuantizationInfo> QuantizationInfo::from_hf_json(const json& config,
                                                          const json* hf_quant_config) {
  KeyReader top(config, "");
  if (const json* section = top.find("quantization_config")) {
    if (!section->is_object()) return top.type_error("quantization_config", "an object", *section);
    KeyReader reader(*section, "quantization_config");
    GEMMA4_ASSIGN_OR_RETURN(auto method, reader.optional_string("quant_method"));
    if (!method) return reader.missing("quant_method");
    if (*method == "compressed-tensors") return parse_compressed_tensors(reader);
    if (*method == "modelopt") return parse_modelopt(reader, *section);
    return reader.unsupported("quant_method", (*section)["quant_method"],
                              "gemma4 reads compressed-tensors and modelopt checkpoints");
  }
  if (hf_quant_config) {
    const json* section = hf_quant_config->is_object() && hf_quant_config->contains("quantization")
                              ? &(*hf_quant_config)["quantization"]
                              : nullptr;
    if (!section || !section->is_object()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "hf_quant_config.json: missing required key 'quantization'");
    }
    auto info = parse_modelopt(KeyReader(*section, "quantization"), *section);
    if (!info) return info.error().with_context("hf_quant_config.json");
    return info;
  }
  return QuantizationInfo{};
}

Expected<QuantizationInfo> QuantizationInfo::from_checkpoint_dir(
    const std::filesystem::path& directory) {
  GEMMA4_ASSIGN_OR_RETURN(json config, read_json_file(directory / "config.json"));
  std::optional<json> hf_quant;
  if (std::filesystem::exists(directory / "hf_quant_config.json")) {
    GEMMA4_ASSIGN_OR_RETURN(hf_quant, read_json_file(directory / "hf_quant_config.json"));
  }
  return from_hf_json(config, hf_quant ? &*hf_quant : nullptr);
}

}  // namespace gemma4::model
