#include "engine/gemma4_engine.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>

#include "engine/decode_recordings.h"
#include "engine/resident_weights.h"

namespace gemma4::engine {

namespace {

using model::LayerGeometry;

// One sequence's slice of a forward pass: rows [first_row, first_row + count) of the pass.
struct Segment {
  SequenceId sequence = -1;
  int64_t first_row = 0;
  int64_t count = 0;
  bool last_of_input = false;  // its last token is the input's last: its logits are wanted
  size_t input_index = 0;
};

struct LayerCache {
  Buffer keys, values, slot_positions;
  int64_t slots = 0;
};

// Decode recordings held at once (distinct ordered sequence lists and depth buckets); a new one
// replaces the least recently used. KV caches, workspace and backend tables never move while the
// engine lives, so a recording stays valid; per-step token ids and positions are uploaded before
// each replay.
constexpr size_t kMaxDecodeRecordings = 64;

struct SequenceState {
  bool open = false;
  int64_t length = 0;
  // One past the furthest position ever written: slots of positions below it may have been
  // overwritten in a ring (truncate_sequence checks against it).
  int64_t high_water = 0;
  std::vector<LayerCache> layers;  // by layer index; empty entries for KV-shared layers
};

}  // namespace

struct Gemma4Engine::Impl {
  model::ModelConfig config;
  std::unique_ptr<Backend> backend;
  ResidentWeights weights;  // where the backend reads them
  EngineOptions options;
  int64_t max_context = 0;
  int ring_history = 0;             // resolved: ring_history_for()
  int64_t sequence_pass_limit = 0;  // most tokens of one sequence in a pass

  std::vector<SequenceState> sequences;
  DecodeRecordings decode_recordings{kMaxDecodeRecordings};

  // Workspace for one pass of up to options.max_pass_tokens rows.
  Buffer token_ids, positions, expert_ids, expert_weights;
  // qkv: q, k and v of a layer, as one [n, q + k + v] matrix or three dense ones.
  // MoE layers: the experts' input in expert_input, the router's in proj.
  Buffer x, normed, qkv, attn, proj, gate, up, branch, moe, expert_input, router_logits, ple,
      ple_tokens, ple_gate, last_hidden, logits;

  int64_t max_rows() const { return options.max_pass_tokens; }

  KvView kv_view(SequenceId sequence, const LayerGeometry& geometry) const {
    const LayerCache& cache = sequences[sequence].layers[geometry.kv_source_layer];
    const LayerGeometry& source = config.layers[geometry.kv_source_layer];
    return {cache.keys.data(),
            cache.values.data(),
            cache.slot_positions.ints(),
            cache.slots,
            source.num_kv_heads,
            source.head_dim,
            options.kv_type,
            source.k_eq_v && config.has_v_norm};
  }

  // K/V slots of the layer's cache in every sequence.
  int64_t cache_slots(const LayerGeometry& g) const {
    return g.window > 0 ? std::min<int64_t>(g.window + ring_history, max_context) : max_context;
  }

  // Most tokens of one sequence the layer can write to its cache and then attend in one go: a
  // chunk of C tokens needs window - 1 + C live slots of a ring (unlimited when nothing wraps).
  int64_t attention_chunk_limit(const LayerGeometry& g) const {
    const int64_t slots = cache_slots(config.layers[g.kv_source_layer]);
    if (g.window == 0 || slots >= max_context) return std::numeric_limits<int64_t>::max();
    return slots - g.window + 1;
  }

  Rows rows(const Buffer& buffer, int64_t count, int64_t width) const {
    return Rows::dense(buffer.floats(), count, width);
  }

  NormParams norm_params;

  void norm(Rows x_in, const float* weight, Rows y) {
    backend->rms_norm(x_in, weight, norm_params.weight_offset, norm_params.eps, y);
  }

  // Where the last layer's residual step puts the final norm of the pass's rows: last_hidden when
  // every row is the last of its input (a decode pass: the rows the logits are taken of, in
  // order), so that forward_to_logits copies and norms nothing; else none (forward_to_logits
  // sets it around forward()).
  Rows final_normed;

