// Models from one GGUF file (weight-formats.md 4): ModelConfig from the metadata of
// general.architecture "gemma4" (spec 4.3) or "gemma3" (llama.cpp's Gemma 3 keys), tensors by
// llama.cpp's names (spec 4.5), quantized types repacked losslessly into the internal formats
// (quant/gguf_repack.h), F32/F16/BF16 read in place.
//
// llama.cpp conventions undone on load, as transformers' GGUF loader does: Gemma 3 files hold
// norm weights with the +1 of Gemma's (1 + w) RMSNorm folded in (llama.cpp's converter adds it),
// so 1 is subtracted again and the config keeps norm_weight_offset = 1 (Gemma 4's converter
// folds nothing: offset 0). ggml dims are fastest first: ne {K, N} is the PyTorch [N, K] matrix.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"
#include "io/gguf.h"
#include "model/config.h"
#include "model/weights.h"

namespace gemma4::model {

// The text-model config a GGUF describes. Missing or contradictory keys, and features the
// engine does not implement (rope scaling, an unknown architecture), fail naming the key.
Expected<ModelConfig> config_from_gguf(const io::GgufFile& file);

// llama.cpp's name of a Hugging Face tensor or Linear module name relative to the text model
// ("layers.3.self_attn.q_proj" -> "blk.3.attn_q.weight", "norm.weight" -> "output_norm.weight");
// nullopt for names without one. Per-expert names ("layers.3.experts.5.up_proj") are slices of
// stacked tensors and have none.
std::optional<std::string> gguf_tensor_name(std::string_view name);

// config_from_gguf + every tensor resolved (repacked where the type needs it). An unsupported
// tensor type fails naming the tensor and the type.
Expected<LoadedModel> open_gguf_model(const std::filesystem::path& path);
// The same over an opened (or parsed) file, which the model keeps alive.
Expected<LoadedModel> gguf_model(std::shared_ptr<const io::GgufFile> file);

}  // namespace gemma4::model
