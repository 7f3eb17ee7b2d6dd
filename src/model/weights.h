// ModelWeights: every tensor the Gemma 4 text decoder reads, resolved once from a checkpoint
// (gemma4-architecture.md 1.3, weight-formats.md 2.2, 2.6, 3.2, 3.6, 6.3, 6.4).
//
// Matrices are quant::QMatrix views straight into the mmapped checkpoint (zero-copy; a packed
// matrix is never expanded). The format of each matrix is decided by the tensors present, not by
// the config (weight-formats.md 2.1): `<m>.weight_packed` I32 = compressed-tensors w4g32,
// `<m>.weight_packed` U8 = compressed-tensors NVFP4 (global scale is a divisor), `<m>.weight` U8
// with `weight_scale_2` = ModelOpt NVFP4 (multiplier), `<m>.weight` BF16/F32 = plain.
// Small vectors (norm weights, layer_scalar, router scales) are converted to float and owned.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "quant/qmatrix.h"
#include "quant/quantize.h"

namespace gemma4::model {

// A matrix slot that a layer may not have (data == nullptr).
inline bool present(const quant::QMatrix& m) {
  return m.data != nullptr;
}

// One MoE expert: gate/up [moe_intermediate, H], down [H, moe_intermediate]. From a bf16
// checkpoint's fused `experts.gate_up_proj [E, 2I, H]` these are row-range views (gate = rows
// 0..I-1, up = rows I..2I-1) and `experts.down_proj [E, H, I]` slices; from a quantized one the
// per-expert Linears `experts.E.{gate,up,down}_proj`.
struct ExpertMatrices {
  quant::QMatrix gate;
  quant::QMatrix up;
  quant::QMatrix down;
};

struct LayerWeights {
  // Attention. k_proj/k_norm are absent (not loaded, even if the file has them) on KV-shared
  // layers; v_proj is absent on those and on k_eq_v layers.
  quant::QMatrix q_proj;      // [nH*hd, H]
  quant::QMatrix k_proj;      // [nKV*hd, H]
  quant::QMatrix v_proj;      // [nKV*hd, H]
  quant::QMatrix o_proj;      // [H, nH*hd]
  std::vector<float> q_norm;  // [hd]
  std::vector<float> k_norm;  // [hd]; empty on KV-shared layers

  std::vector<float> input_layernorm;             // [H]
  std::vector<float> post_attention_layernorm;    // [H]
  std::vector<float> pre_feedforward_layernorm;   // [H] (dense MLP input)
  std::vector<float> post_feedforward_layernorm;  // [H] (after the dense (+ MoE) sum)

  // Dense MLP (every layer; width = LayerGeometry::ffn_width).
  quant::QMatrix gate_proj;  // [I, H]
  quant::QMatrix up_proj;    // [I, H]
  quant::QMatrix down_proj;  // [H, I]

  // MoE (ModelConfig::moe): router + experts, and the three extra norms.
  quant::QMatrix router_proj;                       // [E, H]
  std::vector<float> router_scale;                  // [H]
  std::vector<float> per_expert_scale;              // [E]
  std::vector<ExpertMatrices> experts;              // [E]
  std::vector<float> post_feedforward_layernorm_1;  // [H] dense branch output
  std::vector<float> pre_feedforward_layernorm_2;   // [H] expert input
  std::vector<float> post_feedforward_layernorm_2;  // [H] expert output

  // Per-layer embeddings (ModelConfig::ple_dim > 0).
  quant::QMatrix per_layer_input_gate;           // [P, H]
  quant::QMatrix per_layer_projection;           // [H, P]
  std::vector<float> post_per_layer_input_norm;  // [H]

  float layer_scalar = 1.0f;  // `layer_scalar` [1], from the checkpoint
};

struct ModelWeights {
  // Keeps the mapping alive: every QMatrix points into it (safetensors checkpoints).
  std::shared_ptr<const io::Checkpoint> checkpoint;
  // GGUF checkpoints: the file (F32/F16/BF16 matrices are views into its mapping) and the
  // matrices repacked into internal formats (weight-formats.md 5), which own their bytes.
  std::shared_ptr<const io::GgufFile> gguf;
  std::vector<std::shared_ptr<const quant::PackedMatrix>> repacked;

  quant::QMatrix embed_tokens;  // [V, H], unscaled
  // The logits matrix: embed_tokens when tie_word_embeddings (a tied `lm_head.weight` in the
  // file is ignored), else `lm_head.weight` [V, H].
  quant::QMatrix lm_head;
  std::vector<float> final_norm;  // `norm.weight` [H]

  // Per-layer embeddings (ple_dim > 0).
  quant::QMatrix embed_tokens_per_layer;         // [ple_vocab, L*P], layer-major columns
  quant::QMatrix per_layer_model_projection;     // [L*P, H]
  std::vector<float> per_layer_projection_norm;  // [P]

  std::vector<LayerWeights> layers;

  // Full names of every checkpoint tensor the weights above were read from (others, e.g. K/V
  // tensors of KV-shared layers or a tied lm_head copy, are unused); GGUF names for a GGUF.
  std::set<std::string> used_tensors;

  // Resolves every tensor `config` needs (names under config.tensor_prefix). A missing tensor,
  // a wrong shape or dtype, or an unusable quantized tensor set fails with the tensor's name.
  static Expected<ModelWeights> load(std::shared_ptr<const io::Checkpoint> checkpoint,
                                     const ModelConfig& config);
};

// A checkpoint opened for inference: config.json (+ generation_config.json), the quantization
// scheme, the mapped tensors and the resolved weights; or the same from one .gguf file
// (model/gguf_model.h).
struct LoadedModel {
  ModelConfig config;
  QuantizationInfo quantization;
  ModelWeights weights;

  // A checkpoint directory, or a path ending in .gguf.
  static Expected<LoadedModel> open(const std::filesystem::path& path);
};

// Calls `visit(name, matrix)` for every present matrix, in a fixed order (globals, then layer by
// layer; names like "layers.3.self_attn.q_proj", "layers.0.experts.5.up"): uploading weights to
// a device, reporting, comparing two checkpoints.
void for_each_matrix(
    const ModelWeights& weights,
    const std::function<void(const std::string& name, const quant::QMatrix&)>& visit);

// Reads a 1-D (or [1]) BF16/F16/F32 tensor as floats (norm weights, scalars).
Expected<std::vector<float>> read_float_vector(const io::TensorView& tensor);

}  // namespace gemma4::model
