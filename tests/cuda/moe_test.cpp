// MoE kernels (moe.h) against the CPU backend's route_experts / run_experts (the reference every
// backend is checked against) on host copies of the same weights: fresh random inputs, real
// 26B-A4B shapes (hidden 2816, moe_intermediate 704, 128 experts, top-8) and tiny ones, every
// expert weight format, router ties, every path (decode per pair for one token, per expert below
// moe_grouped_min_tokens tokens, grouped tensor-core tiles from there on; decode at every count
// under MoePrecision::kExactF32).
// Also CudaBackend::add_rms_norm_moe and add_rms_norm_branch against the CPU backend's default
// compositions.
#include "backend/cuda/moe.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gemv.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "packed_matrix.h"

namespace gemma4::cuda {
namespace {

using backend::cpu::CpuBackend;
using engine::Rows;
using quant::ScaleType;
using quant::WeightFormat;
using testing::DeviceArray;
using testing::DeviceMatrix;
using testing::HostMatrix;
using testing::random_matrix;

// Decode path: both sides multiply exactly and accumulate in fp32 (the CPU in double per dot
// product), so they differ by fp32 rounding only; bf16 rounding (2^-8) is the engine's budget.
constexpr double kTolerance = 1e-3;
// Decode path on tensor cores (NVFP4): the products are exact, but x and the activations enter
// them rounded to fp16 (relative 2^-11 each, under a power-of-two scale): independent rounding
// errors over K terms put the output's error near 2^-12 of a typical output, twice (gate/up, then
// down), below the bf16 budget; 2e-3 of the row's largest magnitude leaves room while any
// indexing mistake is O(100 %).
constexpr double kDecodeTensorCoreTolerance = 2e-3;
// Decode path by expert (NVFP4): per pair the arithmetic of the decode path on tensor cores, so
// its tolerance against the CPU. Against that path itself: gate/up activations differ by fp32
// summation order only (two mma chains over all of K per warp, even and odd rounds, instead of
// four summed; K = 2816 terms: ~1e-6 of the row's largest activation), 2e-5 leaves room.
constexpr double kByExpertActivationsAgainstPerPair = 2e-5;
// The per-pair path hands its activations to down as fp16 (moe_kernels.h's handoff): decoded, they
// carry that rounding (2^-11 of each at most, so of the row's largest) on top.
constexpr double kByExpertActivationsAgainstHandoff = kByExpertActivationsAgainstPerPair + 0x1p-11;
// The outputs then differ where such an activation crosses an fp16 rounding boundary when down
// stages it (probability ~ its fp32 difference over half an fp16 ulp, ~1 %): that product moves
// by 2^-11 of itself. ~60 such moves among top_k · inner = 5632 products put the difference near
// 2e-5 of the row's largest output (measured: 3e-5 at the tail); 2e-4 leaves room, while any
// indexing mistake is O(100 %).
constexpr double kByExpertOutputsAgainstPerPair = 2e-4;
// Grouped path: tokens, activations and w4g32 weights enter the tensor cores as bf16 (relative
// rounding 2^-9 each). A float64 model of exactly that rounding at 26B-A4B shapes (random
// w4g32 / NVFP4 experts, x uniform in [-1, 1]) puts the largest error at 0.55-0.62 % of the row's
// largest magnitude; 2 % leaves room for other seeds while any indexing mistake is O(100 %).
constexpr double kGroupedTolerance = 2e-2;

constexpr int kHidden = 2816;
constexpr int kInner = 704;
constexpr int kExperts = 128;
constexpr int kTopK = 8;

struct ExpertFormat {
  const char* name;
  WeightFormat format;
  ScaleType scale_type = ScaleType::kBF16;
  bool nv_divisor = true;
  // bf16 experts as a checkpoint without quantization has them: gate and up are the two row
  // halves of one fused [2·inner, hidden] matrix.
  bool fused_gate_up = false;
};

const ExpertFormat kW4G32Bf16 = {"w4g32 bf16 scales", WeightFormat::kW4G32};
const ExpertFormat kW4G32F16 = {"w4g32 f16 scales", WeightFormat::kW4G32, ScaleType::kF16};
const ExpertFormat kW4G32F32 = {"w4g32 f32 scales", WeightFormat::kW4G32, ScaleType::kF32};
const ExpertFormat kNvfp4Divisor = {"nvfp4 divisor", WeightFormat::kNVFP4};
const ExpertFormat kNvfp4Multiplier = {"nvfp4 multiplier", WeightFormat::kNVFP4, ScaleType::kBF16,
                                       false};
const ExpertFormat kBf16Fused = {"bf16 fused gate_up", WeightFormat::kBF16, ScaleType::kBF16, true,
                                 true};

// One layer's experts: the random matrices on the host and their device copies, viewed as
// model::ExpertMatrices on each side.
struct ExpertSet {
  std::vector<HostMatrix> host;
  std::vector<std::unique_ptr<DeviceMatrix>> device;
  std::vector<model::ExpertMatrices> host_views;
  std::vector<model::ExpertMatrices> device_views;
};

// `down_format`: the down matrices' format where it differs from gate/up's.
ExpertSet make_experts(const ExpertFormat& f, int num_experts, int64_t hidden, int64_t inner,
                       uint32_t seed, const ExpertFormat* down_format = nullptr) {
  ExpertSet set;
  set.host.reserve(3 * num_experts);  // views point into the elements: no reallocation
  auto add = [&](int64_t rows, int64_t cols, const ExpertFormat& m) {
    set.host.push_back(random_matrix(m.format, rows, cols, seed++, m.scale_type, m.nv_divisor));
    set.device.push_back(std::make_unique<DeviceMatrix>(set.host.back()));
    return std::make_pair(set.host.back().view(), set.device.back()->view);
  };
  for (int e = 0; e < num_experts; ++e) {
    model::ExpertMatrices on_host, on_device;
    if (f.fused_gate_up) {
      const auto [host, device] = add(2 * inner, hidden, f);
      on_host.gate = quant::row_slice(host, 0, inner);
      on_host.up = quant::row_slice(host, inner, inner);
      on_device.gate = quant::row_slice(device, 0, inner);
      on_device.up = quant::row_slice(device, inner, inner);
    } else {
      std::tie(on_host.gate, on_device.gate) = add(inner, hidden, f);
      std::tie(on_host.up, on_device.up) = add(inner, hidden, f);
    }
    std::tie(on_host.down, on_device.down) =
        add(hidden, inner, down_format != nullptr ? *down_format : f);
    set.host_views.push_back(on_host);
    set.device_views.push_back(on_device);
  }
  return set;
}

// Routing from the CPU reference on random logits: distinct experts per token, realistic weights.
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routing cpu_route(CpuBackend& cpu, int tokens, int num_experts, int top_k, uint32_t seed,
                  int shared_experts = 0) {
  std::vector<float> logits = testing::random_floats(tokens * num_experts, -4.0f, 4.0f, seed);
  for (int t = 0; t < tokens; ++t) {
    std::fill_n(logits.begin() + t * num_experts, shared_experts, 8.0f);
  }
  const std::vector<float> scale = testing::random_floats(num_experts, 0.5f, 1.5f, seed + 1);
  Routing r;
  r.ids.resize(tokens * top_k);
  r.weights.resize(tokens * top_k);
  cpu.route_experts(Rows::dense(logits.data(), tokens, num_experts), {top_k, scale.data()},
                    r.ids.data(), r.weights.data());
  return r;
}

struct RunOptions {
  bool strided = false;       // x and out rows wider than hidden
  bool invalid_id = false;    // one pick outside the table (contributes nothing)
  bool same_experts = false;  // every token picks experts 0 .. top_k-1 (one long slot each)
  // Experts 0 .. shared_experts-1 tie at the top of every token's logits (the router keeps them,
  // lowest ids first): slots of `tokens` pairs beside the random picks' short ones.
  int shared_experts = 0;
  // A path forced through launch_moe (at most kMoeTokensPerPass tokens), else run_experts' own.
  std::optional<MoePath> path = std::nullopt;
  // run_experts' precision (when no path is forced).
  MoePrecision precision = MoePrecision::kBf16TensorCores;
};

const char* path_name(MoePath path) {
  switch (path) {
    case MoePath::kDecode:
      return "decode path";
    case MoePath::kDecodeTensorCores:
      return "decode path on tensor cores";
    case MoePath::kDecodeByExpert:
      return "decode path by expert";
    case MoePath::kGrouped:
      return "grouped path";
  }
  return "?";
}

// What the path's arithmetic allows (the tolerances above) for these experts.
double tolerance_for(MoePath path, const model::ExpertMatrices& experts) {
  if (path == MoePath::kGrouped) return kGroupedTolerance;
  const bool nvfp4 =
      experts.gate.format == WeightFormat::kNVFP4 || experts.down.format == WeightFormat::kNVFP4;
  const bool tensor_cores = path == MoePath::kDecodeTensorCores || path == MoePath::kDecodeByExpert;
  return tensor_cores && nvfp4 ? kDecodeTensorCoreTolerance : kTolerance;
}

// Runs the experts for `tokens` tokens on the device and on the CPU reference and compares every
// output element (finite, within kTolerance of its row's largest magnitude).
void check_run(CpuBackend& cpu, const ExpertSet& set, int tokens, int top_k, uint32_t seed,
               RunOptions options = {}) {
  const auto num_experts = static_cast<int>(set.host_views.size());
  const int64_t hidden = set.host_views[0].gate.cols;
  SCOPED_TRACE("tokens=" + std::to_string(tokens) + " top_k=" + std::to_string(top_k) +
               " experts=" + std::to_string(num_experts) + " hidden=" + std::to_string(hidden) +
               (options.strided ? " strided" : "") + (options.invalid_id ? " invalid id" : "") +
               (options.same_experts ? " same experts" : "") +
               (options.shared_experts > 0
                    ? " shared experts " + std::to_string(options.shared_experts)
                    : std::string()) +
               (options.path ? std::string(" ") + path_name(*options.path) : std::string()) +
               (options.precision == MoePrecision::kExactF32 ? " exact f32" : ""));
  const int64_t x_stride = options.strided ? hidden + 32 : hidden;
  const int64_t out_stride = options.strided ? hidden + 64 : hidden;
  std::vector<float> x = testing::random_floats(tokens * x_stride, -1.0f, 1.0f, seed);
  Routing routing = cpu_route(cpu, tokens, num_experts, top_k, seed + 1, options.shared_experts);
  // Both kinds of invalid id: negative and one past the table.
  if (options.same_experts) {
    for (size_t i = 0; i < routing.ids.size(); ++i)
      routing.ids[i] = static_cast<int32_t>(i % top_k);
  }
  if (options.invalid_id) routing.ids[routing.ids.size() / 2] = options.strided ? -1 : num_experts;

  std::vector<float> expected(tokens * hidden);
  cpu.run_experts(set.host_views, Rows{x.data(), tokens, hidden, x_stride}, routing.ids.data(),
                  routing.weights.data(), top_k, Rows::dense(expected.data(), tokens, hidden));

  MoeExpertTable table;
  CUDA_ASSERT_OK(MoeExpertTable::create(set.device_views, table));
  DeviceArray<float> x_device(x);
  DeviceArray<int32_t> ids(routing.ids);
  DeviceArray<float> weights(routing.weights);
  DeviceArray<float> out(tokens * out_stride);
  const MoePath path =
      options.path.value_or(moe_path_for(table.shape(), tokens, options.precision));
  DeviceArray<uint8_t> workspace(
      options.path ? moe_workspace_layout(table.shape(), tokens, top_k, path).bytes
                   : moe_workspace_bytes(table, tokens, top_k, options.precision));
  ASSERT_TRUE(x_device.ok() && ids.ok() && weights.ok() && out.ok() && workspace.ok());
  if (options.path) {
    const MoeRunArgs args = {table.device(), table.shape(), x_device.get(),  x_stride,
                             tokens,         top_k,         ids.get(),       weights.get(),
                             out.get(),      out_stride,    workspace.get(), path};
    CUDA_ASSERT_OK(launch_moe(args, Launch{}));
  } else {
    CUDA_ASSERT_OK(run_experts(table, x_device.get(), x_stride, tokens, top_k, ids.get(),
                               weights.get(), out.get(), out_stride, workspace.get(), Launch{},
                               options.precision));
  }
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<float> got_strided = out.download();

  std::vector<float> got(tokens * hidden);
  std::vector<double> reference(tokens * hidden), magnitude(tokens * hidden);
  for (int t = 0; t < tokens; ++t) {
    double row_max = 0.0;
    for (int64_t j = 0; j < hidden; ++j) {
      row_max = std::max(row_max, std::fabs(static_cast<double>(expected[t * hidden + j])));
    }
    for (int64_t j = 0; j < hidden; ++j) {
      got[t * hidden + j] = got_strided[t * out_stride + j];
      reference[t * hidden + j] = expected[t * hidden + j];
      magnitude[t * hidden + j] = row_max;
    }
  }
  testing::expect_close(got, reference, magnitude, tolerance_for(path, set.host_views[0]),
                        "run_experts");
}

void check_router(CpuBackend& cpu, const std::vector<float>& logits, int tokens, int num_experts,
                  int top_k, uint32_t seed) {
  SCOPED_TRACE("tokens=" + std::to_string(tokens) + " experts=" + std::to_string(num_experts) +
               " top_k=" + std::to_string(top_k));
  const std::vector<float> scale = testing::random_floats(num_experts, 0.5f, 1.5f, seed);
  std::vector<int32_t> expected_ids(tokens * top_k);
  std::vector<float> expected_weights(tokens * top_k);
  std::vector<float> host_logits = logits;
  cpu.route_experts(Rows::dense(host_logits.data(), tokens, num_experts), {top_k, scale.data()},
                    expected_ids.data(), expected_weights.data());

  DeviceArray<float> logits_device(logits);
  DeviceArray<float> scale_device(scale);
  DeviceArray<int32_t> ids(tokens * top_k);
  DeviceArray<float> weights(tokens * top_k);
  CUDA_ASSERT_OK(route_experts(logits_device.get(), num_experts, tokens, num_experts, top_k,
                               scale_device.get(), ids.get(), weights.get(), Launch{}));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  EXPECT_EQ(ids.download(), expected_ids);
  const std::vector<float> got = weights.download();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], expected_weights[i], 1e-5 * std::fabs(expected_weights[i])) << "pick " << i;
  }
}

