#include <cstdio>
#include <string>

#include "cli/build_info.h"
#include "cli/command.h"

namespace gemma4::cli {

std::vector<CommandRegistrar>& command_registry() {
  static std::vector<CommandRegistrar> registry;
  return registry;
}

}  // namespace gemma4::cli

int main(int argc, char** argv) {
  CLI::App app{"gemma4: fast, faithful Gemma 4 inference and an OpenAI-compatible server"};
  app.set_version_flag("--version", std::string("gemma4 ") + gemma4::cli::build_commit());
  app.require_subcommand(1);
  int exit_code = 0;
  for (auto& registrar : gemma4::cli::command_registry()) registrar(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
