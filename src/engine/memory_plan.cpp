#include "engine/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <set>

#include "quant/pack_w4g32.h"
#include "quant/quantize_w8.h"

namespace gemma4::engine {
namespace {

using model::LayerGeometry;

constexpr int64_t kFloat = sizeof(float);
constexpr int64_t kInt = sizeof(int32_t);

// The CUDA backend's scratch constants (backend/cuda: cuda_backend.cpp, attention.h, moe.h,
// prefill_matmul.*), mirrored here because the engine library cannot include CUDA code.
// Decode attention: up to kMaxAttentionSplits parts of kKeysPerSplit keys per (sequence, kv
// head), at most kMaxAttentionBlocks (sequence, kv head, split) blocks per launch of at most
// kMaxBatchedSequences sequences, head_dim + 2 floats per (query head, split).
constexpr int64_t kKeysPerSplit = 256;
constexpr int64_t kMaxAttentionSplits = 1024;
constexpr int64_t kMaxAttentionBlocks = 2048;
constexpr int64_t kMaxBatchedSequences = 64;
// Prefill attention (prefill_kernels.h) shares the decode partials' scratch: at most
// kMaxPrefillSplits splits of a pass's rows, within kMaxPrefillPartialBytes.
constexpr int64_t kMaxPrefillSplits = 8;
constexpr int64_t kMaxPrefillPartialBytes = int64_t{32} << 20;
// run_experts works through at most this many tokens at once.
constexpr int64_t kMoeTokensPerPass = 512;
// Tensor-core prefill: the cuBLAS workspace, one bf16 weight tile, bf16 activations.
constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
constexpr int64_t kWeightTileBytes = int64_t{32} << 20;

double mib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 20);
}

int64_t context_of(const model::ModelConfig& config, int64_t requested) {
  return config.max_position_embeddings > 0 ? std::min(requested, config.max_position_embeddings)
                                            : requested;
}

// One sequence's K, V and slot positions on every layer that owns a cache (Gemma4Engine::create:
// sliding layers hold a ring of window + ring_history slots, full layers max_context).
int64_t kv_bytes_per_sequence(const model::ModelConfig& config, const EngineOptions& options) {
  const int64_t history = ring_history_for(config, options);
  int64_t bytes = 0;
  for (const LayerGeometry& g : config.layers) {
    if (!g.owns_kv()) continue;
    const int64_t slots =
        g.window > 0 ? std::min(g.window + history, options.max_context) : options.max_context;
    bytes += slots * (2 * kv_element_bytes(options.kv_type) * g.kv_width() + kInt);
  }
  return bytes;
}

// Gemma4Engine::create's workspace: one pass of max_pass_tokens rows, logits per sequence.
int64_t workspace_bytes(const model::ModelConfig& config, const EngineOptions& options) {
  const int64_t rows = options.max_pass_tokens;
  const int64_t H = config.hidden_size;
  int64_t floats_per_row = 4 * H                          // x, normed, proj, branch
                           + 2 * config.max_q_width()     // q, attn
                           + 2 * config.max_kv_width()    // k, v
                           + 2 * config.max_ffn_width();  // gate, up
  int64_t ints_per_row = 2;                               // token ids, positions
  if (config.moe) {
    const auto& p = config.moe_params;
    floats_per_row += 2 * H + p.num_experts + p.top_k;  // moe, expert input, router logits,
                                                        // expert weights
    ints_per_row += p.top_k;                            // expert ids
  }
  if (config.ple_dim > 0) {
    floats_per_row += 2 * int64_t{config.num_layers} * config.ple_dim  // ple, ple_tokens
                      + config.ple_dim;                                // ple_gate
  }
  const int64_t per_sequence = kFloat * (H + config.vocab_size);  // last_hidden, logits
  return rows * (kFloat * floats_per_row + kInt * ints_per_row) +
         options.max_sequences * per_sequence;
}