TEST(MoeRouter, MatchesCpuReference) {
  CpuBackend cpu(0);
  struct Case {
    int tokens, experts, top_k;
  };
  uint32_t seed = 10;
  for (const Case& c : {Case{1, kExperts, kTopK}, Case{64, kExperts, kTopK}, Case{300, 128, 8},
                        Case{7, 200, 5}, Case{3, 8, 2}, Case{2, 32, 32}, Case{5, 256, 1}}) {
    const auto logits = testing::random_floats(c.tokens * c.experts, -4.0f, 4.0f, seed++);
    check_router(cpu, logits, c.tokens, c.experts, c.top_k, seed++);
  }
}

// Logits drawn from three values: dozens of experts tie exactly at the top, and the CPU
// reference keeps the lowest ids. One row with every logit equal.
TEST(MoeRouter, TiesGoToLowerIds) {
  CpuBackend cpu(0);
  const int tokens = 16;
  const auto words = testing::random_words(tokens * kExperts, 5);
  std::vector<float> logits(words.size());
  for (size_t i = 0; i < words.size(); ++i) logits[i] = static_cast<float>(words[i] % 3);
  for (int e = 0; e < kExperts; ++e) logits[3 * kExperts + e] = 0.25f;
  check_router(cpu, logits, tokens, kExperts, kTopK, 6);
}

TEST(MoeRouter, RejectsBadArguments) {
  DeviceArray<float> logits(512), scale(512), weights(64);
  DeviceArray<int32_t> ids(64);
  const Launch launch;
  EXPECT_EQ(route_experts(logits.get(), 8, 1, 8, 9, scale.get(), ids.get(), weights.get(), launch),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      route_experts(logits.get(), 300, 1, 300, 8, scale.get(), ids.get(), weights.get(), launch),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      route_experts(logits.get(), 64, 1, 64, 33, scale.get(), ids.get(), weights.get(), launch),
      cudaErrorInvalidValue);
  EXPECT_EQ(route_experts(logits.get(), 8, 0, 8, 2, scale.get(), ids.get(), weights.get(), launch),
            cudaErrorInvalidValue);
  // The fused decode router: x wider than it stages (the caller then routes apart).
  DeviceArray<float> wide(kFusedRouterMaxHidden + 8);
  quant::QMatrix router;
  router.format = WeightFormat::kBF16;
  router.rows = 8;
  router.cols = kFusedRouterMaxHidden + 8;
  router.data = wide.get();
  EXPECT_EQ(route_token(router, wide.get(), true, 2, scale.get(), logits.get(), ids.get(),
                        weights.get(), launch),
            cudaErrorInvalidValue);
}

// Decode (one token), batches of streams and prefill chunks (grouped by expert) at real shapes,
// and the exact-fp32 decode kernels (the --fp32 mode's) on one token and a batch.
TEST(MoeExperts, RealShapesNvfp4) {
  CpuBackend cpu(0);
  uint32_t seed = 100;
  for (const ExpertFormat& f : {kNvfp4Divisor, kNvfp4Multiplier}) {
    SCOPED_TRACE(f.name);
    const ExpertSet set = make_experts(f, kExperts, kHidden, kInner, seed);
    for (int tokens : {1, 8, 32, kMoeGroupedMinTokens, 200})
      check_run(cpu, set, tokens, kTopK, seed++);
    for (int tokens : {1, 8})
      check_run(cpu, set, tokens, kTopK, seed++, {.precision = MoePrecision::kExactF32});
  }
}

TEST(MoeExperts, RealShapesW4G32) {
  CpuBackend cpu(0);
  const ExpertSet set = make_experts(kW4G32Bf16, kExperts, kHidden, kInner, 200);
  for (int tokens : {1, 2, 64, 160}) check_run(cpu, set, tokens, kTopK, 300 + tokens);
}

