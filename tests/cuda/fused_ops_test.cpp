// CudaBackend's fused decode operations (add_rms_norm, prepare_attention, attention_rows,
// prepare_and_attend) against the CPU backend, whose versions are engine::Backend's default
// compositions of the primitives (the reference the engine's results are defined by). Fresh
// random inputs: several sequences at positions past the sliding window, head_dim 256 and 512,
// q/k/v as column views of one fused QKV buffer, k_eq_v-style V (the raw K projection), more
// sequences than one launch takes, and a recorded decode step replayed at later positions.
// Tolerances are float32-level (relative to 1 + |reference|): the kernels reduce in another order
// than the CPU, nothing is rounded to bf16 (but for a k_eq_v cache's keys read from its values:
// KEqVPrepareAndAttendReadsTheRotatedKeyDimsOnly).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "engine/backend.h"

namespace gemma4::cuda {
namespace {

using backend::cpu::CpuBackend;
using engine::KvView;
using engine::Rows;
using engine::SequenceRows;

constexpr double kTolerance = 1e-5;

using testing::make_gpu;

using testing::Mirrored;

void expect_same(const Mirrored<float>& values, const std::string& what) {
  const std::vector<float>& expected = values.cpu_values();
  std::vector<double> reference(expected.begin(), expected.end()), magnitude(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) magnitude[i] = 1.0 + std::fabs(reference[i]);
  testing::expect_close(values.gpu_values(), reference, magnitude, kTolerance, what.c_str());
}

// Random floats in [lo, hi), rounded to bf16 values when `bf16_exact`.
std::vector<float> random_values(int64_t n, float lo, float hi, uint32_t seed, bool bf16_exact) {
  std::vector<float> values = testing::random_floats(n, lo, hi, seed);
  if (bf16_exact) {
    for (float& x : values) x = round_bf16(x);
  }
  return values;
}

// One sequence's KV cache of a layer, filled up to position `depth` (exclusive) with random K/V:
// slot s holds the latest position p < depth with p % slots == s (a ring once depth > slots),
// slots never written hold -1. bf16_values: V holds bf16 values (tensor cores read them exactly).
struct MirroredCache {
  MirroredCache(engine::Backend& gpu, int64_t slots, int kv_heads, int head_dim, int32_t depth,
                uint32_t seed, bool bf16_values = false)
      : slots(slots),
        kv_heads(kv_heads),
        head_dim(head_dim),
        keys(gpu, testing::random_floats(slots * kv_heads * head_dim, -0.5f, 0.5f, seed)),
        values(gpu, random_values(slots * kv_heads * head_dim, -1.0f, 1.0f, seed + 1, bf16_values)),
        slot_positions(gpu, ring_positions(slots, depth)) {}

  static std::vector<int32_t> ring_positions(int64_t slots, int32_t depth) {
    std::vector<int32_t> positions(slots, -1);
    for (int64_t s = 0; s < std::min<int64_t>(slots, depth); ++s) {
      positions[s] = static_cast<int32_t>(depth - 1 - (depth - 1 - s) % slots);
    }
    return positions;
  }
  KvView cpu() {
    return {keys.cpu(), values.cpu(), slot_positions.cpu(), slots, kv_heads, head_dim};
  }
  KvView gpu() const {
    return {keys.gpu(), values.gpu(), slot_positions.gpu(), slots, kv_heads, head_dim};
  }
  void expect_same(const std::string& what) const {
    cuda::expect_same(keys, what + " keys");
    cuda::expect_same(values, what + " values");
    EXPECT_EQ(slot_positions.gpu_values(), slot_positions.cpu_values()) << what;
  }

  int64_t slots;
  int kv_heads, head_dim;
  Mirrored<float> keys, values;
  Mirrored<int32_t> slot_positions;
};

// The sequences of one pass: sequence i has rows[i] rows starting at position depth[i].
struct Pass {
  std::vector<int32_t> depths;
  std::vector<int64_t> rows;

  int64_t total_rows() const {
    int64_t n = 0;
    for (int64_t r : rows) n += r;
    return n;
  }
  std::vector<int32_t> positions() const {
    std::vector<int32_t> out;
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int64_t r = 0; r < rows[i]; ++r) out.push_back(static_cast<int32_t>(depths[i] + r));
    }
    return out;
  }
};

// A pass over `n` sequences of one row each at the given depths.
Pass decode_pass(std::vector<int32_t> depths) {
  Pass pass{std::move(depths), {}};
  pass.rows.assign(pass.depths.size(), 1);
  return pass;
}

// The caches of a pass's sequences and their SequenceRows on each backend.
struct MirroredSequences {
  MirroredSequences(engine::Backend& gpu, const Pass& pass, int64_t slots, int kv_heads,
                    int head_dim, uint32_t seed, bool bf16_values = false) {
    int64_t first_row = 0;
    for (size_t i = 0; i < pass.rows.size(); ++i) {
      caches.push_back(std::make_unique<MirroredCache>(gpu, slots, kv_heads, head_dim,
                                                       pass.depths[i], seed + 2 * i, bf16_values));
      cpu_rows.push_back({caches.back()->cpu(), first_row, pass.rows[i]});
      gpu_rows.push_back({caches.back()->gpu(), first_row, pass.rows[i]});
      first_row += pass.rows[i];
    }
  }
  void expect_same(const std::string& what) const {
    for (size_t i = 0; i < caches.size(); ++i) {
      caches[i]->expect_same(what + " sequence " + std::to_string(i));
    }
  }

  std::vector<std::unique_ptr<MirroredCache>> caches;
  std::vector<SequenceRows> cpu_rows, gpu_rows;
};

struct AddNormCase {
  const char* name;
  int64_t rows, width, stride;
  float weight_offset, scalar;
  bool next, next_weight;
};

