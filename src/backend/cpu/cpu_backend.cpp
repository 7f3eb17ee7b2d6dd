#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "quant/qmatrix.h"

namespace gemma4::backend::cpu {

using engine::Rows;

namespace {

// Rows per parallel task below which splitting costs more than it saves.
constexpr int64_t kMinElementsPerThread = 1 << 14;

float dot(const float* a, const float* b, int64_t n) {
  // Four independent partial sums: deterministic, and lets the compiler pipeline the loop.
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// Applies fn(row index) to every row, split over the pool by rows of `width` elements.
template <typename Fn>
void for_each_row(ThreadPool& pool, int64_t count, int64_t width, Fn&& fn) {
  pool.parallel_for(count,
                    std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, width)),
                    [&](int64_t begin, int64_t end) {
                      for (int64_t r = begin; r < end; ++r) fn(r);
                    });
}

}  // namespace

float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  const float inner = kSqrt2OverPi * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

CpuBackend::CpuBackend(int threads) : pool_(threads) {}

engine::Buffer CpuBackend::allocate(size_t bytes) {
  void* data = std::calloc(std::max<size_t>(bytes, 1), 1);
  return engine::Buffer(data, bytes, [](void* p) { std::free(p); });
}

void CpuBackend::upload(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}
void CpuBackend::download(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}

void CpuBackend::embed(const quant::QMatrix& table, const int32_t* ids, float scale, Rows out) {
  for_each_row(pool_, out.count, out.width, [&](int64_t t) {
    float* row = out.row(t);
    quant::dequantize_row(table, ids[t], row);
    for (int64_t j = 0; j < out.width; ++j) row[j] *= scale;
  });
}

void CpuBackend::matmul(const quant::QMatrix& w, Rows x, Rows y) {
  const int64_t k = w.cols;
  // Parallel over output features: each weight row is dequantised once and used for every
  // token row of x.
  pool_.parallel_for(w.rows, std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, k)),
                     [&](int64_t begin, int64_t end) {
                       std::vector<float> weight_row(k);
                       for (int64_t n = begin; n < end; ++n) {
                         quant::dequantize_row(w, n, weight_row.data());
                         for (int64_t t = 0; t < x.count; ++t)
                           y.row(t)[n] = dot(x.row(t), weight_row.data(), k);
                       }
                     });
}

void CpuBackend::matmul_gelu_pairs(const quant::QMatrix& w, Rows x, Rows y) {
  const int64_t k = w.cols;
  // matmul() over the rows of one pair, then gelu_tanh_mul(): the same dot products and the same
  // float operations, so the result is bit for bit that of separate gate and up matrices.
  pool_.parallel_for(y.width,
                     std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, 2 * k)),
                     [&](int64_t begin, int64_t end) {
                       std::vector<float> gate_row(k), up_row(k);
                       for (int64_t i = begin; i < end; ++i) {
                         quant::dequantize_row(w, 2 * i, gate_row.data());
                         quant::dequantize_row(w, 2 * i + 1, up_row.data());
                         for (int64_t t = 0; t < x.count; ++t) {
                           const float gate = dot(x.row(t), gate_row.data(), k);
                           const float up = dot(x.row(t), up_row.data(), k);
                           y.row(t)[i] = gelu_tanh(gate) * up;
                         }
                       }
                     });
}

void CpuBackend::rms_norm(Rows x, const float* weight, float weight_offset, float eps, Rows y) {
  for_each_row(pool_, x.count, x.width, [&](int64_t r) {
    const float* in = x.row(r);
    float* out = y.row(r);
    double sum_squares = 0.0;
    for (int64_t j = 0; j < x.width; ++j) sum_squares += double{in[j]} * in[j];
    const float mean_squared = static_cast<float>(sum_squares / static_cast<double>(x.width)) + eps;
    const float inv_rms = std::pow(mean_squared, -0.5f);
    for (int64_t j = 0; j < x.width; ++j) {
      const float normed = in[j] * inv_rms;
      out[j] = weight ? normed * (weight_offset + weight[j]) : normed;
    }
  });
}

