// Model shapes that `gemma4 synth` writes: the four released sizes with their real config values
// (gemma4-architecture.md 1.1, weight-formats.md 6.2) and three tiny configs that keep every
// feature of the real ones at a size CI can run through transformers.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace gemma4::model {

// "tiny", "tiny-moe", "tiny-dense", "e2b", "e4b", "26b-a4b", "31b".
const std::vector<std::string>& preset_names();

// The HF text config (the keys of Gemma4TextConfig, as in `text_config` of a released
// config.json) of a preset.
//
// tiny: E-style dense: hidden 64, 5 layers (sliding, sliding, full, sliding, full), layers 3-4
//   KV-shared (sources 1 and 2) with double-wide MLP, PLE width 32, sliding window 8, head dim
//   32 sliding / 64 full with proportional rope (8 of 32 pairs rotate), 4 q heads, 2 kv heads.
// tiny-moe: 26B-style: hidden 64, 6 layers ((sliding, sliding, full) x 2), k_eq_v full layers
//   with 1 global kv head, 8 experts top-2 of width 32 beside a dense MLP of width 64.
// tiny-dense: 31B-style: tiny-moe's attention (k_eq_v full layers, 1 global kv head) with a
//   dense MLP of width 128 only: no experts, no per-layer inputs, no KV sharing.
// All keep the real 262,144-token vocabulary, and every matrix K is a multiple of 32.
Expected<nlohmann::json> preset_text_config(std::string_view name);

enum class ConfigLayout : uint8_t {
  kText,        // Gemma4ForCausalLM: text keys at top level, tensors under "model."
  kMultimodal,  // Gemma4ForConditionalGeneration: nested text_config, "model.language_model."
};

// A complete config.json around `text_config` (no vision/audio towers in either layout).
nlohmann::json hf_config_json(const nlohmann::json& text_config, ConfigLayout layout);

// generation_config.json of the released instruction-tuned checkpoints (arch spec 5).
nlohmann::json hf_generation_config_json();

}  // namespace gemma4::model
