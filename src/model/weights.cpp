#include "model/weights.h"

#include <cstring>

#include "core/numeric.h"
#include "model/gguf_model.h"
#include "model/tensor_source.h"
#include "quant/checkpoint_views.h"

namespace gemma4::model {
namespace {

using quant::QMatrix;

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

// Tensors of a safetensors checkpoint, under config.tensor_prefix.
class SafetensorsSource final : public TensorSource {
 public:
  SafetensorsSource(const io::Checkpoint& checkpoint, std::string prefix,
                    std::set<std::string>& used)
      : checkpoint_(checkpoint), prefix_(std::move(prefix)), used_(used) {}

  bool has(const std::string& name) const override { return find_full(prefix_ + name) != nullptr; }

  Expected<std::vector<float>> vector(const std::string& name, int64_t length) const override {
    const io::TensorView* tensor = find_full(prefix_ + name);
    if (!tensor) {
      return make_error(ErrorCode::kNotFound, "checkpoint {}: missing tensor {}{}",
                        checkpoint_.directory().string(), prefix_, name);
    }
    GEMMA4_RETURN_IF_ERROR(expect_shape(*tensor, {length}));
    return read_float_vector(*tensor);
  }

  // In whichever format the file stores it (quant::qmatrix_from_tensors decides by the tensors
  // present).
  Expected<QMatrix> matrix(const std::string& module, int64_t rows, int64_t cols,
                           std::optional<int64_t> expert) const override {
    return full_matrix(prefix_ + module, rows, cols, expert);
  }

  // lm_head sits outside the text model's prefix in both layouts.
  Expected<QMatrix> lm_head(int64_t rows, int64_t cols) const override {
    return full_matrix("lm_head", rows, cols, std::nullopt);
  }

 private:
  Expected<QMatrix> full_matrix(const std::string& base, int64_t rows, int64_t cols,
                                std::optional<int64_t> expert) const {
    auto lookup = [this](std::string_view name) { return find_full(name); };
    auto m = quant::qmatrix_from_tensors(lookup, base, expert);
    if (!m) return m.error().with_context(checkpoint_.directory().string());
    if (m->rows != rows || m->cols != cols) {
      return make_error(ErrorCode::kInvalidArgument,
                        "checkpoint {}: tensor {}: shape [{}, {}] where [{}, {}] was expected",
                        checkpoint_.directory().string(), base, m->rows, m->cols, rows, cols);
    }
    return m;
  }

  const io::TensorView* find_full(std::string_view name) const {
    const io::TensorView* tensor = checkpoint_.find(name);
    if (tensor) used_.insert(tensor->name);
    return tensor;
  }