TEST(FusedOps, AddRmsNormMatchesTheComposition) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  const AddNormCase cases[] = {
      // E2B: post-attention norm into the pre-feedforward norm; the layer's last norm with the
      // layer scalar into the next layer's input norm; the last layer (no next).
      {"attention", 3, 1536, 1536, 0.0f, 1.0f, true, true},
      {"layer-end", 3, 1536, 1600, 0.0f, 0.625f, true, true},
      {"last-layer", 2, 1536, 1536, 0.0f, 0.625f, false, false},
      // Gemma 3 style offset, an odd width, a weightless next norm.
      {"offset-odd", 5, 1000, 1001, 1.0f, 1.0f, true, false},
      // 26B-A4B's width (704 threads of one quad each); 31B's and a wider unaligned row take two
      // quads per thread.
      {"26B", 2, 2816, 2816, 0.0f, 0.5f, true, true},
      {"31B", 2, 5376, 5376, 0.0f, 1.0f, true, true},
      {"two-quads-odd", 2, 8191, 8193, 1.0f, 0.75f, true, true},
  };
  uint32_t seed = 100;
  for (const AddNormCase& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t elements = c.rows * c.stride;
    Mirrored<float> acc(*gpu, testing::random_floats(elements, -40.0f, 40.0f, seed++));
    Mirrored<float> x(*gpu, testing::random_floats(elements, -3.0f, 3.0f, seed++));
    Mirrored<float> weight(*gpu, testing::random_floats(c.width, -1.0f, 1.5f, seed++));
    Mirrored<float> next_weight(*gpu, testing::random_floats(c.width, -1.0f, 1.5f, seed++));
    Mirrored<float> next(*gpu, std::vector<float>(elements, 7.25f));
    const engine::NormParams norm = {c.weight_offset, 1e-6f};
    auto rows = [&](float* data) { return Rows{data, c.rows, c.width, c.stride}; };
    cpu.add_rms_norm(rows(acc.cpu()), rows(x.cpu()), weight.cpu(), c.scalar,
                     c.next_weight ? next_weight.cpu() : nullptr,
                     c.next ? rows(next.cpu()) : Rows{}, norm);
    gpu->add_rms_norm(rows(acc.gpu()), rows(x.gpu()), weight.gpu(), c.scalar,
                      c.next_weight ? next_weight.gpu() : nullptr,
                      c.next ? rows(next.gpu()) : Rows{}, norm);
    expect_same(acc, "acc");
    expect_same(next, "next");  // untouched (padding and all) when there is no next
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

struct LayerShape {
  int q_heads, kv_heads, head_dim;
  model::RopeParams rope;
  int64_t slots;
  int window;
};

// E2B's sliding layers (theta 10^4, full rotation) and full layers (proportional rope: 64 of
// 256 pairs, theta 10^6), a 26B-A4B-like sliding layer (8 kv heads), and a small head_dim the
// decode kernel does not take (and one whose rows are not 16-byte aligned).
const LayerShape kSliding = {8, 1, 256, {10000.0, 128, 256}, 600, 512};
const LayerShape kFull = {8, 1, 512, {1000000.0, 64, 512}, 4096, 0};
const LayerShape kWideSliding = {16, 8, 256, {10000.0, 128, 256}, 1100, 1024};
const LayerShape kSmallHeads = {4, 2, 64, {10000.0, 32, 64}, 96, 0};
// Half a head of 10: not whole 16-byte quads, the kernel's scalar path.
const LayerShape kOddHeads = {3, 1, 20, {10000.0, 10, 20}, 40, 0};
// Full layers whose caches hold 1100 positions (deeper queries wrap them as rings), one 31B-like
// (8 q heads per kv head of 512, 4 of them).
const LayerShape kFullRing = {8, 1, 512, {1000000.0, 64, 512}, 1100, 0};
const LayerShape kWideFullRing = {32, 4, 512, {1000000.0, 64, 512}, 1100, 0};

// q, k, v of a pass as column views of one [rows, q + k + v] buffer, as the fused QKV matmul
// writes them.
struct MirroredQkv {
  MirroredQkv(engine::Backend& gpu, const LayerShape& shape, int64_t rows, bool k_eq_v,
              uint32_t seed, bool bf16_values = false)
      : q_width(int64_t{shape.q_heads} * shape.head_dim),
        kv_width(int64_t{shape.kv_heads} * shape.head_dim),
        rows(rows),
        stride(q_width + 2 * kv_width),
        values(gpu, make_values(rows, q_width, kv_width, k_eq_v, seed, bf16_values)) {}

  // bf16_values: every value a bf16 value.
  static std::vector<float> make_values(int64_t rows, int64_t q_width, int64_t kv_width,
                                        bool k_eq_v, uint32_t seed, bool bf16_values = false) {
    const int64_t stride = q_width + 2 * kv_width;
    auto values = random_values(rows * stride, -2.0f, 2.0f, seed, bf16_values);
    if (k_eq_v) {
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(&values[r * stride + q_width + kv_width], &values[r * stride + q_width],
                    sizeof(float) * kv_width);
      }
    }
    return values;
  }
  Rows q(float* base) const { return {base, rows, q_width, stride}; }
  Rows k(float* base) const { return {base + q_width, rows, kv_width, stride}; }
  Rows v(float* base) const { return {base + q_width + kv_width, rows, kv_width, stride}; }
  // v as the engine hands it to `gpu` for a k_eq_v layer: k's own rows where the backend allows
  // (Backend::values_may_alias_keys), so the comparison with the CPU's copy checks the aliasing.
  Rows gpu_v(const engine::Backend& gpu, float* base, bool k_eq_v) const {
    return k_eq_v && gpu.values_may_alias_keys() ? k(base) : v(base);
  }

  int64_t q_width, kv_width, rows, stride;
  Mirrored<float> values;
};

struct PrepareCase {
  const char* name;
  LayerShape shape;
  Pass pass;
  bool owns_kv, k_eq_v, norm_v;
  float weight_offset;
};