// bf16 experts (row slices of a fused gate_up) at real widths, fewer experts to bound memory.
TEST(MoeExperts, RealWidthsBf16FusedGateUp) {
  CpuBackend cpu(0);
  const ExpertSet set = make_experts(kBf16Fused, 16, kHidden, kInner, 400);
  for (int tokens : {1, 5, 130}) check_run(cpu, set, tokens, kTopK, 500 + tokens);
}

// Every format and scale type at a tiny shape, with strided rows, an invalid pick, a top-1
// router and a batch wider than the expert count.
TEST(MoeExperts, TinyAllFormats) {
  CpuBackend cpu(0);
  uint32_t seed = 600;
  for (const ExpertFormat& f :
       {kW4G32Bf16, kW4G32F16, kW4G32F32, kNvfp4Divisor, kNvfp4Multiplier, kBf16Fused}) {
    SCOPED_TRACE(f.name);
    const ExpertSet set = make_experts(f, 16, 96, 64, seed++);
    check_run(cpu, set, 1, 4, seed++);
    check_run(cpu, set, 3, 4, seed++, {.strided = true});
    check_run(cpu, set, 1, 4, seed++, {.invalid_id = true});
    check_run(cpu, set, 9, 4, seed++, {.strided = true, .invalid_id = true});
    check_run(cpu, set, 65, 1, seed++);
    check_run(cpu, set, 33, 16, seed++);
    // Grouped: tiles of a slot, partial tiles, K and column tails (hidden 96, inner 64).
    check_run(cpu, set, 150, 4, seed++, {.strided = true, .invalid_id = true});
    check_run(cpu, set, 300, 1, seed++);
    check_run(cpu, set, 140, 16, seed++);
    check_run(cpu, set, 129, 4, seed++, {.same_experts = true});
  }
}

// The grouped GEMM's tiles (64 pairs of one expert) at real shapes: a prefill pass of 512 tokens
// (~32 pairs per expert, some experts with none), 97 tokens (partial 16-row fragments), and 160
// tokens that all pick experts 0 .. 7 (160 pairs each: tiles of 64, 64 and 32).
TEST(MoeExperts, GroupedTilesAtRealShapes) {
  CpuBackend cpu(0);
  uint32_t seed = 800;
  for (const ExpertFormat& f : {kNvfp4Divisor, kW4G32Bf16}) {
    SCOPED_TRACE(f.name);
    const ExpertSet set = make_experts(f, kExperts, kHidden, kInner, seed++);
    check_run(cpu, set, 97, kTopK, seed++);
    check_run(cpu, set, 160, kTopK, seed++, {.same_experts = true});
    if (f.format == WeightFormat::kNVFP4) check_run(cpu, set, kMoeTokensPerPass, kTopK, seed++);
  }
}

// The decode kernels stage one token's activations in shared memory: x (hidden floats) for
// gate/up, top_k · inner floats for down (half that as fp16 on tensor cores). Rows beyond the
// default 48 KiB of dynamic shared memory (hidden 13312: 52 KiB; top_k 8 of inner 1664: 52 KiB)
// take the raised limit.
TEST(MoeExperts, DecodeStagingBeyond48KiB) {
  CpuBackend cpu(0);
  uint32_t seed = 620;
  const ExpertSet wide = make_experts(kNvfp4Divisor, 8, 13312, 64, seed++);
  check_run(cpu, wide, 1, 4, seed++);
  // By expert: staged columns of 13312 fp16 (26 KiB each), as many as fit beside the weight
  // ring (6); 7 tokens that pick the same 4 experts make tiles of 6 pairs and of 1.
  check_run(cpu, wide, 2, 4, seed++, {.path = MoePath::kDecodeByExpert});
  check_run(cpu, wide, 7, 4, seed++, {.same_experts = true, .path = MoePath::kDecodeByExpert});
  check_run(cpu, wide, 1, 4, seed++, {.precision = MoePrecision::kExactF32});
  check_run(cpu, wide, 2, 4, seed++, {.strided = true, .precision = MoePrecision::kExactF32});
  const ExpertSet wide_down = make_experts(kNvfp4Multiplier, 8, 64, 6656, seed++);
  check_run(cpu, wide_down, 1, 4, seed++);  // tensor cores: 4 · 6656 fp16 = 52 KiB staged
  // By expert: 8 columns of 6656 fp16 (104 KiB).
  check_run(cpu, wide_down, 3, 4, seed++, {.path = MoePath::kDecodeByExpert});
  const ExpertSet deep = make_experts(kW4G32Bf16, 16, 96, 1664, seed++);
  check_run(cpu, deep, 1, 8, seed++);
  check_run(cpu, deep, 3, 8, seed++, {.invalid_id = true});
}

// Each path at batch sizes run_experts gives the other one (moe_bench compares them there).
TEST(MoeExperts, EitherPathAtAnyBatch) {
  CpuBackend cpu(0);
  uint32_t seed = 630;
  for (const ExpertFormat& f : {kW4G32Bf16, kNvfp4Multiplier}) {
    SCOPED_TRACE(f.name);
    const ExpertSet set = make_experts(f, 16, 96, 64, seed++);
    for (MoePath path : {MoePath::kDecode, MoePath::kDecodeTensorCores, MoePath::kDecodeByExpert,
                         MoePath::kGrouped}) {
      // By expert runs NVFP4 only (ByExpertRefusesOtherFormats).
      if (path == MoePath::kDecodeByExpert && f.format != WeightFormat::kNVFP4) continue;
      for (int tokens : {1, 8, 130}) check_run(cpu, set, tokens, 4, seed++, {.path = path});
    }
  }
}

// The decode path by expert (run_experts' default for NVFP4 experts from kMoeByExpertMinTokens
// to moe_grouped_min_tokens - 1 tokens; forced below that) at real shapes: random routings (most
// experts with no pair, a few with two or three; at kMoeByExpertGroupedMinTokens - 1 tokens ~6,
// some experts two tiles of pairs), experts that every token picks (tiles of more than 8 pairs: 32
// and 39 pairs are 4 and 5 tiles).
TEST(MoeExperts, ByExpertRealShapes) {
  CpuBackend cpu(0);
  uint32_t seed = 1200;
  const ExpertSet set = make_experts(kNvfp4Divisor, kExperts, kHidden, kInner, seed++);
  for (int tokens : {2, 5, 32, 39, kMoeByExpertGroupedMinTokens - 1}) {
    const RunOptions by_expert = {.path = MoePath::kDecodeByExpert};
    check_run(cpu, set, tokens, kTopK, seed++, by_expert);
    check_run(cpu, set, tokens, kTopK, seed++,
              {.strided = true, .shared_experts = 3, .path = MoePath::kDecodeByExpert});
  }
  check_run(cpu, set, 32, kTopK, seed++);  // run_experts' own choice
  check_run(cpu, set, 9, kTopK, seed++, {.invalid_id = true, .same_experts = true});
}

// Unusual routings at a tiny shape, both NVFP4 conventions: invalid picks, more pairs than experts
// (every slot live), top-16 of 16, and one expert that all 17 pairs pick (three tiles).
TEST(MoeExperts, ByExpertTinyShapes) {
  CpuBackend cpu(0);
  uint32_t seed = 1300;
  for (const ExpertFormat& f : {kNvfp4Divisor, kNvfp4Multiplier}) {
    SCOPED_TRACE(f.name);
    const ExpertSet set = make_experts(f, 16, 96, 64, seed++);
    const RunOptions by_expert = {.path = MoePath::kDecodeByExpert};
    check_run(cpu, set, 2, 4, seed++, by_expert);
    check_run(cpu, set, 11, 4, seed++,
              {.strided = true, .invalid_id = true, .path = MoePath::kDecodeByExpert});
    check_run(cpu, set, 20, 4, seed++, {.shared_experts = 2, .path = MoePath::kDecodeByExpert});
    check_run(cpu, set, 3, 16, seed++, by_expert);
    check_run(cpu, set, 17, 1, seed++, {.same_experts = true, .path = MoePath::kDecodeByExpert});
  }
}

// Partial pieces of the by-expert kernels' work at shapes between tiny and real: K not a whole
// number of rounds (4 chunks of 32: hidden 1632 = 51 chunks, the last round 3 live lanes; inner
// 224 = 7 chunks) nor of passes (13 rounds = 6 + 6 + 1), a down block's second row tile partly
// (hidden 160: rows 128-159) or wholly (hidden 1632: the last block's rows 1536-1631) past the
// matrix, and experts with more than one tile of pairs (the rounds loaded again for each).
TEST(MoeExperts, ByExpertPartialTilesAndRounds) {
  CpuBackend cpu(0);
  uint32_t seed = 1360;
  for (const int64_t hidden : {160, 1632}) {
    const ExpertSet set = make_experts(kNvfp4Multiplier, 16, hidden, 224, seed++);
    check_run(cpu, set, 5, 4, seed++, {.path = MoePath::kDecodeByExpert});
    check_run(cpu, set, 12, 4, seed++,
              {.strided = true, .shared_experts = 1, .path = MoePath::kDecodeByExpert});
    check_run(cpu, set, 19, 2, seed++, {.same_experts = true, .path = MoePath::kDecodeByExpert});
  }
}

