#include "model/inspect.h"

#include <algorithm>
#include <map>
#include <vector>

#include <fmt/format.h>

namespace gemma4::model {
namespace {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[unit]);
}

std::string rope_text(const RopeParams& rope, int head_dim) {
  return fmt::format("theta={:g} {}/{} pairs /{}", rope.theta, rope.rotated_pairs, head_dim / 2,
                     rope.exponent_denominator);
}

void append_config(const LoadedModel& model, std::string& out) {
  const ModelConfig& c = model.config;
  out +=
      fmt::format("architecture   {} (tensor prefix \"{}\")\n", c.hf_architecture, c.tensor_prefix);
  out += fmt::format("hidden         {} · {} layers · {} q heads · vocab {} · max positions {}\n",
                     c.hidden_size, c.num_layers, c.layers.empty() ? 0 : c.layers[0].num_q_heads,
                     c.vocab_size, c.max_position_embeddings);
  out += fmt::format(
      "norms          rms eps {:g} · embedding scale {:g} · final softcap {:g} · tied "
      "embeddings {}\n",
      c.rms_norm_eps, c.embedding_scale(), c.final_logit_softcap, c.tie_word_embeddings);
  out += fmt::format("sliding window {}\n", c.sliding_window);
  if (c.ple_dim > 0) {
    out += fmt::format("per-layer emb  {} per layer (table {} x {})\n", c.ple_dim, c.ple_vocab_size,
                       int64_t{c.ple_dim} * c.num_layers);
  }
  if (c.num_kv_shared_layers > 0) {
    out += fmt::format("KV sharing     last {} layers (from layer {})\n", c.num_kv_shared_layers,
                       c.first_kv_shared_layer());
  }
  if (c.moe) {
    out +=
        fmt::format("MoE            {} experts, top-{}, expert width {}\n",
                    c.moe_params.num_experts, c.moe_params.top_k, c.moe_params.intermediate_size);
  }
  out += fmt::format("tokens         bos {} · pad {} · eos {}\n", c.bos_token_id, c.pad_token_id,
                     fmt::join(c.eos_token_ids, ", "));
  const QuantizationInfo& q = model.quantization;
  if (q.method == QuantizationInfo::Method::kNone) {
    out += "quantization   none\n";
  } else if (q.method == QuantizationInfo::Method::kGguf) {
    out += fmt::format("quantization   gguf {} (repacked on load; layer 0 q_proj -> {})\n",
                       q.format, quant::weight_format_name(q.weight_format));
  } else {
    out += fmt::format("quantization   {} {} -> {} ({} bits, group {}, {})\n",
                       quant_method_name(q.method), q.format,
                       quant::weight_format_name(q.weight_format), q.num_bits, q.group_size,
                       q.symmetric ? "symmetric" : "asymmetric");
  }
}

void append_layers(const ModelConfig& c, std::string& out) {
  out += "\nlayer  type     head_dim  q_heads  kv_heads  kv_source  k_eq_v  ffn     window  rope\n";
  for (const auto& l : c.layers) {
    out +=
        fmt::format("{:5}  {:7}  {:8}  {:7}  {:8}  {:9}  {:6}  {:6}  {:6}  {}\n", l.layer_index,
                    layer_type_name(l.type), l.head_dim, l.num_q_heads, l.num_kv_heads,
                    l.owns_kv() ? std::string("own") : std::to_string(l.kv_source_layer),
                    l.k_eq_v ? "yes" : "-", l.ffn_width, l.window, rope_text(l.rope, l.head_dim));
  }
}

// What each checkpoint tensor is to the loader: a matrix in its internal format, the scales of
// one, a small vector or quantization metadata, or unused.
std::map<const void*, std::string> matrix_roles(const ModelWeights& weights) {
  std::map<const void*, std::string> roles;
  for_each_matrix(weights, [&](const std::string&, const quant::QMatrix& m) {
    roles.emplace(m.data, quant::weight_format_name(m.format));
    if (m.scales)
      roles.emplace(m.scales, fmt::format("{} scales", quant::weight_format_name(m.format)));
  });
  return roles;
}