TEST(FusedOps, PrepareAttentionMatchesTheComposition) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  std::vector<int32_t> many_depths;
  for (int i = 0; i < 70; ++i) many_depths.push_back(i * 37 % 300);
  const PrepareCase cases[] = {
      // Decode rows past the window (the ring wrapped), a fresh sequence, a deep one.
      {"sliding-decode", kSliding, decode_pass({1000, 3, 5000}), true, false, true, 0.0f},
      // Prefill chunks of three sequences on a full layer, V = the raw K projection.
      {"full-prefill-k_eq_v", kFull, {{700, 0, 4000}, {4, 1, 6}}, true, true, true, 0.0f},
      {"wide-sliding", kWideSliding, {{2000, 300}, {2, 3}}, true, false, false, 1.0f},
      // A layer reading another layer's KV: q only.
      {"kv-shared", kFull, decode_pass({900, 17}), false, false, true, 0.0f},
      // More sequences than one launch takes (two launches).
      {"70-sequences", kSliding, decode_pass(many_depths), true, false, true, 0.0f},
      {"small-heads", kSmallHeads, {{50, 95}, {3, 2}}, true, false, true, 0.0f},
      {"odd-heads", kOddHeads, {{30, 7}, {2, 1}}, true, false, true, 0.5f},
  };
  uint32_t seed = 200;
  for (const PrepareCase& c : cases) {
    SCOPED_TRACE(c.name);
    const LayerShape& shape = c.shape;
    const int hd = shape.head_dim;
    const int64_t n = c.pass.total_rows();
    MirroredQkv qkv(*gpu, shape, n, c.k_eq_v, seed++);
    MirroredSequences sequences(*gpu, c.pass, shape.slots, shape.kv_heads, hd, seed);
    seed += 200;
    Mirrored<int32_t> positions(*gpu, c.pass.positions());
    Mirrored<float> q_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
    Mirrored<float> k_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
    const engine::NormParams norm = {c.weight_offset, 1e-6f};
    float* const cpu_base = qkv.values.cpu();
    float* const gpu_base = qkv.values.gpu();
    cpu.prepare_attention(qkv.q(cpu_base), c.owns_kv ? qkv.k(cpu_base) : Rows{},
                          c.owns_kv ? qkv.v(cpu_base) : Rows{}, q_norm.cpu(), k_norm.cpu(),
                          c.norm_v, hd, positions.cpu(), shape.rope, sequences.cpu_rows, norm);
    gpu->prepare_attention(qkv.q(gpu_base), c.owns_kv ? qkv.k(gpu_base) : Rows{},
                           c.owns_kv ? qkv.gpu_v(*gpu, gpu_base, c.k_eq_v) : Rows{}, q_norm.gpu(),
                           k_norm.gpu(), c.norm_v, hd, positions.gpu(), shape.rope,
                           sequences.gpu_rows, norm);
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    // q in place; k and v are scratch afterwards (the CPU default normalizes them in place, the
    // kernel only reads them), so only q's columns of the buffer are compared.
    std::vector<float> gpu_q = qkv.values.gpu_values();
    std::vector<double> expected_q, magnitude;
    std::vector<float> got_q;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < qkv.q_width; ++j) {
        const float expected = qkv.values.cpu_values()[r * qkv.stride + j];
        expected_q.push_back(expected);
        magnitude.push_back(1.0 + std::fabs(expected));
        got_q.push_back(gpu_q[r * qkv.stride + j]);
      }
    }
    testing::expect_close(got_q, expected_q, magnitude, kTolerance, "q");
    sequences.expect_same(c.name);
  }
}

struct AttentionCase {
  const char* name;
  LayerShape shape;
  Pass pass;
};

TEST(FusedOps, AttentionRowsMatchesPerSequenceAttention) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  std::vector<int32_t> many_depths;
  for (int i = 0; i < 70; ++i) many_depths.push_back(i * 53 % 400);
  const AttentionCase cases[] = {
      // Decode batches (one launch + merge): ring past the window, first token, deep.
      {"sliding", kSliding, decode_pass({1000, 0, 5000, 40})},
      // A 4096-slot full layer at depth 101 (most splits unused) next to deep ones.
      {"full", kFull, decode_pass({100, 4000, 2500})},
      {"wide-sliding", kWideSliding, decode_pass({2000, 300})},
      // Two launches; each sequence's depth wraps its 600-slot ring or not.
      {"70-sequences", kSliding, decode_pass(many_depths)},
      // Not a decode batch, or a head_dim the decode kernel does not take: per sequence.
      {"prefill-mix", kSliding, {{700, 20}, {3, 1}}},
      {"small-heads", kSmallHeads, decode_pass({50, 95})},
  };
  uint32_t seed = 300;
  for (const AttentionCase& c : cases) {
    SCOPED_TRACE(c.name);
    const LayerShape& shape = c.shape;
    const int64_t n = c.pass.total_rows();
    // Each query attends up to and including its own position: the caches hold one more.
    Pass filled = c.pass;
    for (size_t i = 0; i < filled.depths.size(); ++i) filled.depths[i] += filled.rows[i];
    MirroredSequences sequences(*gpu, filled, shape.slots, shape.kv_heads, shape.head_dim, seed);
    seed += 200;
    MirroredQkv qkv(*gpu, shape, n, false, seed++);
    Mirrored<int32_t> positions(*gpu, c.pass.positions());
    const int64_t out_width = qkv.q_width;
    Mirrored<float> out(*gpu, std::vector<float>(n * out_width, std::nanf("")));
    const float scale = 1.0f / 16.0f;
    cpu.attention_rows(qkv.q(qkv.values.cpu()), positions.cpu(), sequences.cpu_rows, shape.window,
                       scale, Rows::dense(out.cpu(), n, out_width));
    gpu->attention_rows(qkv.q(qkv.values.gpu()), positions.gpu(), sequences.gpu_rows, shape.window,
                        scale, Rows::dense(out.gpu(), n, out_width));
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    expect_same(out, "out");
  }
}