  const io::Checkpoint& checkpoint_;
  std::string prefix_;
  std::set<std::string>& used_;
};

Status load_experts(const TensorSource& resolve, const std::string& layer,
                    const ModelConfig& config, LayerWeights& out) {
  const int64_t experts = config.moe_params.num_experts;
  const int64_t width = config.moe_params.intermediate_size;
  const int64_t hidden = config.hidden_size;
  out.experts.resize(experts);
  if (resolve.has(layer + "experts.gate_up_proj")) {
    // The bf16 release: fused 3-D parameters [E, 2I, H] and [E, H, I], sliced per expert.
    for (int64_t e = 0; e < experts; ++e) {
      GEMMA4_ASSIGN_OR_RETURN(QMatrix gate_up,
                              resolve.matrix(layer + "experts.gate_up_proj", 2 * width, hidden, e));
      out.experts[e].gate = quant::row_slice(gate_up, 0, width);
      out.experts[e].up = quant::row_slice(gate_up, width, width);
      GEMMA4_ASSIGN_OR_RETURN(out.experts[e].down,
                              resolve.matrix(layer + "experts.down_proj", hidden, width, e));
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

Expected<LayerWeights> load_layer(const TensorSource& resolve, const ModelConfig& config,
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

  if (config.has_layer_scalar) {
    GEMMA4_ASSIGN_OR_RETURN(auto scalar, resolve.vector(p + "layer_scalar", 1));
    w.layer_scalar = scalar[0];
  }
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

void for_each_matrix(const ModelWeights& weights,
                     const std::function<void(const std::string&, const QMatrix&)>& visit) {
  auto visit_present = [&](const std::string& name, const QMatrix& m) {
    if (present(m)) visit(name, m);
  };
  visit_present("embed_tokens", weights.embed_tokens);
  if (weights.lm_head.data != weights.embed_tokens.data) visit_present("lm_head", weights.lm_head);
  visit_present("embed_tokens_per_layer", weights.embed_tokens_per_layer);
  visit_present("per_layer_model_projection", weights.per_layer_model_projection);
  for (size_t i = 0; i < weights.layers.size(); ++i) {
    const LayerWeights& layer = weights.layers[i];
    const std::string p = fmt::format("layers.{}.", i);
    visit_present(p + "self_attn.q_proj", layer.q_proj);
    visit_present(p + "self_attn.k_proj", layer.k_proj);
    visit_present(p + "self_attn.v_proj", layer.v_proj);
    visit_present(p + "self_attn.o_proj", layer.o_proj);
    visit_present(p + "mlp.gate_proj", layer.gate_proj);
    visit_present(p + "mlp.up_proj", layer.up_proj);
    visit_present(p + "mlp.down_proj", layer.down_proj);
    visit_present(p + "router.proj", layer.router_proj);
    for (size_t e = 0; e < layer.experts.size(); ++e) {
      visit_present(fmt::format("{}experts.{}.gate", p, e), layer.experts[e].gate);
      visit_present(fmt::format("{}experts.{}.up", p, e), layer.experts[e].up);
      visit_present(fmt::format("{}experts.{}.down", p, e), layer.experts[e].down);
    }
    visit_present(p + "per_layer_input_gate", layer.per_layer_input_gate);
    visit_present(p + "per_layer_projection", layer.per_layer_projection);
  }
}

Status load_weights(const TensorSource& resolve, const ModelConfig& config, ModelWeights& w) {
  const int64_t hidden = config.hidden_size;
  GEMMA4_ASSIGN_OR_RETURN(w.embed_tokens,
                          resolve.matrix("embed_tokens", config.vocab_size, hidden));
  if (config.tie_word_embeddings) {
    w.lm_head = w.embed_tokens;
  } else {
    GEMMA4_ASSIGN_OR_RETURN(w.lm_head, resolve.lm_head(config.vocab_size, hidden));
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
  return Status::ok_status();
}

Expected<ModelWeights> ModelWeights::load(std::shared_ptr<const io::Checkpoint> checkpoint,
                                          const ModelConfig& config) {
  ModelWeights w;
  SafetensorsSource source(*checkpoint, config.tensor_prefix, w.used_tensors);
  GEMMA4_RETURN_IF_ERROR(load_weights(source, config, w));
  w.checkpoint = std::move(checkpoint);
  return w;
}

Expected<LoadedModel> LoadedModel::open(const std::filesystem::path& directory) {
  if (directory.extension() == ".gguf" && !std::filesystem::is_directory(directory)) {
    return open_gguf_model(directory);
  }
  LoadedModel model;
  GEMMA4_ASSIGN_OR_RETURN(model.config, ModelConfig::from_hf_file(directory / "config.json"));
  GEMMA4_ASSIGN_OR_RETURN(model.quantization, QuantizationInfo::from_checkpoint_dir(directory));
  GEMMA4_ASSIGN_OR_RETURN(io::Checkpoint opened, io::Checkpoint::open(directory));
  auto checkpoint = std::make_shared<const io::Checkpoint>(std::move(opened));
  // Loading reads only small scattered tensors (norms, scalars, global scales): without this,
  // read-ahead around each of them pulls in far more of a large checkpoint than is used.
  for (const auto& shard : checkpoint->shards()) shard.advise(io::MappedFile::Access::kRandom);
  auto weights = ModelWeights::load(checkpoint, model.config);
  for (const auto& shard : checkpoint->shards()) shard.advise(io::MappedFile::Access::kNormal);
  if (!weights) return weights.error();
  model.weights = std::move(weights).value();
  return model;
}

}  // namespace gemma4::model
