#include "model/weights.h"

#include <cstring>

#include "core/numeric.h"

namespace gemma4::model {
namespace {

using quant::QMatrix;
using quant::WeightFormat;

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

Status expect_shape(const io::TensorView& tensor, const std::vector<int64_t>& shape) {
  if (tensor.shape != shape) {
    return make_error(ErrorCode::kInvalidArgument, "tensor {}: shape {} where {} was expected",
                      tensor.name, shape_string(tensor.shape), shape_string(shape));
  }
  return Status::ok_status();
}

Status expect_dtype(const io::TensorView& tensor, std::initializer_list<DType> dtypes) {
  for (DType dtype : dtypes) {
    if (tensor.dtype == dtype) return Status::ok_status();
  }
  std::vector<std::string_view> names;
  for (DType dtype : dtypes) names.push_back(dtype_name(dtype));
  return make_error(ErrorCode::kInvalidArgument, "tensor {}: dtype {} where {} was expected",
                    tensor.name, dtype_name(tensor.dtype), fmt::join(names, " or "));
}

// A one-element F32 tensor of shape [] or [1] (NVFP4 global scales).
Expected<float> read_scalar_f32(const io::TensorView& tensor) {
  GEMMA4_RETURN_IF_ERROR(expect_dtype(tensor, {DType::kF32}));
  if (tensor.numel() != 1 || tensor.shape.size() > 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "tensor {}: shape {} where a scalar was expected", tensor.name,
                      shape_string(tensor.shape));
  }
  float value;
  std::memcpy(&value, tensor.data, sizeof value);
  if (!std::isfinite(value) || value <= 0.0f) {
    return make_error(ErrorCode::kInvalidArgument, "tensor {}: global scale {} is not positive",
                      tensor.name, value);
  }
  return value;
}

class TensorResolver {
 public:
  TensorResolver(const io::Checkpoint& checkpoint, std::string prefix)
      : checkpoint_(checkpoint), prefix_(std::move(prefix)) {}

  const io::TensorView* find(const std::string& name) const {
    return checkpoint_.find(prefix_ + name);
  }
  Expected<const io::TensorView*> require(const std::string& name) const {
    const io::TensorView* tensor = find(name);
    if (!tensor) {
      return make_error(ErrorCode::kNotFound, "checkpoint {}: missing tensor {}{}",
                        checkpoint_.directory().string(), prefix_, name);
    }
    return tensor;
  }

  Expected<std::vector<float>> vector(const std::string& name, int64_t length) const {
    GEMMA4_ASSIGN_OR_RETURN(const io::TensorView* tensor, require(name));
    GEMMA4_RETURN_IF_ERROR(expect_shape(*tensor, {length}));
    return read_float_vector(*tensor);
  }

  // The Linear `<module>` as a [rows, cols] QMatrix, in whichever format the file stores it.
  Expected<QMatrix> matrix(const std::string& module, int64_t rows, int64_t cols) const {
    if (const io::TensorView* packed = find(module + ".weight_packed")) {
      if (packed->dtype == DType::kU8) return nvfp4(module, *packed, rows, cols, false);
      return w4g32(module, *packed, rows, cols);
    }
    GEMMA4_ASSIGN_OR_RETURN(const io::TensorView* weight, require(module + ".weight"));
    if (weight->dtype == DType::kU8) return nvfp4(module, *weight, rows, cols, true);
    GEMMA4_RETURN_IF_ERROR(expect_dtype(*weight, {DType::kBF16, DType::kF32}));
    GEMMA4_RETURN_IF_ERROR(expect_shape(*weight, {rows, cols}));
    return plain(*weight, rows, cols, 0);
  }

  // A [rows, cols] view of a bf16/f32 tensor starting at element `first_element` (a whole
  // Linear, or one expert's block of a stacked 3-D expert tensor).
  static QMatrix plain(const io::TensorView& tensor, int64_t rows, int64_t cols,
                       int64_t first_element) {
    QMatrix m;
    m.format = tensor.dtype == DType::kF32 ? WeightFormat::kF32 : WeightFormat::kBF16;
    m.rows = rows;
    m.cols = cols;
    m.data = tensor.data + first_element * (dtype_bits(tensor.dtype) / 8);
    return m;
  }