// prepare_and_attend of a decode batch: CUDA's one launch (attention.h: DecodePrepare) against
// the CPU's composition (prepare_attention, then attention_rows): the outputs and every cache.
TEST(FusedOps, PrepareAndAttendMatchesTheComposition) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(2);
  std::vector<int32_t> many_depths;
  for (int i = 0; i < 70; ++i) many_depths.push_back(i * 41 % 700);
  const PrepareCase cases[] = {
      // The ring wrapped (the new key overwrites a slot mid-ring), a first token, a deep one.
      {"sliding", kSliding, decode_pass({1000, 0, 5000, 40}), true, false, true, 0.0f},
      // Most splits unused next to deep caches; V = the raw K projection.
      {"full-k_eq_v", kFull, decode_pass({100, 4000, 2500}), true, true, true, 0.0f},
      {"wide-sliding", kWideSliding, decode_pass({2000, 300}), true, false, false, 1.0f},
      // A layer reading another layer's KV: q prepared, nothing stored.
      {"kv-shared", kFull, decode_pass({900, 17}), false, false, true, 0.0f},
      // Two launches.
      {"70-sequences", kSliding, decode_pass(many_depths), true, false, true, 0.0f},
      // Not taken by the decode kernel: the composition on the device.
      {"small-heads", kSmallHeads, decode_pass({50, 95}), true, false, true, 0.0f},
      {"prefill-mix", kSliding, {{700, 20}, {3, 1}}, true, false, true, 0.0f},
  };
  uint32_t seed = 500;
  for (const PrepareCase& c : cases) {
    SCOPED_TRACE(c.name);
    const LayerShape& shape = c.shape;
    const int hd = shape.head_dim;
    const int64_t n = c.pass.total_rows();
    MirroredQkv qkv(*gpu, shape, n, c.k_eq_v, seed++);
    // A KV-shared layer attends a cache that already holds its own position.
    Pass filled = c.pass;
    if (!c.owns_kv) {
      for (size_t i = 0; i < filled.depths.size(); ++i) filled.depths[i] += filled.rows[i];
    }
    MirroredSequences sequences(*gpu, filled, shape.slots, shape.kv_heads, hd, seed);
    seed += 200;
    Mirrored<int32_t> positions(*gpu, c.pass.positions());
    Mirrored<float> q_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
    Mirrored<float> k_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
    Mirrored<float> out(*gpu, std::vector<float>(n * qkv.q_width, std::nanf("")));
    const engine::NormParams norm = {c.weight_offset, 1e-6f};
    const float scale = 1.0f / 16.0f;
    float* const cpu_base = qkv.values.cpu();
    float* const gpu_base = qkv.values.gpu();
    cpu.prepare_and_attend(qkv.q(cpu_base), c.owns_kv ? qkv.k(cpu_base) : Rows{},
                           c.owns_kv ? qkv.v(cpu_base) : Rows{}, q_norm.cpu(), k_norm.cpu(),
                           c.norm_v, hd, positions.cpu(), shape.rope, sequences.cpu_rows, norm,
                           shape.window, scale, Rows::dense(out.cpu(), n, qkv.q_width));
    gpu->prepare_and_attend(qkv.q(gpu_base), c.owns_kv ? qkv.k(gpu_base) : Rows{},
                            c.owns_kv ? qkv.gpu_v(*gpu, gpu_base, c.k_eq_v) : Rows{}, q_norm.gpu(),
                            k_norm.gpu(), c.norm_v, hd, positions.gpu(), shape.rope,
                            sequences.gpu_rows, norm, shape.window, scale,
                            Rows::dense(out.gpu(), n, qkv.q_width));
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    expect_same(out, "out");
    sequences.expect_same(c.name);
  }
}

// A 26B-A4B-like sliding layer (16 q / 8 kv heads of 256, window 1024) with its default ring of
// 1056 slots: passes of more than 33 rows do not fit. And head_dim 512 on a short ring.
const LayerShape kShortRing = {16, 8, 256, {10000.0, 128, 256}, 1056, 1024};
const LayerShape kShortRing512 = {8, 2, 512, {1000000.0, 64, 512}, 300, 256};

struct PiecesCase {
  const char* name;
  LayerShape shape;
  Pass pass;
};

// prepare_and_attend_pieces of passes longer than the ring lets one write and then attend: CUDA's
// staged chunk (prepare into scratch, prefill_chunk_attention, store_staged_kv) against the CPU's
// default pieces of chunk_limit rows. The caches (fp32) as the pieces leave them, float32-level;
// the outputs on bf16 tensor cores, so within the bf16 bound: with q = 0 (a zero q_norm weight)
// every weight is exactly 1 and V holds bf16 values, so the output is the mean of the visible
// values up to fp32 sums (one key too many or too few moves it by ~max|v| / window); with random
// q, within what rounding q, k and the weights to bf16 allows (|q̃·k̃ − q·k| <= (2u + u²)·|q|·|k|,
// u = 2^-8, by Cauchy-Schwarz over the head).
void check_pieces(bool zero_query, uint32_t seed) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  CpuBackend cpu(0);  // every hardware thread: ~15 G multiply-adds of reference attention
  const PiecesCase cases[] = {
      {"first-1000", kShortRing, {{0}, {1000}}},
      {"deep-512", kShortRing, {{3000}, {512}}},
      // Two sequences staged; one that fits beside one staged.
      {"deep-65-and-first-97", kShortRing, {{1500, 0}, {65, 97}}},
      {"fits-33-beside-deep-97", kShortRing, {{2000, 5000}, {33, 97}}},
      {"hd512-deep-300", kShortRing512, {{700}, {300}}},
  };
  constexpr double kBf16Unit = 1.0 / 256;
  constexpr double kFp32Unit = 1.0 / 16777216;
  constexpr double kMaxValue = 2.0;  // |v| of the inputs and caches (norm_v off)
  for (const PiecesCase& c : cases) {
    SCOPED_TRACE(c.name);
    const LayerShape& shape = c.shape;
    const int hd = shape.head_dim;
    const int64_t n = c.pass.total_rows();
    const int64_t chunk_limit = shape.slots - shape.window + 1;
    MirroredQkv qkv(*gpu, shape, n, false, seed++, /*bf16_values=*/true);
    MirroredSequences sequences(*gpu, c.pass, shape.slots, shape.kv_heads, hd, seed,
                                /*bf16_values=*/true);
    seed += 200;
    Mirrored<int32_t> positions(*gpu, c.pass.positions());
    Mirrored<float> q_norm(*gpu, zero_query ? std::vector<float>(hd, 0.0f)
                                            : testing::random_floats(hd, -1.0f, 1.5f, seed++));
    Mirrored<float> k_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
    Mirrored<float> out(*gpu, std::vector<float>(n * qkv.q_width, std::nanf("")));
    const engine::NormParams norm = {0.0f, 1e-6f};
    const float scale = 1.0f / 16.0f;
    float* const cpu_base = qkv.values.cpu();
    float* const gpu_base = qkv.values.gpu();
    cpu.prepare_and_attend_pieces(qkv.q(cpu_base), qkv.k(cpu_base), qkv.v(cpu_base), q_norm.cpu(),
                                  k_norm.cpu(), false, hd, positions.cpu(), shape.rope,
                                  sequences.cpu_rows, norm, shape.window, scale,
                                  Rows::dense(out.cpu(), n, qkv.q_width), chunk_limit);
    gpu->prepare_and_attend_pieces(qkv.q(gpu_base), qkv.k(gpu_base), qkv.v(gpu_base), q_norm.gpu(),
                                   k_norm.gpu(), false, hd, positions.gpu(), shape.rope,
                                   sequences.gpu_rows, norm, shape.window, scale,
                                   Rows::dense(out.gpu(), n, qkv.q_width), chunk_limit);
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    sequences.expect_same(c.name);

    // The bound per (row, q head): the CPU's q rows were prepared in place; the largest key
    // norm of the head's kv head over the pass's prepared k rows (in place too) and the caches.
    const int group = shape.q_heads / shape.kv_heads;
    std::vector<double> max_key_norm(shape.kv_heads, 0.0);
    auto head_norm = [&](const float* x) {
      double sum = 0.0;
      for (int d = 0; d < hd; ++d) sum += double{x[d]} * x[d];
      return std::sqrt(sum);
    };
    for (int g = 0; g < shape.kv_heads; ++g) {
      for (int64_t r = 0; r < n; ++r) {
        max_key_norm[g] = std::max(max_key_norm[g], head_norm(qkv.k(cpu_base).row(r) + g * hd));
      }
      for (const auto& cache : sequences.caches) {
        for (int64_t slot = 0; slot < cache->slots; ++slot) {
          max_key_norm[g] = std::max(max_key_norm[g], head_norm(cache->keys.cpu_values().data() +
                                                                (slot * shape.kv_heads + g) * hd));
        }
      }
    }
    const double sums = 4.0 * shape.window * kFp32Unit;  // both sides' fp32 sums of the mean
    std::vector<double> bound(n * qkv.q_width);
    for (int64_t r = 0; r < n; ++r) {
      for (int h = 0; h < shape.q_heads; ++h) {
        const double dot_bound =
            scale * head_norm(qkv.q(cpu_base).row(r) + int64_t{h} * hd) * max_key_norm[h / group];
        // (+ the fp32 sums of the dot products, the scaling by log2(e) and exp2.)
        const double epsilon =
            dot_bound * (2 * kBf16Unit + kBf16Unit * kBf16Unit + 4.0 * hd * kFp32Unit) +
            4.0 * kFp32Unit * (1.0 + 2.0 * dot_bound);
        const double beta =
            zero_query ? 1.0 : std::exp(2 * epsilon) * (1 + kBf16Unit) / (1 - kBf16Unit);
        std::fill_n(bound.begin() + r * qkv.q_width + int64_t{h} * hd, hd,
                    (beta - 1 + sums) * kMaxValue);
      }
    }
    const std::vector<float>& expected = out.cpu_values();
    testing::expect_close(out.gpu_values(), std::vector<double>(expected.begin(), expected.end()),
                          bound, 1.0, zero_query ? "uniform weights" : "random queries");
  }
}