  // The pass's rows; every query sits below position_bound (SequenceRows::position_bound).
  void forward(std::span<const Segment> segments, int64_t total_rows, int64_t position_bound);
  // forward(), then the logits of every segment that ends its input, in rows of `logits` in
  // segment order; returns how many.
  int64_t forward_to_logits(std::span<const Segment> segments, int64_t total_rows,
                            int64_t position_bound);
  // The logits of the first `count` rows of last_hidden (final-normed), into logits; returns count.
  int64_t forward_logits(int64_t count);
  // forward_to_logits of a decode pass (one row per segment, the sequences' lengths already
  // counting it) for its depth bucket, through that bucket's recording where the options allow.
  void run_decode_pass(const std::vector<Segment>& segments);
  // The sequence's KV of positions >= length forgotten, its length set (truncate_sequence, once
  // it checked that the KV before that point is still held; high_water stays).
  void roll_back(SequenceId sequence, int64_t length) {
    for (const LayerGeometry& g : config.layers) {
      if (g.owns_kv()) backend->forget_kv(kv_view(sequence, g), length);
    }
    sequences[sequence].length = length;
  }
  // step_sampled's checks of its inputs (open, distinct sequences; ids in the vocabulary; room
  // in the context).
  Status check_inputs(std::span<const StepInput> inputs) const;
  // The first matmul of layer l's attention block (of the input norm, `normed`): the stacked
  // q/k/v projection, else q's; its output rows for n rows.
  struct FirstMatmul {
    const quant::QMatrix* weights = nullptr;
    Rows out;
  };
  FirstMatmul first_attention_matmul(int l, int64_t n) const;
  // Whether the previous layer's residual step ran this layer's first matmul too
  // (add_rms_norm_ple_matmul); attention_block clears it.
  bool first_matmul_done = false;
  void attention_block(int l, std::span<const Segment> segments, int64_t n, int64_t position_bound,
                       Rows hidden);
  void feed_forward_block(int l, int64_t n, Rows hidden);
  // Hands layer l's router logits and picks of the pass's n rows to options.router_trace.
  void trace_routing(int l, int64_t n);
  void per_layer_inputs(int64_t n, Rows h0);
};

void Gemma4Engine::Impl::per_layer_inputs(int64_t n, Rows h0) {
  // arch spec 2.3: ple[l] = (RMSNorm(h0 · Wplmᵀ · H^-1/2) + Eple[tok] · √P) · 2^-1/2
  const auto& w = weights;
  const int64_t width = int64_t{config.num_layers} * config.ple_dim;
  Rows context = rows(ple, n, width);
  backend->matmul(w.per_layer_model_projection, h0, context);
  backend->scale(context, nullptr, 1.0f / std::sqrt(static_cast<float>(config.hidden_size)));
  norm(context.heads(config.ple_dim), w.per_layer_projection_norm, context.heads(config.ple_dim));
  Rows tokens = rows(ple_tokens, n, width);
  backend->embed(w.embed_tokens_per_layer, token_ids.ints(),
                 std::sqrt(static_cast<float>(config.ple_dim)), tokens);
  backend->add(context, tokens);
  backend->scale(context, nullptr, 1.0f / std::sqrt(2.0f));
}

Gemma4Engine::Impl::FirstMatmul Gemma4Engine::Impl::first_attention_matmul(int l, int64_t n) const {
  const LayerGeometry& g = config.layers[l];
  const ResidentLayer& lw = weights.layers[l];
  if (model::present(lw.qkv)) {
    return {&lw.qkv,
            Rows::dense(qkv.floats(), n, g.q_width() + 2 * g.kv_width()).columns(0, lw.qkv.rows)};
  }
  return {&lw.q_proj, Rows::dense(qkv.floats(), n, g.q_width())};
}

void Gemma4Engine::Impl::attention_block(int l, std::span<const Segment> segments, int64_t n,
                                         int64_t position_bound, Rows hidden) {
  const LayerGeometry& g = config.layers[l];
  const ResidentLayer& lw = weights.layers[l];
  const int hd = g.head_dim;
  const int64_t q_width = g.q_width(), kv_width = g.kv_width();
  const Rows a = rows(normed, n, config.hidden_size);  // input_layernorm(hidden), made before

  // q, k, v: column views of one [n, q + k + v] matrix when the projections are stacked (one
  // matmul), else three dense matrices. A KV-shared layer has no k/v of its own.
  const FirstMatmul first = first_attention_matmul(l, n);
  if (!first_matmul_done) backend->matmul(*first.weights, a, first.out);
  first_matmul_done = false;
  Rows queries, keys, values;
  if (model::present(lw.qkv)) {
    const Rows stacked = Rows::dense(qkv.floats(), n, q_width + 2 * kv_width);
    queries = stacked.columns(0, q_width);
    keys = stacked.columns(q_width, kv_width);
    values = stacked.columns(q_width + kv_width, kv_width);
  } else {
    queries = first.out;
    if (g.owns_kv()) {
      keys = Rows::dense(qkv.floats() + max_rows() * config.max_q_width(), n, kv_width);
      values = Rows::dense(keys.data + max_rows() * config.max_kv_width(), n, kv_width);
      backend->matmul(lw.k_proj, a, keys);
      if (!g.k_eq_v) backend->matmul(lw.v_proj, a, values);
    }
  }
  // V is the raw K projection (before k_norm and RoPE): the same rows where the backend reads
  // both before writing either (one launch less a k_eq_v layer), else a copy.
  if (g.owns_kv() && g.k_eq_v) {
    if (backend->values_may_alias_keys()) {
      values = keys;
    } else {
      backend->copy(keys, values);
    }
  }

  std::vector<SequenceRows> sequence_rows;
  sequence_rows.reserve(segments.size());
  for (const Segment& s : segments) {
    sequence_rows.push_back({kv_view(s.sequence, g), s.first_row, s.count, position_bound});
  }
  Rows out = rows(attn, n, q_width);
  const int64_t chunk_limit = attention_chunk_limit(g);
  const bool fits = std::all_of(segments.begin(), segments.end(),
                                [&](const Segment& s) { return s.count <= chunk_limit; });
  if (fits) {
    backend->prepare_and_attend(queries, keys, values, lw.q_norm, lw.k_norm, config.has_v_norm, hd,
                                positions.ints(), g.rope, sequence_rows, norm_params, g.window,
                                config.attention_scale, out);
  } else {
    // A sequence's rows are longer than the ring can hold (only a layer that owns its ring: a
    // KV-shared one gets passes that fit, see step()).
    backend->prepare_and_attend_pieces(
        queries, keys, values, lw.q_norm, lw.k_norm, config.has_v_norm, hd, positions.ints(),
        g.rope, sequence_rows, norm_params, g.window, config.attention_scale, out, chunk_limit);
  }

  const int64_t H = config.hidden_size;
  Rows projected = rows(proj, n, H);
  backend->matmul(lw.o_proj, out, projected);
  if (!config.moe) {
    backend->add_rms_norm(hidden, projected, lw.post_attention_layernorm, 1.0f,
                          lw.pre_feedforward_layernorm, rows(normed, n, H), norm_params);
    return;
  }
  // arch spec 3: the router's and the experts' inputs are norms of the same residual as the dense
  // MLP's. The router's input goes to proj (this step consumes projected).
  const MoeInputs moe_inputs = {lw.router_scale, 1.0f / std::sqrt(static_cast<float>(H)),
                                lw.pre_feedforward_layernorm_2, rows(proj, n, H),
                                rows(expert_input, n, H)};
  backend->add_rms_norm_moe(hidden, projected, lw.post_attention_layernorm, 1.0f,
                            lw.pre_feedforward_layernorm, rows(normed, n, H), moe_inputs,
                            norm_params);
}

void Gemma4Engine::Impl::feed_forward_block(int l, int64_t n, Rows hidden) {
  const LayerGeometry& g = config.layers[l];
  const ResidentLayer& lw = weights.layers[l];
  const int64_t H = config.hidden_size;

  // Dense MLP (the always-on shared expert in MoE models).
  const Rows m = rows(normed, n, H);  // pre_feedforward_layernorm(hidden), made before
  Rows dense_out = rows(branch, n, H);
  // The gated activations, down's input.
  const auto dense_mlp_gates = [&] {
    Rows gates = rows(gate, n, g.ffn_width);
    if (model::present(lw.gate_up)) {
      backend->matmul_gelu_pairs(lw.gate_up, m, gates);
    } else {
      Rows ups = rows(up, n, g.ffn_width);
      backend->matmul(lw.gate_proj, m, gates);
      backend->matmul(lw.up_proj, m, ups);
      backend->gelu_tanh_mul(gates, ups, gates);
    }
    return gates;
  };

  Rows expert_out = rows(moe, n, H);
  if (config.moe) {
    // arch spec 3: dense and expert branches each post-normed, summed, then post-normed again.
    // The two branches share no buffer (the router's and the experts' inputs were made by the
    // attention block's residual step), so the backend may overlap them.
    const auto& p = config.moe_params;
    backend->concurrently(
        n,
        [&] {
          backend->matmul(lw.down_proj, dense_mlp_gates(), dense_out);
          backend->rms_norm(dense_out, lw.post_feedforward_layernorm_1, norm_params.weight_offset,
                            norm_params.eps, dense_out);
        },
        [&] {
          Rows scores = rows(router_logits, n, p.num_experts);
          backend->matmul_route_experts(lw.router_proj, rows(proj, n, H), scores,
                                        {p.top_k, lw.per_expert_scale}, expert_ids.ints(),
                                        expert_weights.floats());
          if (options.router_trace) trace_routing(l, n);
          backend->run_experts(lw.experts, rows(expert_input, n, H), expert_ids.ints(),
                               expert_weights.floats(), p.top_k, expert_out);
        });
  }
  // The layer ends by norming its output for the next layer's attention; the last layer for the
  // logits when forward() asked for it (final_normed).
  const bool last = l + 1 == config.num_layers;
  const float* next_norm = !last                          ? weights.layers[l + 1].input_layernorm
                           : final_normed.data != nullptr ? weights.final_norm
                                                          : nullptr;
  const Rows next = last ? final_normed : rows(normed, n, H);
  // The feed-forward residual step; a MoE layer's expert output joins the dense one in it
  // (dense_out + norm(expert_out; post_feedforward_layernorm_2) is what post_feedforward_layernorm
  // norms).
  if (config.ple_dim == 0) {
    if (config.moe) {
      backend->add_rms_norm_branch(hidden, dense_out, expert_out, lw.post_feedforward_layernorm_2,
                                   lw.post_feedforward_layernorm, lw.layer_scalar, next_norm, next,
                                   norm_params);
    } else {
      backend->matmul(lw.down_proj, dense_mlp_gates(), dense_out);
      backend->add_rms_norm(hidden, dense_out, lw.post_feedforward_layernorm, lw.layer_scalar,
                            next_norm, next, norm_params);
    }
    return;
  }
  // With per-layer inputs the step comes first, then the PLE one (a MoE layer's two branches
  // joined as add_rms_norm_branch joins them).
  if (config.moe) {
    backend->add_rms_norm(dense_out, expert_out, lw.post_feedforward_layernorm_2, 1.0f, nullptr,
                          Rows{}, norm_params);
  } else {
    backend->matmul(lw.down_proj, dense_mlp_gates(), dense_out);
  }
  // arch spec 2.4 step 7: gelu(h · Wgateᵀ) ⊙ ple[l], projected back, normed, added.
  const Rows layer_ple = rows(ple, n, int64_t{config.num_layers} * config.ple_dim)
                             .columns(int64_t{l} * config.ple_dim, config.ple_dim);
  // The next layer's first matmul reads next: the backend may run it in the same launch.
  if (last) {
    backend->add_rms_norm_ple(
        hidden, dense_out, lw.post_feedforward_layernorm, lw.per_layer_input_gate, layer_ple,
        rows(ple_gate, n, config.ple_dim), lw.per_layer_projection, rows(proj, n, H),
        lw.post_per_layer_input_norm, lw.layer_scalar, next_norm, next, norm_params);
    return;
  }
  const FirstMatmul following = first_attention_matmul(l + 1, n);
  backend->add_rms_norm_ple_matmul(hidden, dense_out, lw.post_feedforward_layernorm,
                                   lw.per_layer_input_gate, layer_ple,
                                   rows(ple_gate, n, config.ple_dim), lw.per_layer_projection,
                                   rows(proj, n, H), lw.post_per_layer_input_norm, lw.layer_scalar,
                                   next_norm, next, norm_params, *following.weights, following.out);
  first_matmul_done = true;
}

void Gemma4Engine::Impl::trace_routing(int l, int64_t n) {
  const auto& p = config.moe_params;
  std::vector<int32_t> row_positions(n), ids(n * p.top_k);
  std::vector<float> scores(n * p.num_experts), picked(n * p.top_k);
  backend->download(row_positions.data(), positions.data(), sizeof(int32_t) * n);
  backend->download(scores.data(), router_logits.data(), sizeof(float) * scores.size());
  backend->download(ids.data(), expert_ids.data(), sizeof(int32_t) * ids.size());
  backend->download(picked.data(), expert_weights.data(), sizeof(float) * picked.size());
  options.router_trace({l, p.num_experts, p.top_k, row_positions, scores, ids, picked});
}

void Gemma4Engine::Impl::forward(std::span<const Segment> segments, int64_t n,
                                 int64_t position_bound) {
  const auto& w = weights;
  Rows hidden = rows(x, n, config.hidden_size);
  // transformers casts the √H scale to the weight dtype: exact in float32 (what this engine
  // computes in, and what the golden fixtures use), bf16(√H) only in a bf16 run
  // (ModelConfig::embedding_scale()). The two agree whenever √H is exact in bf16.
  backend->embed(w.embed_tokens, token_ids.ints(),
                 std::sqrt(static_cast<float>(config.hidden_size)), hidden);
  if (config.ple_dim > 0) per_layer_inputs(n, hidden);
  first_matmul_done = false;  // a failed pass may have left it set
  // Every later layer's input norm is fused into the end of the layer before it.
  norm(hidden, w.layers.front().input_layernorm, rows(normed, n, config.hidden_size));
  for (int l = 0; l < config.num_layers; ++l) {
    attention_block(l, segments, n, position_bound, hidden);
    feed_forward_block(l, n, hidden);
  }
}

int64_t Gemma4Engine::Impl::forward_to_logits(std::span<const Segment> segments, int64_t n,
                                              int64_t position_bound) {
  const int64_t H = config.hidden_size;
  // A decode pass (every row its input's last): the last layer norms its rows for the logits
  // into last_hidden itself.
  const bool every_row_last = std::all_of(segments.begin(), segments.end(), [](const Segment& s) {
    return s.count == 1 && s.last_of_input;
  });
  final_normed = every_row_last ? rows(last_hidden, n, H) : Rows{};
  forward(segments, n, position_bound);
  final_normed = {};
  if (every_row_last) return forward_logits(n);
  Rows hidden = rows(x, n, H);
  int64_t count = 0;
  for (const Segment& s : segments) {
    if (!s.last_of_input) continue;
    Rows dst = rows(last_hidden, count + 1, H).slice(count, 1);
    backend->copy(hidden.slice(s.first_row + s.count - 1, 1), dst);
    ++count;
  }
  if (count == 0) return 0;
  Rows last = rows(last_hidden, count, H);
  norm(last, weights.final_norm, last);
  return forward_logits(count);
}

int64_t Gemma4Engine::Impl::forward_logits(int64_t count) {
  Rows last = rows(last_hidden, count, config.hidden_size);
  Rows out = rows(logits, count, config.vocab_size);
  backend->matmul(count > kLmHeadQ8MaxRows ? weights.lm_head_batched : weights.lm_head, last, out);
  if (config.final_logit_softcap > 0) backend->softcap(out, config.final_logit_softcap);
  return count;
}

Status Gemma4Engine::Impl::check_inputs(std::span<const StepInput> inputs) const {
  const int64_t vocab = config.vocab_size;
  if (inputs.size() > sequences.size())
    return make_error(ErrorCode::kInvalidArgument, "{} inputs in one step, at most {}",
                      inputs.size(), sequences.size());
  std::vector<bool> seen(sequences.size(), false);
  for (const StepInput& input : inputs) {
    if (input.sequence < 0 || input.sequence >= std::ssize(sequences) ||
        !sequences[input.sequence].open)
      return make_error(ErrorCode::kInvalidArgument, "sequence {} is not open", input.sequence);
    if (seen[input.sequence])
      return make_error(ErrorCode::kInvalidArgument, "sequence {} appears twice in one step",
                        input.sequence);
    seen[input.sequence] = true;
    if (input.tokens.empty())
      return make_error(ErrorCode::kInvalidArgument, "sequence {}: no tokens to append",
                        input.sequence);
    for (int32_t token : input.tokens) {
      if (token < 0 || token >= vocab)
        return make_error(ErrorCode::kInvalidArgument,
                          "token id {} is outside the vocabulary [0, {})", token, vocab);
    }
    const int64_t new_length = sequences[input.sequence].length + std::ssize(input.tokens);
    if (new_length > max_context)
      return make_error(ErrorCode::kResourceExhausted,
                        "sequence {} would reach {} tokens, the context holds {}", input.sequence,
                        new_length, max_context);
  }
  return Status::ok_status();
}

void Gemma4Engine::Impl::run_decode_pass(const std::vector<Segment>& segments) {
  const auto n = std::ssize(segments);
  int64_t deepest = 0;
  for (const Segment& s : segments) deepest = std::max(deepest, sequences[s.sequence].length - 1);
  const int64_t bound = decode_position_bound(deepest, max_context);
  const bool record = options.record_decode && !options.router_trace;
  if (!record || !backend->can_record()) {
    forward_to_logits(segments, n, bound);
    return;
  }
  DecodeRecordings::Key key{{}, bound};
  for (const Segment& s : segments) key.order.push_back(s.sequence);
  if (RecordedWork* work = decode_recordings.find(key)) {
    backend->replay(*work);
    return;
  }
  if (!decode_recordings.warmed_up(key.order)) {
    // Unrecorded, so scratch, rope tables and expert tables are made outside any recording (none
    // depends on the bucket: a deeper one is recorded straight away).
    forward_to_logits(segments, n, bound);
    decode_recordings.hold(key, nullptr);
    return;
  }
  // The recorded closure holds its own copy of the segments, as a graph holds its arguments.
  auto work =
      backend->record([this, segments, n, bound] { forward_to_logits(segments, n, bound); });
  if (work == nullptr) return;  // backend->status() reports why
  backend->replay(*decode_recordings.hold(key, std::move(work)));
}

int ring_history_for(const model::ModelConfig& config, const EngineOptions& options) {
  if (options.ring_history > 0) return options.ring_history;
  constexpr int kRollBackHistory = 32;
  const bool shared_sliding =
      std::any_of(config.layers.begin(), config.layers.end(),
                  [](const LayerGeometry& g) { return !g.owns_kv() && g.window > 0; });
  return shared_sliding ? std::max(1, options.max_pass_tokens - 1) : kRollBackHistory;
}

Expected<std::unique_ptr<Gemma4Engine>> Gemma4Engine::create(const model::ModelConfig& config,
                                                             const model::ModelWeights& weights,
                                                             std::unique_ptr<Backend> backend,
                                                             const EngineOptions& options) {
  if (options.max_sequences < 1 || options.max_context < 1 || options.ring_history < 0 ||
      options.max_pass_tokens < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "engine options: max_sequences, max_context and max_pass_tokens must all be "
                      ">= 1, ring_history >= 0");
  }
  if (!backend->supports_kv_type(options.kv_type)) {
    return make_error(ErrorCode::kUnsupported, "the {} backend does not keep a {} KV cache",
                      backend->name(), kv_type_name(options.kv_type));
  }
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->backend = std::move(backend);
  GEMMA4_ASSIGN_OR_RETURN(impl->weights,
                          ResidentWeights::create(weights, *impl->backend, options.lm_head));
  impl->options = options;
  impl->norm_params = {config.norm_weight_offset, config.rms_norm_eps};
  impl->max_context = config.max_position_embeddings > 0
                          ? std::min(options.max_context, config.max_position_embeddings)
                          : options.max_context;
  impl->ring_history = ring_history_for(config, options);
  // A KV-shared layer attends after its source layer wrote the whole pass: the pass must fit.
  impl->sequence_pass_limit = options.max_pass_tokens;
  for (const LayerGeometry& g : config.layers) {
    if (!g.owns_kv()) {
      impl->sequence_pass_limit =
          std::min(impl->sequence_pass_limit, impl->attention_chunk_limit(g));
    }
  }

