#include "model/synth.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/numeric.h"
#include "io/safetensors.h"
#include "model/config.h"

namespace gemma4::model {
namespace {

using nlohmann::json;

// ---- Deterministic randomness ------------------------------------------------------------------

uint64_t splitmix64(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ull;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t mix64(uint64_t value) {
  return splitmix64(value);
}

uint64_t fnv1a64(std::string_view text) {
  uint64_t hash = 0xCBF29CE484222325ull;
  for (char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001B3ull;
  }
  return hash;
}

// The random stream of one row of one logical tensor. Rows are independent, so any row can be
// generated alone (threads, chunks, fused and split layouts all give the same values).
class RowRandom {
 public:
  RowRandom(uint64_t tensor_key, int64_t row)
      : state_(mix64(tensor_key ^ mix64(static_cast<uint64_t>(row) + 1))) {}

  uint64_t bits() { return splitmix64(state_); }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(bits() >> 11) * 0x1.0p-53; }
  // Uniform in [low, high). std::fma is one correctly rounded operation on every platform, so a
  // compiler that contracts a * b + c differently cannot change the bytes.
  double uniform(double low, double high) { return std::fma(high - low, uniform(), low); }
  // Approximately standard normal: Irwin-Hall sum of four 16-bit uniforms, centred and divided
  // by its exact standard deviation 65536/sqrt(3) (integer math plus one division: no libm).
  double normal() {
    const uint64_t b = bits();
    const int64_t sum = static_cast<int64_t>((b & 0xFFFF) + ((b >> 16) & 0xFFFF) +
                                             ((b >> 32) & 0xFFFF) + (b >> 48));
    return static_cast<double>(sum - 131070) / 37837.2270;
  }

 private:
  uint64_t state_;
};

// ---- Value grids --------------------------------------------------------------------------------

// Rounds a positive normal float to `bits` significant bits (so that times a small integer it
// stays exact in bf16).
float round_significant(float value, int bits) {
  const int drop = 24 - bits;
  uint32_t u = std::bit_cast<uint32_t>(value);
  u = (u + (1u << (drop - 1))) & ~((1u << drop) - 1);
  return std::bit_cast<float>(u);
}

// Dequantised weights have rms about 1/sqrt(K) so activations keep their scale through a layer.
double weight_rms(int64_t cols) {
  return 1.0 / std::sqrt(static_cast<double>(cols));
}

// One w4g32 row: levels q in [-8, 7] (a rounded normal of std 2.5) and one bf16 scale per 32,
// each with at most 5 significant bits: q * scale has at most 8 and is exact in bf16.
void w4g32_row(uint64_t key, int64_t row, int64_t cols, int8_t* levels, float* scales) {
  RowRandom rng(key, row);
  const double target = weight_rms(cols) / 2.5;
  for (int64_t g = 0; g < cols / 32; ++g) {
    scales[g] = round_significant(static_cast<float>(target * rng.uniform(0.75, 1.25)), 5);
  }
  for (int64_t k = 0; k < cols; ++k) {
    const double level = std::nearbyint(rng.normal() * 2.5);
    levels[k] = static_cast<int8_t>(std::clamp(level, -8.0, 7.0));
  }
}

// rms of an e2m1 value with a uniformly random 4-bit code: sqrt(mean(0, .25, 1, 2.25, 4, 9, 16,
// 36)).
constexpr double kUniformE2m1Rms = 2.93;

// Power-of-two NVFP4 global scale (a divisor) that puts the e4m3 block scales of a matrix with
// K = cols near 64..160, well inside e4m3's normal range.
float nvfp4_global_scale(int64_t cols) {
  const double block_target = weight_rms(cols) / kUniformE2m1Rms;
  int exponent = 0;
  std::frexp(64.0 / block_target, &exponent);
  return static_cast<float>(std::ldexp(1.0, exponent));
}

// float_to_e4m3 for a positive finite value, found by binary search over the monotone positive
// codes instead of core's exhaustive scan (which dominated real-shape NVFP4 synthesis). The
// result is the same code: the nearest value, and core's own tie rule on an exact midpoint.
uint8_t positive_float_to_e4m3(float value) {
  uint8_t low = 0, high = 0x7E;  // 0x7E = 448, the largest finite code
  if (value >= e4m3_to_float(high)) return high;
  while (high - low > 1) {  // invariant: e4m3(low) <= value < e4m3(high)
    const uint8_t middle = static_cast<uint8_t>((low + high) / 2);
    (e4m3_to_float(middle) <= value ? low : high) = middle;
  }
  const float below = value - e4m3_to_float(low), above = e4m3_to_float(high) - value;
  if (below == above) return float_to_e4m3(value);
  return below < above ? low : high;
}

// One NVFP4 row: uniform e2m1 codes and one e4m3 block scale per 16 (stored already multiplied
// by the global scale, as compressed-tensors does).
void nvfp4_row(uint64_t key, int64_t row, int64_t cols, uint8_t* codes, uint8_t* block_scales) {
  RowRandom rng(key, row);
  const double block_target = weight_rms(cols) / kUniformE2m1Rms;
  const double global = nvfp4_global_scale(cols);
  for (int64_t b = 0; b < cols / 16; ++b) {
    block_scales[b] =
        positive_float_to_e4m3(static_cast<float>(block_target * rng.uniform(0.75, 1.25) * global));
  }
  for (int64_t k = 0; k < cols; k += 16) {
    const uint64_t bits = rng.bits();
    for (int i = 0; i < 16; ++i) codes[k + i] = static_cast<uint8_t>((bits >> (4 * i)) & 15);
  }
}

// The values of one row of a quantizable matrix on `grid`, as floats (exact in bf16).
void grid_row_values(SynthGrid grid, uint64_t key, int64_t row, int64_t cols, float* out) {
  switch (grid) {
    case SynthGrid::kNone: {
      RowRandom rng(key, row);
      const double rms = weight_rms(cols);
      for (int64_t k = 0; k < cols; ++k)
        out[k] = round_bf16(static_cast<float>(rng.normal() * rms));
      return;
    }
    case SynthGrid::kW4G32: {
      std::vector<int8_t> levels(cols);
      std::vector<float> scales(cols / 32);
      w4g32_row(key, row, cols, levels.data(), scales.data());
      for (int64_t k = 0; k < cols; ++k) out[k] = static_cast<float>(levels[k]) * scales[k / 32];
      return;
    }
    case SynthGrid::kNVFP4: {
      std::vector<uint8_t> codes(cols), block_scales(cols / 16);
      nvfp4_row(key, row, cols, codes.data(), block_scales.data());
      const float global = nvfp4_global_scale(cols);
      for (int64_t k = 0; k < cols; ++k) {
        // compressed-tensors order: (block scale / global) in fp32, times the element.
        out[k] = e2m1_to_float(codes[k]) * (e4m3_to_float(block_scales[k / 16]) / global);
      }
      return;
    }
  }
}

void store_bf16(const float* values, int64_t count, std::byte* out) {
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t bits = float_to_bf16(values[i]);
    std::memcpy(out + 2 * i, &bits, 2);
  }
}

// ---- Output tensors -----------------------------------------------------------------------------

// One tensor of the file: `rows` independent rows of `row_bytes`, each produced by `fill`.
struct OutTensor {
  io::TensorSpec spec;
  int64_t rows = 0;
  size_t row_bytes = 0;
  std::function<void(int64_t row, std::byte* out)> fill;
};

// Maps a logical row of a stacked tensor to (stream key, row within that stream).
using RowSource = std::function<std::pair<uint64_t, int64_t>(int64_t row)>;

class TensorPlan {
 public:
  TensorPlan(const SynthOptions& options, std::string prefix)
      : options_(options), prefix_(std::move(prefix)) {
    grid_ = options.format == SynthFormat::kW4A16   ? SynthGrid::kW4G32
            : options.format == SynthFormat::kNVFP4 ? SynthGrid::kNVFP4
                                                    : options.grid;
  }

