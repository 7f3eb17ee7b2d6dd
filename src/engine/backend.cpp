// The default fused operations of Backend: the primitives each replaces, called in exactly the
// order the engine issued them before the fused operations existed, so a backend that keeps these
// defaults computes bit for bit what it did then.
#include "engine/backend.h"

#include <algorithm>

namespace gemma4::engine {

int64_t kv_element_bytes(KvType type) {
  switch (type) {
    case KvType::kBF16:
      return 2;
    case KvType::kFP8:
      return 1;
    case KvType::kF32:
      break;
  }
  return 4;
}

const char* kv_type_name(KvType type) {
  switch (type) {
    case KvType::kBF16:
      return "bf16";
    case KvType::kFP8:
      return "fp8";
    case KvType::kF32:
      break;
  }
  return "f32";
}

Expected<KvType> parse_kv_type(std::string_view name) {
  for (KvType type : {KvType::kF32, KvType::kBF16, KvType::kFP8}) {
    if (name == kv_type_name(type)) return type;
  }
  return make_error(ErrorCode::kInvalidArgument, "KV cache type '{}': expected f32, bf16 or fp8",
                    name);
}

namespace {

// rms_norm over every head_dim-wide head of every row of x, in place. A dense x is one call over
// x.heads(); a column view of a wider buffer (q/k/v of a fused QKV projection) has no uniform
// stride between heads of consecutive rows, so it is normed row by row (the same per-head
// arithmetic either way).
void norm_heads(Backend& backend, Rows x, int head_dim, const float* weight,
                const NormParams& norm) {
  if (x.stride == x.width) {
    const Rows heads = x.heads(head_dim);
    backend.rms_norm(heads, weight, norm.weight_offset, norm.eps, heads);
    return;
  }
  for (int64_t r = 0; r < x.count; ++r) {
    const Rows heads = Rows::dense(x.row(r), 1, x.width).heads(head_dim);
    backend.rms_norm(heads, weight, norm.weight_offset, norm.eps, heads);
  }
}

}  // namespace

void Backend::add_rms_norm(Rows acc, Rows x, const float* weight, float scalar,
                           const float* next_weight, Rows next, const NormParams& norm) {
  rms_norm(x, weight, norm.weight_offset, norm.eps, x);
  add(acc, x);
  if (scalar != 1.0f) scale(acc, nullptr, scalar);
  if (next.data != nullptr) rms_norm(acc, next_weight, norm.weight_offset, norm.eps, next);
}

void Backend::add_rms_norm_branch(Rows acc, Rows branch, Rows x, const float* branch_weight,
                                  const float* weight, float scalar, const float* next_weight,
                                  Rows next, const NormParams& norm) {
  add_rms_norm(branch, x, branch_weight, 1.0f, nullptr, Rows{}, norm);
  add_rms_norm(acc, branch, weight, scalar, next_weight, next, norm);
}

void Backend::add_rms_norm_ple(Rows acc, Rows x, const float* weight, const quant::QMatrix& gate,
                               Rows multiplier, Rows gated, const quant::QMatrix& projection,
                               Rows projected, const float* projected_weight, float scalar,
                               const float* next_weight, Rows next, const NormParams& norm) {
  add_rms_norm(acc, x, weight, 1.0f, nullptr, Rows{}, norm);
  matmul_gelu_mul(gate, acc, multiplier, gated);
  matmul(projection, gated, projected);
  add_rms_norm(acc, projected, projected_weight, scalar, next_weight, next, norm);
}

void Backend::add_rms_norm_ple_matmul(Rows acc, Rows x, const float* weight,
                                      const quant::QMatrix& gate, Rows multiplier, Rows gated,
                                      const quant::QMatrix& projection, Rows projected,
                                      const float* projected_weight, float scalar,
                                      const float* next_weight, Rows next, const NormParams& norm,
                                      const quant::QMatrix& matmul_weights, Rows matmul_out) {
  add_rms_norm_ple(acc, x, weight, gate, multiplier, gated, projection, projected, projected_weight,
                   scalar, next_weight, next, norm);
  matmul(matmul_weights, next, matmul_out);
}

void Backend::matmul_route_experts(const quant::QMatrix& router_proj, Rows x, Rows logits,
                                   const RouterParams& router, int32_t* expert_ids,
                                   float* weights) {
  matmul(router_proj, x, logits);
  route_experts(logits, router, expert_ids, weights);
}

void Backend::add_rms_norm_moe(Rows acc, Rows x, const float* weight, float scalar,
                               const float* next_weight, Rows next, const MoeInputs& moe,
                               const NormParams& norm) {
  add_rms_norm(acc, x, weight, scalar, next_weight, next, norm);
  rms_norm(acc, nullptr, norm.weight_offset, norm.eps, moe.router_in);
  scale(moe.router_in, moe.router_scale, moe.router_factor);
  rms_norm(acc, moe.expert_weight, norm.weight_offset, norm.eps, moe.expert_in);
}

void Backend::concurrently(int64_t rows, const std::function<void()>& first,
                           const std::function<void()>& second) {
  (void)rows;
  first();
  second();
}

void Backend::prepare_attention(Rows q, Rows k, Rows v, const float* q_norm, const float* k_norm,
                                bool norm_v, int head_dim, const int32_t* positions,
                                const model::RopeParams& rope_params,
                                std::span<const SequenceRows> sequences, const NormParams& norm) {
  norm_heads(*this, q, head_dim, q_norm, norm);
  rope(q, head_dim, positions, rope_params);
  if (k.data == nullptr) return;  // a KV-shared layer reads its source layer's cache
  norm_heads(*this, k, head_dim, k_norm, norm);
  rope(k, head_dim, positions, rope_params);
  if (norm_v) norm_heads(*this, v, head_dim, nullptr, norm);
  for (const SequenceRows& s : sequences) {
    write_kv(s.kv, k.slice(s.first_row, s.count), v.slice(s.first_row, s.count),
             positions + s.first_row);
  }
}

void Backend::prepare_and_attend(Rows q, Rows k, Rows v, const float* q_norm, const float* k_norm,
                                 bool norm_v, int head_dim, const int32_t* positions,
                                 const model::RopeParams& rope,
                                 std::span<const SequenceRows> sequences, const NormParams& norm,
                                 int window, float scale, Rows out) {
  prepare_attention(q, k, v, q_norm, k_norm, norm_v, head_dim, positions, rope, sequences, norm);
  attention_rows(q, positions, sequences, window, scale, out);
}

void Backend::prepare_and_attend_pieces(Rows q, Rows k, Rows v, const float* q_norm,
                                        const float* k_norm, bool norm_v, int head_dim,
                                        const int32_t* positions, const model::RopeParams& rope,
                                        std::span<const SequenceRows> sequences,
                                        const NormParams& norm, int window, float scale, Rows out,
                                        int64_t chunk_limit) {
  for (const SequenceRows& s : sequences) {
    for (int64_t done = 0; done < s.count; done += chunk_limit) {
      const int64_t row = s.first_row + done;
      const SequenceRows piece{s.kv, 0, std::min(chunk_limit, s.count - done), s.position_bound};
      const std::span<const SequenceRows> pieces(&piece, 1);
      const int32_t* piece_positions = positions + row;
      prepare_attention(q.slice(row, piece.count), k.slice(row, piece.count),
                        v.slice(row, piece.count), q_norm, k_norm, norm_v, head_dim,
                        piece_positions, rope, pieces, norm);
      attention_rows(q.slice(row, piece.count), piece_positions, pieces, window, scale,
                     out.slice(row, piece.count));
    }
  }
}

void Backend::attention_rows(Rows q, const int32_t* positions,
                             std::span<const SequenceRows> sequences, int window, float scale,
                             Rows out) {
  for (const SequenceRows& s : sequences) {
    attention(q.slice(s.first_row, s.count), positions + s.first_row, s.kv, window, scale,
              out.slice(s.first_row, s.count));
  }
}

void Backend::matmul_gelu_mul(const quant::QMatrix& w, Rows x, Rows multiplier, Rows y) {
  matmul(w, x, y);
  gelu_tanh_mul(y, multiplier, y);
}

void Backend::summarize_logits(Rows logits, std::span<const LogitRowRequest> rows,
                               std::span<LogitSummary> summaries) {
  std::vector<float> row(static_cast<size_t>(logits.width));
  for (size_t r = 0; r < rows.size(); ++r) {
    download(row.data(), logits.row(rows[r].row), sizeof(float) * row.size());
    engine::summarize_logits(row, rows[r].request.edits, rows[r].request.candidates, summaries[r]);
  }
}

void Backend::enqueue_greedy(Rows logits, int32_t* token_ids, int32_t* positions,
                             std::span<GreedyToken> tokens, int slot) {
  (void)slot;
  const LogitRequest greedy{1, {}};
  std::vector<LogitRowRequest> rows;
  for (int64_t r = 0; r < logits.count; ++r) rows.push_back({r, greedy});
  std::vector<LogitSummary> summaries(rows.size());
  summarize_logits(logits, rows, summaries);
  std::vector<int32_t> ids(rows.size()), next_positions(rows.size());
  const size_t bytes = sizeof(int32_t) * rows.size();
  download(next_positions.data(), positions, bytes);
  for (size_t r = 0; r < rows.size(); ++r) {
    const LogitSummary& summary = summaries[r];
    // No candidate only after a failure, which status() reports.
    if (!summary.top.empty())
      tokens[r] = {summary.top.front().first, summary.top.front().second, summary.log_normaliser};
    ids[r] = tokens[r].id;
    ++next_positions[r];
  }
  upload(token_ids, ids.data(), bytes);
  upload(positions, next_positions.data(), bytes);
}

}  // namespace gemma4::engine
