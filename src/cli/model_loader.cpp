#include "cli/model_loader.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "backend/cpu/cpu_backend.h"
#include "cli/gpu_info.h"
#include "io/hf_hub.h"
#include "model/gguf_text.h"

#if GEMMA4_HAS_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace gemma4::cli {
namespace {

constexpr int kGpu = 0;  // the CUDA engine runs on the first GPU

struct ChosenBackend {
  std::unique_ptr<engine::Backend> backend;
  Device device = Device::kCpu;
  std::string description;
  std::string activations = "f32";  // the CPU reference computes in fp32
};

Expected<ChosenBackend> make_backend(const EngineLoadOptions& options) {
  if (options.device == Device::kCpu ||
      (options.device == Device::kAuto && cuda_device_count() == 0)) {
    return ChosenBackend{std::make_unique<backend::cpu::CpuBackend>(options.threads), Device::kCpu,
                         "CPU reference engine"};
  }
#if GEMMA4_HAS_CUDA
  cuda::CudaOptions cuda_options;
  cuda_options.pdl = options.pdl;
  if (options.activations == "f32") cuda_options.activations = cuda::ActivationMode::kF32;
  if (options.activations == "bf16") cuda_options.activations = cuda::ActivationMode::kBF16;
  if (options.activations == "q8") cuda_options.activations = cuda::ActivationMode::kQ8;
  auto backend = cuda::make_cuda_backend(kGpu, cuda_options);
  if (!backend.ok()) return backend.error().with_context("--device cuda");
  return ChosenBackend{std::move(backend).value(), Device::kCuda,
                       fmt::format("CUDA engine on {} (GPU {})", cuda_device_name(kGpu), kGpu),
                       cuda::activation_mode_name(cuda_options.activations)};
#else
  return make_error(ErrorCode::kUnsupported,
                    "--device cuda: this gemma4 was built without the CUDA backend "
                    "(configure with -DGEMMA4_CUDA=ON)");
#endif
}

// --kv-cache resolved for the chosen device: bf16 on CUDA (what a bf16 transformers model
// caches) unless activations are exact fp32; the CPU reference keeps fp32 only.
Expected<engine::KvType> resolve_kv_cache(const EngineLoadOptions& options, Device device) {
  if (options.kv_cache.empty()) {
    return device == Device::kCuda && options.activations != "f32" ? engine::KvType::kBF16
                                                                   : engine::KvType::kF32;
  }
  auto type = engine::parse_kv_type(options.kv_cache);
  if (!type.ok()) return type.error().with_context("--kv-cache");
  if (device != Device::kCuda && *type != engine::KvType::kF32)
    return make_error(ErrorCode::kInvalidArgument,
                      "--kv-cache {}: the CPU reference engine keeps an f32 KV cache only",
                      options.kv_cache);
  return type;
}

}  // namespace

Expected<engine::LmHeadFormat> parse_lm_head(std::string_view name) {
  if (name.empty()) return engine::LmHeadFormat::kExact;
  auto format = engine::parse_lm_head_format(name);
  if (!format.ok()) return format.error().with_context("--lm-head");
  return format;
}

Expected<std::string> resolve_activations(std::string_view name, bool fp32) {
  if (!name.empty() && name != "f32" && name != "bf16" && name != "q8") {
    return make_error(ErrorCode::kInvalidArgument, "--activations: '{}' is none of f32, bf16, q8",
                      name);
  }
  if (fp32 && !name.empty() && name != "f32") {
    return make_error(ErrorCode::kInvalidArgument, "--fp32 is --activations f32, not '{}'", name);
  }
  return fp32 ? std::string("f32") : std::string(name);
}

namespace {

double mib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 20);
}

// The engine's memory plan (engine/memory_plan.h), logged in one line. With --gpu-memory on a
// device, the sequences and context are fitted to the budget, or loading fails naming the numbers
// before anything is allocated.
Expected<engine::MemoryPlan> plan_engine_memory(const model::LoadedModel& model,
                                                const engine::Backend& backend,
                                                const EngineLoadOptions& options) {
  const bool on_device = !backend.reads_host_memory();
  if (options.gpu_memory > 0 && !on_device)
    std::fprintf(stderr, "gemma4: --gpu-memory ignored: the %s backend keeps nothing on a GPU\n",
                 backend.name());
  const engine::ResidentWeightBytes resident =
      engine::resident_weight_bytes(model.weights, backend, options.engine.lm_head);
  const int64_t weights = resident.bytes;
  const engine::MemoryPlan requested =
      engine::plan_memory(model.config, weights, options.engine, on_device);
  engine::MemoryPlan plan = requested;
  const bool budgeted = options.gpu_memory > 0 && on_device;
  if (budgeted) {
    auto fitted = engine::fit_memory_plan(model.config, weights, options.engine, on_device,
                                          options.gpu_memory);
    if (!fitted.ok()) return fitted.error().with_context("--gpu-memory");
    plan = *fitted;
  }
  std::string line = "gemma4: memory plan: " + plan.summary();
  if (budgeted) {
    line += fmt::format(" of {:.0f} MiB (--gpu-memory)", mib(options.gpu_memory));
    const engine::EngineOptions& want = requested.options;
    if (plan.options.max_sequences != want.max_sequences ||
        plan.options.max_context != want.max_context ||
        plan.options.max_pass_tokens != want.max_pass_tokens)
      line += fmt::format("; lowered from {} x {} tokens, passes of {}, to fit", want.max_sequences,
                          want.max_context, want.max_pass_tokens);
  }
  if (!resident.packed_tables.empty())
    line +=
        fmt::format("; {} packed to 4 bits (lossless)", fmt::join(resident.packed_tables, ", "));
  if (resident.lm_head_q8) {
    line += "; the logits matrix quantized to 8 bits (--lm-head q8)";
  } else if (options.engine.lm_head == engine::LmHeadFormat::kQ8) {
    line += fmt::format("; --lm-head q8 ignored: the logits matrix is {}{}",
                        quant::weight_format_name(model.weights.lm_head.format),
                        model.weights.lm_head.format == quant::WeightFormat::kBF16
                            ? " on the int4 grid (kept exact)"
                            : "");
  }
  if (on_device) {
    if (auto used = cuda_memory_used_bytes(kGpu))
      line += fmt::format("; {:.0f} MiB of the GPU in use before loading", mib(*used));
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  return plan;
}

bool is_synthetic(const std::filesystem::path& path) {
  auto config_text = read_text_file(path / "config.json");
  return config_text.ok() &&
         nlohmann::json::parse(*config_text, nullptr, false).value("gemma4_synthetic", false);
}

}  // namespace