  uint64_t key(std::string_view stream) const {
    return mix64(fnv1a64(stream) ^ mix64(options_.seed));
  }

  // A bf16 vector whose elements come from `value(rng)`.
  void vector(const std::string& name, int64_t length, std::function<double(RowRandom&)> value) {
    const uint64_t k = key(name);
    add({prefix_ + name, DType::kBF16, {length}}, 1, 2 * length,
        [k, length, value](int64_t, std::byte* out) {
          RowRandom rng(k, 0);
          std::vector<float> values(length);
          for (auto& v : values) v = static_cast<float>(value(rng));
          store_bf16(values.data(), length, out);
        });
  }
  // Weights around `center` with relative spread: norm weights.
  void norm(const std::string& name, int64_t length, double center = 1.0, double spread = 0.2) {
    vector(name, length,
           [=](RowRandom& rng) { return center * std::fma(spread, rng.normal(), 1.0); });
  }

  // A matrix that stays bf16 in every format (embeddings, PLE table and projection, router).
  void plain_matrix(const std::string& name, int64_t rows, int64_t cols, double stddev) {
    const uint64_t k = key(name);
    add({prefix_ + name, DType::kBF16, {rows, cols}}, rows, 2 * cols,
        [k, cols, stddev](int64_t row, std::byte* out) {
          RowRandom rng(k, row);
          std::vector<float> values(cols);
          for (auto& v : values) v = static_cast<float>(rng.normal() * stddev);
          store_bf16(values.data(), cols, out);
        });
  }

