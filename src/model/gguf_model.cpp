#include "model/gguf_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "core/numeric.h"
#include "model/tensor_source.h"
#include "quant/gguf_repack.h"

namespace gemma4::model {
namespace {

using io::GgufFile;
using io::GgufTensorInfo;
using io::GgufType;
using io::GgufValue;
using quant::QMatrix;

// Sizes beyond this are corrupt metadata, not models.
constexpr int64_t kMaxSize = int64_t{1} << 30;
// Chat turn terminators that generation_config.json lists as stop tokens beside <eos>
// (Gemma 3 instruct: 106 <end_of_turn>; Gemma 4: 106 <turn|>, 50 <|tool_response>).
constexpr std::string_view kChatStopTokens[] = {"<end_of_turn>", "<turn|>", "<|tool_response>"};

// Reads `<architecture>.<key>` (or a full key) from the metadata; errors name the key and file.
class MetadataReader {
 public:
  MetadataReader(const GgufFile& file, std::string architecture)
      : file_(file), architecture_(std::move(architecture)) {}

  std::string key_of(std::string_view key) const {
    return fmt::format("{}.{}", architecture_, key);
  }
  const GgufValue* find(std::string_view key) const { return file_.find_metadata(key_of(key)); }

  Error missing(std::string_view key) const {
    return make_error(ErrorCode::kInvalidArgument, "GGUF {}: missing required key '{}'",
                      file_.path().string(), key_of(key));
  }
  Error invalid(std::string_view key, std::string_view why) const {
    return make_error(ErrorCode::kInvalidArgument, "GGUF {}: key '{}' {}", file_.path().string(),
                      key_of(key), why);
  }
  Error unsupported(std::string_view key, std::string_view why) const {
    return make_error(ErrorCode::kUnsupported, "GGUF {}: unsupported '{}': {}",
                      file_.path().string(), key_of(key), why);
  }

  // A positive integer that fits an int.
  Expected<int> size(std::string_view key, std::optional<int64_t> fallback) const {
    const GgufValue* value = find(key);
    if (!value) {
      if (fallback) return static_cast<int>(*fallback);
      return missing(key);
    }
    const auto number = value->as_int();
    if (!number || value->array_size() > 0) return invalid(key, "must be an integer");
    if (*number <= 0 || *number > kMaxSize) {
      return invalid(key, fmt::format("= {} is not a valid size", *number));
    }
    return static_cast<int>(*number);
  }
  // A non-negative integer (counts that may be 0).
  Expected<int> count(std::string_view key) const {
    const GgufValue* value = find(key);
    if (!value) return 0;
    const auto number = value->as_int();
    if (!number || value->array_size() > 0 || *number < 0 || *number > kMaxSize) {
      return invalid(key, "must be a non-negative integer");
    }
    return static_cast<int>(*number);
  }
  Expected<double> number(std::string_view key, double fallback) const {
    const GgufValue* value = find(key);
    if (!value) return fallback;
    if (auto f = value->as_float()) return *f;
    if (auto i = value->as_int(); i && value->array_size() == 0) return static_cast<double>(*i);
    return invalid(key, "must be a number");
  }
  // One positive size per layer: a scalar for all layers, or an array of num_layers.
  Expected<std::vector<int>> per_layer_size(std::string_view key, int num_layers) const {
    const GgufValue* value = find(key);
    if (!value) return missing(key);
    if (value->type != io::GgufValueType::kArray) {
      GEMMA4_ASSIGN_OR_RETURN(int scalar, size(key, std::nullopt));
      return std::vector<int>(static_cast<size_t>(num_layers), scalar);
    }
    const auto list = value->as_int_array();
    if (!list) return invalid(key, "must be an integer or an integer array");
    if (std::ssize(*list) != num_layers) {
      return invalid(key, fmt::format("has {} entries for {} layers", list->size(), num_layers));
    }
    std::vector<int> out;
    for (int64_t item : *list) {
      if (item <= 0 || item > kMaxSize) return invalid(key, fmt::format("has entry {}", item));
      out.push_back(static_cast<int>(item));
    }
    return out;
  }