  Backend& b = *impl->backend;
  const int64_t rows = options.max_pass_tokens;
  const int64_t H = config.hidden_size;
  auto floats = [&](int64_t count, int64_t width) {
    return b.allocate(sizeof(float) * count * width);
  };
  impl->token_ids = b.allocate(sizeof(int32_t) * rows);
  impl->positions = b.allocate(sizeof(int32_t) * rows);
  impl->x = floats(rows, H);
  impl->normed = floats(rows, H);
  impl->proj = floats(rows, H);
  impl->branch = floats(rows, H);
  impl->qkv = floats(rows, config.max_q_width() + 2 * config.max_kv_width());
  impl->attn = floats(rows, config.max_q_width());
  impl->gate = floats(rows, config.max_ffn_width());
  impl->up = floats(rows, config.max_ffn_width());
  if (config.moe) {
    const auto& p = config.moe_params;
    impl->moe = floats(rows, H);
    impl->expert_input = floats(rows, H);
    impl->router_logits = floats(rows, p.num_experts);
    impl->expert_ids = b.allocate(sizeof(int32_t) * rows * p.top_k);
    impl->expert_weights = floats(rows, p.top_k);
  }
  if (config.ple_dim > 0) {
    impl->ple = floats(rows, int64_t{config.num_layers} * config.ple_dim);
    impl->ple_tokens = floats(rows, int64_t{config.num_layers} * config.ple_dim);
    impl->ple_gate = floats(rows, config.ple_dim);
  }
  impl->last_hidden = floats(options.max_sequences, H);
  impl->logits = floats(options.max_sequences, config.vocab_size);