  // A Linear `<module>` [rows, cols] in the checkpoint's format.
  void linear(const std::string& module, int64_t rows, int64_t cols) {
    const uint64_t k = key(module);
    const std::string name = prefix_ + module;
    const SynthGrid grid = grid_;
    switch (options_.format) {
      case SynthFormat::kBF16:
        add({name + ".weight", DType::kBF16, {rows, cols}}, rows, 2 * cols,
            [k, cols, grid](int64_t row, std::byte* out) {
              std::vector<float> values(cols);
              grid_row_values(grid, k, row, cols, values.data());
              store_bf16(values.data(), cols, out);
            });
        return;
      case SynthFormat::kW4A16:
        add({name + ".weight_packed", DType::kI32, {rows, cols / 8}}, rows, cols / 2,
            [k, cols](int64_t row, std::byte* out) {
              std::vector<int8_t> levels(cols);
              std::vector<float> scales(cols / 32);
              w4g32_row(k, row, cols, levels.data(), scales.data());
              // Offset binary, element 0 in the low nibble of each little-endian word.
              for (int64_t b = 0; b < cols / 2; ++b) {
                out[b] =
                    static_cast<std::byte>((levels[2 * b] + 8) | ((levels[2 * b + 1] + 8) << 4));
              }
            });
        add({name + ".weight_scale", DType::kBF16, {rows, cols / 32}}, rows, cols / 16,
            [k, cols](int64_t row, std::byte* out) {
              std::vector<int8_t> levels(cols);
              std::vector<float> scales(cols / 32);
              w4g32_row(k, row, cols, levels.data(), scales.data());
              store_bf16(scales.data(), cols / 32, out);
            });
        add({name + ".weight_shape", DType::kI64, {2}}, 1, 16,
            [rows, cols](int64_t, std::byte* out) {
              const int64_t shape[2] = {rows, cols};
              std::memcpy(out, shape, 16);
            });
        return;
      case SynthFormat::kNVFP4:
        add({name + ".weight_packed", DType::kU8, {rows, cols / 2}}, rows, cols / 2,
            [k, cols](int64_t row, std::byte* out) {
              std::vector<uint8_t> codes(cols), scales(cols / 16);
              nvfp4_row(k, row, cols, codes.data(), scales.data());
              for (int64_t b = 0; b < cols / 2; ++b) {
                out[b] = static_cast<std::byte>(codes[2 * b] | (codes[2 * b + 1] << 4));
              }
            });
        add({name + ".weight_scale", DType::kF8E4M3, {rows, cols / 16}}, rows, cols / 16,
            [k, cols](int64_t row, std::byte* out) {
              std::vector<uint8_t> codes(cols), scales(cols / 16);
              nvfp4_row(k, row, cols, codes.data(), scales.data());
              std::memcpy(out, scales.data(), scales.size());
            });
        add({name + ".weight_global_scale", DType::kF32, {1}}, 1, 4,
            [cols](int64_t, std::byte* out) {
              const float global = nvfp4_global_scale(cols);
              std::memcpy(out, &global, 4);
            });
        return;
    }
  }

