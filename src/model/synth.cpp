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
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/gguf_model.h"
#include "quant/gguf_blocks.h"

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

// One w4g32 row of rms about `rms`: levels q in [-8, 7] (a rounded normal of std 2.5) and one
// bf16 scale per 32, each with at most 5 significant bits: q * scale has at most 8 and is exact
// in bf16.
void w4g32_row(uint64_t key, int64_t row, int64_t cols, double rms, int8_t* levels, float* scales) {
  RowRandom rng(key, row);
  const double target = rms / 2.5;
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

// Whether a row of `cols` elements on `grid` is stored as Q4_K (else as w4g32 / Q4_0 levels):
// K-quant blocks are 256 wide, so narrower matrices fall back (as llama-quantize falls back).
bool q4_k_row(SynthGrid grid, int64_t cols) {
  return grid == SynthGrid::kQ4K && cols % quant::kQ4_KBlockElements == 0;
}

// One row of random bf16 values, normal with the rms of a weight of width `cols`.
std::vector<float> plain_row(uint64_t key, int64_t row, int64_t cols) {
  RowRandom rng(key, row);
  const double rms = weight_rms(cols);
  std::vector<float> values(static_cast<size_t>(cols));
  for (auto& v : values) v = round_bf16(static_cast<float>(rng.normal() * rms));
  return values;
}

// The Q4_K blocks of a q4_k_row: plain values through quant::quantize_q4_k, whose values are
// exact in bf16.
std::vector<std::byte> q4_k_blocks(uint64_t key, int64_t row, int64_t cols) {
  return quant::quantize_q4_k(plain_row(key, row, cols), 1, cols).value();
}

// The values of one row of a quantizable matrix on `grid`, as floats (exact in bf16).
void grid_row_values(SynthGrid grid, uint64_t key, int64_t row, int64_t cols, float* out) {
  if (q4_k_row(grid, cols)) {
    const auto values =
        quant::dequantize_ggml(quant::kGgmlQ4_K, q4_k_blocks(key, row, cols), 1, cols).value();
    std::copy(values.begin(), values.end(), out);
    return;
  }
  switch (grid) {
    case SynthGrid::kNone: {
      const auto values = plain_row(key, row, cols);
      std::copy(values.begin(), values.end(), out);
      return;
    }
    case SynthGrid::kQ4K:  // a row too narrow for Q4_K
    case SynthGrid::kW4G32: {
      std::vector<int8_t> levels(cols);
      std::vector<float> scales(cols / 32);
      w4g32_row(key, row, cols, weight_rms(cols), levels.data(), scales.data());
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

// ---- GGUF rows ----------------------------------------------------------------------------------

// The ggml type a quantizable row of `cols` elements on `grid` is written as.
io::GgufType gguf_row_type(SynthGrid grid, int64_t cols) {
  return q4_k_row(grid, cols) ? io::GgufType::kQ4_K : io::GgufType::kQ4_0;
}

int64_t gguf_row_bytes(SynthGrid grid, int64_t cols) {
  return q4_k_row(grid, cols) ? cols / quant::kQ4_KBlockElements * quant::kQ4_KBlockBytes
                              : cols / quant::kQ4_0BlockElements * quant::kQ4_0BlockBytes;
}

// The GGUF blocks of one row: Q4_K blocks, or Q4_0 blocks holding the w4g32 levels and scales
// (d = the 5-significant-bit scale, exact in fp16; nibble = level + 8).
void gguf_row(SynthGrid grid, uint64_t key, int64_t row, int64_t cols, std::byte* out) {
  if (q4_k_row(grid, cols)) {
    const auto blocks = q4_k_blocks(key, row, cols);
    std::memcpy(out, blocks.data(), blocks.size());
    return;
  }
  std::vector<int8_t> levels(cols);
  std::vector<float> scales(cols / 32);
  w4g32_row(key, row, cols, weight_rms(cols), levels.data(), scales.data());
  for (int64_t b = 0; b < cols / 32; ++b) {
    std::byte* block = out + b * quant::kQ4_0BlockBytes;
    const uint16_t d = float_to_fp16(scales[b]);
    std::memcpy(block, &d, 2);
    for (int i = 0; i < 16; ++i) {
      block[2 + i] =
          static_cast<std::byte>((levels[32 * b + i] + 8) | ((levels[32 * b + i + 16] + 8) << 4));
    }
  }
}

// llama.cpp's name of an HF tensor of the text model (every tensor synth writes has one).
std::string gguf_name_of(std::string_view name) {
  auto mapped = gguf_tensor_name(name);
  if (!mapped && name.ends_with(".weight"))
    mapped = gguf_tensor_name(name.substr(0, name.size() - 7));
  return mapped.value_or(std::string(name));
}

// ---- Output tensors -----------------------------------------------------------------------------

// One tensor of the file: `rows` independent rows of `row_bytes`, each produced by `fill`.
struct OutTensor {
  io::TensorSpec spec;      // safetensors checkpoints
  io::GgufTensorSpec gguf;  // GGUF checkpoints
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
    grid_ = options.format == SynthFormat::kW4A16      ? SynthGrid::kW4G32
            : options.format == SynthFormat::kNVFP4    ? SynthGrid::kNVFP4
            : options.format == SynthFormat::kGgufQ4_0 ? SynthGrid::kW4G32
            : options.format == SynthFormat::kGgufQ4_K ? SynthGrid::kQ4K
                                                       : options.grid;
  }

  bool gguf() const { return is_gguf(options_.format); }
  // The w4a16 format and its twins (bf16 and gguf-q4_0 files of the w4g32 grid).
  bool w4g32_grid() const { return grid_ == SynthGrid::kW4G32; }

  uint64_t key(std::string_view stream) const {
    return mix64(fnv1a64(stream) ^ mix64(options_.seed));
  }

  // A bf16 vector whose elements come from `value(rng)`.
  void vector(const std::string& name, int64_t length, std::function<double(RowRandom&)> value) {
    const uint64_t k = key(name);
    if (gguf()) {  // F32, as llama.cpp stores 1-D tensors, holding the same bf16 values
      add_gguf({gguf_name_of(name), io::GgufType::kF32, {length}}, 1, 4 * length,
               [k, length, value](int64_t, std::byte* out) {
                 RowRandom rng(k, 0);
                 for (int64_t i = 0; i < length; ++i) {
                   const float v = round_bf16(static_cast<float>(value(rng)));
                   std::memcpy(out + 4 * i, &v, 4);
                 }
               });
      return;
    }
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
  // `qat_grid`: on the w4g32 grid (levels times bf16 scales, rms about `stddev`), as a
  // quantization-aware-trained checkpoint stores a table it keeps in bf16.
  void plain_matrix(const std::string& name, int64_t rows, int64_t cols, double stddev,
                    bool qat_grid = false) {
    const uint64_t k = key(name);
    auto fill = [k, cols, stddev, qat_grid](int64_t row, std::byte* out) {
      std::vector<float> values(cols);
      if (qat_grid) {
        std::vector<int8_t> levels(cols);
        std::vector<float> scales(cols / 32);
        w4g32_row(k, row, cols, stddev, levels.data(), scales.data());
        for (int64_t c = 0; c < cols; ++c)
          values[c] = static_cast<float>(levels[c]) * scales[c / 32];
      } else {
        RowRandom rng(k, row);
        for (auto& v : values) v = static_cast<float>(rng.normal() * stddev);
      }
      store_bf16(values.data(), cols, out);
    };
    if (gguf()) {
      add_gguf({gguf_name_of(name), io::GgufType::kBF16, {cols, rows}}, rows, 2 * cols, fill);
    } else {
      add({prefix_ + name, DType::kBF16, {rows, cols}}, rows, 2 * cols, fill);
    }
  }

  // A Linear `<module>` [rows, cols] in the checkpoint's format.
  void linear(const std::string& module, int64_t rows, int64_t cols) {
    const uint64_t k = key(module);
    const std::string name = prefix_ + module;
    const SynthGrid grid = grid_;
    switch (options_.format) {
      case SynthFormat::kGgufQ4_0:
      case SynthFormat::kGgufQ4_K:
        add_gguf({gguf_name_of(module), gguf_row_type(grid, cols), {cols, rows}}, rows,
                 gguf_row_bytes(grid, cols), [k, cols, grid](int64_t row, std::byte* out) {
                   gguf_row(grid, k, row, cols, out);
                 });
        return;
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
              w4g32_row(k, row, cols, weight_rms(cols), levels.data(), scales.data());
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
              w4g32_row(k, row, cols, weight_rms(cols), levels.data(), scales.data());
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
    if (options_.format != SynthFormat::kBF16 && !gguf()) {
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
    if (gguf()) {  // stacked {K, N, E} tensors of quantized rows (spec 4.5)
      add_gguf({gguf_name_of(layer + "experts.gate_up_proj"),
                gguf_row_type(grid, hidden),
                {hidden, 2 * width, experts}},
               experts * 2 * width, gguf_row_bytes(grid, hidden), [=](int64_t row, std::byte* out) {
                 const int64_t e = row / (2 * width), r = row % (2 * width);
                 gguf_row(grid, r < width ? gate[e] : up[e], r % width, hidden, out);
               });
      add_gguf({gguf_name_of(layer + "experts.down_proj"),
                gguf_row_type(grid, width),
                {width, hidden, experts}},
               experts * hidden, gguf_row_bytes(grid, width), [=](int64_t row, std::byte* out) {
                 gguf_row(grid, down[row / hidden], row % hidden, width, out);
               });
      return;
    }
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

  // A GGUF tensor by its llama.cpp name (also those without an HF counterpart: rope_freqs).
  void add_gguf(io::GgufTensorSpec spec, int64_t rows, size_t row_bytes,
                std::function<void(int64_t, std::byte*)> fill) {
    tensors_.push_back({{}, std::move(spec), rows, row_bytes, std::move(fill)});
  }

  std::vector<OutTensor>& tensors() { return tensors_; }

 private:
  void add(io::TensorSpec spec, int64_t rows, size_t row_bytes,
           std::function<void(int64_t, std::byte*)> fill) {
    tensors_.push_back({std::move(spec), {}, rows, row_bytes, std::move(fill)});
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
  // h0 = E * sqrt(H) has rms 3; tied logits then have std about 3. On the w4g32 grid the table
  // (the tied lm_head too) holds int4 grid values, like the PLE table below: a device backend
  // keeps it in 4 bits losslessly, so a decode step reads 4-bit logits weights
  // (quant/pack_w4g32.h).
  plan.plain_matrix("embed_tokens.weight", config.vocab_size, hidden,
                    3.0 / std::sqrt(static_cast<double>(hidden)), plan.w4g32_grid());
  plan.norm("norm.weight", hidden);
  if (config.ple_dim > 0) {
    const int64_t packed = int64_t{config.num_layers} * config.ple_dim;
    // Google's QAT checkpoints are said to hold this table on the int4 grid: the w4g32 twins do,
    // so a device backend can keep it in 4 bits losslessly (quant/pack_w4g32.h).
    plan.plain_matrix("embed_tokens_per_layer.weight", config.ple_vocab_size, packed, 1.0 / 16.0,
                      plan.w4g32_grid());
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

// Streams all tensors into `writer` (safetensors or GGUF: both take the data in spec order):
// rows are generated in chunks of about 32 MiB, split over threads.
template <typename Writer>
Status stream_tensors(const SynthOptions& options, const std::vector<OutTensor>& tensors,
                      Writer& writer) {
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

Status write_tensors(const SynthOptions& options, const std::vector<OutTensor>& tensors) {
  std::vector<io::TensorSpec> specs;
  for (const auto& tensor : tensors) specs.push_back(tensor.spec);
  GEMMA4_ASSIGN_OR_RETURN(auto writer,
                          io::ShardedSafetensorsWriter::create(options.output, std::move(specs),
                                                               options.max_shard_bytes));
  return stream_tensors(options, tensors, writer);
}

// ---- GGUF checkpoints ---------------------------------------------------------------------------

using GgufMetadata = std::vector<std::pair<std::string, io::GgufValue>>;

// A per-layer size: a UINT32 when every layer has the same, else an INT32 array (spec 4.3).
io::GgufValue per_layer(const std::vector<int64_t>& values) {
  if (std::all_of(values.begin(), values.end(), [&](int64_t v) { return v == values[0]; })) {
    return io::GgufValue::u32(static_cast<uint32_t>(values[0]));
  }
  return io::GgufValue::array(io::GgufValueType::kI32, values);
}

// The gemma4.* keys of spec 4.3 for `config` (the inverse of config_from_gguf).
GgufMetadata gguf_metadata(const ModelConfig& config, const std::string& preset) {
  const auto u32 = [](int64_t v) { return io::GgufValue::u32(static_cast<uint32_t>(v)); };
  const auto f32 = [](double v) { return io::GgufValue::f32(static_cast<float>(v)); };
  const LayerGeometry* full = nullptr;
  const LayerGeometry* sliding = nullptr;
  std::vector<int64_t> ffn, kv_heads;
  std::vector<bool> sliding_pattern;
  for (const auto& layer : config.layers) {
    (layer.type == LayerType::kFull ? full : sliding) = &layer;
    ffn.push_back(layer.ffn_width);
    kv_heads.push_back(layer.num_kv_heads);
    sliding_pattern.push_back(layer.type == LayerType::kSliding);
  }
  if (!full) full = &config.layers.back();
  if (!sliding) sliding = full;
  GgufMetadata m = {
      {"general.architecture", io::GgufValue::string("gemma4")},
      {"general.name", io::GgufValue::string("gemma4 synthetic " + preset)},
      {"gemma4.context_length", u32(config.max_position_embeddings)},
      {"gemma4.embedding_length", u32(config.hidden_size)},
      {"gemma4.block_count", u32(config.num_layers)},
      {"gemma4.feed_forward_length", per_layer(ffn)},
      {"gemma4.attention.head_count", u32(config.layers[0].num_q_heads)},
      {"gemma4.attention.head_count_kv", per_layer(kv_heads)},
      {"gemma4.attention.key_length", u32(full->head_dim)},
      {"gemma4.attention.value_length", u32(full->head_dim)},
      {"gemma4.attention.key_length_swa", u32(sliding->head_dim)},
      {"gemma4.attention.value_length_swa", u32(sliding->head_dim)},
      {"gemma4.attention.layer_norm_rms_epsilon", f32(config.rms_norm_eps)},
      {"gemma4.attention.sliding_window", u32(config.sliding_window)},
      {"gemma4.attention.sliding_window_pattern",
       io::GgufValue::array(io::GgufValueType::kBool, sliding_pattern)},
      {"gemma4.attention.shared_kv_layers", u32(config.num_kv_shared_layers)},
      {"gemma4.embedding_length_per_layer_input", u32(config.ple_dim)},
      {"gemma4.rope.freq_base", f32(full->rope.theta)},
      {"gemma4.rope.freq_base_swa", f32(sliding->rope.theta)},
      {"gemma4.rope.dimension_count", u32(full->rope.exponent_denominator)},
      {"gemma4.rope.dimension_count_swa", u32(sliding->rope.exponent_denominator)},
      {"gemma4.final_logit_softcapping", f32(config.final_logit_softcap)},
      {"tokenizer.ggml.bos_token_id", u32(config.bos_token_id)},
      {"tokenizer.ggml.eos_token_id", u32(config.eos_token_ids.at(0))},
      {"tokenizer.ggml.padding_token_id", u32(config.pad_token_id)},
  };
  if (config.moe) {
    m.push_back({"gemma4.expert_count", u32(config.moe_params.num_experts)});
    m.push_back({"gemma4.expert_used_count", u32(config.moe_params.top_k)});
    m.push_back({"gemma4.expert_feed_forward_length", u32(config.moe_params.intermediate_size)});
  }
  return m;
}

// rope_freqs.weight (spec 4.3): per-pair frequency divisors of the full layers, 1 for the pairs
// that rotate and 1e30 for the rest (proportional rope).
void plan_rope_freqs(const ModelConfig& config, TensorPlan& plan) {
  const auto full = std::find_if(config.layers.begin(), config.layers.end(),
                                 [](const LayerGeometry& l) { return l.type == LayerType::kFull; });
  if (full == config.layers.end()) return;
  const int64_t pairs = full->rope.exponent_denominator / 2;
  const int64_t rotated = full->rope.rotated_pairs;
  plan.add_gguf({"rope_freqs.weight", io::GgufType::kF32, {pairs}}, 1, 4 * pairs,
                [pairs, rotated](int64_t, std::byte* out) {
                  for (int64_t i = 0; i < pairs; ++i) {
                    const float divisor = i < rotated ? 1.0f : 1e30f;
                    std::memcpy(out + 4 * i, &divisor, 4);
                  }
                });
}

Status write_gguf(const SynthOptions& options, const ModelConfig& config,
                  const std::vector<OutTensor>& tensors) {
  std::vector<io::GgufTensorSpec> specs;
  for (const auto& tensor : tensors) specs.push_back(tensor.gguf);
  GEMMA4_ASSIGN_OR_RETURN(
      auto writer, io::GgufWriter::create(options.output, gguf_metadata(config, options.config),
                                          std::move(specs)));
  return stream_tensors(options, tensors, writer);
}

Status synthesize_gguf(const SynthOptions& options, const ModelConfig& config) {
  if (options.output.extension() != ".gguf") {
    return make_error(ErrorCode::kInvalidArgument,
                      "synth: GGUF formats write one file: the output must end in .gguf, got {}",
                      options.output.string());
  }
  if (!options.tokenizer.empty() || !options.chat_template.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "synth: --tokenizer / --chat-template apply to safetensors checkpoints");
  }
  if (options.output.has_parent_path()) {
    std::error_code error;
    std::filesystem::create_directories(options.output.parent_path(), error);
  }
  TensorPlan plan(options, "");
  plan_model(config, plan);
  plan_rope_freqs(config, plan);
  return write_gguf(options, config, plan.tensors());
}

}  // namespace

Expected<SynthFormat> parse_synth_format(std::string_view name) {
  if (name == "bf16") return SynthFormat::kBF16;
  if (name == "w4a16") return SynthFormat::kW4A16;
  if (name == "nvfp4") return SynthFormat::kNVFP4;
  if (name == "gguf-q4_0") return SynthFormat::kGgufQ4_0;
  if (name == "gguf-q4_k") return SynthFormat::kGgufQ4_K;
  return make_error(ErrorCode::kInvalidArgument,
                    "unknown format '{}' (bf16, w4a16, nvfp4, gguf-q4_0, gguf-q4_k)", name);
}

Expected<SynthGrid> parse_synth_grid(std::string_view name) {
  if (name == "none") return SynthGrid::kNone;
  if (name == "w4g32") return SynthGrid::kW4G32;
  if (name == "nvfp4") return SynthGrid::kNVFP4;
  if (name == "q4_k") return SynthGrid::kQ4K;
  return make_error(ErrorCode::kInvalidArgument, "unknown grid '{}' (none, w4g32, nvfp4, q4_k)",
                    name);
}

namespace {

// The text config of `config`: a preset's, or that of a config.json file (its text_config when
// nested; the keys a checkpoint's config.json adds around the text model are dropped).
Expected<json> synth_text_config(const std::string& config) {
  if (!config.ends_with(".json")) return preset_text_config(config);
  std::ifstream in(config, std::ios::binary);
  if (!in) return make_error(ErrorCode::kNotFound, "synth: cannot open config {}", config);
  json parsed = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object()) {
    return make_error(ErrorCode::kInvalidArgument, "synth: {} is not a JSON object", config);
  }
  json text = parsed.contains("text_config") ? parsed["text_config"] : parsed;
  for (const char* key :
       {"architectures", "quantization_config", "gemma4_synthetic", "transformers_version"}) {
    text.erase(key);
  }
  return text;
}

}  // namespace

Status synthesize_checkpoint(const SynthOptions& options) {
  if (options.output.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "synth: no output directory");
  }
  GEMMA4_ASSIGN_OR_RETURN(json text, synth_text_config(options.config));
  json config_json = hf_config_json(text, options.layout);
  GEMMA4_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::from_hf_json(config_json));
  if (is_gguf(options.format)) return synthesize_gguf(options, config);
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
