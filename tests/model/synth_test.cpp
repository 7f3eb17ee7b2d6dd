// gemma4 synth: identical bytes for the same seed (any thread count), and quantized checkpoints
// whose bf16 twins hold exactly the dequantised values. Dequantisation here follows the spec's
// formulas (weight-formats.md 2.3-2.4, 3.2-3.3) independently of any engine code.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "core/numeric.h"
#include "model/synth.h"
#include "model/weights.h"
#include "quant/pack_w4g32.h"
#include "test_support.h"

namespace gemma4::model {
namespace {

using quant::QMatrix;
using quant::WeightFormat;

template <typename T>
T load(const void* base, int64_t index) {
  T value;
  std::memcpy(&value, static_cast<const std::byte*>(base) + index * sizeof(T), sizeof(T));
  return value;
}

float scale_value(const QMatrix& m, int64_t index) {
  switch (m.scale_type) {
    case quant::ScaleType::kBF16:
      return bf16_to_float(load<uint16_t>(m.scales, index));
    case quant::ScaleType::kF16:
      return fp16_to_float(load<uint16_t>(m.scales, index));
    case quant::ScaleType::kF32:
      return load<float>(m.scales, index);
  }
  return 0.0f;
}

float dequantize(const QMatrix& m, int64_t row, int64_t col) {
  switch (m.format) {
    case WeightFormat::kF32:
      return load<float>(m.data, row * m.cols + col);
    case WeightFormat::kBF16:
      return bf16_to_float(load<uint16_t>(m.data, row * m.cols + col));
    case WeightFormat::kW4G32: {
      // int32 word k/8, nibble k%8 (element 0 lowest), offset binary; times the group scale.
      const uint32_t word = load<uint32_t>(m.data, row * (m.cols / 8) + col / 8);
      const int level = static_cast<int>((word >> (4 * (col % 8))) & 15) - 8;
      return static_cast<float>(level) * scale_value(m, row * (m.cols / 32) + col / 32);
    }
    case WeightFormat::kNVFP4: {
      const uint8_t byte = load<uint8_t>(m.data, row * (m.cols / 2) + col / 2);
      const uint8_t code = col % 2 ? byte >> 4 : byte & 15;
      const float block = e4m3_to_float(load<uint8_t>(m.scales, row * (m.cols / 16) + col / 16));
      return e2m1_to_float(code) * m.nv_global.apply(block);
    }
    default:  // synthetic safetensors checkpoints hold only the formats above
      ADD_FAILURE() << "unexpected format " << quant::weight_format_name(m.format);
  }
  return 0.0f;
}

std::filesystem::path synth(const std::string& config, SynthFormat format, SynthGrid grid,
                            const std::string& tag, int threads = 0,
                            uint64_t max_shard_bytes = uint64_t{4} << 30) {
  auto dir = testing::scratch_dir("synth_" + tag);
  SynthOptions options;
  options.config = config;
  options.format = format;
  options.grid = grid;
  options.seed = 11;
  options.output = dir;
  options.threads = threads;
  options.max_shard_bytes = max_shard_bytes;
  Status status = synthesize_checkpoint(options);
  EXPECT_TRUE(status.ok()) << status.error().to_string();
  return dir;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every vector the model reads.
void for_each_vector(
    const ModelWeights& w,
    const std::function<void(const std::string&, const std::vector<float>&)>& visit) {
  visit("norm", w.final_norm);
  visit("per_layer_projection_norm", w.per_layer_projection_norm);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    for (const auto* vec :
         {&l.q_norm, &l.k_norm, &l.input_layernorm, &l.post_attention_layernorm,
          &l.pre_feedforward_layernorm, &l.post_feedforward_layernorm, &l.router_scale,
          &l.per_expert_scale, &l.post_feedforward_layernorm_1, &l.pre_feedforward_layernorm_2,
          &l.post_feedforward_layernorm_2, &l.post_per_layer_input_norm}) {
      visit(p + "vector", *vec);
    }
    visit(p + "layer_scalar", {l.layer_scalar});
  }
}

// Both checkpoints compute the same function: every weight dequantises to the same floats.
void expect_same_values(const std::filesystem::path& a_dir, const std::filesystem::path& b_dir,
                        int64_t* quantized_matrices) {
  auto a = LoadedModel::open(a_dir);
  auto b = LoadedModel::open(b_dir);
  ASSERT_TRUE(a.ok()) << a.error().to_string();
  ASSERT_TRUE(b.ok()) << b.error().to_string();
  std::vector<std::vector<float>> b_vectors;
  for_each_vector(b->weights,
                  [&](const std::string&, const std::vector<float>& v) { b_vectors.push_back(v); });
  size_t index = 0;
  for_each_vector(a->weights, [&](const std::string& name, const std::vector<float>& v) {
    ASSERT_LT(index, b_vectors.size());
    EXPECT_EQ(v, b_vectors[index++]) << name;
  });
  EXPECT_EQ(index, b_vectors.size());

  std::vector<const QMatrix*> b_matrices;
  for_each_matrix(b->weights,
                  [&](const std::string&, const QMatrix& m) { b_matrices.push_back(&m); });
  index = 0;
  int64_t mismatches = 0;
  for_each_matrix(a->weights, [&](const std::string& name, const QMatrix& m) {
    ASSERT_LT(index, b_matrices.size());
    const QMatrix& bm = *b_matrices[index++];
    ASSERT_EQ(m.rows, bm.rows) << name;
    ASSERT_EQ(m.cols, bm.cols) << name;
    if (m.format != bm.format) ++*quantized_matrices;
    // The 262,144-row tables are plain bf16 in every format: compare a sample of rows.
    const int64_t step = m.rows > 4096 ? 997 : 1;
    for (int64_t r = 0; r < m.rows; r += step) {
      for (int64_t c = 0; c < m.cols; ++c) {
        if (dequantize(m, r, c) != dequantize(bm, r, c) && ++mismatches < 5) {
          ADD_FAILURE() << name << " [" << r << ", " << c << "]: " << dequantize(m, r, c) << " vs "
                        << dequantize(bm, r, c);
        }
      }
    }
  });
  EXPECT_EQ(index, b_matrices.size());
  EXPECT_EQ(mismatches, 0);
}

TEST(Synth, SameSeedSameBytesForAnyThreadCount) {
  auto one = synth("tiny-moe", SynthFormat::kW4A16, SynthGrid::kW4G32, "det_1", 1);
  auto three = synth("tiny-moe", SynthFormat::kW4A16, SynthGrid::kW4G32, "det_3", 3);
  for (const char* file : {"model.safetensors", "config.json", "generation_config.json"}) {
    const std::string a = read_file(one / file), b = read_file(three / file);
    EXPECT_FALSE(a.empty()) << file;
    EXPECT_TRUE(a == b) << file << " differs";
  }
  // A different seed changes the weights.
  SynthOptions options;
  options.config = "tiny-moe";
  options.format = SynthFormat::kW4A16;
  options.seed = 12;
  options.output = testing::scratch_dir("synth_det_seed12");
  ASSERT_TRUE(synthesize_checkpoint(options).ok());
  EXPECT_NE(read_file(one / "model.safetensors"), read_file(options.output / "model.safetensors"));
}

// Synthesizes `config` in the quantized `format` and as its bf16 twin on `grid`, expects both to
// compute the same function, and returns the quantized checkpoint (scratch dirs named by `tag`).
std::filesystem::path expect_bf16_twin_is_the_same_function(const char* config, SynthFormat format,
                                                            SynthGrid grid,
                                                            const std::string& tag) {
  auto packed = synth(config, format, grid, tag + "_packed");
  auto twin = synth(config, SynthFormat::kBF16, grid, tag + "_twin");
  int64_t quantized = 0;
  expect_same_values(packed, twin, &quantized);
  EXPECT_GT(quantized, 10);
  return packed;
}

TEST(Synth, W4A16TwinsAreTheSameFunction) {
  for (const char* config : {"tiny", "tiny-moe"}) {
    SCOPED_TRACE(config);
    expect_bf16_twin_is_the_same_function(config, SynthFormat::kW4A16, SynthGrid::kW4G32, "w4");
  }
}

// On the w4g32 grid the bf16 embedding (the tied lm_head) and PLE tables hold grid values (as a
// QAT checkpoint does), so a device backend can pack them losslessly; plain tables (other grids)
// are not on it.
TEST(Synth, TablesAreOnTheInt4GridOnlyForTheW4G32Grid) {
  struct Case {
    SynthFormat format;
    SynthGrid grid;
    bool on_grid;
  };
  for (const Case& c : {Case{SynthFormat::kW4A16, SynthGrid::kW4G32, true},
                        Case{SynthFormat::kBF16, SynthGrid::kW4G32, true},
                        Case{SynthFormat::kBF16, SynthGrid::kNone, false},
                        Case{SynthFormat::kNVFP4, SynthGrid::kNVFP4, false}}) {
    auto model = LoadedModel::open(synth("tiny", c.format, c.grid, "ple_grid"));
    ASSERT_TRUE(model.ok()) << model.error().to_string();
    for (const QMatrix* table :
         {&model->weights.embed_tokens, &model->weights.embed_tokens_per_layer}) {
      EXPECT_EQ(table->format, WeightFormat::kBF16);
      EXPECT_EQ(quant::check_w4g32_exact(*table).ok(), c.on_grid)
          << static_cast<int>(c.format) << "/" << static_cast<int>(c.grid) << " "
          << (table == &model->weights.embed_tokens ? "embed_tokens" : "embed_tokens_per_layer");
    }
  }
}

TEST(Synth, NvFp4TwinsAreTheSameFunction) {
  for (const char* config : {"tiny", "tiny-moe"}) {
    SCOPED_TRACE(config);
    auto packed =
        expect_bf16_twin_is_the_same_function(config, SynthFormat::kNVFP4, SynthGrid::kNVFP4, "nv");
    // Global scales are powers of two (exact in bf16 and as divisors).
    auto model = LoadedModel::open(packed);
    ASSERT_TRUE(model.ok());
    const float global = model->weights.layers[0].q_proj.nv_global.value;
    int exponent = 0;
    EXPECT_EQ(std::frexp(global, &exponent), 0.5f) << global;
  }
}

TEST(Synth, ShardedOutputHoldsTheSameTensors) {
  auto single = synth("tiny-moe", SynthFormat::kNVFP4, SynthGrid::kNVFP4, "single");
  auto sharded = synth("tiny-moe", SynthFormat::kNVFP4, SynthGrid::kNVFP4, "sharded", 0, 8u << 20);
  EXPECT_FALSE(std::filesystem::exists(sharded / "model.safetensors"));
  auto index = nlohmann::json::parse(read_file(sharded / "model.safetensors.index.json"));
  EXPECT_GT(index["weight_map"].size(), 100u);
  int64_t quantized = 0;
  expect_same_values(single, sharded, &quantized);
  EXPECT_EQ(quantized, 0);
}

TEST(Synth, WritesConfigsAndCopiesTokenizerFiles) {
  auto dir = testing::scratch_dir("synth_files");
  SynthOptions options;
  options.config = "tiny";
  options.format = SynthFormat::kW4A16;
  options.layout = ConfigLayout::kMultimodal;
  options.output = dir;
  options.tokenizer = testing::shared_data_dir() / "tokenizer" / "tokenizer.json";
  const auto templates = testing::shared_data_dir() / "chat-templates";
  ASSERT_TRUE(std::filesystem::exists(options.tokenizer));
  for (const auto& entry : std::filesystem::directory_iterator(templates)) {
    options.chat_template = entry.path();
    break;
  }
  ASSERT_TRUE(synthesize_checkpoint(options).ok());
  EXPECT_EQ(read_file(dir / "tokenizer.json"), read_file(options.tokenizer));
  EXPECT_EQ(read_file(dir / "chat_template.jinja"), read_file(options.chat_template));
  auto model = LoadedModel::open(dir);
  ASSERT_TRUE(model.ok()) << model.error().to_string();
  EXPECT_EQ(model->config.tensor_prefix, "model.language_model.");
  EXPECT_EQ(model->config.eos_token_ids, (std::vector<int>{1, 106, 50}));
  EXPECT_EQ(model->quantization.weight_format, WeightFormat::kW4G32);
  EXPECT_EQ(model->quantization.group_size, 32);

  options.config = "tiny-xl";
  Status bad = synthesize_checkpoint(options);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("tiny-xl"), std::string::npos);
}

// --config FILE.json: the shapes of that config (here a tiny checkpoint's own config.json with
// fewer layers and a smaller vocabulary, nested as a multimodal config.json nests them).
TEST(Synth, ConfigFileGivesItsShapes) {
  const auto tiny = synth("tiny", SynthFormat::kW4A16, SynthGrid::kW4G32, "config_source");
  auto config = nlohmann::json::parse(read_file(tiny / "config.json"));
  config["num_hidden_layers"] = 3;
  config["layer_types"] = {"sliding_attention", "sliding_attention", "full_attention"};
  config["num_kv_shared_layers"] = 0;
  config["vocab_size"] = 4096;
  config["vocab_size_per_layer_input"] = 4096;
  const auto file = testing::scratch_dir("synth_config_file") / "small.json";
  std::ofstream(file) << nlohmann::json{{"text_config", config}}.dump();

  auto dir = synth(file.string(), SynthFormat::kW4A16, SynthGrid::kW4G32, "from_config_file");
  auto model = LoadedModel::open(dir);
  ASSERT_TRUE(model.ok()) << model.error().to_string();
  EXPECT_EQ(model->config.num_layers, 3);
  EXPECT_EQ(model->config.vocab_size, 4096);
  EXPECT_EQ(model->weights.embed_tokens.rows, 4096);
  EXPECT_EQ(model->quantization.weight_format, WeightFormat::kW4G32);

  SynthOptions missing;
  missing.config = (dir / "no-such-config.json").string();
  missing.output = dir;
  Status bad = synthesize_checkpoint(missing);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("no-such-config.json"), std::string::npos);
}

}  // namespace
}  // namespace gemma4::model