  // A layer's experts: fused 3-D bf16 tensors in a bf16 checkpoint, per-expert Linears in a
  // quantized one; the values of expert e's gate/up/down are the same streams either way.
  void experts(const std::string& layer, int64_t experts, int64_t width, int64_t hidden) {
    auto stream = [&](int64_t e, const char* which) {
      return fmt::format("{}experts.{}.{}", layer, e, which);
    };
    if (options_.format != SynthFormat::kBF16) {
      for (int64_t e = 0; e < experts; ++e) {
        linear(stream(e, "gate_proj"), width, hidden);
        linear(stream(e, "up_proj"), width, hidden);
        linear(stream(e, "down_proj"), hidden, width);
      }
      return;
    }
    std::vector<uint64_t> gate, up, down;
    for (int64_t e = 0; e < experts; ++e) {
      gate.push_back(key(stream(e, "gate_proj")));
      up.push_back(key(stream(e, "up_proj")));
      down.push_back(key(stream(e, "down_proj")));
    }
    const SynthGrid grid = grid_;
    add({prefix_ + layer + "experts.gate_up_proj", DType::kBF16, {experts, 2 * width, hidden}},
        experts * 2 * width, 2 * hidden, [=](int64_t row, std::byte* out) {
          const int64_t e = row / (2 * width), r = row % (2 * width);
          std::vector<float> values(hidden);
          grid_row_values(grid, r < width ? gate[e] : up[e], r % width, hidden, values.data());
          store_bf16(values.data(), hidden, out);
        });
    add({prefix_ + layer + "experts.down_proj", DType::kBF16, {experts, hidden, width}},
        experts * hidden, 2 * width, [=](int64_t row, std::byte* out) {
          std::vector<float> values(width);
          grid_row_values(grid, down[row / hidden], row % hidden, width, values.data());
          store_bf16(values.data(), width, out);
        });
  }

  std::vector<OutTensor>& tensors() { return tensors_; }

 private:
  void add(io::TensorSpec spec, int64_t rows, size_t row_bytes,
           std::function<void(int64_t, std::byte*)> fill) {
    tensors_.push_back({std::move(spec), rows, row_bytes, std::move(fill)});
  }