  // Every sequence's KV is planned and allocated up front (DESIGN.md engine rule 5).
  impl->sequences.resize(options.max_sequences);
  for (auto& sequence : impl->sequences) {
    sequence.layers.resize(config.num_layers);
    for (const LayerGeometry& g : config.layers) {
      if (!g.owns_kv()) continue;
      LayerCache& cache = sequence.layers[g.layer_index];
      cache.slots = impl->cache_slots(g);
      const int64_t kv_bytes = kv_element_bytes(options.kv_type) * cache.slots * g.kv_width();
      cache.keys = b.allocate(kv_bytes);
      cache.values = b.allocate(kv_bytes);
      cache.slot_positions = b.allocate(sizeof(int32_t) * cache.slots);
    }
  }
  if (Status status = b.status(); !status.ok()) {
    return status.error().with_context("allocating the engine's workspace and KV cache: ");
  }
  return std::unique_ptr<Gemma4Engine>(new Gemma4Engine(std::move(impl)));
}

Gemma4Engine::Gemma4Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Gemma4Engine::~Gemma4Engine() = default;

int32_t Gemma4Engine::vocab_size() const {
  return impl_->config.vocab_size;
}
int64_t Gemma4Engine::max_context() const {
  return impl_->max_context;
}
int32_t Gemma4Engine::max_sequences() const {
  return impl_->options.max_sequences;
}

