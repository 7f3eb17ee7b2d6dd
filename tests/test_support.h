// Helpers shared by the C++ tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

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

// `count` draws of N(0, stddev²) from std::mt19937(seed): random test inputs, the same on every
// run of one build (the expected values are always computed from them in the same run).
inline std::vector<float> random_normal(size_t count, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

// `n` token ids for a test prompt: the BOS id 2, then ids in [1000, 201000) that `salt` varies.
inline std::vector<int32_t> prompt_ids(int n, int salt) {
  std::vector<int32_t> ids{2};
  for (int i = 1; i < n; ++i) ids.push_back(1000 + (i * 7919 + salt * 104729) % 200000);
  return ids;
}

// `result` failed with `code`, and its message names every fragment.
template <typename T>
void expect_error(const Expected<T>& result, ErrorCode code,
                  std::initializer_list<std::string_view> fragments) {
  ASSERT_FALSE(result.ok()) << "expected an error";
  EXPECT_EQ(result.error().code, code) << result.error().to_string();
  for (std::string_view fragment : fragments) {
    EXPECT_NE(result.error().message.find(fragment), std::string::npos)
        << "'" << fragment << "' not in: " << result.error().message;
  }
}

}  // namespace gemma4::testing
