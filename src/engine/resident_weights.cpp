#include "engine/resident_weights.h"

#include <algorithm>
#include <map>
#include <span>
#include <tuple>

#include "engine/memory_plan.h"
#include "quant/quantize_w8.h"
#include "quant/row_stack.h"

namespace gemma4::engine {

// Puts each matrix and vector where the backend reads it: the host view itself, or a copy in a
// backend buffer owned by `out`. Declared a friend of ResidentWeights (it fills the buffers).
class WeightPlacer {
 public:
  WeightPlacer(Backend& backend, ResidentWeights& out)
      : backend_(backend), out_(out), copy_(!backend.reads_host_memory()) {}

  quant::QMatrix matrix(const quant::QMatrix& m) {
    if (!copy_ || !model::present(m)) return m;
    // A tied lm_head is the embedding table itself: copied once.
    if (auto it = copied_.find(key_of(m)); it != copied_.end()) return it->second;
    return copied_.emplace(key_of(m), copy(m)).first->second;
  }

  // A table (embedding, tied lm_head, per-layer embedding): as matrix(), except that a bf16
  // table on the int4 grid (QAT) is kept in 4 bits: lossless, and 3.5x smaller (E2B: the
  // embedding 805 -> 227 MB, read by every decode step as the lm_head; the PLE table 4.7 ->
  // 1.3 GB). Placed under the bf16 source's key, so a tied lm_head finds the packed copy.
  quant::QMatrix table(const quant::QMatrix& m) {
    if (auto it = copied_.find(key_of(m)); it != copied_.end()) return it->second;
    const auto packed = pack_table_for_device(m, backend_);
    if (!packed) return matrix(m);
    return copied_.emplace(key_of(m), copy(packed->view())).first->second;
  }

  // A matrix made at load: copied, or on a backend that reads host memory kept by `out`.
  quant::QMatrix made(quant::PackedMatrix&& m) {
    if (copy_) return copy(m.view());
    return out_.host_matrices_.emplace_back(std::move(m)).view();
  }

  // A matrix stacked in host memory (quant/row_stack.h), copied.
  quant::QMatrix stacked(const quant::StackedRows& rows) {
    quant::QMatrix placed = rows.shape;
    placed.data = bytes(rows.data.data(), std::ssize(rows.data));
    if (!rows.scales.empty()) placed.scales = bytes(rows.scales.data(), std::ssize(rows.scales));
    return placed;
  }

  bool copies() const { return copy_; }

  const float* vector(const std::vector<float>& v) {
    if (v.empty()) return nullptr;
    if (!copy_) return v.data();
    return static_cast<const float*>(bytes(v.data(), v.size() * sizeof(float)));
  }

 private:
  using Key = std::tuple<const void*, int64_t, int64_t, quant::WeightFormat>;
  static Key key_of(const quant::QMatrix& m) { return {m.data, m.rows, m.cols, m.format}; }

  quant::QMatrix copy(const quant::QMatrix& m) {
    quant::QMatrix placed = m;
    placed.data = bytes(m.data, m.rows * quant::row_data_bytes(m));
    if (m.scales != nullptr) placed.scales = bytes(m.scales, m.rows * quant::row_scale_bytes(m));
    return placed;
  }

  const void* bytes(const void* source, int64_t count) {
    Buffer buffer = backend_.allocate(static_cast<size_t>(count));
    if (buffer.data() == nullptr) return nullptr;  // the backend's status() reports why
    backend_.upload(buffer.data(), source, static_cast<size_t>(count));
    out_.copied_bytes_ += count;
    const void* placed = buffer.data();
    out_.buffers_.push_back(std::move(buffer));
    return placed;
  }