Expected<SequenceId> Gemma4Engine::open_sequence() {
  for (size_t i = 0; i < impl_->sequences.size(); ++i) {
    SequenceState& sequence = impl_->sequences[i];
    if (sequence.open) continue;
    sequence.open = true;
    sequence.length = 0;
    sequence.high_water = 0;
    for (const LayerGeometry& g : impl_->config.layers) {
      if (g.owns_kv()) impl_->backend->forget_kv(impl_->kv_view(static_cast<SequenceId>(i), g), 0);
    }
    return static_cast<SequenceId>(i);
  }
  return make_error(ErrorCode::kResourceExhausted, "all {} sequences are in use",
                    impl_->sequences.size());
}

void Gemma4Engine::close_sequence(SequenceId sequence) {
  if (sequence >= 0 && sequence < max_sequences()) impl_->sequences[sequence].open = false;
}

int64_t Gemma4Engine::sequence_length(SequenceId sequence) const {
  if (sequence < 0 || sequence >= max_sequences() || !impl_->sequences[sequence].open) return 0;
  return impl_->sequences[sequence].length;
}

Status Gemma4Engine::truncate_sequence(SequenceId sequence, int64_t length) {
  if (sequence < 0 || sequence >= max_sequences() || !impl_->sequences[sequence].open)
    return make_error(ErrorCode::kInvalidArgument, "sequence {} is not open", sequence);
  SequenceState& state = impl_->sequences[sequence];
  if (length < 0 || length > state.length)
    return make_error(ErrorCode::kOutOfRange, "cannot truncate sequence {} of length {} to {}",
                      sequence, state.length, length);
  if (length == state.length) return Status::ok_status();
  // The next query (at position `length`) needs positions [length - W + 1, length) of every
  // sliding ring; a ring lost position p once p + slots was written.
  for (const LayerGeometry& g : impl_->config.layers) {
    if (!g.owns_kv() || g.window == 0 || length == 0) continue;
    const int64_t oldest_needed = std::max<int64_t>(0, length - g.window + 1);
    if (oldest_needed + state.layers[g.layer_index].slots < state.high_water)
      return make_error(ErrorCode::kOutOfRange,
                        "sequence {}: the sliding-window KV for length {} was overwritten "
                        "(written up to {}); re-prefill instead",
                        sequence, length, state.high_water);
  }
  impl_->roll_back(sequence, length);
  return Status::ok_status();
}