TEST(FusedOps, PrepareAndAttendPiecesUniformWeightsAverageTheVisibleValues) {
  check_pieces(/*zero_query=*/true, 700);
}

TEST(FusedOps, PrepareAndAttendPiecesRandomQueriesWithinTheBf16Bound) {
  check_pieces(/*zero_query=*/false, 800);
}

// One layer's attention of a decode batch recorded once (as the engine records a decode step) and
// replayed at later positions: the sequence tables live in the recorded kernel parameters, the
// positions in device memory. fused: the step as prepare_and_attend (what the engine records),
// else as prepare_attention + attention_rows.
void recorded_decode_steps(bool fused) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  ASSERT_TRUE(gpu->can_record());
  CpuBackend cpu(2);
  const LayerShape shape = kSliding;
  const int hd = shape.head_dim;
  Pass pass = decode_pass({510, 7, 2000});
  const int64_t n = pass.total_rows();
  MirroredSequences sequences(*gpu, pass, shape.slots, shape.kv_heads, hd, 400);
  Mirrored<float> q_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, 401));
  Mirrored<float> k_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, 402));
  Mirrored<int32_t> positions(*gpu, pass.positions());
  MirroredQkv qkv(*gpu, shape, n, false, 403);
  Mirrored<float> out(*gpu, std::vector<float>(n * qkv.q_width, 0.0f));
  const engine::NormParams norm = {0.0f, 1e-6f};
  const float scale = 1.0f / 16.0f;
  // One layer's attention of the step on `backend`, over its copies of everything.
  struct Operands {
    float* qkv;
    int32_t* positions;
    const float* q_norm;
    const float* k_norm;
    const std::vector<SequenceRows>& rows;
    float* out;
  };
  auto step = [&](engine::Backend& backend, const Operands& o) {
    if (fused) {
      backend.prepare_and_attend(qkv.q(o.qkv), qkv.k(o.qkv), qkv.v(o.qkv), o.q_norm, o.k_norm, true,
                                 hd, o.positions, shape.rope, o.rows, norm, shape.window, scale,
                                 Rows::dense(o.out, n, qkv.q_width));
      return;
    }
    backend.prepare_attention(qkv.q(o.qkv), qkv.k(o.qkv), qkv.v(o.qkv), o.q_norm, o.k_norm, true,
                              hd, o.positions, shape.rope, o.rows, norm);
    backend.attention_rows(qkv.q(o.qkv), o.positions, o.rows, shape.window, scale,
                           Rows::dense(o.out, n, qkv.q_width));
  };
  const Operands on_cpu = {qkv.values.cpu(), positions.cpu(),    q_norm.cpu(),
                           k_norm.cpu(),     sequences.cpu_rows, out.cpu()};
  const Operands on_gpu = {qkv.values.gpu(), positions.gpu(),    q_norm.gpu(),
                           k_norm.gpu(),     sequences.gpu_rows, out.gpu()};
  std::unique_ptr<engine::RecordedWork> recording;
  for (int s = 0; s < 3; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    // Fresh q/k/v rows and the next positions for both backends.
    const std::vector<float> inputs =
        MirroredQkv::make_values(n, qkv.q_width, qkv.kv_width, false, 410 + s);
    std::copy(inputs.begin(), inputs.end(), qkv.values.cpu());
    gpu->upload(qkv.values.gpu(), inputs.data(), sizeof(float) * inputs.size());
    for (size_t i = 0; i < pass.depths.size(); ++i) positions.cpu()[i] = pass.depths[i] + s;
    gpu->upload(positions.gpu(), positions.cpu(), sizeof(int32_t) * n);

    step(cpu, on_cpu);
    if (s == 0) {
      step(*gpu, on_gpu);  // unrecorded first, as the engine warms up a recording
    } else {
      if (recording == nullptr) {
        recording = gpu->record([&] { step(*gpu, on_gpu); });
        ASSERT_NE(recording, nullptr) << gpu->status().error().to_string();
      }
      gpu->replay(*recording);
    }
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    expect_same(out, "out");
    sequences.expect_same("caches");
  }
}