  Backend& backend_;
  ResidentWeights& out_;
  const bool copy_;
  std::map<Key, quant::QMatrix> copied_;
};

namespace {

bool stackable(std::span<const quant::QMatrix> parts) {
  return std::all_of(parts.begin(), parts.end(), [&](const quant::QMatrix& m) {
    return quant::same_row_encoding(m, parts.front());
  });
}

// q_proj, k_proj, v_proj: stacked into r.qkv when the backend gets copies and their rows share
// one encoding (a KV-shared layer has only q_proj: nothing to stack), else placed one by one.
void place_attention_projections(const model::LayerWeights& w, WeightPlacer& place,
                                 ResidentLayer& r) {
  std::vector<quant::QMatrix> parts{w.q_proj};
  for (const quant::QMatrix* m : {&w.k_proj, &w.v_proj}) {
    if (model::present(*m)) parts.push_back(*m);
  }
  if (!place.copies() || parts.size() < 2 || !stackable(parts)) {
    r.q_proj = place.matrix(w.q_proj);
    r.k_proj = place.matrix(w.k_proj);
    r.v_proj = place.matrix(w.v_proj);
    return;
  }
  r.qkv = place.stacked(quant::concatenate_rows(parts));
  if (r.qkv.data == nullptr) return;  // allocation failed: the backend's status() reports it
  int64_t first = 0;
  const auto next_slice = [&](const quant::QMatrix& source) {
    if (!model::present(source)) return quant::QMatrix{};
    const quant::QMatrix slice = quant::row_slice(r.qkv, first, source.rows);
    first += source.rows;
    return slice;
  };
  r.q_proj = next_slice(w.q_proj);
  r.k_proj = next_slice(w.k_proj);
  r.v_proj = next_slice(w.v_proj);
}

ResidentLayer place_layer(const model::LayerWeights& w, WeightPlacer& place, bool fuse_gate_up) {
  ResidentLayer r;
  place_attention_projections(w, place, r);
  r.o_proj = place.matrix(w.o_proj);
  r.q_norm = place.vector(w.q_norm);
  r.k_norm = place.vector(w.k_norm);
  r.input_layernorm = place.vector(w.input_layernorm);
  r.post_attention_layernorm = place.vector(w.post_attention_layernorm);
  r.pre_feedforward_layernorm = place.vector(w.pre_feedforward_layernorm);
  r.post_feedforward_layernorm = place.vector(w.post_feedforward_layernorm);
  if (place.copies() && fuse_gate_up && model::present(w.gate_proj) &&
      quant::same_row_encoding(w.gate_proj, w.up_proj) && w.gate_proj.rows == w.up_proj.rows) {
    r.gate_up = place.stacked(quant::interleave_rows(w.gate_proj, w.up_proj));
  } else {
    r.gate_proj = place.matrix(w.gate_proj);
    r.up_proj = place.matrix(w.up_proj);
  }
  r.down_proj = place.matrix(w.down_proj);
  r.router_proj = place.matrix(w.router_proj);
  r.router_scale = place.vector(w.router_scale);
  r.per_expert_scale = place.vector(w.per_expert_scale);
  r.experts.reserve(w.experts.size());
  for (const model::ExpertMatrices& e : w.experts) {
    r.experts.push_back({place.matrix(e.gate), place.matrix(e.up), place.matrix(e.down)});
  }
  r.post_feedforward_layernorm_1 = place.vector(w.post_feedforward_layernorm_1);
  r.pre_feedforward_layernorm_2 = place.vector(w.pre_feedforward_layernorm_2);
  r.post_feedforward_layernorm_2 = place.vector(w.post_feedforward_layernorm_2);
  r.per_layer_input_gate = place.matrix(w.per_layer_input_gate);
  r.per_layer_projection = place.matrix(w.per_layer_projection);
  r.post_per_layer_input_norm = place.vector(w.post_per_layer_input_norm);
  r.layer_scalar = w.layer_scalar;
  return r;
}

}  // namespace

Expected<ResidentWeights> ResidentWeights::create(const model::ModelWeights& weights,
                                                  Backend& backend, LmHeadFormat lm_head) {
  ResidentWeights out;
  WeightPlacer place(backend, out);
  out.embed_tokens = place.table(weights.embed_tokens);
  if (lm_head_quantizes(weights.lm_head, lm_head)) {
    auto quantized = quant::quantize_w8g32(weights.lm_head);
    if (!quantized.ok()) return quantized.error().with_context("--lm-head q8");
    out.lm_head = place.made(std::move(quantized).value());
    const bool tied = weights.lm_head.data == weights.embed_tokens.data;
    out.lm_head_batched = tied ? out.embed_tokens : out.lm_head;
  } else {
    out.lm_head = out.lm_head_batched = place.table(weights.lm_head);
  }
  out.final_norm = place.vector(weights.final_norm);
  out.embed_tokens_per_layer = place.table(weights.embed_tokens_per_layer);
  out.per_layer_model_projection = place.matrix(weights.per_layer_model_projection);
  out.per_layer_projection_norm = place.vector(weights.per_layer_projection_norm);
  out.layers.reserve(weights.layers.size());
  for (const model::LayerWeights& layer : weights.layers) {
    out.layers.push_back(place_layer(layer, place, backend.fuses_gate_up()));
  }
  if (Status status = backend.status(); !status.ok()) {
    return status.error().with_context(
        fmt::format("copying the weights to the {} backend ({} bytes so far): ", backend.name(),
                    out.copied_bytes_));
  }
  return out;
}

}  // namespace gemma4::engine
