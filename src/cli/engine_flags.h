// The engine flags that `run`, `serve` and `bench` share (--device, --no-graphs, --no-pdl, --fp32,
// --kv-cache, --activations, --lm-head, --gpu-memory, --threads): one definition of their names,
// help texts and parsing, so the three subcommands cannot drift apart.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "cli/model_loader.h"
#include "core/status.h"

namespace gemma4::cli {

// The flags as given on the command line (unparsed).
struct EngineFlags {
  std::string device = "auto";
  bool no_graphs = false;
  bool no_pdl = false;
  bool fp32 = false;
  std::string kv_cache;
  std::string activations;
  std::string lm_head;
  std::string gpu_memory;
  int threads = 0;  // CPU backend threads (0 = all)
};

// Registers the flags on `cmd`, writing into `flags` (which must outlive the parse).
void add_engine_flags(CLI::App& cmd, EngineFlags& flags);

// The load options the flags ask for (model and sizes left at their defaults); an error naming
// the flag for a bad value.
Expected<EngineLoadOptions> engine_load_options(const EngineFlags& flags);

}  // namespace gemma4::cli
