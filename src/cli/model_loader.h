// The one place that turns CLI arguments into a ready engine, shared by `run`, `serve` and
// `bench`: resolve -m (local path or HF repo id), open the checkpoint, pick the backend from
// --device, create the engine; and the single loaders of a model's tokenizer and chat template.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "core/status.h"
#include "engine/backend.h"
#include "engine/gemma4_engine.h"
#include "engine/memory_plan.h"
#include "model/weights.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace gemma4::cli {

// --device: auto = CUDA when this binary has the CUDA backend and a GPU is present, else CPU.
enum class Device { kAuto, kCpu, kCuda };

Expected<Device> parse_device(std::string_view name);

// --activations NAME (empty: not given) and --fp32 as one EngineLoadOptions::activations value;
// an error for an unknown name or for --fp32 with another mode.
Expected<std::string> resolve_activations(std::string_view name, bool fp32);

// --lm-head NAME (empty: exact) as an EngineOptions::lm_head value; an error for an unknown name.
Expected<engine::LmHeadFormat> parse_lm_head(std::string_view name);

struct EngineLoadOptions {
  std::string model;  // -m: a checkpoint directory, a .gguf file or an HF repo id
  Device device = Device::kAuto;
  int threads = 0;  // CPU backend threads (0 = all)
  bool pdl = true;  // CUDA: programmatic dependent launch between kernels
  // CUDA: "f32", "bf16" or "q8" (--activations); empty: the engine's default.
  std::string activations;
  // --gpu-memory in bytes (0 = no budget): on a device, engine.max_sequences / max_context are
  // lowered to fit it (engine/memory_plan.h).
  int64_t gpu_memory = 0;
  // --kv-cache: f32, bf16 or fp8; empty picks the device's default (--kv-cache). Overrides
  // engine.kv_type.
  std::string kv_cache;
  engine::EngineOptions engine;
};

// A model opened on a backend. Members are declared so that the engine is destroyed before the
// weights it reads.
struct LoadedEngine {
  std::filesystem::path path;  // the resolved local directory or file
  std::shared_ptr<model::LoadedModel> model;
  // Owned by `engine`; kept to ask the backend for its own statistics (bench).
  const engine::Backend* backend = nullptr;
  Device device = Device::kCpu;     // the backend --device resolved to (never kAuto)
  std::string backend_description;  // "CPU reference engine", "CUDA engine on NVIDIA H200"
  std::string activations;          // what decode matmuls read: "f32", "bf16" or "q8"
  bool synthetic = false;           // a `gemma4 synth` checkpoint: random weights
  engine::MemoryPlan memory_plan;   // what the engine was sized to (logged at load)
  std::unique_ptr<engine::Gemma4Engine> engine;

  // One line for logs: "<path> (<backend_description>)".
  std::string description() const;
};

// --gpu-memory's value in bytes (engine::parse_memory_size); 0 when empty (no budget).
Expected<int64_t> parse_gpu_memory(std::string_view text);

// The resolved local path of -m (io::resolve_model_path with the environment's hub options).
Expected<std::filesystem::path> resolve_model(std::string_view model);

// Opens the model (config and mapped weights) already resolved to `path`.
Expected<std::shared_ptr<model::LoadedModel>> open_model(const std::filesystem::path& path);

// Creates an engine for `model` (opened from `path`) on the backend options.device picks. Several
// engines may share one opened model.
Expected<LoadedEngine> create_engine(const std::filesystem::path& path,
                                     std::shared_ptr<model::LoadedModel> model,
                                     const EngineLoadOptions& options);

// open_model + create_engine.
Expected<LoadedEngine> load_engine(const std::filesystem::path& path,
                                   const EngineLoadOptions& options);

// The tokenizer of the model at `path`: tokenizer.json in a checkpoint directory, or a .gguf
// file's tokenizer metadata.
Expected<text::Tokenizer> load_tokenizer(const std::filesystem::path& path);

// The chat template of the model at `path`: chat_template.jinja in a checkpoint directory, or a
// .gguf file's (tokenizer.chat_template, else the one of its architecture).
Expected<text::ChatTemplate> load_chat_template(const std::filesystem::path& path);

// A chat template from a Jinja file (--chat-template of the scripted test engine).
Expected<text::ChatTemplate> chat_template_from_file(const std::filesystem::path& file);

// Reads a text file whole; the error names the file.
Expected<std::string> read_text_file(const std::filesystem::path& path);

}  // namespace gemma4::cli
