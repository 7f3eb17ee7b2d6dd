// Deterministic synthetic checkpoints (`gemma4 synth`): real Hugging Face layout (config.json,
// generation_config.json, safetensors, sharded with an index when large), values from a seed.
//
// Determinism: every value comes from a counter-based splitmix64 stream keyed by (seed, logical
// tensor name, row) and only integer and exactly-rounded IEEE operations (+, *, /, sqrt, explicit
// fma; no libm transcendentals, no a*b+c left to the compiler's contraction choice), so the bytes
// are identical on every machine, for any thread count and any tensor layout.
//
// Quantized twins: a quantized matrix is generated ON its grid (w4g32: int4 levels and bf16
// group scales with at most 5 significant bits; nvfp4: e2m1 codes, e4m3 block scales and a
// power-of-two global scale). Every dequantised value is then exact in bf16, so the bf16 file of
// the same seed and grid (`--format bf16 --grid w4g32|nvfp4`) holds exactly the dequantised
// values: both files are the same function.
//
// Which tensors are quantized follows the released checkpoints (weight-formats.md 2.7, 3.6-3.8):
// attention, MLP, per-layer-input gate/projection and experts (as per-expert Linears
// `experts.E.{gate,up,down}_proj`); embeddings, the PLE table, per_layer_model_projection, the
// router and every vector stay bf16. On the w4g32 grid (w4a16 and its bf16 / gguf-q4_0 twins)
// the bf16 embedding table (the tied lm_head) and PLE table hold w4g32 grid values, as Google's
// QAT checkpoints are said to: a device backend packs them to 4 bits losslessly
// (quant/pack_w4g32.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "core/status.h"
#include "model/presets.h"

namespace gemma4::model {

// kGgufQ4_0 / kGgufQ4_K: one GGUF file (spec 4), Gemma 4 metadata and llama.cpp tensor names;
// quantizable matrices as Q4_0 blocks (grid w4g32) or Q4_K blocks (grid q4_k), everything else
// BF16 (matrices) or F32 (vectors) holding the bf16 values of the safetensors twin.
enum class SynthFormat : uint8_t { kBF16, kW4A16, kNVFP4, kGgufQ4_0, kGgufQ4_K };
inline bool is_gguf(SynthFormat format) {
  return format == SynthFormat::kGgufQ4_0 || format == SynthFormat::kGgufQ4_K;
}
// The value grid of the quantizable matrices. kNone: plain bf16 values (bf16 format only).
// kQ4K: plain values through quant::quantize_q4_k (exact in bf16) where K % 256 == 0, the w4g32
// grid on narrower matrices (where the gguf-q4_k file falls back to Q4_0).
enum class SynthGrid : uint8_t { kNone, kW4G32, kNVFP4, kQ4K };

struct SynthOptions {
  // A preset name (presets.h), or a config.json file (name ending in .json) for other shapes.
  std::string config = "tiny";
  SynthFormat format = SynthFormat::kBF16;
  // Only for kBF16; kW4A16 always uses kW4G32 and kNVFP4 kNVFP4.
  SynthGrid grid = SynthGrid::kW4G32;
  uint64_t seed = 0;
  ConfigLayout layout = ConfigLayout::kText;
  // A directory; for the GGUF formats the .gguf file.
  std::filesystem::path output;
  // Copied in as tokenizer.json / chat_template.jinja when set.
  std::filesystem::path tokenizer;
  std::filesystem::path chat_template;
  // Shard size limit of the safetensors data (one file when everything fits).
  uint64_t max_shard_bytes = uint64_t{4} << 30;
  int threads = 0;  // 0 = hardware concurrency
};

// Writes the checkpoint into options.output (created; existing checkpoint files are replaced).
Status synthesize_checkpoint(const SynthOptions& options);

// bf16, w4a16, nvfp4, gguf-q4_0, gguf-q4_k
Expected<SynthFormat> parse_synth_format(std::string_view name);
Expected<SynthGrid> parse_synth_grid(std::string_view name);  // none, w4g32, nvfp4, q4_k

}  // namespace gemma4::model