 private:
  // compressed-tensors pack-quantized int4, group 32, symmetric (weight-formats.md 2.2).
  Expected<QMatrix> w4g32(const std::string& module, const io::TensorView& packed, int64_t rows,
                          int64_t cols) const {
    if (cols % 32 != 0) {
      return make_error(ErrorCode::kUnsupported, "tensor {}: K = {} is not a multiple of 32",
                        packed.name, cols);
    }
    GEMMA4_RETURN_IF_ERROR(expect_dtype(packed, {DType::kI32}));
    GEMMA4_RETURN_IF_ERROR(expect_shape(packed, {rows, cols / 8}));
    for (const char* suffix : {".weight_zero_point", ".weight_g_idx"}) {
      if (find(module + suffix)) {
        return make_error(ErrorCode::kUnsupported,
                          "tensor {}{}{}: asymmetric or act-order int4 is not supported", prefix_,
                          module, suffix);
      }
    }
    GEMMA4_ASSIGN_OR_RETURN(const io::TensorView* scale, require(module + ".weight_scale"));
    GEMMA4_RETURN_IF_ERROR(expect_dtype(*scale, {DType::kBF16, DType::kF16, DType::kF32}));
    GEMMA4_RETURN_IF_ERROR(expect_shape(*scale, {rows, cols / 32}));
    if (const io::TensorView* shape = find(module + ".weight_shape")) {
      GEMMA4_RETURN_IF_ERROR(expect_dtype(*shape, {DType::kI64, DType::kI32}));
      GEMMA4_RETURN_IF_ERROR(expect_shape(*shape, {2}));
      int64_t stored[2];
      for (int i = 0; i < 2; ++i) {
        if (shape->dtype == DType::kI64) {
          std::memcpy(&stored[i], shape->data + 8 * i, 8);
        } else {
          int32_t value;
          std::memcpy(&value, shape->data + 4 * i, 4);
          stored[i] = value;
        }
      }
      if (stored[0] != rows || stored[1] != cols) {
        return make_error(ErrorCode::kInvalidArgument,
                          "tensor {}: weight_shape [{}, {}] where [{}, {}] was expected",
                          shape->name, stored[0], stored[1], rows, cols);
      }
    }
    QMatrix m;
    m.format = WeightFormat::kW4G32;
    m.rows = rows;
    m.cols = cols;
    m.data = packed.data;
    m.scales = scale->data;
    m.scale_type = scale->dtype == DType::kBF16  ? quant::ScaleType::kBF16
                   : scale->dtype == DType::kF16 ? quant::ScaleType::kF16
                                                 : quant::ScaleType::kF32;
    return m;
  }

  // NVFP4: compressed-tensors (`weight_packed` + divisor `weight_global_scale`) or ModelOpt
  // (`weight` + multiplier `weight_scale_2`) (weight-formats.md 3.2, 3.6).
  Expected<QMatrix> nvfp4(const std::string& module, const io::TensorView& packed, int64_t rows,
                          int64_t cols, bool modelopt) const {
    if (cols % 16 != 0) {
      return make_error(ErrorCode::kUnsupported, "tensor {}: K = {} is not a multiple of 16",
                        packed.name, cols);
    }
    GEMMA4_RETURN_IF_ERROR(expect_shape(packed, {rows, cols / 2}));
    GEMMA4_ASSIGN_OR_RETURN(const io::TensorView* scale, require(module + ".weight_scale"));
    GEMMA4_RETURN_IF_ERROR(expect_dtype(*scale, {DType::kF8E4M3}));
    GEMMA4_RETURN_IF_ERROR(expect_shape(*scale, {rows, cols / 16}));
    const char* global_name = modelopt ? ".weight_scale_2" : ".weight_global_scale";
    GEMMA4_ASSIGN_OR_RETURN(const io::TensorView* global, require(module + global_name));
    GEMMA4_ASSIGN_OR_RETURN(float global_value, read_scalar_f32(*global));
    QMatrix m;
    m.format = WeightFormat::kNVFP4;
    m.rows = rows;
    m.cols = cols;
    m.data = packed.data;
    m.scales = scale->data;
    m.nv_global = quant::NvGlobalScale{global_value, /*is_divisor=*/!modelopt};
    return m;
  }