// Other formats stay on the per-pair kernels: run_experts never picks the by-expert path for them,
// and forcing it is refused.
// The tensor-core decode path at shapes off the real ones: one chunk of K per pick (inner 32), an
// odd number per pick (inner 96) at top_k 1 to 5, several tokens, strided rows, an invalid pick,
// and a hidden of 53 chunks (gate/up warps of 7 rounds: a second pass of weight loads that fills
// part of its slots, the last round's chunks partly past the row).
TEST(MoeExperts, DecodeTensorCoresOddShapes) {
  CpuBackend cpu(0);
  uint32_t seed = 1400;
  const ExpertSet one_chunk = make_experts(kNvfp4Multiplier, 8, 64, 32, seed++);
  check_run(cpu, one_chunk, 1, 1, seed++, {.path = MoePath::kDecodeTensorCores});
  check_run(cpu, one_chunk, 3, 2, seed++, {.strided = true, .path = MoePath::kDecodeTensorCores});
  const ExpertSet odd = make_experts(kNvfp4Divisor, 16, 96, 96, seed++);
  for (int top_k : {1, 3, 5}) {
    check_run(cpu, odd, 2, top_k, seed++, {.path = MoePath::kDecodeTensorCores});
  }
  check_run(cpu, odd, 1, 3, seed++, {.invalid_id = true, .path = MoePath::kDecodeTensorCores});
  const ExpertSet long_rows = make_experts(kNvfp4Multiplier, 8, 53 * 32, 96, seed++);
  check_run(cpu, long_rows, 1, 2, seed++, {.path = MoePath::kDecodeTensorCores});
  check_run(cpu, long_rows, 3, 3, seed++, {.path = MoePath::kDecodeTensorCores});
}

// Gate/up and down in different formats on the tensor-core decode path: NVFP4 gate/up on its mma
// kernel with a w4g32 down (fp32 activations, no fp16 handoff) and w4g32 gate/up with an NVFP4
// down (both on the CUDA-core kernels: the mma down kernel takes only the mma gate/up's handoff).
TEST(MoeExperts, DecodeTensorCoresMixedFormats) {
  CpuBackend cpu(0);
  uint32_t seed = 1500;
  const ExpertSet nvfp4_gate_up = make_experts(kNvfp4Divisor, 16, 96, 64, seed++, &kW4G32Bf16);
  const ExpertSet nvfp4_down = make_experts(kW4G32Bf16, 16, 96, 64, seed++, &kNvfp4Multiplier);
  for (const ExpertSet* set : {&nvfp4_gate_up, &nvfp4_down}) {
    check_run(cpu, *set, 1, 4, seed++, {.path = MoePath::kDecodeTensorCores});
    check_run(cpu, *set, 3, 2, seed++, {.invalid_id = true, .path = MoePath::kDecodeTensorCores});
  }
}

TEST(MoeExperts, ByExpertRefusesOtherFormats) {
  const ExpertSet set = make_experts(kW4G32Bf16, 16, 96, 64, 1350);
  MoeExpertTable table;
  CUDA_ASSERT_OK(MoeExpertTable::create(set.device_views, table));
  EXPECT_EQ(moe_path_for(table.shape(), 32, MoePrecision::kBf16TensorCores),
            MoePath::kDecodeTensorCores);
  const int tokens = 9;
  DeviceArray<float> x(testing::random_floats(tokens * 96, -1.0f, 1.0f, 1351));
  DeviceArray<int32_t> ids(std::vector<int32_t>(tokens * 4, 1));
  DeviceArray<float> weights(std::vector<float>(tokens * 4, 0.25f));
  DeviceArray<float> out(tokens * 96);
  DeviceArray<uint8_t> workspace(
      moe_workspace_layout(table.shape(), tokens, 4, MoePath::kDecodeByExpert).bytes);
  const MoeRunArgs args = {
      table.device(), table.shape(), x.get(),   96, tokens,          4,
      ids.get(),      weights.get(), out.get(), 96, workspace.get(), MoePath::kDecodeByExpert};
  EXPECT_EQ(launch_moe(args, Launch{}), cudaErrorInvalidValue);
}

// An fp16 value's bits as a float.
float half_bits_to_float(uint16_t bits) {
  const int exponent = (bits >> 10) & 31;
  const int mantissa = bits & 1023;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)
                          : exponent == 31
                              ? (mantissa != 0 ? NAN : INFINITY)
                              : std::ldexp(static_cast<float>(mantissa + 1024), exponent - 25);
  return (bits & 0x8000) != 0 ? -magnitude : magnitude;
}

// The activations of moe_kernels.h's handoff (NVFP4 on kDecodeTensorCores), [pairs, inner]: each
// fp16 value times its block's scale, the pick's routing weight and down global scale divided out.
std::vector<float> handoff_activations(const std::vector<uint16_t>& halves,
                                       const std::vector<float>& scales, int64_t inner,
                                       const Routing& routing,
                                       const std::vector<model::ExpertMatrices>& experts) {
  const int64_t chunks = inner / 32;
  std::vector<float> activations(routing.ids.size() * inner);
  for (size_t pair = 0; pair < routing.ids.size(); ++pair) {
    const float factor = experts[routing.ids[pair]].down.nv_global.apply(routing.weights[pair]);
    for (int64_t n = 0; n < inner; ++n) {
      const int64_t chunk = static_cast<int64_t>(pair) * chunks + n / 32;
      const int64_t e = n % 32;
      const int64_t word = 16 * chunk + 4 * (e / 8) + e % 4;
      activations[pair * inner + n] =
          half_bits_to_float(halves[2 * word + (e % 8) / 4]) * scales[2 * chunk + e / 16] / factor;
    }
  }
  return activations;
}