Status Gemma4Engine::step(std::span<const StepInput> inputs, std::span<float> logits) {
  const int64_t vocab = impl_->config.vocab_size;
  if (logits.size() < inputs.size() * static_cast<size_t>(vocab))
    return make_error(ErrorCode::kInvalidArgument, "logits buffer holds {} floats, need {}",
                      logits.size(), inputs.size() * vocab);
  // Every input's full row: packed in input order, as step() returns them.
  const std::vector<LogitRequest> requests(inputs.size());
  std::vector<LogitSummary> unused(inputs.size());
  return step_sampled(inputs, requests, unused, logits);
}

Status Gemma4Engine::step_sampled(std::span<const StepInput> inputs,
                                  std::span<const LogitRequest> requests,
                                  std::span<LogitSummary> summaries, std::span<float> full_rows) {
  Impl& m = *impl_;
  const int64_t vocab = m.config.vocab_size;
  GEMMA4_RETURN_IF_ERROR(
      check_logit_requests(inputs.size(), requests, summaries, full_rows, m.config.vocab_size));
  // Where each full-row input's row goes in full_rows.
  std::vector<int64_t> full_row(inputs.size(), 0);
  for (size_t i = 0, full = 0; i < inputs.size(); ++i) {
    if (requests[i].candidates == 0) full_row[i] = static_cast<int64_t>(full++);
  }
  GEMMA4_RETURN_IF_ERROR(m.check_inputs(inputs));

  // Passes: each takes up to sequence_pass_limit tokens from every input that has some left, and
  // at most max_pass_tokens in all.
  std::vector<size_t> consumed(inputs.size(), 0);
  std::vector<int32_t> ids, positions;
  std::vector<Segment> segments;
  while (true) {
    ids.clear();
    positions.clear();
    segments.clear();
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t left = std::ssize(inputs[i].tokens) - static_cast<int64_t>(consumed[i]);
      const int64_t budget = m.max_rows() - std::ssize(ids);
      const int64_t take = std::min({left, m.sequence_pass_limit, budget});
      if (take <= 0) continue;
      SequenceState& state = m.sequences[inputs[i].sequence];
      Segment segment;
      segment.sequence = inputs[i].sequence;
      segment.first_row = std::ssize(ids);
      segment.count = take;
      segment.input_index = i;
      segment.last_of_input = take == left;
      for (int64_t t = 0; t < take; ++t) {
        ids.push_back(inputs[i].tokens[consumed[i] + t]);
        positions.push_back(static_cast<int32_t>(state.length + t));
      }
      consumed[i] += take;
      state.length += take;
      state.high_water = std::max(state.high_water, state.length);
      segments.push_back(segment);
    }
    if (segments.empty()) break;
    const int64_t n = std::ssize(ids);
    m.backend->upload(m.token_ids.data(), ids.data(), sizeof(int32_t) * n);
    m.backend->upload(m.positions.data(), positions.data(), sizeof(int32_t) * n);
    // A decode pass: one token per segment, each ending its input.
    const bool decode = std::all_of(segments.begin(), segments.end(), [](const Segment& s) {
      return s.count == 1 && s.last_of_input;
    });
    if (decode) {
      m.run_decode_pass(segments);
    } else {
      int64_t bound = 0;
      for (const Segment& s : segments) bound = std::max(bound, m.sequences[s.sequence].length);
      m.forward_to_logits(segments, n, bound);
    }

    // Logits of the last token of every input that finished in this pass (row r of m.logits
    // for the r-th such input): full rows copied, the others summarised where they are.
    std::vector<size_t> summarised;
    std::vector<LogitRowRequest> summary_rows;
    int64_t r = 0;
    for (const Segment& s : segments) {
      if (!s.last_of_input) continue;
      const LogitRequest& request = requests[s.input_index];
      if (request.candidates == 0) {
        m.backend->download(full_rows.data() + full_row[s.input_index] * vocab,
                            m.logits.floats() + r * vocab, sizeof(float) * vocab);
      } else {
        summarised.push_back(s.input_index);
        summary_rows.push_back({r, request});
      }
      ++r;
    }
    if (!summary_rows.empty()) {
      std::vector<LogitSummary> pass_summaries(summary_rows.size());
      m.backend->summarize_logits(m.rows(m.logits, r, vocab), summary_rows, pass_summaries);
      for (size_t k = 0; k < summarised.size(); ++k)
        summaries[summarised[k]] = std::move(pass_summaries[k]);
    }
  }
  // Operations report failures only here (asynchronously on a device); downloads synchronize.
  return m.backend->status();
}

