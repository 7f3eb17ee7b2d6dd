#include "cli/model_loader.h"

#include <nlohmann/json.hpp>

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

struct ChosenBackend {
  std::unique_ptr<engine::Backend> backend;
  Device device = Device::kCpu;
  std::string description;
};

Expected<ChosenBackend> make_backend(const EngineLoadOptions& options) {
  if (options.device == Device::kCpu ||
      (options.device == Device::kAuto && cuda_device_count() == 0)) {
    return ChosenBackend{std::make_unique<backend::cpu::CpuBackend>(options.threads), Device::kCpu,
                         "CPU reference engine"};
  }
#if GEMMA4_HAS_CUDA
  constexpr int kGpu = 0;
  auto backend = cuda::make_cuda_backend(kGpu, options.pdl);
  if (!backend.ok()) return backend.error().with_context("--device cuda");
  return ChosenBackend{std::move(backend).value(), Device::kCuda,
                       fmt::format("CUDA engine on {} (GPU {})", cuda_device_name(kGpu), kGpu)};
#else
  return make_error(ErrorCode::kUnsupported,
                    "--device cuda: this gemma4 was built without the CUDA backend "
                    "(configure with -DGEMMA4_CUDA=ON)");
#endif
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
  GEMMA4_ASSIGN_OR_RETURN(loaded.engine,
                          engine::Gemma4Engine::create(loaded.model->config, loaded.model->weights,
                                                       std::move(chosen.backend), options.engine));
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