// What launch_moe on a decode path computes for the given inputs (host copies): the outputs and
// the gate/up activations it leaves in the workspace ([pairs, inner]: fp32 by expert, the handoff
// decoded on tensor cores per pair).
struct PathRun {
  std::vector<float> out;
  std::vector<float> activations;
};
PathRun run_path(const MoeExpertTable& table, const std::vector<model::ExpertMatrices>& experts,
                 const std::vector<float>& x, int tokens, const Routing& routing, int top_k,
                 MoePath path) {
  const int64_t hidden = table.shape().hidden;
  DeviceArray<float> x_device(x), weights(routing.weights), out(tokens * hidden);
  DeviceArray<int32_t> ids(routing.ids);
  const MoeWorkspaceLayout layout = moe_workspace_layout(table.shape(), tokens, top_k, path);
  DeviceArray<uint8_t> workspace(layout.bytes);
  const MoeRunArgs args = {table.device(), table.shape(), x_device.get(),  hidden,
                           tokens,         top_k,         ids.get(),       weights.get(),
                           out.get(),      hidden,        workspace.get(), path};
  EXPECT_EQ(launch_moe(args, Launch{}), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const int64_t elements = tokens * top_k * table.shape().inner;
  PathRun run{out.download(), std::vector<float>(elements)};
  if (path == MoePath::kDecodeTensorCores) {
    std::vector<uint16_t> halves(elements);
    std::vector<float> scales(elements / 16);
    EXPECT_EQ(cudaMemcpy(halves.data(), workspace.get() + layout.activations,
                         halves.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(scales.data(), workspace.get() + layout.handoff_scales,
                         scales.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    run.activations = handoff_activations(halves, scales, table.shape().inner, routing, experts);
  } else {
    EXPECT_EQ(cudaMemcpy(run.activations.data(), workspace.get() + layout.activations,
                         run.activations.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return run;
}

// expect_close of `got` against `expected`, rows of `width`, each element's bound relative to its
// row's largest magnitude in `expected`.
void expect_rows_close(const std::vector<float>& got, const std::vector<float>& expected,
                       int64_t width, double tolerance, const char* what) {
  std::vector<double> reference(expected.begin(), expected.end()), magnitude(expected.size());
  for (size_t row = 0; row * width < expected.size(); ++row) {
    const auto first = reference.begin() + static_cast<int64_t>(row) * width;
    double row_max = 0.0;
    for (auto it = first; it != first + width; ++it) row_max = std::max(row_max, std::fabs(*it));
    std::fill_n(magnitude.begin() + static_cast<int64_t>(row) * width, width, row_max);
  }
  testing::expect_close(got, reference, magnitude, tolerance, what);
}

// The by-expert path against the per-pair tensor-core path it replaces, on the same inputs:
// activations equal up to fp32 summation order, outputs up to that and its fp16 consequences
// (kByExpert*AgainstPerPair): much tighter bounds than either's against the CPU.
TEST(MoeExperts, ByExpertMatchesPerPairPath) {
  CpuBackend cpu(0);
  uint32_t seed = 1400;
  const ExpertSet set = make_experts(kNvfp4Divisor, kExperts, kHidden, kInner, seed++);
  MoeExpertTable table;
  CUDA_ASSERT_OK(MoeExpertTable::create(set.device_views, table));
  for (int tokens : {2, 32}) {
    SCOPED_TRACE("tokens=" + std::to_string(tokens));
    const std::vector<float> x = testing::random_floats(tokens * kHidden, -1.0f, 1.0f, seed++);
    const Routing routing = cpu_route(cpu, tokens, kExperts, kTopK, seed++, 2);
    const PathRun per_pair =
        run_path(table, set.host_views, x, tokens, routing, kTopK, MoePath::kDecodeTensorCores);
    const PathRun by_expert =
        run_path(table, set.host_views, x, tokens, routing, kTopK, MoePath::kDecodeByExpert);
    expect_rows_close(by_expert.activations, per_pair.activations, kInner,
                      kByExpertActivationsAgainstHandoff, "activations, by expert vs per pair");
    expect_rows_close(by_expert.out, per_pair.out, kHidden, kByExpertOutputsAgainstPerPair,
                      "outputs, by expert vs per pair");
  }
}

// MoePrecision::kExactF32 (the backend's --fp32 mode): prefill-sized passes stay on the fp32
// GEMVs, so they meet the decode path's tolerance (the grouped path's bf16 products would not):
// NVFP4 at real widths (16 experts: the test stays short), both quantized formats at a tiny
// shape, over more tokens than one pass takes.
TEST(MoeExperts, ExactF32PrefillMatchesTightly) {
  CpuBackend cpu(0);
  uint32_t seed = 640;
  const ExpertSet real = make_experts(kNvfp4Divisor, 16, kHidden, kInner, seed++);
  check_run(cpu, real, kMoeGroupedMinTokens, kTopK, seed++, {.precision = MoePrecision::kExactF32});
  for (const ExpertFormat& f : {kNvfp4Multiplier, kW4G32Bf16}) {
    SCOPED_TRACE(f.name);
    const ExpertSet tiny = make_experts(f, 16, 96, 64, seed++);
    check_run(cpu, tiny, kMoeTokensPerPass + 130, 4, seed++,
              {.strided = true, .invalid_id = true, .precision = MoePrecision::kExactF32});
  }
}

// MoePrecision::kExactF32 with w4g32 experts at real widths (26B-A4B W4A16 in the --fp32 mode; 16
// experts: the test stays short) against the experts in double (quant::dequantize_row's weights):
// within fp32 accumulation error at every stage, 4 ulp (kFp32Tolerance) of Σ|w·x| per gate / up
// product carried through GELU (slope below 1.2) and the gating, plus 4 ulp of each activation;
// 4 ulp of Σ|d·a| per down product plus the activations' bounds times |d|; the routing weight's
// product. Activations with a nonzero mean, as normed hidden states have.
TEST(MoeExperts, ExactF32W4G32AtFp32Accuracy) {
  CpuBackend cpu(0);
  constexpr double kFp32Tolerance = 4.0 / (1 << 24), kGeluSlope = 1.2;
  constexpr int kFewExperts = 16;
  uint32_t seed = 760;
  const ExpertSet set = make_experts(kW4G32Bf16, kFewExperts, kHidden, kInner, seed++);
  MoeExpertTable table;
  CUDA_ASSERT_OK(MoeExpertTable::create(set.device_views, table));
  for (int tokens : {1, 8}) {
    SCOPED_TRACE("tokens=" + std::to_string(tokens));
    const std::vector<float> x = testing::random_floats(tokens * kHidden, -0.5f, 1.5f, seed++);
    const Routing routing = cpu_route(cpu, tokens, kFewExperts, kTopK, seed++);
    DeviceArray<float> x_device(x), weights(routing.weights), out(tokens * kHidden);
    DeviceArray<int32_t> ids(routing.ids);
    DeviceArray<uint8_t> workspace(
        moe_workspace_bytes(table, tokens, kTopK, MoePrecision::kExactF32));
    ASSERT_TRUE(x_device.ok() && weights.ok() && out.ok() && ids.ok() && workspace.ok());
    CUDA_ASSERT_OK(run_experts(table, x_device.get(), kHidden, tokens, kTopK, ids.get(),
                               weights.get(), out.get(), kHidden, workspace.get(), Launch{},
                               MoePrecision::kExactF32));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());

    std::vector<double> expected(tokens * kHidden, 0.0), bound(tokens * kHidden, 0.0);
    for (int t = 0; t < tokens; ++t) {
      for (int k = 0; k < kTopK; ++k) {
        const model::ExpertMatrices& e = set.host_views[routing.ids[t * kTopK + k]];
        const double routing_weight = routing.weights[t * kTopK + k];
        // The gated activations and their bounds.
        std::vector<double> a(kInner), a_bound(kInner);
        testing::parallel_for(kInner, [&](int64_t j) {
          std::vector<float> gate_row(kHidden), up_row(kHidden);
          quant::dequantize_row(e.gate, j, gate_row.data());
          quant::dequantize_row(e.up, j, up_row.data());
          double g = 0.0, g_magnitude = 0.0, u = 0.0, u_magnitude = 0.0;
          for (int64_t i = 0; i < kHidden; ++i) {
            const double xi = x[t * kHidden + i];
            g += gate_row[i] * xi;
            g_magnitude += std::fabs(gate_row[i] * xi);
            u += up_row[i] * xi;
            u_magnitude += std::fabs(up_row[i] * xi);
          }
          const double gelu =
              0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g)));
          a[j] = gelu * u;
          a_bound[j] = kFp32Tolerance * (kGeluSlope * g_magnitude * std::fabs(u) +
                                         std::fabs(gelu) * u_magnitude + std::fabs(a[j]));
        });
        testing::parallel_for(kHidden, [&](int64_t n) {
          std::vector<float> down_row(kInner);
          quant::dequantize_row(e.down, n, down_row.data());
          double sum = 0.0, magnitude = 0.0, carried = 0.0;
          for (int64_t j = 0; j < kInner; ++j) {
            sum += down_row[j] * a[j];
            magnitude += std::fabs(down_row[j] * a[j]);
            carried += std::fabs(down_row[j]) * a_bound[j];
          }
          expected[t * kHidden + n] += routing_weight * sum;
          bound[t * kHidden + n] +=
              std::fabs(routing_weight) * (kFp32Tolerance * (magnitude + std::fabs(sum)) + carried);
        });
      }
    }
    testing::expect_close(out.download(), expected, bound, 1.0, "run_experts");
  }
}

// CudaBackend::run_experts in ActivationMode::kF32 against the CPU backend over prefill-sized
// chunks: fp32 rounding only (1e-4 of the row's largest magnitude); the default mode on the same
// inputs stays within the grouped path's bf16 budget. Real widths (16 experts) at
// kMoeGroupedMinTokens, and device_check's 1,156-token prompt length (three passes) at a tiny
// shape.
TEST(MoeExperts, CudaBackendFp32ModePrefillIsExact) {
  CpuBackend cpu(0);
  constexpr int kFewExperts = 16;
  struct Case {
    int64_t hidden, inner;
    int tokens;
  };
  uint32_t seed = 660;
  for (const Case& c : {Case{kHidden, kInner, kMoeGroupedMinTokens}, Case{96, 64, 1156}}) {
    SCOPED_TRACE("hidden=" + std::to_string(c.hidden) + " tokens=" + std::to_string(c.tokens));
    const ExpertSet set = make_experts(kNvfp4Divisor, kFewExperts, c.hidden, c.inner, seed++);
    const std::vector<float> x = testing::random_floats(c.tokens * c.hidden, -1.0f, 1.0f, seed++);
    const Routing routing = cpu_route(cpu, c.tokens, kFewExperts, kTopK, seed++);
    std::vector<float> x_cpu = x, expected(c.tokens * c.hidden);
    cpu.run_experts(set.host_views, Rows::dense(x_cpu.data(), c.tokens, c.hidden),
                    routing.ids.data(), routing.weights.data(), kTopK,
                    Rows::dense(expected.data(), c.tokens, c.hidden));
    std::vector<double> reference(expected.begin(), expected.end()), magnitude(expected.size());
    for (int t = 0; t < c.tokens; ++t) {
      double row_max = 0.0;
      for (int64_t j = 0; j < c.hidden; ++j) {
        row_max = std::max(row_max, std::fabs(reference[t * c.hidden + j]));
      }
      std::fill_n(magnitude.begin() + t * c.hidden, c.hidden, row_max);
    }
    for (const bool fp32 : {true, false}) {
      SCOPED_TRACE(fp32 ? "fp32 mode" : "default mode");
      auto made = make_cuda_backend(
          0, {.activations = fp32 ? ActivationMode::kF32 : kDefaultActivationMode});
      ASSERT_TRUE(made.ok()) << made.error().to_string();
      engine::Backend& gpu = **made;
      DeviceArray<float> x_device(x), weights(routing.weights), out(c.tokens * c.hidden);
      DeviceArray<int32_t> ids(routing.ids);
      gpu.run_experts(set.device_views, Rows::dense(x_device.get(), c.tokens, c.hidden), ids.get(),
                      weights.get(), kTopK, Rows::dense(out.get(), c.tokens, c.hidden));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      ASSERT_TRUE(gpu.status().ok()) << gpu.status().error().to_string();
      testing::expect_close(out.download(), reference, magnitude, fp32 ? 1e-4 : kGroupedTolerance,
                            "CudaBackend::run_experts");
    }
  }
}

// More tokens than one pass takes (kMoeTokensPerPass): the passes share the workspace.
TEST(MoeExperts, LongPrefillInPasses) {
  CpuBackend cpu(0);
  const ExpertSet set = make_experts(kW4G32Bf16, 16, 96, 64, 650);
  check_run(cpu, set, 2 * kMoeTokensPerPass + 77, 4, 651, {.strided = true});
}

// Same inputs, same bits on both paths: no atomics in any sum.
TEST(MoeExperts, Deterministic) {
  const ExpertSet set = make_experts(kNvfp4Divisor, 32, 256, 128, 700);
  MoeExpertTable table;
  CUDA_ASSERT_OK(MoeExpertTable::create(set.device_views, table));
  CpuBackend cpu(0);
  for (int tokens : {32, 40, 200}) {
    SCOPED_TRACE(tokens);
    const Routing routing = cpu_route(cpu, tokens, 32, kTopK, 701);
    DeviceArray<float> x(testing::random_floats(tokens * 256, -1.0f, 1.0f, 702));
    DeviceArray<int32_t> ids(routing.ids);
    DeviceArray<float> weights(routing.weights);
    DeviceArray<uint8_t> workspace(moe_workspace_bytes(table, tokens, kTopK));
    std::vector<float> first;
    for (int run = 0; run < 3; ++run) {
      DeviceArray<float> out(tokens * 256);
      CUDA_ASSERT_OK(run_experts(table, x.get(), 256, tokens, kTopK, ids.get(), weights.get(),
                                 out.get(), 256, workspace.get(), Launch{}));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      const std::vector<float> got = out.download();
      if (run == 0) {
        first = got;
      } else {
        EXPECT_EQ(std::memcmp(got.data(), first.data(), got.size() * sizeof(float)), 0);
      }
    }
  }
}

// Router + experts captured in a CUDA graph with PDL launches (decode and a small batch): the
// replays give the plain launches' bits, and new logits written between replays are routed
// (nothing per-step is baked into the graph).
TEST(MoeExperts, GraphWithPdlMatchesPlainLaunches) {
  constexpr int kSmallHidden = 256, kSmallInner = 128, kSmallExperts = 32;
  const ExpertSet set =
      make_experts(kNvfp4Multiplier, kSmallExperts, kSmallHidden, kSmallInner, 1000);
  MoeExpertTable table;
  CUDA_ASSERT_OK(MoeExpertTable::create(set.device_views, table));
  cudaStream_t stream;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int tokens : {1, 4, kMoeByExpertMinTokens + 1, kMoeGroupedMinTokens + 3}) {
    SCOPED_TRACE("tokens=" + std::to_string(tokens));
    DeviceArray<float> logits(tokens * kSmallExperts);
    DeviceArray<float> scale(testing::random_floats(kSmallExperts, 0.5f, 1.5f, 1001));
    DeviceArray<float> x(testing::random_floats(tokens * kSmallHidden, -1.0f, 1.0f, 1002));
    DeviceArray<int32_t> ids(tokens * kTopK);
    DeviceArray<float> weights(tokens * kTopK);
    DeviceArray<float> out(tokens * kSmallHidden);
    DeviceArray<uint8_t> workspace(moe_workspace_bytes(table, tokens, kTopK));
    auto enqueue = [&](bool pdl) {
      const Launch launch = {stream, pdl};
      const cudaError_t routed =
          route_experts(logits.get(), kSmallExperts, tokens, kSmallExperts, kTopK, scale.get(),
                        ids.get(), weights.get(), launch);
      if (routed != cudaSuccess) return routed;
      return run_experts(table, x.get(), kSmallHidden, tokens, kTopK, ids.get(), weights.get(),
                         out.get(), kSmallHidden, workspace.get(), launch);
    };
    auto set_logits = [&](uint32_t seed) {
      const auto host = testing::random_floats(tokens * kSmallExperts, -4.0f, 4.0f, seed);
      return cudaMemcpy(logits.get(), host.data(), host.size() * sizeof(float),
                        cudaMemcpyHostToDevice);
    };

    const testing::RecordedGraph graph(stream, enqueue);
    CUDA_ASSERT_OK(graph.status());
    for (uint32_t step = 0; step < 3; ++step) {
      // Copies and memsets run on the legacy stream, which `stream` does not wait for.
      CUDA_ASSERT_OK(set_logits(1100 + step));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      CUDA_ASSERT_OK(enqueue(false));
      CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
      const std::vector<float> plain = out.download();
      const std::vector<int32_t> plain_ids = ids.download();
      out.poison();
      ids.poison();
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      CUDA_ASSERT_OK(graph.launch(stream));
      CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
      EXPECT_EQ(ids.download(), plain_ids) << "step " << step;
      const std::vector<float> replayed = out.download();
      EXPECT_EQ(std::memcmp(replayed.data(), plain.data(), plain.size() * sizeof(float)), 0)
          << "step " << step;
    }
  }
  CUDA_ASSERT_OK(cudaStreamDestroy(stream));
}

// The decode gate/up kernel on tensor cores stages x before its PDL wait: safe only while every
// launch between x's producer and it lets its dependents start after its own wait (the routers
// do). x is made by a kernel launched just before the router (as add_rms_norm_moe in the
// engine), in a PDL graph, and poisoned before every replay: a gate/up block that staged x early
// would read NaN or the previous replay's x. The producer is a long GEMV (K = 32768: ~60 µs,
// its blocks trigger their dependents at their start), so that such a block would start well
// before x is written (with a one-row rms_norm as the producer, routers triggering at their start
// went unnoticed). Real 26B-A4B shapes, the fused router (one token) and route_experts (4).
TEST(MoeExperts, GateUpStagesXMadeBeforeTheRouter) {
  const ExpertSet set = make_experts(kNvfp4Multiplier, kExperts, kHidden, kInner, 1200);
  MoeExpertTable table;
  CUDA_ASSERT_OK(MoeExpertTable::create(set.device_views, table));
  std::vector<uint16_t> router_bits(static_cast<size_t>(kExperts) * kHidden);
  const auto router_values = testing::random_floats(router_bits.size(), -0.05f, 0.05f, 1201);
  std::transform(router_values.begin(), router_values.end(), router_bits.begin(), float_to_bf16);
  DeviceArray<uint16_t> router_weights(router_bits);
  quant::QMatrix router;
  router.format = WeightFormat::kBF16;
  router.rows = kExperts;
  router.cols = kHidden;
  router.data = router_weights.get();
  // The producer's weights: one bf16 value (0x3C3C, ~0.0115) throughout.
  constexpr int64_t kProducerK = 32768;
  DeviceArray<uint16_t> producer_weights(static_cast<size_t>(kHidden) * kProducerK);
  CUDA_ASSERT_OK(cudaMemset(producer_weights.get(), 0x3C, kHidden * kProducerK * 2));
  quant::QMatrix producer;
  producer.format = WeightFormat::kBF16;
  producer.rows = kHidden;
  producer.cols = kProducerK;
  producer.data = producer_weights.get();
  cudaStream_t stream;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int tokens : {1, 4}) {
    SCOPED_TRACE("tokens=" + std::to_string(tokens));
    DeviceArray<float> source(tokens * kProducerK), x(tokens * kHidden);
    DeviceArray<float> logits(tokens * kExperts);
    DeviceArray<float> scale(testing::random_floats(kExperts, 0.5f, 1.5f, 1202));
    DeviceArray<int32_t> ids(tokens * kTopK);
    DeviceArray<float> weights(tokens * kTopK);
    DeviceArray<float> out(tokens * kHidden);
    DeviceArray<uint8_t> workspace(moe_workspace_bytes(table, tokens, kTopK));
    auto enqueue = [&](bool pdl) {
      const Launch launch = {stream, pdl};
      GemvInput in;
      in.data = source.get();
      in.rows = tokens;
      in.stride = kProducerK;
      GemvOutput made;
      made.data = x.get();
      made.stride = kHidden;
      cudaError_t status = gemv(producer, in, made, launch);
      if (status != cudaSuccess) return status;
      status = tokens == 1 ? route_token(router, x.get(), true, kTopK, scale.get(), logits.get(),
                                         ids.get(), weights.get(), launch)
                           : route_experts(logits.get(), kExperts, tokens, kExperts, kTopK,
                                           scale.get(), ids.get(), weights.get(), launch);
      if (status != cudaSuccess) return status;
      return run_experts(table, x.get(), kHidden, tokens, kTopK, ids.get(), weights.get(),
                         out.get(), kHidden, workspace.get(), launch);
    };
    auto set_inputs = [&](uint32_t seed) {
      const auto host_source = testing::random_floats(tokens * kProducerK, -2.0f, 2.0f, seed);
      const auto host_logits = testing::random_floats(tokens * kExperts, -4.0f, 4.0f, seed + 1);
      const cudaError_t status = cudaMemcpy(source.get(), host_source.data(),
                                            host_source.size() * sizeof(float), cudaMemcpyDefault);
      if (status != cudaSuccess) return status;
      return cudaMemcpy(logits.get(), host_logits.data(), host_logits.size() * sizeof(float),
                        cudaMemcpyDefault);
    };
    const testing::RecordedGraph graph(stream, enqueue);
    CUDA_ASSERT_OK(graph.status());
    for (uint32_t step = 0; step < 8; ++step) {
      CUDA_ASSERT_OK(set_inputs(1210 + 2 * step));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      CUDA_ASSERT_OK(enqueue(false));
      CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
      const std::vector<float> plain = out.download();
      // The routers of tokens > 1 read the logits set above; the fused one remakes them.
      if (tokens == 1) logits.poison();
      x.poison();
      out.poison();
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      CUDA_ASSERT_OK(graph.launch(stream));
      CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
      const std::vector<float> replayed = out.download();
      EXPECT_EQ(std::memcmp(replayed.data(), plain.data(), plain.size() * sizeof(float)), 0)
          << "step " << step;
    }
  }
  CUDA_ASSERT_OK(cudaStreamDestroy(stream));
}

TEST(MoeExperts, KernelCount) {
  const MoeShape nvfp4 = {PackedFormat::kNVFP4, PackedFormat::kNVFP4, kExperts, kHidden, kInner};
  const MoeShape w4g32 = {PackedFormat::kW4G32, PackedFormat::kW4G32, kExperts, kHidden, kInner};
  EXPECT_EQ(run_experts_kernel_count(nvfp4, 1), 2);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, kMoeByExpertMinTokens - 1), 2);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, kMoeByExpertMinTokens), 3);
  const int grouped = moe_grouped_min_tokens(nvfp4);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, grouped - 1), 3);
  EXPECT_EQ(run_experts_kernel_count(w4g32, kMoeGroupedMinTokens - 1), 2);
  EXPECT_EQ(run_experts_kernel_count(w4g32, kMoeGroupedMinTokens), 4);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, grouped), 4);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, kMoeTokensPerPass), 4);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, kMoeTokensPerPass + 1), 6);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, kMoeTokensPerPass + grouped), 8);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, 2 * kMoeTokensPerPass + 5), 10);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, 2 * kMoeTokensPerPass + kMoeByExpertMinTokens), 11);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, kMoeGroupedMinTokens, MoePrecision::kExactF32), 2);
  EXPECT_EQ(run_experts_kernel_count(nvfp4, 2 * kMoeTokensPerPass + 5, MoePrecision::kExactF32), 6);
}