// The CUDA backend's scratch at its largest: decode attention partials at the widest layer,
// the gate/up products of a prefill pass (matmul_gelu_pairs off the GEMV), the MoE workspace of a
// full pass, the tensor-core prefill's buffers, a pass's K/V staged for a sliding ring shorter
// than the pass, one RoPE table per layer.
int64_t backend_scratch_bytes(const model::ModelConfig& config, const EngineOptions& options) {
  const int64_t history = ring_history_for(config, options);
  const int64_t batch = std::min<int64_t>(options.max_sequences, kMaxBatchedSequences);
  int64_t attention = 0, rope = 0, staged_kv = 0;
  for (const LayerGeometry& g : config.layers) {
    const int64_t slots =
        g.window > 0 ? std::min(g.window + history, options.max_context) : options.max_context;
    // A ring too short for a pass stages the pass's K/V and positions (CudaBackend::
    // prepare_and_attend_pieces), each area 256-byte aligned.
    if (g.owns_kv() && g.window > 0 && slots < options.max_context &&
        slots - g.window + 1 < options.max_pass_tokens) {
      const int64_t area =
          (options.max_pass_tokens * g.kv_width() * kv_element_bytes(options.kv_type) + 255) / 256 *
          256;
      staged_kv = std::max(staged_kv, 2 * area + kInt * options.max_pass_tokens);
    }
    const int64_t splits = std::clamp<int64_t>(
        (slots + kKeysPerSplit - 1) / kKeysPerSplit, 1,
        std::min(kMaxAttentionSplits,
                 std::max<int64_t>(1, kMaxAttentionBlocks / (batch * g.num_kv_heads))));
    attention = std::max(attention, kFloat * batch * g.num_q_heads * splits * (g.head_dim + 2));
    attention = std::max(attention, std::min(kMaxPrefillPartialBytes,
                                             kFloat * kMaxPrefillSplits * options.max_pass_tokens *
                                                 g.num_q_heads * (g.head_dim + 2)));
    rope += kFloat * g.head_dim / 2;
  }
  const int64_t rows = options.max_pass_tokens;
  const int64_t pair_products = kFloat * rows * 2 * config.max_ffn_width();
  const int64_t widest_input = std::max({int64_t{config.hidden_size}, int64_t{config.max_q_width()},
                                         int64_t{config.max_ffn_width()}});
  const int64_t prefill = kCublasWorkspaceBytes + kWeightTileBytes +
                          int64_t{sizeof(uint16_t)} * rows * (widest_input + 8);  // K padded to 8
  int64_t moe = 0;
  if (config.moe) {
    const auto& p = config.moe_params;
    const int64_t pairs = std::min(rows, kMoeTokensPerPass) * p.top_k;
    moe = kFloat * pairs * (p.intermediate_size + config.hidden_size) +
          kInt * (2 + 2 * p.num_experts + pairs);
  }
  return attention + staged_kv + pair_products + prefill + moe + rope;
}

std::string options_line(const EngineOptions& o) {
  return fmt::format("{} x {} tokens, passes of {}", o.max_sequences, o.max_context,
                     o.max_pass_tokens);
}

}  // namespace

std::string MemoryPlan::summary() const {
  const std::string weights =
      weight_bytes > 0 ? fmt::format("{:.0f} MiB", mib(weight_bytes)) : "read in place";
  return fmt::format(
      "weights {} + KV {:.0f} MiB ({}, {}) + workspace {:.0f} MiB + scratch {:.0f} MiB + "
      "runtime reserve {:.0f} MiB = {:.0f} MiB",
      weights, mib(kv_bytes), options_line(options), kv_type_name(options.kv_type),
      mib(workspace_bytes), mib(scratch_bytes), mib(reserve_bytes), mib(total()));
}

