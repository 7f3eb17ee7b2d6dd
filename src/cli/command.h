// Subcommand registry: each src/cli/cmd_<name>.cpp registers itself with GEMMA4_COMMAND, so
// adding a subcommand touches no shared file.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <vector>

namespace gemma4::cli {

// Adds one subcommand to `app`; the callback set on it returns the process exit code through
// `exit_code`.
using CommandRegistrar = std::function<void(CLI::App& app, int& exit_code)>;

std::vector<CommandRegistrar>& command_registry();

struct RegisterCommand {
  explicit RegisterCommand(CommandRegistrar registrar) {
    command_registry().push_back(std::move(registrar));
  }
};

}  // namespace gemma4::cli

#define GEMMA4_COMMAND(name, function) \
  static const ::gemma4::cli::RegisterCommand gemma4_command_##name{function}
