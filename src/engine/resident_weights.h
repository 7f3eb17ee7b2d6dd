// The model weights as the backend reads them. model::ModelWeights points into the host mmap and
// owns its norm vectors in std::vector: a backend that reads host memory (CPU) gets views of
// exactly those bytes (zero-copy: a 15 GB mapping is never doubled); any other backend (CUDA)
// gets a copy of every matrix (packed data + scales, format and global factor kept) and every
// norm vector in its own buffers, made once when the engine is created.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "engine/backend.h"
#include "engine/lm_head.h"
#include "model/weights.h"
#include "quant/qmatrix.h"
#include "quant/quantize.h"

namespace gemma4::engine {

// model::LayerWeights with backend-readable pointers; a norm that the layer lacks is nullptr.
struct ResidentLayer {
  quant::QMatrix q_proj, k_proj, v_proj, o_proj;
  // On a backend that gets copies (not reads_host_memory()), when q_proj and the layer's own
  // k_proj (and v_proj, if any) share one row encoding (quant::same_row_encoding): their rows
  // stacked q|k|v in one matrix, read by one matmul; q_proj/k_proj/v_proj are then row slices of
  // it. Else absent.
  quant::QMatrix qkv;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;

  const float* input_layernorm = nullptr;
  const float* post_attention_layernorm = nullptr;
  const float* pre_feedforward_layernorm = nullptr;
  const float* post_feedforward_layernorm = nullptr;

  quant::QMatrix gate_proj, up_proj, down_proj;
  // On a copying backend that fuses_gate_up(), when gate_proj and up_proj share one row
  // encoding: their rows interleaved (gate 0, up 0, gate 1, up 1, ...) for matmul_gelu_pairs;
  // gate_proj/up_proj are then absent (each row is held once). Else absent.
  quant::QMatrix gate_up;

  quant::QMatrix router_proj;
  const float* router_scale = nullptr;
  const float* per_expert_scale = nullptr;
  std::vector<model::ExpertMatrices> experts;
  const float* post_feedforward_layernorm_1 = nullptr;
  const float* pre_feedforward_layernorm_2 = nullptr;
  const float* post_feedforward_layernorm_2 = nullptr;

  quant::QMatrix per_layer_input_gate, per_layer_projection;
  const float* post_per_layer_input_norm = nullptr;

  float layer_scalar = 1.0f;  // a host scalar: operations take it by value
};

class ResidentWeights {
 public:
  // `weights` must outlive the result when `backend` reads host memory (the views point into
  // it). `lm_head` says how the logits matrix is held (engine/lm_head.h). Fails if a backend
  // buffer cannot be allocated or the logits matrix cannot be quantized.
  static Expected<ResidentWeights> create(const model::ModelWeights& weights, Backend& backend,
                                          LmHeadFormat lm_head = LmHeadFormat::kExact);

  quant::QMatrix embed_tokens;
  quant::QMatrix lm_head;
  // What passes of more than kLmHeadQ8MaxRows logits rows read: the exact tied table when lm_head
  // is its 8-bit copy (engine/lm_head.h), else lm_head.
  quant::QMatrix lm_head_batched;
  const float* final_norm = nullptr;
  quant::QMatrix embed_tokens_per_layer;
  quant::QMatrix per_layer_model_projection;
  const float* per_layer_projection_norm = nullptr;
  std::vector<ResidentLayer> layers;

  // Bytes copied into backend buffers (0 on a zero-copy backend).
  int64_t copied_bytes() const { return copied_bytes_; }

 private:
  friend class WeightPlacer;
  std::vector<Buffer> buffers_;
  // Matrices made at load that a backend reading host memory reads where they are (the
  // quantized logits matrix).
  std::vector<quant::PackedMatrix> host_matrices_;
  int64_t copied_bytes_ = 0;
};

}  // namespace gemma4::engine