TEST(MoeExperts, RejectsUnusableExperts) {
  ExpertSet set = make_experts(kW4G32Bf16, 4, 96, 64, 800);
  EXPECT_EQ(check_experts(set.device_views), "");
  std::vector<model::ExpertMatrices> experts = set.device_views;
  experts[2].up = experts[2].down;
  EXPECT_NE(check_experts(experts).find("expert 2 up: shape"), std::string::npos)
      << check_experts(experts);
  experts = set.device_views;
  experts[1].down.format = WeightFormat::kNVFP4;
  EXPECT_NE(check_experts(experts).find("expert 1 down: nvfp4"), std::string::npos)
      << check_experts(experts);
  experts = set.device_views;
  experts[3].gate.data = static_cast<const uint8_t*>(experts[3].gate.data) + 4;
  EXPECT_NE(check_experts(experts).find("aligned"), std::string::npos) << check_experts(experts);
  experts = set.device_views;
  for (auto& e : experts) e.gate.format = e.up.format = WeightFormat::kF32;
  EXPECT_NE(check_experts(experts).find("f32"), std::string::npos) << check_experts(experts);
  MoeExpertTable table;
  EXPECT_EQ(MoeExpertTable::create(experts, table), cudaErrorInvalidValue);
  EXPECT_EQ(check_experts({}), "no experts");
}