std::string tensor_role(const io::TensorView& tensor, const ModelWeights& weights,
                        const std::map<const void*, std::string>& roles) {
  if (auto it = roles.find(tensor.data); it != roles.end()) return it->second;
  if (!weights.used_tensors.contains(tensor.name)) return "unused";
  for (const char* suffix : {".weight_shape", ".weight_global_scale", ".weight_scale_2"}) {
    if (tensor.name.ends_with(suffix)) return "quant meta";
  }
  return "vector";
}

}  // namespace

KvCacheEstimate estimate_kv_cache(const ModelConfig& config, int64_t context, int element_bytes) {
  KvCacheEstimate estimate;
  for (const auto& layer : config.layers) {
    if (!layer.owns_kv()) continue;
    const int64_t per_token = int64_t{2} * layer.num_kv_heads * layer.head_dim * element_bytes;
    if (layer.type == LayerType::kFull) {
      estimate.full_bytes += per_token * context;
      ++estimate.full_layers;
    } else {
      estimate.sliding_bytes += per_token * std::min<int64_t>(context, layer.window);
      ++estimate.sliding_layers;
    }
  }
  return estimate;
}

std::string inspect_report(const LoadedModel& model, const InspectOptions& options) {
  std::string out;
  append_config(model, out);
  append_layers(model.config, out);

  // One row per checkpoint tensor: name, stored type, shape, loader role, bytes.
  struct TensorRow {
    std::string name, type, shape, role;
    uint64_t bytes = 0;
  };
  std::vector<TensorRow> rows;
  if (model.weights.checkpoint) {
    const auto roles = matrix_roles(model.weights);
    for (const io::TensorView* tensor : model.weights.checkpoint->tensors()) {
      rows.push_back({tensor->name, std::string(dtype_name(tensor->dtype)),
                      fmt::format("[{}]", fmt::join(tensor->shape, ", ")),
                      tensor_role(*tensor, model.weights, roles), tensor->nbytes});
    }
  } else if (model.weights.gguf) {
    // GGUF: ggml types and ne (fastest first); used tensors are counted under their type.
    for (const io::GgufTensorInfo& tensor : model.weights.gguf->tensors()) {
      const std::string type = io::gguf_type_name(tensor.type);
      rows.push_back({tensor.name, type, fmt::format("{{{}}}", fmt::join(tensor.ne, ", ")),
                      model.weights.used_tensors.contains(tensor.name) ? type : "unused",
                      tensor.nbytes});
    }
  }
  std::map<std::string, std::pair<int64_t, uint64_t>> totals;  // role -> (tensors, bytes)
  if (options.list_tensors) {
    out += fmt::format("\n{} tensors\nname  dtype  shape  format  bytes\n", rows.size());
  }
  for (const TensorRow& row : rows) {
    auto& [count, bytes] = totals[row.role];
    ++count;
    bytes += row.bytes;
    if (options.list_tensors) {
      out +=
          fmt::format("{}  {}  {}  {}  {}\n", row.name, row.type, row.shape, row.role, row.bytes);
    }
  }
  out += "\ntotals by format\n";
  uint64_t all = 0;
  for (const auto& [role, total] : totals) {
    out += fmt::format("  {:14} {:7} tensors  {:>14} bytes  {}\n", role, total.first, total.second,
                       human_bytes(static_cast<double>(total.second)));
    all += total.second;
  }
  out += fmt::format("  {:14} {:7} tensors  {:>14} bytes  {}\n", "all", rows.size(), all,
                     human_bytes(static_cast<double>(all)));

  const int64_t context =
      options.context > 0 ? options.context : model.config.max_position_embeddings;
  const KvCacheEstimate kv = estimate_kv_cache(model.config, context);
  out += fmt::format(
      "\nKV cache, bf16, one sequence of {} tokens: {} ({} full layers {} + {} sliding rings {})\n",
      context, human_bytes(static_cast<double>(kv.total())), kv.full_layers,
      human_bytes(static_cast<double>(kv.full_bytes)), kv.sliding_layers,
      human_bytes(static_cast<double>(kv.sliding_bytes)));
  return out;
}

}  // namespace gemma4::model