MemoryPlan plan_memory(const model::ModelConfig& config, int64_t weight_bytes,
                       const EngineOptions& options, bool on_device) {
  MemoryPlan plan;
  plan.options = options;
  plan.options.max_context = context_of(config, options.max_context);
  plan.weight_bytes = weight_bytes;
  plan.kv_bytes = options.max_sequences * kv_bytes_per_sequence(config, plan.options);
  for (const LayerGeometry& g : config.layers) {
    if (g.owns_kv() && g.window == 0)
      plan.kv_full_bytes_per_token += 2 * kv_element_bytes(options.kv_type) * g.kv_width() + kInt;
  }
  plan.workspace_bytes = workspace_bytes(config, plan.options);
  plan.scratch_bytes = on_device ? backend_scratch_bytes(config, plan.options) : 0;
  plan.reserve_bytes = on_device ? kCudaRuntimeReserveBytes : 0;
  return plan;
}

Expected<MemoryPlan> fit_memory_plan(const model::ModelConfig& config, int64_t weight_bytes,
                                     const EngineOptions& requested, bool on_device,
                                     int64_t budget_bytes) {
  int pass_tokens = requested.max_pass_tokens;
  auto plan_for = [&](int32_t sequences, int64_t context) {
    EngineOptions options = requested;
    options.max_sequences = sequences;
    options.max_context = context;
    options.max_pass_tokens = pass_tokens;
    return plan_memory(config, weight_bytes, options, on_device);
  };
  const MemoryPlan wanted = plan_memory(config, weight_bytes, requested, on_device);
  if (wanted.total() <= budget_bytes) return wanted;
  // Fewer sequences at the requested context.
  const int64_t context = wanted.options.max_context;
  for (int32_t sequences = requested.max_sequences - 1; sequences >= 1; --sequences) {
    const MemoryPlan plan = plan_for(sequences, context);
    if (plan.total() <= budget_bytes) return plan;
  }
  // One sequence in shorter prefill passes (a smaller workspace; more weight reads per prompt).
  while (pass_tokens / 2 >= kMinPassTokens) {
    pass_tokens /= 2;
    const MemoryPlan plan = plan_for(1, context);
    if (plan.total() <= budget_bytes) return plan;
  }
  // One sequence in the shortest passes, the longest context that fits (the plan grows with it).
  const int64_t shortest = std::min(context, kContextGranularity);
  const MemoryPlan smallest = plan_for(1, shortest);
  if (smallest.total() > budget_bytes) {
    return make_error(ErrorCode::kResourceExhausted,
                      "the model does not fit in {:.0f} MiB of GPU memory: even one sequence of "
                      "{} tokens needs {}",
                      mib(budget_bytes), shortest, smallest.summary());
  }
  int64_t fits = 1, too_long = context / kContextGranularity + 1;  // in units of granularity
  while (too_long - fits > 1) {
    const int64_t middle = (fits + too_long) / 2;
    (plan_for(1, middle * kContextGranularity).total() <= budget_bytes ? fits : too_long) = middle;
  }
  return shortest < kContextGranularity ? smallest : plan_for(1, fits * kContextGranularity);
}

namespace {

// Whether a device copy of `table` is worth trying to pack (the grid check decides the rest).
bool packing_candidate(const quant::QMatrix& table, const Backend& backend) {
  return !backend.reads_host_memory() && model::present(table) &&
         table.format == quant::WeightFormat::kBF16;
}

}  // namespace

bool table_packs_on_device(const quant::QMatrix& table, const Backend& backend) {
  return packing_candidate(table, backend) && quant::check_w4g32_exact(table).ok();
}

std::optional<quant::PackedMatrix> pack_table_for_device(const quant::QMatrix& table,
                                                         const Backend& backend) {
  if (!packing_candidate(table, backend)) return std::nullopt;
  auto packed = quant::pack_w4g32_exact(table);
  if (!packed.ok()) return std::nullopt;
  return std::move(packed).value();
}