TEST(MoeExperts, RejectsBadArguments) {
  const ExpertSet set = make_experts(kW4G32Bf16, 40, 96, 64, 850);
  MoeExpertTable table;
  CUDA_ASSERT_OK(MoeExpertTable::create(set.device_views, table));
  DeviceArray<float> x(4 * 96), weights(4 * 40), out(4 * 96);
  DeviceArray<int32_t> ids(4 * 40);
  DeviceArray<uint8_t> workspace(moe_workspace_bytes(table, 4, 33));
  auto run = [&](const float* x_rows, int64_t x_stride, int tokens, int top_k) {
    return run_experts(table, x_rows, x_stride, tokens, top_k, ids.get(), weights.get(), out.get(),
                       96, workspace.get(), Launch{});
  };
  EXPECT_EQ(run(x.get(), 96, 4, 4), cudaSuccess);
  EXPECT_EQ(run(x.get(), 96, 4, kMaxTopK + 1), cudaErrorInvalidValue);
  EXPECT_EQ(run(x.get(), 96, 4, 0), cudaErrorInvalidValue);
  EXPECT_EQ(run(x.get(), 96, 0, 4), cudaErrorInvalidValue);
  EXPECT_EQ(run(x.get(), 64, 4, 4), cudaErrorInvalidValue);      // rows overlap
  EXPECT_EQ(run(x.get() + 1, 96, 4, 4), cudaErrorInvalidValue);  // not 16-byte aligned
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
}

TEST(MoeExperts, CachedTableFollowsTheDescriptors) {
  const ExpertSet set = make_experts(kW4G32Bf16, 4, 96, 64, 900);
  std::vector<model::ExpertMatrices> experts = set.device_views;
  std::string why;
  const MoeExpertTable* first = cached_expert_table(experts, &why);
  ASSERT_NE(first, nullptr) << why;
  EXPECT_EQ(cached_expert_table(experts, &why), first);
  EXPECT_EQ(first->shape().num_experts, 4);
  // Same address, other weights: the table is rebuilt with them.
  std::swap(experts[0], experts[1]);
  const MoeExpertTable* second = cached_expert_table(experts, &why);
  ASSERT_NE(second, nullptr) << why;
  EXPECT_EQ(second->descriptors()[0].gate.weights, set.device_views[1].gate.data);
  experts[0].gate.format = WeightFormat::kF32;
  EXPECT_EQ(cached_expert_table(experts, &why), nullptr);
  EXPECT_NE(why.find("f32"), std::string::npos) << why;
}

// CudaBackend::add_rms_norm_moe (one kernel: the attention block's residual step and the MoE
// inputs) against the CPU backend's default composition of add_rms_norm, rms_norm and scale:
// 26B-A4B's width, strided rows, an unaligned odd width with a Gemma 3 style offset; the router's
// input in x's place (as the engine puts it) and in rows of its own.
TEST(MoeNorms, AddRmsNormMoeMatchesTheComposition) {
  auto made = make_cuda_backend();
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  engine::Backend& gpu = **made;
  CpuBackend cpu(0);
  struct Case {
    int64_t rows, width, stride;
    float weight_offset;
    bool router_in_x;
  };
  uint32_t seed = 900;
  for (const Case& c :
       {Case{1, kHidden, kHidden, 0.0f, true}, Case{3, kHidden, kHidden + 4, 0.0f, false},
        Case{2, 1001, 1003, 1.0f, true}}) {
    SCOPED_TRACE("width=" + std::to_string(c.width));
    const int64_t elements = c.rows * c.stride;
    const auto acc = testing::random_floats(elements, -30.0f, 30.0f, seed++);
    const auto x = testing::random_floats(elements, -3.0f, 3.0f, seed++);
    const auto weight = testing::random_floats(c.width, -1.0f, 1.5f, seed++);
    const auto next_weight = testing::random_floats(c.width, -1.0f, 1.5f, seed++);
    const auto router_scale = testing::random_floats(c.width, 0.5f, 2.0f, seed++);
    const auto expert_weight = testing::random_floats(c.width, -1.0f, 1.5f, seed++);
    const float factor = 1.0f / std::sqrt(static_cast<float>(c.width));
    const engine::NormParams norm = {c.weight_offset, 1e-6f};
    auto rows = [&](float* data) { return Rows{data, c.rows, c.width, c.stride}; };

    std::vector<float> cpu_acc = acc, cpu_x = x, cpu_next(elements, 0.0f),
                       cpu_router(elements, 0.0f), cpu_expert(elements, 0.0f);
    const engine::MoeInputs cpu_moe = {router_scale.data(), factor, expert_weight.data(),
                                       rows(c.router_in_x ? cpu_x.data() : cpu_router.data()),
                                       rows(cpu_expert.data())};
    cpu.add_rms_norm_moe(rows(cpu_acc.data()), rows(cpu_x.data()), weight.data(), 1.0f,
                         next_weight.data(), rows(cpu_next.data()), cpu_moe, norm);

    DeviceArray<float> d_acc(acc), d_x(x), d_weight(weight), d_next_weight(next_weight),
        d_router_scale(router_scale), d_expert_weight(expert_weight),
        d_next(std::vector<float>(elements, 0.0f)), d_router(std::vector<float>(elements, 0.0f)),
        d_expert(std::vector<float>(elements, 0.0f));
    const engine::MoeInputs gpu_moe = {d_router_scale.get(), factor, d_expert_weight.get(),
                                       rows(c.router_in_x ? d_x.get() : d_router.get()),
                                       rows(d_expert.get())};
    gpu.add_rms_norm_moe(rows(d_acc.get()), rows(d_x.get()), d_weight.get(), 1.0f,
                         d_next_weight.get(), rows(d_next.get()), gpu_moe, norm);
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(gpu.status().ok()) << gpu.status().error().to_string();
    auto expect_same = [&](const char* name, const std::vector<float>& got,
                           const std::vector<float>& expected) {
      for (int64_t r = 0; r < c.rows; ++r) {
        for (int64_t j = 0; j < c.width; ++j) {
          const int64_t i = r * c.stride + j;
          ASSERT_NEAR(got[i], expected[i], 1e-5 * (1.0 + std::fabs(expected[i])))
              << name << " element " << i;
        }
      }
    };
    expect_same("acc", d_acc.download(), cpu_acc);
    expect_same("next", d_next.download(), cpu_next);
    expect_same("router_in", c.router_in_x ? d_x.download() : d_router.download(),
                c.router_in_x ? cpu_x : cpu_router);
    expect_same("expert_in", d_expert.download(), cpu_expert);
  }
}