// The bytes of a cache of `type` with `elements` random elements below 2^bound_exponent in
// magnitude: fp32 or bf16 (rounded as the device writers round: attention_kv.cuh) from uniform
// floats, e4m3 drawn as codes (testing::random_e4m3).
std::vector<uint8_t> random_cache(int64_t elements, engine::KvType type, int bound_exponent,
                                  uint32_t seed) {
  if (type == engine::KvType::kFP8) return testing::random_e4m3(elements, bound_exponent + 6, seed);
  const float bound = std::ldexp(1.0f, bound_exponent);
  const std::vector<float> values = testing::random_floats(elements, -bound, bound, seed);
  std::vector<uint8_t> bytes(values.size() * engine::kv_element_bytes(type));
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == engine::KvType::kBF16) {
      const uint16_t b = float_to_bf16(values[i]);
      std::memcpy(&bytes[2 * i], &b, 2);
    } else {
      std::memcpy(&bytes[4 * i], &values[i], 4);
    }
  }
  return bytes;
}

// prepare_and_attend in one launch (the new K/V made in the kernel, shared by every block of its
// key range through shared memory, stored by one) against the same step as prepare_attention then
// attention_rows on the device (the attention reading the new K/V back from the cache), for
// every cache type (the CPU backend holds fp32 caches only: PrepareAndAttendMatchesTheComposition
// checks the fp32 composition against it) and sequences at depths 1, 7, 33, 1025 and 5000 in one
// launch: the outputs agree to float32 rounding, the caches bit for bit.
TEST(FusedOps, PrepareAndAttendMatchesTheDeviceCompositionForEveryKvType) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  const Pass pass = decode_pass({0, 6, 32, 1024, 4999});
  struct Case {
    const char* name;
    LayerShape shape;
    bool owns_kv, k_eq_v, norm_v;
  };
  const Case cases[] = {
      {"sliding", kSliding, true, false, true},
      {"wide-sliding", kWideSliding, true, false, false},
      {"full-k_eq_v", kFullRing, true, true, true},
      {"wide-full", kWideFullRing, true, false, true},
      {"kv-shared", kFullRing, false, false, true},
  };
  uint32_t seed = 900;
  for (const engine::KvType type :
       {engine::KvType::kF32, engine::KvType::kBF16, engine::KvType::kFP8}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + engine::kv_type_name(type));
      const LayerShape& shape = c.shape;
      const int hd = shape.head_dim;
      const int64_t n = pass.total_rows();
      const int64_t q_width = int64_t{shape.q_heads} * hd;
      const int64_t kv_width = int64_t{shape.kv_heads} * hd;
      const std::vector<float> inputs =
          MirroredQkv::make_values(n, q_width, kv_width, c.k_eq_v, seed++);
      Mirrored<float> fused_qkv(*gpu, inputs), composed_qkv(*gpu, inputs);
      const int64_t stride = q_width + 2 * kv_width;
      auto q = [&](float* base) { return Rows{base, n, q_width, stride}; };
      auto k = [&](float* base) {
        return c.owns_kv ? Rows{base + q_width, n, kv_width, stride} : Rows{};
      };
      auto v = [&](float* base) {
        return c.owns_kv ? Rows{base + q_width + kv_width, n, kv_width, stride} : Rows{};
      };
      // Per sequence and path: keys, values, slot positions (a KV-shared layer's cache already
      // holds the query's position).
      std::vector<std::unique_ptr<Mirrored<uint8_t>>> arrays;
      std::vector<std::unique_ptr<Mirrored<int32_t>>> positions_of_slots;
      std::vector<SequenceRows> fused_rows, composed_rows;
      for (size_t i = 0; i < pass.depths.size(); ++i) {
        const int64_t elements = shape.slots * kv_width;
        const std::vector<uint8_t> keys = random_cache(elements, type, -1, seed++);
        const std::vector<uint8_t> values = random_cache(elements, type, 0, seed++);
        const std::vector<int32_t> slot_positions =
            MirroredCache::ring_positions(shape.slots, pass.depths[i] + (c.owns_kv ? 0 : 1));
        for (std::vector<SequenceRows>* rows : {&fused_rows, &composed_rows}) {
          arrays.push_back(std::make_unique<Mirrored<uint8_t>>(*gpu, keys));
          arrays.push_back(std::make_unique<Mirrored<uint8_t>>(*gpu, values));
          positions_of_slots.push_back(std::make_unique<Mirrored<int32_t>>(*gpu, slot_positions));
          const KvView kv = {arrays[arrays.size() - 2]->gpu(),
                             arrays.back()->gpu(),
                             positions_of_slots.back()->gpu(),
                             shape.slots,
                             shape.kv_heads,
                             hd,
                             type};
          rows->push_back({kv, static_cast<int64_t>(i), 1});
        }
      }
      Mirrored<int32_t> positions(*gpu, pass.positions());
      Mirrored<float> q_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
      Mirrored<float> k_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
      Mirrored<float> fused_out(*gpu, std::vector<float>(n * q_width, std::nanf("")));
      Mirrored<float> composed_out(*gpu, std::vector<float>(n * q_width, std::nanf("")));
      const engine::NormParams norm = {0.0f, 1e-6f};
      const float scale = 1.0f / 16.0f;
      gpu->prepare_and_attend(q(fused_qkv.gpu()), k(fused_qkv.gpu()), v(fused_qkv.gpu()),
                              q_norm.gpu(), k_norm.gpu(), c.norm_v, hd, positions.gpu(), shape.rope,
                              fused_rows, norm, shape.window, scale,
                              Rows::dense(fused_out.gpu(), n, q_width));
      gpu->prepare_attention(q(composed_qkv.gpu()), k(composed_qkv.gpu()), v(composed_qkv.gpu()),
                             q_norm.gpu(), k_norm.gpu(), c.norm_v, hd, positions.gpu(), shape.rope,
                             composed_rows, norm);
      gpu->attention_rows(q(composed_qkv.gpu()), positions.gpu(), composed_rows, shape.window,
                          scale, Rows::dense(composed_out.gpu(), n, q_width));
      ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
      const std::vector<float> composed = composed_out.gpu_values();
      std::vector<double> reference(composed.begin(), composed.end()), magnitude(composed.size());
      for (size_t i = 0; i < composed.size(); ++i) magnitude[i] = 1.0 + std::fabs(reference[i]);
      testing::expect_close(fused_out.gpu_values(), reference, magnitude, kTolerance, "out");
      // arrays: per sequence fused keys, fused values, composed keys, composed values.
      for (size_t a = 0; a < arrays.size(); a += 4) {
        EXPECT_EQ(arrays[a]->gpu_values(), arrays[a + 2]->gpu_values()) << "keys " << a / 4;
        EXPECT_EQ(arrays[a + 1]->gpu_values(), arrays[a + 3]->gpu_values()) << "values " << a / 4;
        EXPECT_EQ(positions_of_slots[a / 2]->gpu_values(),
                  positions_of_slots[a / 2 + 1]->gpu_values())
            << "slot positions " << a / 4;
      }
    }
  }
}

