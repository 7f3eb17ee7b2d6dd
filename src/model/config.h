// ModelConfig: a checkpoint's config.json (or GGUF metadata) turned into data, with every
// per-layer choice resolved once (gemma4-architecture.md sections 1, 2.4, 2.5), so the forward
// pass never re-derives geometry or special-cases a model size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"
#include "quant/qmatrix.h"

namespace gemma4::model {

enum class Architecture : uint8_t { kGemma4, kGemma3 };
enum class LayerType : uint8_t { kSliding, kFull };

const char* layer_type_name(LayerType type);  // "sliding" / "full"

struct RopeParams {
  double theta = 10000.0;
  // Number of frequency pairs that rotate; the rest have inv_freq 0 (proportional rope).
  int rotated_pairs = 0;
  // Denominator of the exponent: inv_freq[i] = theta^(-2i / exponent_denominator). The head dim
  // for default rope, the full head dim for proportional rope.
  int exponent_denominator = 0;
};

struct LayerGeometry {
  LayerType type = LayerType::kSliding;
  int head_dim = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int ffn_width = 0;        // dense MLP intermediate size of this layer (double-wide resolved)
  bool k_eq_v = false;      // V is the raw K projection (no v_proj tensor)
  int kv_source_layer = 0;  // == layer_index when the layer owns its KV; else the layer it reads
  int window = 0;           // sliding window W in keys incl. the current one; 0 on full layers
  RopeParams rope;

  int layer_index = 0;

  bool owns_kv() const { return kv_source_layer == layer_index; }
  int q_width() const { return num_q_heads * head_dim; }
  int kv_width() const { return num_kv_heads * head_dim; }
};

// What a config gives about each layer, in whichever format: ModelConfig::resolve_layers' input.
struct LayerShapes {
  std::vector<LayerType> types;
  std::vector<int> num_kv_heads;  // per layer
  std::vector<int> ffn_widths;    // per layer, double-wide resolved
  int num_q_heads = 0;
  int sliding_head_dim = 0;
  int full_head_dim = 0;
  RopeParams sliding_rope;
  RopeParams full_rope;
};

struct MoeParams {
  int num_experts = 0;
  int top_k = 0;
  int intermediate_size = 0;
};

struct ModelConfig {
  Architecture architecture = Architecture::kGemma4;
  int hidden_size = 0;
  int num_layers = 0;
  int vocab_size = 0;
  float rms_norm_eps = 1e-6f;
  float final_logit_softcap = 0.0f;  // 0 = none
  float attention_scale = 1.0f;      // Gemma 4: 1.0; Gemma 3: query_pre_attn_scalar^-0.5
  float norm_weight_offset = 0.0f;   // RMSNorm multiplies by (offset + w): 0 Gemma 4, 1 Gemma 3
  bool has_v_norm = true;            // Gemma 4 normalises V without weight
  bool has_layer_scalar = true;      // Gemma 4's per-layer output multiplier (Gemma 3: none)
  int64_t max_position_embeddings = 0;
  int sliding_window = 0;        // W of the sliding layers (also in each LayerGeometry)
  int num_kv_shared_layers = 0;  // the last N layers read another layer's KV
  // false: logits come from a separate `lm_head.weight` instead of the embedding matrix.
  bool tie_word_embeddings = true;

  // Per-layer embeddings (E2B/E4B); 0 = none.
  int ple_dim = 0;
  int ple_vocab_size = 0;

  bool moe = false;
  MoeParams moe_params;

  int bos_token_id = 2;
  int pad_token_id = 0;
  // Stop tokens: generation_config.json's list when from_hf_file finds one, else the config's
  // top-level eos_token_id, else text_config's.
  std::vector<int> eos_token_ids;

  // "Gemma4ForConditionalGeneration" or "Gemma4ForCausalLM" (what config.json declares).
  std::string hf_architecture;
  // Tensor name prefix of the text model: "model.language_model." (Gemma4ForConditionalGeneration)
  // or "model." (Gemma4ForCausalLM).
  std::string tensor_prefix;

  std::vector<LayerGeometry> layers;

  // The embedding multiplier as the reference applies it in a bf16 model: bf16(sqrt(H)).
  float embedding_scale() const;
  // Largest per-layer sizes, for workspace planning.
  int max_q_width() const;
  int max_kv_width() const;
  int max_ffn_width() const;
  // First KV-shared layer (num_layers when no layer shares).
  int first_kv_shared_layer() const { return num_layers - num_kv_shared_layers; }

  // The layer whose K/V KV-shared layer `layer` reads: the last layer before the shared block
  // (which starts at first_shared) with the same attention type (arch spec 2.4); -1 if none.
  static int kv_source_layer(const std::vector<LayerType>& types, int first_shared, int layer);
  // The first KV-shared layer with no layer to read (kv_source_layer -1); -1 when there is none.
  static int first_layer_without_kv_source(const std::vector<LayerType>& types, int first_shared);

  // Fills `layers` from `shapes`, sliding_window and num_kv_shared_layers, the same way for every
  // config format; k_eq_v is left false. The caller has checked the shapes (KV heads divide the
  // query heads, first_layer_without_kv_source finds none) to name the key at fault its own way.
  void resolve_layers(const LayerShapes& shapes);

  // Parses an HF config.json (multimodal with nested text_config, or text-only). Unknown
  // architectures, missing or contradictory keys fail with a message naming the key.
  static Expected<ModelConfig> from_hf_json(const nlohmann::json& config);
  // Reads config.json (a file, or a directory holding one); a generation_config.json beside it
  // supplies the stop-token list.
  static Expected<ModelConfig> from_hf_file(const std::filesystem::path& config_json);
};

// How a checkpoint's Linear weights are stored, from config.json `quantization_config`
// (compressed-tensors, ModelOpt) or ModelOpt's hf_quant_config.json. Only the scheme parameters
// are read: which module is quantized is decided per tensor by the tensors present
// (weight-formats.md 2.1 "robust loading rule").
struct QuantizationInfo {
  // kGguf: per-tensor ggml types, repacked on load (model/gguf_model.h).
  enum class Method : uint8_t { kNone, kCompressedTensors, kModelOpt, kGguf };

  Method method = Method::kNone;
  // Internal format of the quantized Linears: kBF16 when not quantized, kW4G32 or kNVFP4.
  quant::WeightFormat weight_format = quant::WeightFormat::kBF16;
  // compressed-tensors "format" ("pack-quantized", ...); ModelOpt quant_algo; GGUF: the ggml
  // types of the matrices ("Q4_K, Q5_0, Q6_K, Q8_0").
  std::string format;
  int num_bits = 16;
  int group_size = 0;
  bool symmetric = true;
  std::vector<std::string> ignore;  // module patterns left unquantized, as the file lists them

  // `config` is the whole config.json; `hf_quant_config` is hf_quant_config.json or null.
  // Unsupported schemes (auto-round, asymmetric int4, ...) fail naming the key and value.
  static Expected<QuantizationInfo> from_hf_json(const nlohmann::json& config,
                                                 const nlohmann::json* hf_quant_config);
  // Reads config.json and, if present, hf_quant_config.json from a checkpoint directory.
  static Expected<QuantizationInfo> from_checkpoint_dir(const std::filesystem::path& directory);
};

const char* quant_method_name(QuantizationInfo::Method method);

}  // namespace gemma4::model