// CudaBackend::add_rms_norm_branch (one kernel: the MoE block's end) against the CPU backend's
// two add_rms_norm calls, with and without the next norm, strided rows.
TEST(MoeNorms, AddRmsNormBranchMatchesTheComposition) {
  auto made = make_cuda_backend();
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  engine::Backend& gpu = **made;
  CpuBackend cpu(0);
  uint32_t seed = 980;
  for (const bool with_next : {true, false}) {
    const int64_t rows = 3, width = kHidden, stride = kHidden + 4;
    const int64_t elements = rows * stride;
    const auto acc = testing::random_floats(elements, -40.0f, 40.0f, seed++);
    const auto branch = testing::random_floats(elements, -3.0f, 3.0f, seed++);
    const auto x = testing::random_floats(elements, -3.0f, 3.0f, seed++);
    const auto branch_weight = testing::random_floats(width, -1.0f, 1.5f, seed++);
    const auto weight = testing::random_floats(width, -1.0f, 1.5f, seed++);
    const auto next_weight = testing::random_floats(width, -1.0f, 1.5f, seed++);
    const engine::NormParams norm = {0.0f, 1e-6f};
    auto view = [&](float* data) { return Rows{data, rows, width, stride}; };
    std::vector<float> cpu_acc = acc, cpu_branch = branch, cpu_x = x, cpu_next(elements, 0.0f);
    cpu.add_rms_norm_branch(view(cpu_acc.data()), view(cpu_branch.data()), view(cpu_x.data()),
                            branch_weight.data(), weight.data(), 0.75f, next_weight.data(),
                            with_next ? view(cpu_next.data()) : Rows{}, norm);
    DeviceArray<float> d_acc(acc), d_branch(branch), d_x(x), d_branch_weight(branch_weight),
        d_weight(weight), d_next_weight(next_weight), d_next(std::vector<float>(elements, 0.0f));
    gpu.add_rms_norm_branch(view(d_acc.get()), view(d_branch.get()), view(d_x.get()),
                            d_branch_weight.get(), d_weight.get(), 0.75f, d_next_weight.get(),
                            with_next ? view(d_next.get()) : Rows{}, norm);
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(gpu.status().ok()) << gpu.status().error().to_string();
    const auto got_acc = d_acc.download(), got_next = d_next.download();
    for (int64_t i = 0; i < elements; ++i) {
      ASSERT_NEAR(got_acc[i], cpu_acc[i], 1e-5 * (1.0 + std::fabs(cpu_acc[i]))) << "acc " << i;
      ASSERT_NEAR(got_next[i], cpu_next[i], 1e-5 * (1.0 + std::fabs(cpu_next[i]))) << "next " << i;
    }
  }
}

// CudaBackend::matmul_route_experts for one token (the fused router kernel: a cluster of blocks,
// then the routing in block 0) against the CPU backend's matmul + route_experts, in both
// activation modes (fp32 x, and x rounded to bf16 as the GEMV's bf16 mode; the CPU reference
// gets the rounded x then), at 26B-A4B's router shape and at odd expert counts, with a top-k
// that reaches the cluster's last rows. Two tokens take the two-operation path.
TEST(MoeRouter, FusedDecodeRouterMatchesTheComposition) {
  CpuBackend cpu(0);
  struct Case {
    int experts;
    int64_t hidden;
    int top_k;
    int tokens;
  };
  uint32_t seed = 950;
  for (const bool fp32 : {true, false}) {
    auto made =
        make_cuda_backend(0, {.activations = fp32 ? ActivationMode::kF32 : kDefaultActivationMode});
    ASSERT_TRUE(made.ok()) << made.error().to_string();
    engine::Backend& gpu = **made;
    // hidden 5120: x staged in more pieces (1280) than the router's threads load at once (1024).
    for (const Case& c :
         {Case{kExperts, kHidden, kTopK, 1}, Case{256, 3200, 32, 1}, Case{13, 64, 5, 1},
          Case{64, 5120, 4, 1}, Case{kExperts, kHidden, kTopK, 2}}) {
      SCOPED_TRACE("experts=" + std::to_string(c.experts) + " hidden=" + std::to_string(c.hidden) +
                   " tokens=" + std::to_string(c.tokens) + (fp32 ? " fp32" : " bf16 x"));
      const HostMatrix w = random_matrix(WeightFormat::kBF16, c.experts, c.hidden, seed++);
      const DeviceMatrix w_device(w);
      std::vector<float> x = testing::random_floats(c.tokens * c.hidden, -2.0f, 2.0f, seed++);
      const auto scale = testing::random_floats(c.experts, 0.5f, 1.5f, seed++);
      std::vector<float> x_cpu = x;
      if (!fp32) {
        for (float& v : x_cpu) v = round_bf16(v);
      }
      std::vector<float> logits(c.tokens * c.experts), weights(c.tokens * c.top_k);
      std::vector<int32_t> ids(c.tokens * c.top_k);
      cpu.matmul_route_experts(w.view(), Rows::dense(x_cpu.data(), c.tokens, c.hidden),
                               Rows::dense(logits.data(), c.tokens, c.experts),
                               {c.top_k, scale.data()}, ids.data(), weights.data());

      DeviceArray<float> x_device(x), scale_device(scale), logits_device(c.tokens * c.experts),
          weights_device(c.tokens * c.top_k);
      DeviceArray<int32_t> ids_device(c.tokens * c.top_k);
      gpu.matmul_route_experts(w_device.view, Rows::dense(x_device.get(), c.tokens, c.hidden),
                               Rows::dense(logits_device.get(), c.tokens, c.experts),
                               {c.top_k, scale_device.get()}, ids_device.get(),
                               weights_device.get());
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      ASSERT_TRUE(gpu.status().ok()) << gpu.status().error().to_string();
      const auto got_logits = logits_device.download();
      for (size_t i = 0; i < logits.size(); ++i) {
        ASSERT_NEAR(got_logits[i], logits[i], 1e-4 * (1.0 + std::fabs(logits[i]))) << "logit " << i;
      }
      EXPECT_EQ(ids_device.download(), ids);
      const auto got_weights = weights_device.download();
      for (size_t i = 0; i < weights.size(); ++i) {
        EXPECT_NEAR(got_weights[i], weights[i], 1e-5 * (1.0 + std::fabs(weights[i])))
            << "pick " << i;
      }
    }
  }
}

// The fused decode router with exact ties: router rows repeat with period 5, so the logits take
// five values, each shared by ~25 experts, and the top 8 all tie; the CPU reference keeps the
// lowest ids (and the GPU computes identical rows to identical bits).
TEST(MoeRouter, FusedDecodeRouterTiesGoToLowerIds) {
  CpuBackend cpu(0);
  auto made = make_cuda_backend();
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  engine::Backend& gpu = **made;
  HostMatrix w = random_matrix(WeightFormat::kBF16, kExperts, kHidden, 970);
  const size_t row_bytes = w.data.size() / kExperts;
  for (int e = 5; e < kExperts; ++e) {
    std::memcpy(w.data.data() + e * row_bytes, w.data.data() + (e % 5) * row_bytes, row_bytes);
  }
  const DeviceMatrix w_device(w);
  const std::vector<float> x = testing::random_floats(kHidden, -2.0f, 2.0f, 971);
  const auto scale = testing::random_floats(kExperts, 0.5f, 1.5f, 972);
  std::vector<float> x_cpu(x.size()), logits(kExperts), weights(kTopK);
  for (size_t i = 0; i < x.size(); ++i) x_cpu[i] = round_bf16(x[i]);  // the default mode's x
  std::vector<int32_t> ids(kTopK);
  cpu.matmul_route_experts(w.view(), Rows::dense(x_cpu.data(), 1, kHidden),
                           Rows::dense(logits.data(), 1, kExperts), {kTopK, scale.data()},
                           ids.data(), weights.data());
  DeviceArray<float> x_device(x), scale_device(scale), logits_device(kExperts),
      weights_device(kTopK);
  DeviceArray<int32_t> ids_device(kTopK);
  gpu.matmul_route_experts(w_device.view, Rows::dense(x_device.get(), 1, kHidden),
                           Rows::dense(logits_device.get(), 1, kExperts),
                           {kTopK, scale_device.get()}, ids_device.get(), weights_device.get());
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(gpu.status().ok()) << gpu.status().error().to_string();
  const std::vector<float> got_logits = logits_device.download();
  for (int e = 5; e < kExperts; ++e) ASSERT_EQ(got_logits[e], got_logits[e % 5]) << "expert " << e;
  EXPECT_EQ(ids_device.download(), ids);
  const auto got_weights = weights_device.download();
  for (int k = 0; k < kTopK; ++k) {
    EXPECT_NEAR(got_weights[k], weights[k], 1e-5 * (1.0 + std::fabs(weights[k]))) << "pick " << k;
  }
}

}  // namespace
}  // namespace gemma4::cuda