 private:
  const GgufFile& file_;
  std::string architecture_;
};

std::optional<int> token_id(const GgufFile& file, std::string_view key) {
  const GgufValue* value = file.find_metadata(key);
  if (!value) return std::nullopt;
  const auto id = value->as_int();
  if (!id || *id < 0 || *id > kMaxSize) return std::nullopt;
  return static_cast<int>(*id);
}

// Layer types: the per-layer bool array (true = sliding) when the file has one, else Gemma 3's
// fixed pattern (every 6th layer global, as llama.cpp and transformers' Gemma3TextConfig).
Expected<std::vector<LayerType>> layer_types(const MetadataReader& meta, int num_layers,
                                             bool pattern_required) {
  const char* key = "attention.sliding_window_pattern";
  std::vector<LayerType> types;
  const GgufValue* value = meta.find(key);
  if (!value) {
    if (pattern_required) return meta.missing(key);
    for (int i = 0; i < num_layers; ++i) {
      types.push_back((i + 1) % 6 == 0 ? LayerType::kFull : LayerType::kSliding);
    }
    return types;
  }
  const std::vector<bool>* sliding = value->as_bool_array();
  if (!sliding) return meta.invalid(key, "must be a bool array");
  if (std::ssize(*sliding) != num_layers) {
    return meta.invalid(key,
                        fmt::format("has {} entries for {} layers", sliding->size(), num_layers));
  }
  for (bool s : *sliding) types.push_back(s ? LayerType::kSliding : LayerType::kFull);
  return types;
}

// Full-layer rope of a Gemma 4 GGUF: `rope_freqs.weight` holds per-pair frequency divisors, 1 for
// the pairs that rotate followed by ~1e30 (proportional rope, spec 4.3); other shapes of divisor
// are not implemented.
Expected<int> rotated_pairs_from_rope_freqs(const GgufFile& file, int pairs) {
  const GgufTensorInfo* freqs = file.find("rope_freqs.weight");
  if (freqs == nullptr) return pairs;
  if (freqs->type != static_cast<uint32_t>(GgufType::kF32) || freqs->ne.size() != 1 ||
      freqs->ne[0] != pairs) {
    return make_error(ErrorCode::kInvalidArgument,
                      "GGUF {}: tensor rope_freqs.weight must be F32 [{}] (rope pairs)",
                      file.path().string(), pairs);
  }
  int rotated = 0;
  for (int i = 0; i < pairs; ++i) {
    float divisor;
    std::memcpy(&divisor, freqs->data + 4 * i, 4);
    if (divisor == 1.0f && rotated == i) {
      ++rotated;
    } else if (!(divisor >= 1e20f)) {
      return make_error(ErrorCode::kUnsupported,
                        "GGUF {}: rope_freqs.weight[{}] = {}: only ones followed by ~1e30 "
                        "(proportional rope) are implemented",
                        file.path().string(), i, divisor);
    }
  }
  return rotated;
}

Status reject_rope_scaling(const MetadataReader& meta) {
  if (const GgufValue* type = meta.find("rope.scaling.type")) {
    const std::string* name = type->as_string();
    if (!name || (*name != "none" && !name->empty())) {
      return meta.unsupported("rope.scaling.type", "rope scaling is not implemented");
    }
  }
  GEMMA4_ASSIGN_OR_RETURN(double factor, meta.number("rope.scaling.factor", 1.0));
  if (factor != 1.0 && factor != 0.0) {
    return meta.unsupported("rope.scaling.factor", "rope scaling is not implemented");
  }
  return Status::ok_status();
}

// The "blk.L." tensor of a Gemma 4 layer with a given suffix, if present.
bool layer_has(const GgufFile& file, int layer, std::string_view suffix) {
  return file.find(fmt::format("blk.{}.{}", layer, suffix)) != nullptr;
}

}  // namespace

Expected<ModelConfig> config_from_gguf(const GgufFile& file) {
  const GgufValue* arch_value = file.find_metadata("general.architecture");
  const std::string* arch = arch_value ? arch_value->as_string() : nullptr;
  if (arch == nullptr) {
    return make_error(ErrorCode::kInvalidArgument,
                      "GGUF {}: missing required key 'general.architecture'", file.path().string());
  }
  if (*arch != "gemma4" && *arch != "gemma3") {
    return make_error(ErrorCode::kUnsupported,
                      "GGUF {}: general.architecture '{}' (gemma4 runs gemma4 and gemma3)",
                      file.path().string(), *arch);
  }
  const bool gemma3 = *arch == "gemma3";
  const MetadataReader meta(file, *arch);
  ModelConfig c;
  c.architecture = gemma3 ? Architecture::kGemma3 : Architecture::kGemma4;
  c.hf_architecture = gemma3 ? "Gemma3ForCausalLM" : "Gemma4ForCausalLM";
  GEMMA4_ASSIGN_OR_RETURN(c.hidden_size, meta.size("embedding_length", std::nullopt));
  GEMMA4_ASSIGN_OR_RETURN(c.num_layers, meta.size("block_count", std::nullopt));
  if (c.num_layers > 4096) return meta.invalid("block_count", "is not a plausible layer count");
  GEMMA4_ASSIGN_OR_RETURN(int context, meta.size("context_length", 131072));
  c.max_position_embeddings = context;
  GEMMA4_ASSIGN_OR_RETURN(double eps, meta.number("attention.layer_norm_rms_epsilon", 1e-6));
  c.rms_norm_eps = static_cast<float>(eps);
  GEMMA4_ASSIGN_OR_RETURN(c.sliding_window, meta.size("attention.sliding_window", std::nullopt));
  GEMMA4_ASSIGN_OR_RETURN(double softcap, meta.number("final_logit_softcapping", 0.0));
  c.final_logit_softcap = static_cast<float>(softcap);
  GEMMA4_ASSIGN_OR_RETURN(int num_heads, meta.size("attention.head_count", std::nullopt));
  GEMMA4_ASSIGN_OR_RETURN(auto kv_heads,
                          meta.per_layer_size("attention.head_count_kv", c.num_layers));
  GEMMA4_ASSIGN_OR_RETURN(auto ffn, meta.per_layer_size("feed_forward_length", c.num_layers));
  GEMMA4_RETURN_IF_ERROR(reject_rope_scaling(meta));

  const GgufTensorInfo* embedding = file.find("token_embd.weight");
  if (embedding == nullptr || embedding->ne.size() != 2 || embedding->ne[0] != c.hidden_size ||
      embedding->ne[1] <= 0 || embedding->ne[1] > kMaxSize) {
    return make_error(ErrorCode::kInvalidArgument,
                      "GGUF {}: token_embd.weight must be a {{{}, vocab}} matrix",
                      file.path().string(), c.hidden_size);
  }
  c.vocab_size = static_cast<int>(embedding->ne[1]);
  c.tie_word_embeddings = file.find("output.weight") == nullptr;

  c.bos_token_id = token_id(file, "tokenizer.ggml.bos_token_id").value_or(2);
  c.pad_token_id = token_id(file, "tokenizer.ggml.padding_token_id").value_or(0);
  c.eos_token_ids = {token_id(file, "tokenizer.ggml.eos_token_id").value_or(1)};
  if (const GgufValue* tokens = file.find_metadata("tokenizer.ggml.tokens")) {
    if (const auto* names = tokens->as_string_array()) {
      for (size_t id = 0; id < names->size(); ++id) {
        if (std::ranges::find(kChatStopTokens, (*names)[id]) != std::end(kChatStopTokens)) {
          c.eos_token_ids.push_back(static_cast<int>(id));
        }
      }
    }
  }

  GEMMA4_ASSIGN_OR_RETURN(auto types, layer_types(meta, c.num_layers, !gemma3));
  int sliding_head_dim = 0, full_head_dim = 0;
  RopeParams sliding_rope, full_rope;
  if (gemma3) {
    // Gemma 3 (transformers' Gemma3TextConfig): one head dim, default rope on both layer kinds
    // (local base 1e4 unless the file says otherwise), (1 + w) norms, no V norm, no layer scalar.
    GEMMA4_ASSIGN_OR_RETURN(sliding_head_dim, meta.size("attention.key_length", 256));
    full_head_dim = sliding_head_dim;
    GEMMA4_ASSIGN_OR_RETURN(full_rope.theta, meta.number("rope.freq_base", 1e6));
    GEMMA4_ASSIGN_OR_RETURN(sliding_rope.theta, meta.number("rope.freq_base_swa", 1e4));
    for (RopeParams* rope : {&sliding_rope, &full_rope}) {
      rope->rotated_pairs = sliding_head_dim / 2;
      rope->exponent_denominator = sliding_head_dim;
    }
    // query_pre_attn_scalar is not in the file: it is the head dim for every Gemma 3 size except
    // 27B (62 layers), which uses hidden / heads (llama.cpp's rule).
    const double query_pre_attn_scalar =
        c.num_layers == 62 ? static_cast<double>(c.hidden_size) / num_heads : sliding_head_dim;
    c.attention_scale = static_cast<float>(1.0 / std::sqrt(query_pre_attn_scalar));
    c.norm_weight_offset = 1.0f;
    c.has_v_norm = false;
    c.has_layer_scalar = false;
    c.ple_dim = 0;
  } else {
    GEMMA4_ASSIGN_OR_RETURN(full_head_dim, meta.size("attention.key_length", std::nullopt));
    GEMMA4_ASSIGN_OR_RETURN(sliding_head_dim, meta.size("attention.key_length_swa", std::nullopt));
    GEMMA4_ASSIGN_OR_RETURN(sliding_rope.theta, meta.number("rope.freq_base_swa", 1e4));
    GEMMA4_ASSIGN_OR_RETURN(full_rope.theta, meta.number("rope.freq_base", 1e6));
    GEMMA4_ASSIGN_OR_RETURN(int sliding_dims,
                            meta.size("rope.dimension_count_swa", sliding_head_dim));
    GEMMA4_ASSIGN_OR_RETURN(int full_dims, meta.size("rope.dimension_count", full_head_dim));
    if (sliding_dims > sliding_head_dim || full_dims > full_head_dim) {
      return meta.unsupported("rope.dimension_count", "rope wider than the head");
    }
    sliding_rope.rotated_pairs = sliding_dims / 2;
    sliding_rope.exponent_denominator = sliding_dims;
    GEMMA4_ASSIGN_OR_RETURN(full_rope.rotated_pairs,
                            rotated_pairs_from_rope_freqs(file, full_dims / 2));
    full_rope.exponent_denominator = full_dims;
    GEMMA4_ASSIGN_OR_RETURN(c.num_kv_shared_layers, meta.count("attention.shared_kv_layers"));
    GEMMA4_ASSIGN_OR_RETURN(c.ple_dim, meta.count("embedding_length_per_layer_input"));
    if (c.ple_dim > 0) {
      const GgufTensorInfo* table = file.find("per_layer_token_embd.weight");
      if (table == nullptr || table->ne.size() != 2 || table->ne[1] <= 0 ||
          table->ne[1] > kMaxSize) {
        return make_error(ErrorCode::kInvalidArgument,
                          "GGUF {}: per_layer_token_embd.weight must be a 2-D matrix",
                          file.path().string());
      }
      c.ple_vocab_size = static_cast<int>(table->ne[1]);
    }
    GEMMA4_ASSIGN_OR_RETURN(c.moe_params.num_experts, meta.count("expert_count"));
    c.moe = c.moe_params.num_experts > 0;
    if (c.moe) {
      GEMMA4_ASSIGN_OR_RETURN(c.moe_params.top_k, meta.size("expert_used_count", std::nullopt));
      GEMMA4_ASSIGN_OR_RETURN(c.moe_params.intermediate_size,
                              meta.size("expert_feed_forward_length", std::nullopt));
      if (c.moe_params.top_k > c.moe_params.num_experts) {
        return meta.invalid("expert_used_count", "exceeds expert_count");
      }
    }
  }
  if (c.num_kv_shared_layers >= c.num_layers) {
    return meta.invalid("attention.shared_kv_layers", "leaves no layer computing its own KV");
  }

  for (int i = 0; i < c.num_layers; ++i) {
    const int head_dim = types[i] == LayerType::kFull ? full_head_dim : sliding_head_dim;
    if (int64_t{num_heads} * head_dim > kMaxSize) {
      return meta.invalid("attention.head_count", "times the head dim is not a plausible width");
    }
    if (num_heads % kv_heads[i] != 0) {
      return meta.invalid(
          "attention.head_count_kv",
          fmt::format("{} does not divide head_count {} (layer {})", kv_heads[i], num_heads, i));
    }
  }
  if (const int layer =
          ModelConfig::first_layer_without_kv_source(types, c.first_kv_shared_layer());
      layer >= 0) {
    return meta.invalid("attention.shared_kv_layers",
                        fmt::format("shared layer {} has no earlier {} layer to read", layer,
                                    layer_type_name(types[layer])));
  }
  LayerShapes shapes;
  shapes.types = std::move(types);
  shapes.num_kv_heads = std::move(kv_heads);
  shapes.ffn_widths = std::move(ffn);
  shapes.num_q_heads = num_heads;
  shapes.sliding_head_dim = sliding_head_dim;
  shapes.full_head_dim = full_head_dim;
  shapes.sliding_rope = sliding_rope;
  shapes.full_rope = full_rope;
  c.resolve_layers(shapes);
  for (LayerGeometry& layer : c.layers) {
    const int i = layer.layer_index;
    const bool full = layer.type == LayerType::kFull;
    // Gemma 4's attention_k_eq_v: a full layer with K but no V projection uses raw K as V.
    layer.k_eq_v = !gemma3 && full && layer.owns_kv() && layer_has(file, i, "attn_k.weight") &&
                   !layer_has(file, i, "attn_v.weight");
  }
  return c;
}

namespace {

// The GGUF tensor of a Hugging Face tensor name (relative to the text model), spec 4.5.
struct GgufName {
  std::string tensor;
  std::optional<int64_t> expert;  // slice of a stacked {K, N, E} expert tensor
};

constexpr std::pair<std::string_view, std::string_view> kGlobalNames[] = {
    {"embed_tokens", "token_embd.weight"},
    {"norm.weight", "output_norm.weight"},
    {"embed_tokens_per_layer", "per_layer_token_embd.weight"},
    {"per_layer_model_projection", "per_layer_model_proj.weight"},
    {"per_layer_projection_norm.weight", "per_layer_proj_norm.weight"},
};

constexpr std::pair<std::string_view, std::string_view> kLayerNames[] = {
    {"self_attn.q_proj", "attn_q.weight"},
    {"self_attn.k_proj", "attn_k.weight"},
    {"self_attn.v_proj", "attn_v.weight"},
    {"self_attn.o_proj", "attn_output.weight"},
    {"self_attn.q_norm.weight", "attn_q_norm.weight"},
    {"self_attn.k_norm.weight", "attn_k_norm.weight"},
    {"input_layernorm.weight", "attn_norm.weight"},
    {"post_attention_layernorm.weight", "post_attention_norm.weight"},
    {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
    {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"},
    {"mlp.gate_proj", "ffn_gate.weight"},
    {"mlp.up_proj", "ffn_up.weight"},
    {"mlp.down_proj", "ffn_down.weight"},
    {"router.proj", "ffn_gate_inp.weight"},
    {"router.scale", "ffn_gate_inp.scale"},
    {"router.per_expert_scale", "ffn_down_exps.scale"},
    {"post_feedforward_layernorm_1.weight", "post_ffw_norm_1.weight"},
    {"pre_feedforward_layernorm_2.weight", "pre_ffw_norm_2.weight"},
    {"post_feedforward_layernorm_2.weight", "post_ffw_norm_2.weight"},
    {"experts.gate_up_proj", "ffn_gate_up_exps.weight"},
    {"experts.down_proj", "ffn_down_exps.weight"},
    {"per_layer_input_gate", "inp_gate.weight"},
    {"per_layer_projection", "proj.weight"},
    {"post_per_layer_input_norm.weight", "post_norm.weight"},
    {"layer_scalar", "layer_output_scale.weight"},
};

// Per-expert Linears "experts.E.<which>" of a quantized HF checkpoint = slice E of these.
constexpr std::pair<std::string_view, std::string_view> kExpertNames[] = {
    {"gate_proj", "ffn_gate_exps.weight"},
    {"up_proj", "ffn_up_exps.weight"},
    {"down_proj", "ffn_down_exps.weight"},
};

template <size_t N>
std::optional<std::string_view> lookup(
    const std::pair<std::string_view, std::string_view> (&table)[N], std::string_view key) {
  for (const auto& [hf, gguf] : table) {
    if (hf == key) return gguf;
  }
  return std::nullopt;
}

// Parses a leading decimal number of `text` and the '.' after it.
std::optional<int64_t> leading_index(std::string_view& text) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end == text.data() + text.size() || *end != '.') return std::nullopt;
  text.remove_prefix(static_cast<size_t>(end - text.data()) + 1);
  return value;
}

std::optional<GgufName> gguf_name(std::string_view name) {
  if (auto global = lookup(kGlobalNames, name)) return GgufName{std::string(*global), {}};
  if (!name.starts_with("layers.")) return std::nullopt;
  std::string_view rest = name.substr(7);
  const auto layer = leading_index(rest);
  if (!layer) return std::nullopt;
  if (auto suffix = lookup(kLayerNames, rest)) {
    return GgufName{fmt::format("blk.{}.{}", *layer, *suffix), {}};
  }
  if (!rest.starts_with("experts.")) return std::nullopt;
  rest.remove_prefix(8);
  const auto expert = leading_index(rest);
  const auto suffix = lookup(kExpertNames, rest);
  if (!expert || !suffix) return std::nullopt;
  return GgufName{fmt::format("blk.{}.{}", *layer, *suffix), *expert};
}

Expected<std::vector<float>> read_vector(const GgufTensorInfo& tensor) {
  std::vector<float> out(static_cast<size_t>(tensor.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t bits = 0;
    switch (static_cast<GgufType>(tensor.type)) {
      case GgufType::kF32:
        std::memcpy(&out[i], tensor.data + 4 * i, 4);
        break;
      case GgufType::kF16:
        std::memcpy(&bits, tensor.data + 2 * i, 2);
        out[i] = fp16_to_float(bits);
        break;
      case GgufType::kBF16:
        std::memcpy(&bits, tensor.data + 2 * i, 2);
        out[i] = bf16_to_float(bits);
        break;
      default:
        return make_error(ErrorCode::kUnsupported,
                          "tensor '{}': type {} (vectors must be F32, F16 or BF16)", tensor.name,
                          io::gguf_type_name(tensor.type));
    }
  }
  return out;
}

class GgufSource final : public TensorSource {
 public:
  GgufSource(const GgufFile& file, float norm_offset, ModelWeights& weights)
      : file_(file), norm_offset_(norm_offset), weights_(weights) {}

  bool has(const std::string& name) const override {
    const auto mapped = gguf_name(name);
    return mapped && file_.find(mapped->tensor) != nullptr;
  }

  Expected<QMatrix> matrix(const std::string& module, int64_t rows, int64_t cols,
                           std::optional<int64_t> expert) const override {
    const auto mapped = gguf_name(module);
    if (!mapped) {
      return make_error(ErrorCode::kInternal, "no GGUF name for tensor '{}'", module);
    }
    if (mapped->expert) expert = mapped->expert;
    return named_matrix(mapped->tensor, rows, cols, expert);
  }

  Expected<QMatrix> lm_head(int64_t rows, int64_t cols) const override {
    return named_matrix("output.weight", rows, cols, std::nullopt);
  }

  Expected<std::vector<float>> vector(const std::string& name, int64_t length) const override {
    const auto mapped = gguf_name(name);
    if (!mapped) return make_error(ErrorCode::kInternal, "no GGUF name for tensor '{}'", name);
    GEMMA4_ASSIGN_OR_RETURN(const GgufTensorInfo* tensor, require(mapped->tensor));
    if (tensor->ne.size() != 1 || tensor->ne[0] != length) {
      return error(*tensor, fmt::format("expected {{{}}}", length));
    }
    auto values = read_vector(*tensor);
    if (!values) return values.error().with_context(file_.path().string());
    // llama.cpp folds Gemma's norm offset into every "*norm.weight" (spec: see gguf_model.h).
    if (name.ends_with("norm.weight")) {
      for (float& v : *values) v -= norm_offset_;
    }
    return values;
  }

 private:
  Error error(const GgufTensorInfo& tensor, std::string_view why) const {
    return make_error(ErrorCode::kInvalidArgument, "GGUF {}: tensor '{}' ({} {{{}}}): {}",
                      file_.path().string(), tensor.name, io::gguf_type_name(tensor.type),
                      fmt::join(tensor.ne, ", "), why);
  }

  Expected<const GgufTensorInfo*> require(const std::string& name) const {
    const GgufTensorInfo* tensor = file_.find(name);
    if (tensor == nullptr) {
      return make_error(ErrorCode::kNotFound, "GGUF {}: missing tensor '{}'", file_.path().string(),
                        name);
    }
    weights_.used_tensors.insert(tensor->name);
    return tensor;
  }

  // The [rows, cols] matrix of tensor `name` ({cols, rows}), or slice `expert` of a stacked
  // {cols, rows, E} one.
  Expected<QMatrix> named_matrix(const std::string& name, int64_t rows, int64_t cols,
                                 std::optional<int64_t> expert) const {
    GEMMA4_ASSIGN_OR_RETURN(const GgufTensorInfo* tensor, require(name));
    const size_t rank = expert ? 3 : 2;
    if (tensor->ne.size() != rank || tensor->ne[0] != cols || tensor->ne[1] != rows ||
        (expert && (*expert < 0 || *expert >= tensor->ne[2]))) {
      return error(*tensor, expert ? fmt::format("expected {{{}, {}, E}} with expert {} < E", cols,
                                                 rows, *expert)
                                   : fmt::format("expected {{{}, {}}}", cols, rows));
    }
    GEMMA4_ASSIGN_OR_RETURN(QMatrix whole, whole_matrix(*tensor));
    return expert ? quant::row_slice(whole, *expert * rows, rows) : whole;
  }

  // All of `tensor` as one [numel / ne[0], ne[0]] matrix: a view for float types, else
  // repacked once (stacked experts are sliced from it).
  Expected<QMatrix> whole_matrix(const GgufTensorInfo& tensor) const {
    if (auto it = matrices_.find(tensor.name); it != matrices_.end()) return it->second;
    QMatrix m;
    m.rows = tensor.numel() / tensor.ne[0];
    m.cols = tensor.ne[0];
    switch (static_cast<GgufType>(tensor.type)) {
      case GgufType::kF32:
        m.format = quant::WeightFormat::kF32;
        m.data = tensor.data;
        break;
      case GgufType::kF16:
        m.format = quant::WeightFormat::kF16;
        m.data = tensor.data;
        break;
      case GgufType::kBF16:
        m.format = quant::WeightFormat::kBF16;
        m.data = tensor.data;
        break;
      default: {
        if (!quant::ggml_type_repackable(tensor.type)) {
          return make_error(ErrorCode::kUnsupported,
                            "GGUF {}: tensor '{}' has type {}, which gemma4 does not load "
                            "(supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, "
                            "Q4_K, Q5_K, Q6_K)",
                            file_.path().string(), tensor.name, io::gguf_type_name(tensor.type));
        }
        auto packed = quant::repack_ggml(tensor.type, {tensor.data, tensor.nbytes}, m.rows, m.cols);
        if (!packed) return error(tensor, packed.error().message);
        auto owned = std::make_shared<const quant::PackedMatrix>(std::move(packed).value());
        weights_.repacked.push_back(owned);
        m = owned->view();
      }
    }
    matrices_.emplace(tensor.name, m);
    return m;
  }

  const GgufFile& file_;
  float norm_offset_;
  ModelWeights& weights_;
  mutable std::map<std::string, QMatrix> matrices_;
};

}  // namespace

std::optional<std::string> gguf_tensor_name(std::string_view name) {
  auto mapped = gguf_name(name);
  if (!mapped || mapped->expert) return std::nullopt;
  return mapped->tensor;
}

namespace {

QuantizationInfo gguf_quantization(const GgufFile& file, const ModelWeights& weights) {
  QuantizationInfo info;
  info.method = QuantizationInfo::Method::kGguf;
  std::set<std::string> types;
  for (const std::string& name : weights.used_tensors) {
    const GgufTensorInfo* tensor = file.find(name);
    if (tensor != nullptr && tensor->ne.size() >= 2) types.insert(io::gguf_type_name(tensor->type));
  }
  info.format = fmt::format("{}", fmt::join(types, ", "));
  if (!weights.layers.empty()) info.weight_format = weights.layers[0].q_proj.format;
  return info;
}

}  // namespace

Expected<LoadedModel> open_gguf_model(const std::filesystem::path& path) {
  GEMMA4_ASSIGN_OR_RETURN(GgufFile opened, GgufFile::open(path));
  return gguf_model(std::make_shared<const GgufFile>(std::move(opened)));
}

Expected<LoadedModel> gguf_model(std::shared_ptr<const GgufFile> file) {
  LoadedModel model;
  GEMMA4_ASSIGN_OR_RETURN(model.config, config_from_gguf(*file));
  GgufSource source(*file, model.config.norm_weight_offset, model.weights);
  GEMMA4_RETURN_IF_ERROR(load_weights(source, model.config, model.weights));
  model.weights.gguf = file;
  model.quantization = gguf_quantization(*file, model.weights);
  return model;
}

}  // namespace gemma4::model