void CpuBackend::rope(Rows x, int head_dim, const int32_t* positions,
                      const model::RopeParams& rope) {
  const int half = head_dim / 2;
  const std::vector<float> inv_freq = engine::rope_inverse_frequencies(rope, head_dim);
  const int64_t heads = x.width / head_dim;
  for_each_row(pool_, x.count, x.width, [&](int64_t t) {
    const float position = static_cast<float>(positions[t]);
    for (int i = 0; i < half; ++i) {
      if (inv_freq[i] == 0.0f) continue;  // cos 0 = 1, sin 0 = 0: the pair passes through
      const float angle = position * inv_freq[i];
      const float c = std::cos(angle), s = std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        float* head = x.row(t) + h * head_dim;
        const float a = head[i], b = head[i + half];
        head[i] = a * c - b * s;
        head[i + half] = b * c + a * s;
      }
    }
  });
}

void CpuBackend::gelu_tanh_mul(Rows gate, Rows multiplier, Rows out) {
  for_each_row(pool_, gate.count, gate.width, [&](int64_t r) {
    const float* g = gate.row(r);
    const float* m = multiplier.row(r);
    float* o = out.row(r);
    for (int64_t j = 0; j < gate.width; ++j) o[j] = gelu_tanh(g[j]) * m[j];
  });
}

void CpuBackend::add(Rows acc, Rows x) {
  for (int64_t r = 0; r < acc.count; ++r)
    for (int64_t j = 0; j < acc.width; ++j) acc.row(r)[j] += x.row(r)[j];
}

void CpuBackend::scale(Rows x, const float* column_scale, float scalar) {
  for (int64_t r = 0; r < x.count; ++r) {
    float* row = x.row(r);
    for (int64_t j = 0; j < x.width; ++j)
      row[j] = (column_scale ? row[j] * column_scale[j] : row[j]) * scalar;
  }
}

void CpuBackend::softcap(Rows x, float cap) {
  for_each_row(pool_, x.count, x.width, [&](int64_t r) {
    float* row = x.row(r);
    for (int64_t j = 0; j < x.width; ++j) row[j] = cap * std::tanh(row[j] / cap);
  });
}

void CpuBackend::copy(Rows src, Rows dst) {
  for (int64_t r = 0; r < src.count; ++r)
    std::memcpy(dst.row(r), src.row(r), sizeof(float) * src.width);
}

void CpuBackend::write_kv(const engine::KvView& kv, Rows k, Rows v, const int32_t* positions) {
  // fp32 caches only (supports_kv_type: the engine never makes another kind here).
  const int64_t width = int64_t{kv.kv_heads} * kv.head_dim;
  for (int64_t t = 0; t < k.count; ++t) {
    const int64_t slot = positions[t] % kv.slots;
    std::memcpy(static_cast<float*>(kv.keys) + slot * width, k.row(t), sizeof(float) * width);
    std::memcpy(static_cast<float*>(kv.values) + slot * width, v.row(t), sizeof(float) * width);
    kv.slot_positions[slot] = positions[t];
  }
}

void CpuBackend::forget_kv(const engine::KvView& kv, int64_t from_position) {
  for (int64_t slot = 0; slot < kv.slots; ++slot)
    if (kv.slot_positions[slot] >= from_position) kv.slot_positions[slot] = -1;
}