  const SynthOptions& options_;
  std::string prefix_;
  SynthGrid grid_ = SynthGrid::kNone;
  std::vector<OutTensor> tensors_;
};

// Every tensor of the text model (gemma4-architecture.md 1.3), with magnitudes that keep the
// activations of a random model sane through all layers.
void plan_model(const ModelConfig& config, TensorPlan& plan) {
  const int64_t hidden = config.hidden_size;
  // h0 = E * sqrt(H) has rms 3; tied logits then have std about 3.
  plan.plain_matrix("embed_tokens.weight", config.vocab_size, hidden,
                    3.0 / std::sqrt(static_cast<double>(hidden)));
  plan.norm("norm.weight", hidden);
  if (config.ple_dim > 0) {
    const int64_t packed = int64_t{config.num_layers} * config.ple_dim;
    plan.plain_matrix("embed_tokens_per_layer.weight", config.ple_vocab_size, packed, 1.0 / 16.0);
    plan.plain_matrix("per_layer_model_projection.weight", packed, hidden, weight_rms(hidden));
    plan.norm("per_layer_projection_norm.weight", config.ple_dim);
  }
  for (const auto& layer : config.layers) {
    const std::string p = fmt::format("layers.{}.", layer.layer_index);
    const int64_t hd = layer.head_dim;
    plan.norm(p + "input_layernorm.weight", hidden);
    plan.linear(p + "self_attn.q_proj", layer.q_width(), hidden);
    plan.norm(p + "self_attn.q_norm.weight", hd);
    if (layer.owns_kv()) {
      plan.linear(p + "self_attn.k_proj", layer.kv_width(), hidden);
      if (!layer.k_eq_v) plan.linear(p + "self_attn.v_proj", layer.kv_width(), hidden);
      // q and k are unit-rms per element after their norms; a k_norm of 2.5/sqrt(hd) keeps
      // attention logits (scale 1.0) at a std of about 2.5.
      plan.norm(p + "self_attn.k_norm.weight", hd, 2.5 / std::sqrt(static_cast<double>(hd)));
    }
    plan.linear(p + "self_attn.o_proj", hidden, layer.q_width());
    plan.norm(p + "post_attention_layernorm.weight", hidden);
    plan.norm(p + "pre_feedforward_layernorm.weight", hidden);
    plan.linear(p + "mlp.gate_proj", layer.ffn_width, hidden);
    plan.linear(p + "mlp.up_proj", layer.ffn_width, hidden);
    plan.linear(p + "mlp.down_proj", hidden, layer.ffn_width);
    plan.norm(p + "post_feedforward_layernorm.weight", hidden);
    if (config.moe) {
      const int64_t experts = config.moe_params.num_experts;
      plan.plain_matrix(p + "router.proj.weight", experts, hidden, 1.5);
      plan.norm(p + "router.scale", hidden);
      plan.vector(p + "router.per_expert_scale", experts,
                  [](RowRandom& rng) { return rng.uniform(0.5, 1.5); });
      plan.norm(p + "post_feedforward_layernorm_1.weight", hidden);
      plan.norm(p + "pre_feedforward_layernorm_2.weight", hidden);
      plan.norm(p + "post_feedforward_layernorm_2.weight", hidden);
      plan.experts(p, experts, config.moe_params.intermediate_size, hidden);
    }
    if (config.ple_dim > 0) {
      plan.linear(p + "per_layer_input_gate", config.ple_dim, hidden);
      plan.linear(p + "per_layer_projection", hidden, config.ple_dim);
      plan.norm(p + "post_per_layer_input_norm.weight", hidden);
    }
    plan.vector(p + "layer_scalar", 1, [](RowRandom& rng) { return rng.uniform(0.6, 1.0); });
  }
}

json quantization_config(const ModelConfig& config, SynthFormat format) {
  // Linears left unquantized (router, PLE model projection, lm_head), named as modules.
  json ignore = json::array({"lm_head"});
  if (config.ple_dim > 0) ignore.push_back(config.tensor_prefix + "per_layer_model_projection");
  if (config.moe) {
    for (const auto& layer : config.layers) {
      ignore.push_back(
          fmt::format("{}layers.{}.router.proj", config.tensor_prefix, layer.layer_index));
    }
  }
  const bool w4 = format == SynthFormat::kW4A16;
  const std::string packing = w4 ? "pack-quantized" : "nvfp4-pack-quantized";
  json weights = w4 ? json{{"num_bits", 4},
                           {"type", "int"},
                           {"symmetric", true},
                           {"strategy", "group"},
                           {"group_size", 32},
                           {"dynamic", false},
                           {"actorder", nullptr},
                           {"observer", "minmax"},
                           {"observer_kwargs", json::object()},
                           {"block_structure", nullptr}}
                    : json{{"num_bits", 4},
                           {"type", "float"},
                           {"symmetric", true},
                           {"strategy", "tensor_group"},
                           {"group_size", 16},
                           {"dynamic", false},
                           {"observer", "minmax"},
                           {"observer_kwargs", json::object()},
                           {"scale_dtype", "torch.float8_e4m3fn"}};
  return json{{"quant_method", "compressed-tensors"},
              {"format", packing},
              {"quantization_status", "compressed"},
              {"config_groups",
               {{"group_0",
                 {{"targets", {"Linear"}},
                  {"format", packing},
                  {"weights", weights},
                  {"input_activations", nullptr},
                  {"output_activations", nullptr}}}}},
              {"ignore", ignore},
              {"kv_cache_scheme", nullptr}};
}

Status write_text_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return make_error(ErrorCode::kIo, "cannot write {}", path.string());
  return Status::ok_status();
}

Status copy_into(const std::filesystem::path& source, const std::filesystem::path& target) {
  std::error_code error;
  std::filesystem::copy_file(source, target, std::filesystem::copy_options::overwrite_existing,
                             error);
  if (error) {
    return make_error(ErrorCode::kIo, "cannot copy {} to {}: {}", source.string(), target.string(),
                      error.message());
  }
  return Status::ok_status();
}