Expected<Device> parse_device(std::string_view name) {
  if (name == "auto") return Device::kAuto;
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  return make_error(ErrorCode::kInvalidArgument, "--device '{}': expected auto, cpu or cuda", name);
}

std::string LoadedEngine::description() const {
  return fmt::format("{} ({})", path.string(), backend_description);
}

Expected<int64_t> parse_gpu_memory(std::string_view text) {
  if (text.empty()) return int64_t{0};
  auto bytes = engine::parse_memory_size(text);
  if (!bytes.ok()) return bytes.error().with_context("--gpu-memory");
  return bytes;
}

Expected<std::filesystem::path> resolve_model(std::string_view model) {
  return io::resolve_model_path(io::HubOptions::from_environment(), model);
}

Expected<std::shared_ptr<model::LoadedModel>> open_model(const std::filesystem::path& path) {
  auto model = std::make_shared<model::LoadedModel>();
  GEMMA4_ASSIGN_OR_RETURN(*model, model::LoadedModel::open(path));
  return model;
}

Expected<LoadedEngine> create_engine(const std::filesystem::path& path,
                                     std::shared_ptr<model::LoadedModel> model,
                                     const EngineLoadOptions& options) {
  LoadedEngine loaded;
  loaded.path = path;
  loaded.model = std::move(model);
  GEMMA4_ASSIGN_OR_RETURN(ChosenBackend chosen, make_backend(options));
  loaded.backend = chosen.backend.get();
  loaded.device = chosen.device;
  loaded.backend_description = std::move(chosen.description);
  loaded.activations = std::move(chosen.activations);
  EngineLoadOptions resolved = options;
  if (!chosen.backend->reads_host_memory() &&
      resolved.engine.max_pass_tokens == engine::EngineOptions{}.max_pass_tokens) {
    resolved.engine.max_pass_tokens = engine::kDevicePassTokens;
  }
  GEMMA4_ASSIGN_OR_RETURN(resolved.engine.kv_type, resolve_kv_cache(options, chosen.device));
  GEMMA4_ASSIGN_OR_RETURN(loaded.memory_plan,
                          plan_engine_memory(*loaded.model, *chosen.backend, resolved));
  GEMMA4_ASSIGN_OR_RETURN(
      loaded.engine,
      engine::Gemma4Engine::create(loaded.model->config, loaded.model->weights,
                                   std::move(chosen.backend), loaded.memory_plan.options));
  loaded.synthetic = is_synthetic(path);
  return loaded;
}

Expected<LoadedEngine> load_engine(const std::filesystem::path& path,
                                   const EngineLoadOptions& options) {
  GEMMA4_ASSIGN_OR_RETURN(auto model, open_model(path));
  return create_engine(path, std::move(model), options);
}

Expected<std::string> read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(ErrorCode::kNotFound, "cannot open {}", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

Expected<text::Tokenizer> load_tokenizer(const std::filesystem::path& path) {
  if (path.extension() == ".gguf") return model::tokenizer_from_gguf(path);
  const auto file = path / "tokenizer.json";
  auto text = read_text_file(file);
  if (!text.ok())
    return make_error(ErrorCode::kNotFound, "tokenizer not found: {} is needed", file.string());
  auto tokenizer = text::Tokenizer::from_json_text(*text);
  if (!tokenizer.ok()) return tokenizer.error().with_context(file.string());
  return tokenizer;
}

Expected<text::ChatTemplate> chat_template_from_file(const std::filesystem::path& file) {
  GEMMA4_ASSIGN_OR_RETURN(std::string source, read_text_file(file));
  auto parsed = text::ChatTemplate::from_template_source(source);
  if (!parsed.ok()) return parsed.error().with_context(file.string());
  return parsed;
}

Expected<text::ChatTemplate> load_chat_template(const std::filesystem::path& path) {
  if (path.extension() == ".gguf") return model::chat_template_from_gguf(path);
  const auto file = path / "chat_template.jinja";
  if (!std::filesystem::exists(file))
    return make_error(ErrorCode::kNotFound, "chat template not found: {} is needed", file.string());
  return chat_template_from_file(file);
}

}  // namespace gemma4::cli