  const io::Checkpoint& checkpoint_;
  std::string prefix_;
};

Status load_experts(const TensorResolver& resolve, const std::string& layer,
                    const ModelConfig& config, LayerWeights& out) {
  const int64_t experts = config.moe_params.num_experts;
  const int64_t width = config.moe_params.intermediate_size;
  const int64_t hidden = config.hidden_size;
  out.experts.resize(experts);
  if (const io::TensorView* gate_up = resolve.find(layer + "experts.gate_up_proj")) {
    // The bf16 release: fused 3-D parameters, sliced into per-expert views.
    GEMMA4_RETURN_IF_ERROR(expect_dtype(*gate_up, {DType::kBF16, DType::kF32}));
    GEMMA4_RETURN_IF_ERROR(expect_shape(*gate_up, {experts, 2 * width, hidden}));
    GEMMA4_ASSIGN_OR_RETURN(const io::TensorView* down,
                            resolve.require(layer + "experts.down_proj"));
    GEMMA4_RETURN_IF_ERROR(expect_dtype(*down, {DType::kBF16, DType::kF32}));
    GEMMA4_RETURN_IF_ERROR(expect_shape(*down, {experts, hidden, width}));
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t base = e * 2 * width * hidden;
      out.experts[e].gate = TensorResolver::plain(*gate_up, width, hidden, base);
      out.experts[e].up = TensorResolver::plain(*gate_up, width, hidden, base + width * hidden);
      out.experts[e].down = TensorResolver::plain(*down, hidden, width, e * hidden * width);
    }
    return Status::ok_status();
  }
  // Quantized releases: per-expert Linears (weight-formats.md 2.6, 3.6).
  for (int64_t e = 0; e < experts; ++e) {
    const std::string base = fmt::format("{}experts.{}.", layer, e);
    GEMMA4_ASSIGN_OR_RETURN(out.experts[e].gate, resolve.matrix(base + "gate_proj", width, hidden));
    GEMMA4_ASSIGN_OR_RETURN(out.experts[e].up, resolve.matrix(base + "up_proj", width, hidden));
    GEMMA4_ASSIGN_OR_RETURN(out.experts[e].down, resolve.matrix(base + "down_proj", hidden, width));
  }
  return Status::ok_status();
}

Expected<LayerWeights> load_layer(const TensorResolver& resolve, const ModelConfig& config,
                                  const LayerGeometry& geometry) {
  const std::string p = fmt::format("layers.{}.", geometry.layer_index);
  const int64_t hidden = config.hidden_size;
  const int64_t hd = geometry.head_dim;
  LayerWeights w;
  GEMMA4_ASSIGN_OR_RETURN(w.q_proj,
                          resolve.matrix(p + "self_attn.q_proj", geometry.q_width(), hidden));
  GEMMA4_ASSIGN_OR_RETURN(w.o_proj,
                          resolve.matrix(p + "self_attn.o_proj", hidden, geometry.q_width()));
  GEMMA4_ASSIGN_OR_RETURN(w.q_norm, resolve.vector(p + "self_attn.q_norm.weight", hd));
  // KV-shared layers compute no K/V: their k/v tensors, if the file has them, are ignored.
  if (geometry.owns_kv()) {
    GEMMA4_ASSIGN_OR_RETURN(w.k_proj,
                            resolve.matrix(p + "self_attn.k_proj", geometry.kv_width(), hidden));
    if (!geometry.k_eq_v) {
      GEMMA4_ASSIGN_OR_RETURN(w.v_proj,
                              resolve.matrix(p + "self_attn.v_proj", geometry.kv_width(), hidden));
    }
    GEMMA4_ASSIGN_OR_RETURN(w.k_norm, resolve.vector(p + "self_attn.k_norm.weight", hd));
  }
  GEMMA4_ASSIGN_OR_RETURN(w.input_layernorm, resolve.vector(p + "input_layernorm.weight", hidden));
  GEMMA4_ASSIGN_OR_RETURN(w.post_attention_layernorm,
                          resolve.vector(p + "post_attention_layernorm.weight", hidden));
  GEMMA4_ASSIGN_OR_RETURN(w.pre_feedforward_layernorm,
                          resolve.vector(p + "pre_feedforward_layernorm.weight", hidden));
  GEMMA4_ASSIGN_OR_RETURN(w.post_feedforward_layernorm,
                          resolve.vector(p + "post_feedforward_layernorm.weight", hidden));

  const int64_t ffn = geometry.ffn_width;
  GEMMA4_ASSIGN_OR_RETURN(w.gate_proj, resolve.matrix(p + "mlp.gate_proj", ffn, hidden));
  GEMMA4_ASSIGN_OR_RETURN(w.up_proj, resolve.matrix(p + "mlp.up_proj", ffn, hidden));
  GEMMA4_ASSIGN_OR_RETURN(w.down_proj, resolve.matrix(p + "mlp.down_proj", hidden, ffn));

  if (config.moe) {
    const int64_t experts = config.moe_params.num_experts;
    GEMMA4_ASSIGN_OR_RETURN(w.router_proj, resolve.matrix(p + "router.proj", experts, hidden));
    GEMMA4_ASSIGN_OR_RETURN(w.router_scale, resolve.vector(p + "router.scale", hidden));
    GEMMA4_ASSIGN_OR_RETURN(w.per_expert_scale,
                            resolve.vector(p + "router.per_expert_scale", experts));
    GEMMA4_ASSIGN_OR_RETURN(w.post_feedforward_layernorm_1,
                            resolve.vector(p + "post_feedforward_layernorm_1.weight", hidden));
    GEMMA4_ASSIGN_OR_RETURN(w.pre_feedforward_layernorm_2,
                            resolve.vector(p + "pre_feedforward_layernorm_2.weight", hidden));
    GEMMA4_ASSIGN_OR_RETURN(w.post_feedforward_layernorm_2,
                            resolve.vector(p + "post_feedforward_layernorm_2.weight", hidden));
    GEMMA4_RETURN_IF_ERROR(load_experts(resolve, p, config, w));
  }

  if (config.ple_dim > 0) {
    const int64_t ple = config.ple_dim;
    GEMMA4_ASSIGN_OR_RETURN(w.per_layer_input_gate,
                            resolve.matrix(p + "per_layer_input_gate", ple, hidden));
    GEMMA4_ASSIGN_OR_RETURN(w.per_layer_projection,
                            resolve.matrix(p + "per_layer_projection", hidden, ple));
    GEMMA4_ASSIGN_OR_RETURN(w.post_per_layer_input_norm,
                            resolve.vector(p + "post_per_layer_input_norm.weight", hidden));
  }

  GEMMA4_ASSIGN_OR_RETURN(auto scalar, resolve.vector(p + "layer_scalar", 1));
  w.layer_scalar = scalar[0];
  return w;
}

}  // namespace

