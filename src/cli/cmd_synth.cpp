// `gemma4 synth`: writes a deterministic synthetic checkpoint (model/synth.h) in the real Hugging
// Face layout, for tests, golden data and benchmarks without downloading weights.
#include <iostream>
#include <memory>
#include <string>

#include "cli/command.h"
#include "model/synth.h"

namespace gemma4::cli {
namespace {

struct SynthCliOptions {
  std::string config = "tiny";
  std::string format = "bf16";
  std::string grid;
  std::string layout = "text";
  uint64_t seed = 0;
  std::string output;
  std::string tokenizer;
  std::string chat_template;
  uint64_t max_shard_mib = 4096;
  int threads = 0;
};

Expected<model::SynthOptions> resolve(const SynthCliOptions& cli) {
  model::SynthOptions options;
  options.config = cli.config;
  GEMMA4_ASSIGN_OR_RETURN(options.format, model::parse_synth_format(cli.format));
  if (!cli.grid.empty()) {
    if (options.format != model::SynthFormat::kBF16) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--grid only applies to --format bf16 (the others use their own)");
    }
    GEMMA4_ASSIGN_OR_RETURN(options.grid, model::parse_synth_grid(cli.grid));
  }
  if (cli.layout != "text" && cli.layout != "multimodal") {
    return make_error(ErrorCode::kInvalidArgument, "unknown --layout '{}' (text, multimodal)",
                      cli.layout);
  }
  options.layout =
      cli.layout == "text" ? model::ConfigLayout::kText : model::ConfigLayout::kMultimodal;
  options.seed = cli.seed;
  options.output = cli.output;
  options.tokenizer = cli.tokenizer;
  options.chat_template = cli.chat_template;
  options.max_shard_bytes = cli.max_shard_mib << 20;
  options.threads = cli.threads;
  return options;
}

int run_synth(const SynthCliOptions& cli) {
  auto options = resolve(cli);
  Status status = options ? model::synthesize_checkpoint(*options) : options.status();
  if (!status.ok()) {
    std::cerr << "gemma4 synth: " << status.error().to_string() << "\n";
    return 1;
  }
  return 0;
}

void register_synth(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<SynthCliOptions>();
  CLI::App* command = app.add_subcommand(
      "synth", "Write a deterministic synthetic checkpoint (HF layout) from a seed");
  command
      ->add_option("--config", options->config,
                   "tiny, tiny-moe, tiny-dense, e2b, e4b, 26b-a4b, 31b, or a config.json file (a "
                   "name ending in .json: its text config, e.g. a preset's with fewer layers)")
      ->required();
  command->add_option("--format", options->format,
                      "bf16, w4a16 (compressed-tensors), nvfp4, gguf-q4_0, gguf-q4_k (one GGUF "
                      "file, Gemma 4 metadata and llama.cpp names)");
  command->add_option("--grid", options->grid,
                      "bf16 only: value grid none, w4g32 (default), nvfp4 or q4_k; bf16 with a "
                      "grid holds exactly the dequantised values of that quantized twin "
                      "(gguf-q4_0: w4g32, gguf-q4_k: q4_k)");
  command->add_option("--seed", options->seed, "PRNG seed");
  command->add_option("-o,--output", options->output, "output directory (gguf-*: the .gguf file)")
      ->required();
  command->add_option("--layout", options->layout,
                      "text (Gemma4ForCausalLM, default) or multimodal "
                      "(Gemma4ForConditionalGeneration)");
  command->add_option("--tokenizer", options->tokenizer, "tokenizer.json to copy in")
      ->check(CLI::ExistingFile);
  command
      ->add_option("--chat-template", options->chat_template,
                   "chat template to copy in as chat_template.jinja")
      ->check(CLI::ExistingFile);
  command->add_option("--max-shard-mib", options->max_shard_mib, "safetensors shard size limit");
  command->add_option("--threads", options->threads, "generator threads (0 = all cores)");
  command->callback([options, &exit_code] { exit_code = run_synth(*options); });
}

}  // namespace

GEMMA4_COMMAND(synth, register_synth);

}  // namespace gemma4::cli
