// Helpers shared by the C++ tests.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace gemma4::testing {

// The shared test data folder (tokenizer.json, chat templates, real config.json files): the
// environment variable GEMMA4_SHARED_DATA, else ../shared/data beside the source tree.
inline std::filesystem::path shared_data_dir() {
  if (const char* env = std::getenv("GEMMA4_SHARED_DATA"); env && *env) return env;
  return std::filesystem::path(GEMMA4_SOURCE_DIR) / ".." / "shared" / "data";
}

// A fresh, empty scratch folder under the build tree for one test.
inline std::filesystem::path scratch_dir(const std::string& name) {
  auto dir = std::filesystem::path(GEMMA4_BINARY_DIR) / "test-scratch" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace gemma4::testing
