// Where ModelWeights reads a checkpoint's tensors from (internal to model/). Names are the
// Hugging Face ones relative to the text model ("layers.3.self_attn.q_proj",
// "layers.3.input_layernorm.weight", "embed_tokens"): the safetensors source prefixes them, the
// GGUF source (gguf_model.cpp) maps them to llama.cpp's names (weight-formats.md 4.5). One
// loader (weights.cpp) then resolves every model from either file kind.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/config.h"
#include "model/weights.h"
#include "quant/qmatrix.h"

namespace gemma4::model {

class TensorSource {
 public:
  virtual ~TensorSource() = default;

  // Whether the checkpoint holds tensor (or Linear module) `name`.
  virtual bool has(const std::string& name) const = 0;
  // The Linear `module` (or slice `expert` of a stacked expert tensor) as a [rows, cols] matrix.
  virtual Expected<quant::QMatrix> matrix(const std::string& module, int64_t rows, int64_t cols,
                                          std::optional<int64_t> expert = std::nullopt) const = 0;
  // The output head when it is not tied to the embedding.
  virtual Expected<quant::QMatrix> lm_head(int64_t rows, int64_t cols) const = 0;
  // A 1-D tensor (norm weight, scalar) of `length` elements as floats, with the values the
  // reference model uses (a GGUF's folded norm offset undone).
  virtual Expected<std::vector<float>> vector(const std::string& name, int64_t length) const = 0;
};

// Resolves every tensor `config` needs from `source` into `weights` (the one loader of both
// file kinds); a missing tensor, a wrong shape or type fails naming the tensor.
Status load_weights(const TensorSource& source, const ModelConfig& config, ModelWeights& weights);

}  // namespace gemma4::model
