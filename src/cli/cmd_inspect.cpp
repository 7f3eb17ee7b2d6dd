// `gemma4 inspect DIR`: config, per-layer geometry, tensors with their formats and bytes, and
// the KV cache a context needs (model/inspect.h). Maps the checkpoint; expands nothing.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "cli/command.h"
#include "model/inspect.h"

namespace gemma4::cli {
namespace {

struct InspectCliOptions {
  std::string directory;
  int64_t context = 0;
  bool summary = false;
};

int run_inspect(const InspectCliOptions& cli) {
  auto model = model::LoadedModel::open(cli.directory);
  if (!model) {
    std::cerr << "gemma4 inspect: " << model.error().to_string() << "\n";
    return 1;
  }
  model::InspectOptions options;
  options.context = cli.context;
  options.list_tensors = !cli.summary;
  const std::string report = model::inspect_report(*model, options);
  std::fwrite(report.data(), 1, report.size(), stdout);
  return 0;
}

void register_inspect(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<InspectCliOptions>();
  CLI::App* command = app.add_subcommand(
      "inspect", "Show a checkpoint's config, layer geometry, tensors, formats and KV memory");
  command->add_option("directory", options->directory, "checkpoint directory")->required();
  command->add_option("--ctx", options->context,
                      "context length of the KV estimate (default: max_position_embeddings)");
  command->add_flag("--summary", options->summary, "omit the per-tensor list");
  command->callback([options, &exit_code] { exit_code = run_inspect(*options); });
}

}  // namespace

GEMMA4_COMMAND(inspect, register_inspect);

}  // namespace gemma4::cli
