// Synthetic checkpoints for the C++ tests: synthesized into a scratch folder and mapped.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include "core/status.h"
#include "model/presets.h"
#include "model/synth.h"
#include "model/weights.h"
#include "test_support.h"

namespace gemma4::testing {

// Removes a scratch folder when it goes out of scope. Declare it before the mapping of a
// checkpoint inside the folder, so that the mapping is released first.
struct RemoveOnExit {
  std::filesystem::path path;
  ~RemoveOnExit() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
};

// Synthesizes the checkpoint `options` describe into options.output and maps it.
inline Expected<model::LoadedModel> synthesize_and_open(const model::SynthOptions& options) {
  GEMMA4_RETURN_IF_ERROR(model::synthesize_checkpoint(options));
  return model::LoadedModel::open(options.output);
}

// The checkpoint of (config, format, grid, seed), synthesized and mapped once per test process:
// synthesis and mapping are the slow part of most tests that run a model. The scratch folder is
// named by the process id, as test binaries run in parallel, and removed at exit. A failure
// throws, which fails the calling test with the error's text.
inline const model::LoadedModel& cached_synth_model(const std::string& config,
                                                    model::SynthFormat format,
                                                    model::SynthGrid grid, uint64_t seed) {
  struct Synthesized {
    RemoveOnExit folder;  // destroyed after the mapping
    model::LoadedModel model;
  };
  using Key = std::tuple<std::string, model::SynthFormat, model::SynthGrid, uint64_t>;
  static std::map<Key, Synthesized> models;
  const Key key{config, format, grid, seed};
  if (auto it = models.find(key); it != models.end()) return it->second.model;

  model::SynthOptions synth;
  synth.config = config;
  synth.format = format;
  synth.grid = grid;
  synth.seed = seed;
  synth.output = scratch_dir("synth_" + std::to_string(getpid()) + "_" + config + "_" +
                             std::to_string(static_cast<int>(format)) + "_" +
                             std::to_string(static_cast<int>(grid)) + "_" + std::to_string(seed));
  auto loaded = synthesize_and_open(synth);
  if (!loaded.ok()) {
    std::filesystem::remove_all(synth.output);
    throw std::runtime_error("synthesizing " + config + ": " + loaded.error().to_string());
  }
  Synthesized& entry = models[key];
  entry.folder.path = synth.output;
  entry.model = std::move(*loaded);
  return entry.model;
}

// The tiny presets' checkpoints ("tiny", "tiny-moe") the engine tests share: plain bf16 values,
// and w4a16 (w4g32 weights; its bf16 tables on the int4 grid, as a device packs them).
inline const model::LoadedModel& tiny_bf16_model(const std::string& config) {
  return cached_synth_model(config, model::SynthFormat::kBF16, model::SynthGrid::kNone, 7);
}
inline const model::LoadedModel& tiny_w4a16_model(const std::string& config) {
  return cached_synth_model(config, model::SynthFormat::kW4A16, model::SynthGrid::kW4G32, 11);
}

// "tiny" with E2B's attention heads (8 q heads on 1 kv head, of 256 dims on sliding layers and
// 512 on full ones) and a sliding window of 96, as w4a16 (seed 11): its decode attention takes
// the CUDA split-K kernel (head_dim 256 / 512), whose splits the depth of a pass chooses.
inline const model::LoadedModel& tiny_wide_heads_w4a16_model() {
  struct Synthesized {
    RemoveOnExit folder;  // destroyed after the mapping
    model::LoadedModel model;
  };
  static Synthesized synthesized;
  static const bool made = [] {
    const auto folder = scratch_dir("synth_" + std::to_string(getpid()) + "_tiny_wide_heads");
    synthesized.folder.path = folder;
    auto config = model::preset_text_config("tiny");
    if (!config.ok()) throw std::runtime_error(config.error().to_string());
    (*config)["num_attention_heads"] = 8;
    (*config)["num_key_value_heads"] = 1;
    (*config)["head_dim"] = 256;
    (*config)["global_head_dim"] = 512;
    (*config)["sliding_window"] = 96;
    std::ofstream(folder / "config.json") << config->dump(2);
    model::SynthOptions synth;
    synth.config = (folder / "config.json").string();
    synth.format = model::SynthFormat::kW4A16;
    synth.seed = 11;
    synth.output = folder / "checkpoint";
    auto loaded = synthesize_and_open(synth);
    if (!loaded.ok()) throw std::runtime_error("synthesizing: " + loaded.error().to_string());
    synthesized.model = std::move(*loaded);
    return true;
  }();
  (void)made;
  return synthesized.model;
}

// The test name of a preset parameter ("tiny-moe" -> "tiny_moe": gtest names allow no '-'), for
// INSTANTIATE_TEST_SUITE_P(Tiny, Suite, ::testing::Values("tiny", "tiny-moe"), preset_test_name).
inline std::string preset_test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

}  // namespace gemma4::testing