quant::QMatrix resident_lm_head_layout(const model::ModelWeights& weights, const Backend& backend,
                                       LmHeadFormat lm_head) {
  const quant::QMatrix& m = weights.lm_head;
  if (lm_head_quantizes(m, lm_head)) return quant::w8g32_layout(m.rows, m.cols);
  quant::QMatrix layout = m;
  layout.data = layout.scales = nullptr;
  if (table_packs_on_device(m, backend)) {
    layout.format = quant::WeightFormat::kW4G32;
    layout.scale_type = quant::ScaleType::kBF16;
  }
  return layout;
}

ResidentWeightBytes resident_weight_bytes(const model::ModelWeights& weights,
                                          const Backend& backend, LmHeadFormat lm_head) {
  ResidentWeightBytes out;
  out.lm_head_q8 = lm_head_quantizes(weights.lm_head, lm_head);
  if (backend.reads_host_memory()) return out;
  int64_t& bytes = out.bytes;
  // The 8-bit logits matrix is made at load, apart from the checkpoint's (a tied one's
  // embedding is still copied, for the lookups).
  if (out.lm_head_q8)
    bytes += quant::w8g32_layout(weights.lm_head.rows, weights.lm_head.cols).bytes();
  std::set<const void*> seen;  // a tied lm_head is the embedding table, copied once
  model::for_each_matrix(weights, [&](const std::string& name, const quant::QMatrix& m) {
    if (name == "lm_head" && out.lm_head_q8) return;  // counted above
    if (!seen.insert(m.data).second) return;
    // The tables ResidentWeights places through pack_table_for_device.
    const bool table =
        name == "embed_tokens" || name == "lm_head" || name == "embed_tokens_per_layer";
    if (table && table_packs_on_device(m, backend)) {
      out.packed_tables.push_back(name);
      quant::QMatrix packed = m;
      packed.format = quant::WeightFormat::kW4G32;
      packed.scale_type = quant::ScaleType::kBF16;
      bytes += packed.bytes();
      return;
    }
    bytes += m.bytes();
  });
  auto vector_bytes = [](const std::vector<float>& v) { return kFloat * std::ssize(v); };
  bytes += vector_bytes(weights.final_norm) + vector_bytes(weights.per_layer_projection_norm);
  for (const model::LayerWeights& l : weights.layers) {
    for (const std::vector<float>* v :
         {&l.q_norm, &l.k_norm, &l.input_layernorm, &l.post_attention_layernorm,
          &l.pre_feedforward_layernorm, &l.post_feedforward_layernorm, &l.router_scale,
          &l.per_expert_scale, &l.post_feedforward_layernorm_1, &l.pre_feedforward_layernorm_2,
          &l.post_feedforward_layernorm_2, &l.post_per_layer_input_norm})
      bytes += vector_bytes(*v);
  }
  return out;
}

Expected<int64_t> parse_memory_size(std::string_view text) {
  auto invalid = [&] {
    return make_error(ErrorCode::kInvalidArgument,
                      "memory size '{}': expected a number with a unit, e.g. 3732MiB, 24GiB, 4GB",
                      text);
  };
  size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  double number = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + digits, number);
  if (digits == 0 || error != std::errc() || end != text.data() + digits) return invalid();
  std::string unit(text.substr(digits));
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1},       {"b", 1},        {"k", 0x1p10},   {"kib", 0x1p10}, {"kb", 1e3},
      {"m", 0x1p20}, {"mib", 0x1p20}, {"mb", 1e6},     {"g", 0x1p30},   {"gib", 0x1p30},
      {"gb", 1e9},   {"t", 0x1p40},   {"tib", 0x1p40}, {"tb", 1e12}};
  for (const auto& [name, factor] : kUnits) {
    if (unit != name) continue;
    const double bytes = number * factor;
    if (!(bytes >= 1) || bytes > 0x1p62) return invalid();
    return static_cast<int64_t>(bytes);
  }
  return invalid();
}

}  // namespace gemma4::engine