// A cache's elements (bf16 or e4m3 bytes) as floats.
std::vector<float> cache_floats(const std::vector<uint8_t>& bytes, engine::KvType type) {
  const auto element_bytes = static_cast<size_t>(engine::kv_element_bytes(type));
  std::vector<float> values(bytes.size() / element_bytes);
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == engine::KvType::kFP8) {
      values[i] = e4m3_to_float(bytes[i]);
    } else {
      uint16_t bits;
      std::memcpy(&bits, &bytes[2 * i], 2);
      values[i] = bf16_to_float(bits);
    }
  }
  return values;
}

// A k_eq_v layer's decode step (26B's full layer: 16 q / 2 kv heads of 512, proportional RoPE of 64
// pairs) over caches that prepare_attention filled from raw rows whose V is the raw K, so that the
// relation KvView::k_eq_v promises holds, against the composition that reads K whole
// (prepare_attention, then attention_rows), whose cache it stores bit for bit. bf16:
// prepare_and_attend reads K's rotated dims and V in the others' stead (attention.h:
// KeysFromValues), the query's own key made in the launch; it matches a double-precision softmax
// over those keys (the cache it stored, q as prepared) to float32 rounding, and the composition
// to what the stand-in keys' rounding allows: each of the 384 unrotated products q_d · k_d is off
// by up to 2^-8 of itself (K's and V's bf16 roundings), ~sqrt(384) · rms(q · k) · 2^-9 · scale in
// a score, so larger norm scales (offset 1: 1 + w up to 2.5 on both q and k) err more. Measured
// on the H200: 0.00105 (offset 0, Gemma 4's) and 0.00927 (offset 1) of 1 + |out|. e4m3: K is
// read whole, as the composition does. Sequences at depths 0, 40 and 1000 in one launch.
TEST(FusedOps, KEqVPrepareAndAttendReadsTheRotatedKeyDimsOnly) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  const LayerShape shape = {16, 2, 512, {1000000.0, 64, 512}, 1100, 0};
  const int hd = shape.head_dim;
  const int64_t q_width = int64_t{shape.q_heads} * hd, kv_width = int64_t{shape.kv_heads} * hd;
  const int64_t stride = q_width + 2 * kv_width;
  const std::vector<int32_t> depths = {0, 40, 1000};
  const auto n = static_cast<int64_t>(depths.size());
  auto q = [&](float* base, int64_t rows) { return Rows{base, rows, q_width, stride}; };
  auto k = [&](float* base, int64_t rows) { return Rows{base + q_width, rows, kv_width, stride}; };
  auto v = [&](float* base, int64_t rows) {
    return Rows{base + q_width + kv_width, rows, kv_width, stride};
  };
  uint32_t seed = 1300;
  for (const engine::KvType type : {engine::KvType::kBF16, engine::KvType::kFP8}) {
    for (const float weight_offset : {0.0f, 1.0f}) {
      const std::string what = std::string(engine::kv_type_name(type)) + " weight offset " +
                               std::to_string(weight_offset);
      SCOPED_TRACE(what);
      const engine::NormParams norm = {weight_offset, 1e-6f};
      Mirrored<float> q_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
      Mirrored<float> k_norm(*gpu, testing::random_floats(hd, -1.0f, 1.5f, seed++));
      // Per sequence: the fused path's and the composed path's caches (keys, values, slot
      // positions), filled alike with positions 0 .. depth - 1 from one history of raw rows.
      const size_t cache_bytes = static_cast<size_t>(shape.slots * kv_width) *
                                 static_cast<size_t>(engine::kv_element_bytes(type));
      std::vector<std::unique_ptr<Mirrored<uint8_t>>> arrays;
      std::vector<std::unique_ptr<Mirrored<int32_t>>> slot_positions;
      std::vector<std::unique_ptr<Mirrored<float>>> histories;
      std::vector<std::unique_ptr<Mirrored<int32_t>>> history_positions;
      std::vector<SequenceRows> fused_rows, composed_rows;
      for (int64_t i = 0; i < n; ++i) {
        const int32_t depth = depths[i];
        const std::vector<float> history =
            MirroredQkv::make_values(depth, q_width, kv_width, true, seed++);
        std::vector<int32_t> positions(depth);
        for (int32_t p = 0; p < depth; ++p) positions[p] = p;
        for (std::vector<SequenceRows>* rows : {&fused_rows, &composed_rows}) {
          arrays.push_back(
              std::make_unique<Mirrored<uint8_t>>(*gpu, std::vector<uint8_t>(cache_bytes)));
          arrays.push_back(
              std::make_unique<Mirrored<uint8_t>>(*gpu, std::vector<uint8_t>(cache_bytes)));
          slot_positions.push_back(
              std::make_unique<Mirrored<int32_t>>(*gpu, std::vector<int32_t>(shape.slots, -1)));
          const KvView kv = {arrays[arrays.size() - 2]->gpu(),
                             arrays.back()->gpu(),
                             slot_positions.back()->gpu(),
                             shape.slots,
                             shape.kv_heads,
                             hd,
                             type,
                             true};
          rows->push_back({kv, i, 1});
          if (depth == 0) continue;
          histories.push_back(std::make_unique<Mirrored<float>>(*gpu, history));
          history_positions.push_back(std::make_unique<Mirrored<int32_t>>(*gpu, positions));
          float* const base = histories.back()->gpu();
          const SequenceRows into{kv, 0, depth};
          gpu->prepare_attention(q(base, depth), k(base, depth), v(base, depth), q_norm.gpu(),
                                 k_norm.gpu(), true, hd, history_positions.back()->gpu(),
                                 shape.rope, std::span<const SequenceRows>(&into, 1), norm);
        }
      }
      const std::vector<float> inputs =
          MirroredQkv::make_values(n, q_width, kv_width, true, seed++);
      Mirrored<float> fused_qkv(*gpu, inputs), composed_qkv(*gpu, inputs);
      Mirrored<int32_t> positions(*gpu, depths);
      Mirrored<float> fused_out(*gpu, std::vector<float>(n * q_width, std::nanf("")));
      Mirrored<float> composed_out(*gpu, std::vector<float>(n * q_width, std::nanf("")));
      const float scale = 1.0f / 16.0f;
      gpu->prepare_and_attend(q(fused_qkv.gpu(), n), k(fused_qkv.gpu(), n), v(fused_qkv.gpu(), n),
                              q_norm.gpu(), k_norm.gpu(), true, hd, positions.gpu(), shape.rope,
                              fused_rows, norm, shape.window, scale,
                              Rows::dense(fused_out.gpu(), n, q_width));
      gpu->prepare_attention(q(composed_qkv.gpu(), n), k(composed_qkv.gpu(), n),
                             v(composed_qkv.gpu(), n), q_norm.gpu(), k_norm.gpu(), true, hd,
                             positions.gpu(), shape.rope, composed_rows, norm);
      gpu->attention_rows(q(composed_qkv.gpu(), n), positions.gpu(), composed_rows, shape.window,
                          scale, Rows::dense(composed_out.gpu(), n, q_width));
      ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
      // The keys the fused path reads, over the stored cache (the same on both paths, checked
      // below) and q as the composition prepared it: K in the rotated dims, (offset + k_norm) ⊙ V
      // elsewhere; a double-precision softmax over them.
      const std::vector<float> prepared = composed_qkv.gpu_values();
      const std::vector<float>& k_norm_values = k_norm.cpu_values();
      std::vector<double> reference(static_cast<size_t>(n * q_width)), magnitude(reference.size());
      const int group = shape.q_heads / shape.kv_heads;
      for (int64_t i = 0; i < n; ++i) {
        const std::vector<float> keys = cache_floats(arrays[4 * i]->gpu_values(), type);
        const std::vector<float> values = cache_floats(arrays[4 * i + 1]->gpu_values(), type);
        const std::vector<int32_t> held = slot_positions[2 * i]->gpu_values();
        for (int h = 0; h < shape.q_heads; ++h) {
          const float* q_head = &prepared[i * stride + int64_t{h} * hd];
          const int64_t kv_head = (h / group) * int64_t{hd};
          std::vector<double> scores;
          std::vector<int64_t> visible;
          for (int64_t slot = 0; slot < shape.slots; ++slot) {
            if (held[slot] < 0 || held[slot] > depths[i]) continue;
            double dot = 0.0;
            for (int d = 0; d < hd; ++d) {
              const int64_t e = slot * kv_width + kv_head + d;
              const double key = d % (hd / 2) < shape.rope.rotated_pairs
                                     ? double{keys[e]}
                                     : (double{weight_offset} + k_norm_values[d]) * values[e];
              dot += double{q_head[d]} * key;
            }
            scores.push_back(scale * dot);
            visible.push_back(slot);
          }
          const double top = *std::max_element(scores.begin(), scores.end());
          double total = 0.0;
          for (double& x : scores) total += (x = std::exp(x - top));
          for (int d = 0; d < hd; ++d) {
            double acc = 0.0;
            for (size_t j = 0; j < visible.size(); ++j) {
              acc += scores[j] * values[visible[j] * kv_width + kv_head + d];
            }
            const size_t o = static_cast<size_t>(i * q_width + int64_t{h} * hd + d);
            reference[o] = acc / total;
            magnitude[o] = 1.0 + std::fabs(reference[o]);
          }
        }
      }
      const std::vector<float> fused = fused_out.gpu_values(), composed = composed_out.gpu_values();
      // Against the composition reading K whole: what V standing in for K costs (nothing where K
      // is read whole).
      double max_delta = 0.0;
      for (size_t i = 0; i < fused.size(); ++i) {
        max_delta = std::max(max_delta, std::fabs(double{fused[i]} - composed[i]) /
                                            (1.0 + std::fabs(double{composed[i]})));
      }
      std::printf("[ k_eq_v ] %s: max |fused - composed| / (1 + |composed|) %.3g\n", what.c_str(),
                  max_delta);
      if (type == engine::KvType::kBF16) {
        testing::expect_close(fused, reference, magnitude, 1e-4, "out (the keys it reads)");
        EXPECT_GT(max_delta, 0.0);  // V stood in for K
        EXPECT_LT(max_delta, 2e-2);
      } else {
        EXPECT_LT(max_delta, kTolerance);
      }
      // arrays: per sequence fused keys, fused values, composed keys, composed values.
      for (size_t a = 0; a < arrays.size(); a += 4) {
        EXPECT_EQ(arrays[a]->gpu_values(), arrays[a + 2]->gpu_values()) << "keys " << a / 4;
        EXPECT_EQ(arrays[a + 1]->gpu_values(), arrays[a + 3]->gpu_values()) << "values " << a / 4;
        EXPECT_EQ(slot_positions[a / 2]->gpu_values(), slot_positions[a / 2 + 1]->gpu_values())
            << "slot positions " << a / 4;
      }
    }
  }
}

TEST(FusedOps, RecordedDecodeStepReplaysAtLaterPositions) {
  recorded_decode_steps(false);
}

TEST(FusedOps, RecordedPrepareAndAttendReplaysAtLaterPositions) {
  recorded_decode_steps(true);
}

}  // namespace
}  // namespace gemma4::cuda