Expected<std::vector<float>> read_float_vector(const io::TensorView& tensor) {
  GEMMA4_RETURN_IF_ERROR(expect_dtype(tensor, {DType::kBF16, DType::kF16, DType::kF32}));
  const int64_t count = tensor.numel();
  std::vector<float> out(count);
  for (int64_t i = 0; i < count; ++i) {
    if (tensor.dtype == DType::kF32) {
      std::memcpy(&out[i], tensor.data + 4 * i, 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, tensor.data + 2 * i, 2);
      out[i] = tensor.dtype == DType::kBF16 ? bf16_to_float(bits) : fp16_to_float(bits);
    }
  }
  return out;
}

Expected<ModelWeights> ModelWeights::load(std::shared_ptr<const io::Checkpoint> checkpoint,
                                          const ModelConfig& config) {
  TensorResolver resolve(*checkpoint, config.tensor_prefix);
  ModelWeights w;
  const int64_t hidden = config.hidden_size;
  GEMMA4_ASSIGN_OR_RETURN(w.embed_tokens,
                          resolve.matrix("embed_tokens", config.vocab_size, hidden));
  if (config.tie_word_embeddings) {
    w.lm_head = w.embed_tokens;
  } else {
    // lm_head sits outside the text model's prefix in both layouts.
    TensorResolver top(*checkpoint, "");
    GEMMA4_ASSIGN_OR_RETURN(w.lm_head, top.matrix("lm_head", config.vocab_size, hidden));
  }
  GEMMA4_ASSIGN_OR_RETURN(w.final_norm, resolve.vector("norm.weight", hidden));
  if (config.ple_dim > 0) {
    const int64_t packed_width = int64_t{config.num_layers} * config.ple_dim;
    GEMMA4_ASSIGN_OR_RETURN(
        w.embed_tokens_per_layer,
        resolve.matrix("embed_tokens_per_layer", config.ple_vocab_size, packed_width));
    GEMMA4_ASSIGN_OR_RETURN(w.per_layer_model_projection,
                            resolve.matrix("per_layer_model_projection", packed_width, hidden));
    GEMMA4_ASSIGN_OR_RETURN(w.per_layer_projection_norm,
                            resolve.vector("per_layer_projection_norm.weight", config.ple_dim));
  }
  w.layers.reserve(config.layers.size());
  for (const auto& geometry : config.layers) {
    GEMMA4_ASSIGN_OR_RETURN(auto layer, load_layer(resolve, config, geometry));
    w.layers.push_back(std::move(layer));
  }
  w.checkpoint = std::move(checkpoint);
  return w;
}

Expected<LoadedModel> LoadedModel::open(const std::filesystem::path& directory) {
  LoadedModel model;
  GEMMA4_ASSIGN_OR_RETURN(model.config, ModelConfig::from_hf_file(directory / "config.json"));
  GEMMA4_ASSIGN_OR_RETURN(model.quantization, QuantizationInfo::from_checkpoint_dir(directory));
  GEMMA4_ASSIGN_OR_RETURN(io::Checkpoint checkpoint, io::Checkpoint::open(directory));
  GEMMA4_ASSIGN_OR_RETURN(
      model.weights,
      ModelWeights::load(std::make_shared<const io::Checkpoint>(std::move(checkpoint)),
                         model.config));
  return model;
}

}  // namespace gemma4::model
