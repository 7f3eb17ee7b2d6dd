// gemma4 pull ORG/NAME[/FILE.gguf]: download a model into the HF cache (or find it there) and
// print its local path.
#include <cstdio>

#include "cli/command.h"
#include "io/hf_hub.h"

namespace gemma4::cli {
namespace {

void register_pull(CLI::App& app, int& exit_code) {
  struct Args {
    std::string model;
    std::string revision = "main";
    bool quiet = false;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("pull", "Download a model from the hub into the HF cache");
  cmd->add_option("model", args->model, "repo id org/name, or org/name/file.gguf")->required();
  cmd->add_option("--revision", args->revision, "branch, tag or commit");
  cmd->add_flag("-q,--quiet", args->quiet, "no progress bar");
  cmd->callback([args, &exit_code] {
    auto options = io::HubOptions::from_environment();
    options.revision = args->revision;
    options.show_progress = !args->quiet;
    auto path = io::resolve_model_path(options, args->model);
    if (!path.ok()) {
      std::fprintf(stderr, "gemma4 pull: %s\n", path.error().message.c_str());
      exit_code = 1;
      return;
    }
    std::printf("%s\n", path->c_str());
  });
}

GEMMA4_COMMAND(pull, register_pull);

}  // namespace
}  // namespace gemma4::cli