namespace {

// One decode step of decode_greedy in flight: its sequences (indices into decode_greedy's list,
// in row order), the backend slot its tokens come back in, and where they come back.
struct GreedyStep {
  std::vector<size_t> members;
  int slot = 0;
  std::vector<GreedyToken> tokens;
};

}  // namespace

Status Gemma4Engine::decode_greedy(std::span<const SequenceId> sequences,
                                   std::span<const int32_t> first_tokens,
                                   const GreedyTokenCallback& on_token) {
  Impl& m = *impl_;
  if (first_tokens.size() != sequences.size())
    return make_error(ErrorCode::kInvalidArgument, "{} sequences but {} first tokens",
                      sequences.size(), first_tokens.size());
  if (std::ssize(sequences) > m.max_rows())
    return greedy_decode_by_steps(*this, sequences, first_tokens, on_token);
  std::vector<StepInput> first_step;
  for (size_t i = 0; i < sequences.size(); ++i)
    first_step.push_back({sequences[i], first_tokens.subspan(i, 1)});
  GEMMA4_RETURN_IF_ERROR(m.check_inputs(first_step));

  const int64_t vocab = m.config.vocab_size;
  // The token each sequence appends next, as far as the host knows it (a new chain uploads it).
  std::vector<int32_t> next(first_tokens.begin(), first_tokens.end());
  std::vector<size_t> live;  // sequences not stopped, in list order
  // Sequences whose next step is their last (GreedyNext::kLast): none is enqueued past it.
  std::vector<bool> last(sequences.size(), false);
  for (size_t i = 0; i < sequences.size(); ++i) live.push_back(i);
  std::deque<GreedyStep> in_flight;  // oldest first; at most kGreedySlots
  int slot = 0;

  // Enqueues a decode step of `members`; chained: its ids and positions are those the previous
  // step's enqueue_greedy left in the workspace, else uploaded.
  const auto enqueue_step = [&](const std::vector<size_t>& members, bool chained) {
    std::vector<Segment> segments;
    std::vector<int32_t> ids, positions;
    for (size_t k = 0; k < members.size(); ++k) {
      SequenceState& state = m.sequences[sequences[members[k]]];
      Segment segment;
      segment.sequence = sequences[members[k]];
      segment.first_row = static_cast<int64_t>(k);
      segment.count = 1;
      segment.last_of_input = true;
      segment.input_index = k;
      segments.push_back(segment);
      ids.push_back(next[members[k]]);
      positions.push_back(static_cast<int32_t>(state.length));
      state.length += 1;
      state.high_water = std::max(state.high_water, state.length);
    }
    const auto n = std::ssize(segments);
    if (!chained) {
      m.backend->upload(m.token_ids.data(), ids.data(), sizeof(int32_t) * n);
      m.backend->upload(m.positions.data(), positions.data(), sizeof(int32_t) * n);
    }
    m.run_decode_pass(segments);
    GreedyStep& step = in_flight.emplace_back();
    step.members = members;
    step.slot = slot;
    step.tokens.resize(members.size());
    m.backend->enqueue_greedy(m.rows(m.logits, n, vocab), m.token_ids.ints(), m.positions.ints(),
                              step.tokens, slot);
    slot = (slot + 1) % Backend::kGreedySlots;
  };
  // Whether a step may be enqueued after the one in flight for sequence i.
  const auto goes_on = [&](size_t i) {
    return !last[i] && m.sequences[sequences[i]].length < m.max_context;
  };

  while (!in_flight.empty() || !live.empty()) {
    if (in_flight.empty()) enqueue_step(live, /*chained=*/false);
    // The next step on the guess that every member continues: only while the step in flight
    // holds exactly the live sequences, none of them ends with it and each has room for one
    // more token.
    if (in_flight.size() == 1 && in_flight.front().members == live &&
        std::all_of(live.begin(), live.end(), goes_on)) {
      enqueue_step(live, /*chained=*/true);
    }
    const GreedyStep step = std::move(in_flight.front());
    in_flight.pop_front();
    m.backend->wait_greedy(step.slot);
    if (Status status = m.backend->status(); !status.ok()) {
      // No copy left in flight into a step about to go.
      for (const GreedyStep& later : in_flight) m.backend->wait_greedy(later.slot);
      return status;
    }
    // Whether step `ahead` (the step after this one, if enqueued) appends for sequence i.
    const auto appended_ahead = [&](size_t i) {
      if (in_flight.empty()) return false;
      const auto& members = in_flight.front().members;
      return std::find(members.begin(), members.end(), i) != members.end();
    };
    std::vector<size_t> continuing;
    for (size_t k = 0; k < step.members.size(); ++k) {
      const size_t i = step.members[k];
      // A member that stopped at an earlier step: its token of this step was rolled back.
      if (std::find(live.begin(), live.end(), i) == live.end()) continue;
      const bool ahead = appended_ahead(i);
      const int64_t length = m.sequences[sequences[i]].length - (ahead ? 1 : 0);
      const GreedyNext answer = on_token(i, step.tokens[k]);
      if (!last[i] && answer != GreedyNext::kStop && length < m.max_context) {
        next[i] = step.tokens[k].id;
        last[i] = answer == GreedyNext::kLast;
        continuing.push_back(i);
      } else if (ahead) {
        // The step after wrote the stopped token's K/V at position `length`, into the slot of
        // a position at least one ring (window + history) older in a sliding layer: nothing a
        // query from `length` on attends, and high_water keeps counting it as written.
        m.roll_back(sequences[i], length);
      }
    }
    live = std::move(continuing);
  }
  return m.backend->status();
}

}  // namespace gemma4::engine