// Streams all tensors: rows are generated in chunks of about 32 MiB, split over threads.
Status write_tensors(const SynthOptions& options, std::vector<OutTensor>& tensors) {
  std::vector<io::TensorSpec> specs;
  for (const auto& tensor : tensors) specs.push_back(tensor.spec);
  GEMMA4_ASSIGN_OR_RETURN(auto writer,
                          io::ShardedSafetensorsWriter::create(options.output, std::move(specs),
                                                               options.max_shard_bytes));
  const int threads =
      options.threads > 0 ? options.threads : std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::byte> buffer;
  for (const auto& tensor : tensors) {
    const int64_t chunk_rows =
        std::max<int64_t>(1, static_cast<int64_t>((size_t{32} << 20) / tensor.row_bytes));
    for (int64_t first = 0; first < tensor.rows; first += chunk_rows) {
      const int64_t count = std::min(chunk_rows, tensor.rows - first);
      buffer.resize(count * tensor.row_bytes);
      const int64_t workers = std::min<int64_t>(threads, count);
      auto fill_rows = [&](int64_t worker) {
        for (int64_t r = worker; r < count; r += workers) {
          tensor.fill(first + r, buffer.data() + r * tensor.row_bytes);
        }
      };
      std::vector<std::thread> pool;
      for (int64_t w = 1; w < workers; ++w) pool.emplace_back(fill_rows, w);
      fill_rows(0);
      for (auto& thread : pool) thread.join();
      GEMMA4_RETURN_IF_ERROR(writer.append(buffer));
    }
  }
  return writer.finish();
}

}  // namespace

Expected<SynthFormat> parse_synth_format(std::string_view name) {
  if (name == "bf16") return SynthFormat::kBF16;
  if (name == "w4a16") return SynthFormat::kW4A16;
  if (name == "nvfp4") return SynthFormat::kNVFP4;
  return make_error(ErrorCode::kInvalidArgument, "unknown format '{}' (bf16, w4a16, nvfp4)", name);
}

Expected<SynthGrid> parse_synth_grid(std::string_view name) {
  if (name == "none") return SynthGrid::kNone;
  if (name == "w4g32") return SynthGrid::kW4G32;
  if (name == "nvfp4") return SynthGrid::kNVFP4;
  return make_error(ErrorCode::kInvalidArgument, "unknown grid '{}' (none, w4g32, nvfp4)", name);
}

Status synthesize_checkpoint(const SynthOptions& options) {
  if (options.output.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "synth: no output directory");
  }
  GEMMA4_ASSIGN_OR_RETURN(json text, preset_text_config(options.config));
  json config_json = hf_config_json(text, options.layout);
  GEMMA4_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::from_hf_json(config_json));
  if (options.format != SynthFormat::kBF16) {
    config_json["quantization_config"] = quantization_config(config, options.format);
  }
  // Random weights: loaders (serve's log, /v1/models, the web UI) say the output is noise.
  config_json["gemma4_synthetic"] = true;

  std::error_code error;
  std::filesystem::create_directories(options.output, error);
  if (error) {
    return make_error(ErrorCode::kIo, "cannot create {}: {}", options.output.string(),
                      error.message());
  }
  // Shards of an earlier, differently sharded run would otherwise be left behind.
  for (const auto& entry : std::filesystem::directory_iterator(options.output, error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("model") && name.find(".safetensors") != std::string::npos) {
      std::filesystem::remove(entry.path(), error);
    }
  }

  TensorPlan plan(options, config.tensor_prefix);
  plan_model(config, plan);
  auto& tensors = plan.tensors();
  std::sort(tensors.begin(), tensors.end(),
            [](const OutTensor& a, const OutTensor& b) { return a.spec.name < b.spec.name; });
  GEMMA4_RETURN_IF_ERROR(write_tensors(options, tensors));

  GEMMA4_RETURN_IF_ERROR(
      write_text_file(options.output / "config.json", config_json.dump(2) + "\n"));
  GEMMA4_RETURN_IF_ERROR(write_text_file(options.output / "generation_config.json",
                                         hf_generation_config_json().dump(2) + "\n"));
  if (!options.tokenizer.empty()) {
    GEMMA4_RETURN_IF_ERROR(copy_into(options.tokenizer, options.output / "tokenizer.json"));
  }
  if (!options.chat_template.empty()) {
    GEMMA4_RETURN_IF_ERROR(
        copy_into(options.chat_template, options.output / "chat_template.jinja"));
  }
  return Status::ok_status();
}

}  // namespace gemma4::model