void CpuBackend::attention(Rows q, const int32_t* positions, const engine::KvView& kv, int window,
                           float scale, Rows out) {
  const int head_dim = kv.head_dim;
  const int64_t q_heads = q.width / head_dim;
  const int64_t group = q_heads / kv.kv_heads;
  const int64_t kv_width = int64_t{kv.kv_heads} * head_dim;
  const auto* keys = static_cast<const float*>(kv.keys);  // fp32 caches only (supports_kv_type)
  const auto* values = static_cast<const float*>(kv.values);
  pool_.parallel_for(q.count * q_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kv.slots);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / q_heads, h = task % q_heads, g = h / group;
      const int64_t query_position = positions[t];
      const float* query = q.row(t) + h * head_dim;
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t slot = 0; slot < kv.slots; ++slot) {
        const int64_t p = kv.slot_positions[slot];
        const bool visible =
            p >= 0 && p <= query_position && (window == 0 || query_position - p < window);
        if (!visible) {
          scores[slot] = -std::numeric_limits<float>::infinity();
          continue;
        }
        scores[slot] = dot(query, keys + slot * kv_width + g * head_dim, head_dim) * scale;
        max_score = std::max(max_score, scores[slot]);
      }
      float* o = out.row(t) + h * head_dim;
      std::fill(o, o + head_dim, 0.0f);
      if (max_score == -std::numeric_limits<float>::infinity()) continue;  // nothing visible
      float sum = 0.0f;
      for (int64_t slot = 0; slot < kv.slots; ++slot) {
        scores[slot] = std::exp(scores[slot] - max_score);
        sum += scores[slot];
      }
      for (int64_t slot = 0; slot < kv.slots; ++slot) {
        if (scores[slot] == 0.0f) continue;
        const float p = scores[slot] / sum;
        const float* value = values + slot * kv_width + g * head_dim;
        for (int j = 0; j < head_dim; ++j) o[j] += p * value[j];
      }
    }
  });
}

void CpuBackend::route_experts(Rows logits, const engine::RouterParams& router, int32_t* expert_ids,
                               float* weights) {
  const int64_t experts = logits.width;
  for (int64_t t = 0; t < logits.count; ++t) {
    const float* z = logits.row(t);
    const float max_logit = *std::max_element(z, z + experts);
    std::vector<float> probs(experts);
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) sum += probs[e] = std::exp(z[e] - max_logit);
    for (auto& p : probs) p /= sum;
    std::vector<int32_t> order(experts);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(
        order.begin(), order.begin() + router.top_k, order.end(),
        [&](int32_t a, int32_t b) { return probs[a] != probs[b] ? probs[a] > probs[b] : a < b; });
    float kept = 0.0f;
    for (int k = 0; k < router.top_k; ++k) kept += probs[order[k]];
    for (int k = 0; k < router.top_k; ++k) {
      const int32_t e = order[k];
      expert_ids[t * router.top_k + k] = e;
      weights[t * router.top_k + k] = probs[e] / kept * router.per_expert_scale[e];
    }
  }
}

void CpuBackend::run_experts(std::span<const model::ExpertMatrices> experts, Rows x,
                             const int32_t* expert_ids, const float* weights, int top_k, Rows out) {
  for (int64_t t = 0; t < out.count; ++t) std::fill(out.row(t), out.row(t) + out.width, 0.0f);
  // Expert by expert in ascending id (transformers' eager loop order), over the tokens routed to
  // it, so each expert's weights are read once per call.
  const auto num_experts = static_cast<int32_t>(experts.size());
  for (int32_t e = 0; e < num_experts; ++e) {
    std::vector<int64_t> picks;  // t * top_k + k
    for (int64_t i = 0; i < x.count * top_k; ++i)
      if (expert_ids[i] == e) picks.push_back(i);
    if (picks.empty()) continue;
    const auto m = static_cast<int64_t>(picks.size());
    const int64_t inner = experts[e].gate.rows;
    std::vector<float> input(m * x.width), gates(m * inner), ups(m * inner), output(m * out.width);
    Rows in = Rows::dense(input.data(), m, x.width);
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(in.row(i), x.row(picks[i] / top_k), sizeof(float) * x.width);
    Rows gate = Rows::dense(gates.data(), m, inner);
    Rows up = Rows::dense(ups.data(), m, inner);
    matmul(experts[e].gate, in, gate);
    matmul(experts[e].up, in, up);
    gelu_tanh_mul(gate, up, gate);
    Rows y = Rows::dense(output.data(), m, out.width);
    matmul(experts[e].down, gate, y);
    for (int64_t i = 0; i < m; ++i) {
      const float w = weights[picks[i]];
      float* o = out.row(picks[i] / top_k);
      for (int64_t j = 0; j < out.width; ++j) o[j] += y.row(i)[j] * w;
    }
  }
}

}  // namespace gemma4::backend::cpu
