// MoE layer benchmark (26B-A4B shapes: hidden 2816, moe_intermediate 704, 128 experts, top-8):
// router + experts per layer for 1, 8, 32, 128 and 512 tokens (batch-1 decode, 8 and 32
// streams, prefill chunks), NVFP4 and w4g32, on each MoE path that may serve that batch
// (decode below 512 tokens — per pair, NVFP4 also on tensor cores, "decode-tc", the default for
// one token; per expert, "by-expert", NVFP4's default from kMoeByExpertMinTokens to
// kMoeByExpertGroupedMinTokens —, grouped from 8: run_experts switches at moe_grouped_min_tokens,
// and these lines show where the crossovers really are), chained over distinct expert tables (so
// the selected experts come from DRAM, as successive layers' do), captured in a CUDA graph and
// replayed, plain launches and PDL. Reports µs per layer, tokens/s of the experts alone and the
// GB/s of expert bytes the layer reads (each distinct selected expert once). At one token also
// the fused decode router (route_token: bf16 router GEMV + routing, distinct weights per layer)
// before the experts and alone (its GB/s column then still counts the experts' bytes).
//
// Usage: moe_bench [--quick] [--tokens N[,N...]] [--path NAME]
//   --quick   experts only (no router lines), and 1 and 512 tokens unless --tokens says
//   --path    that path's lines only (decode, decode-tc, by-expert, grouped)
//   --tokens  these token counts only (e.g. --tokens 8,32: the per-pair and by-expert decode
//             paths side by side at 8 and 32 streams)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backend/cuda/moe.h"
#include "bench_util.h"
#include "fill.h"

namespace {

using gemma4::cuda::Launch;
using gemma4::cuda::MoeExpertTable;
using gemma4::cuda::MoePath;
using gemma4::quant::QMatrix;
using gemma4::quant::ScaleType;
using gemma4::quant::WeightFormat;

constexpr int kHidden = 2816;
constexpr int kInner = 704;
constexpr int kExperts = 128;
constexpr int kTopK = 8;
// 4 tables of 128 experts (~1.7 GB in NVFP4): a table comes back after ~100 MB of other
// experts, beyond the 60 MB L2.
constexpr int kTables = 4;
constexpr int kLayers = 32;

// One layer's experts in one device allocation.
struct ExpertTable {
  void* memory = nullptr;
  MoeExpertTable table;
  double expert_bytes = 0;  // one expert: gate + up + down, weights and scales
};

QMatrix carve(WeightFormat format, int64_t rows, int64_t cols, char*& cursor) {
  QMatrix m;
  m.format = format;
  m.rows = rows;
  m.cols = cols;
  m.data = cursor;
  cursor += rows * cols / 2;
  m.scales = cursor;
  cursor += format == WeightFormat::kNVFP4 ? rows * cols / 16 : rows * cols / 32 * 2;
  m.scale_type = ScaleType::kBF16;
  m.nv_global = {3584.0f, true};
  return m;
}

void make_table(WeightFormat format, uint32_t seed, ExpertTable& t) {
  const int64_t matrix_bytes =
      kInner * kHidden / 2 +
      (format == WeightFormat::kNVFP4 ? kInner * kHidden / 16 : kInner * kHidden / 32 * 2);
  t.expert_bytes = 3.0 * matrix_bytes;
  const size_t bytes = static_cast<size_t>(matrix_bytes) * 3 * kExperts;
  CHECK(cudaMalloc(&t.memory, bytes));
  // Every word drawn so that it is a finite scale (e4m3 bytes around 1, bf16 pairs around 2^-6,
  // as kernel_bench's scales); weights get the same bits, their values do not matter here.
  const bool nv = format == WeightFormat::kNVFP4;
  CHECK(fill_random_words(t.memory, bytes / 4, seed, nv ? 0x0F0F0F0Fu : 0x003F003Fu,
                          nv ? 0x30303030u : 0x3C003C00u));
  std::vector<gemma4::model::ExpertMatrices> experts(kExperts);
  char* cursor = static_cast<char*>(t.memory);
  for (auto& e : experts) {
    e.gate = carve(format, kInner, kHidden, cursor);
    e.up = carve(format, kInner, kHidden, cursor);
    e.down = carve(format, kHidden, kInner, cursor);
  }
  CHECK(MoeExpertTable::create(experts, t.table));
}

struct Layer {
  float* logits = nullptr;  // [tokens, kExperts]
  int32_t* ids = nullptr;
  float* weights = nullptr;
  void* router = nullptr;  // bf16 [kExperts, kHidden]: the fused decode router's weights
};

// What one timed layer runs: the experts alone, route_experts on given logits then the experts,
// and (one token) the fused decode router (router GEMV + routing) then the experts, or alone.
enum class Work { kExperts, kRouterExperts, kFusedRouterExperts, kFusedRouter };

const char* work_name(Work w) {
  switch (w) {
    case Work::kExperts:
      return "experts";
    case Work::kRouterExperts:
      return "router+experts";
    case Work::kFusedRouterExperts:
      return "fused-router+experts";
    case Work::kFusedRouter:
      return "fused-router";
  }
  return "?";
}

const char* path_name(MoePath path) {
  switch (path) {
    case MoePath::kDecode:
      return "decode";
    case MoePath::kDecodeTensorCores:
      return "decode-tc";
    case MoePath::kDecodeByExpert:
      return "by-expert";
    case MoePath::kGrouped:
      return "grouped";
  }
  return "?";
}

// Whether `path` runs `format` at `tokens` tokens here (and `only`, when given, is that path).
bool measured(MoePath path, WeightFormat format, int tokens, std::optional<MoePath> only) {
  const bool decode = path != MoePath::kGrouped;
  // kDecodeTensorCores runs w4g32 as kDecode: not measured twice; kDecodeByExpert runs NVFP4 only.
  const bool nvfp4_only = path == MoePath::kDecodeTensorCores || path == MoePath::kDecodeByExpert;
  return !(decode && tokens >= 512) && !(!decode && tokens < 8) &&
         !(nvfp4_only && format != WeightFormat::kNVFP4) && (!only || *only == path);
}

constexpr MoePath kPaths[] = {MoePath::kDecode, MoePath::kDecodeTensorCores,
                              MoePath::kDecodeByExpert, MoePath::kGrouped};

void bench(WeightFormat format, int tokens, bool quick, std::optional<MoePath> only,
           cudaStream_t stream) {
  if (std::none_of(std::begin(kPaths), std::end(kPaths),
                   [&](MoePath path) { return measured(path, format, tokens, only); })) {
    return;
  }
  std::vector<ExpertTable> tables(kTables);
  for (int i = 0; i < kTables; ++i) make_table(format, 100 + i, tables[i]);
  float* scale = nullptr;
  float* x = nullptr;
  float* out = nullptr;
  void* workspace = nullptr;
  CHECK(cudaMalloc(&scale, kExperts * sizeof(float)));
  CHECK(cudaMalloc(&x, size_t(tokens) * kHidden * sizeof(float)));
  CHECK(cudaMalloc(&out, size_t(tokens) * kHidden * sizeof(float)));
  // Room for either path (the grouped layout is the larger).
  CHECK(cudaMalloc(&workspace, gemma4::cuda::moe_workspace_layout(tables[0].table.shape(), tokens,
                                                                  kTopK, MoePath::kGrouped)
                                   .bytes));
  const std::vector<float> ones(kExperts, 1.0f);
  CHECK(cudaMemcpy(scale, ones.data(), kExperts * sizeof(float), cudaMemcpyHostToDevice));
  // Floats with bounded exponents (finite, |v| < 2^-1).
  CHECK(fill_random_words(x, size_t(tokens) * kHidden, 7, 0x3E7FFFFFu, 0x3C000000u));

  std::vector<Layer> layers(kLayers);
  double distinct_total = 0;
  for (int l = 0; l < kLayers; ++l) {
    Layer& layer = layers[l];
    CHECK(cudaMalloc(&layer.logits, size_t(tokens) * kExperts * sizeof(float)));
    CHECK(cudaMalloc(&layer.ids, size_t(tokens) * kTopK * sizeof(int32_t)));
    CHECK(cudaMalloc(&layer.weights, size_t(tokens) * kTopK * sizeof(float)));
    CHECK(cudaMalloc(&layer.router, size_t(kExperts) * kHidden * 2));
    // bf16 pairs of magnitude around 2^-7 (finite).
    CHECK(fill_random_words(layer.router, size_t(kExperts) * kHidden / 2, 2000 + l, 0x807F807Fu,
                            0x3C003C00u));
    CHECK(fill_random_words(layer.logits, size_t(tokens) * kExperts, 1000 + l, 0x007FFFFFu,
                            0x3F800000u));  // logits in [1, 2)
    CHECK(gemma4::cuda::route_experts(layer.logits, kExperts, tokens, kExperts, kTopK, scale,
                                      layer.ids, layer.weights, Launch{stream, false}));
    std::vector<int32_t> ids(size_t(tokens) * kTopK);
    // cudaMemcpy runs on the legacy stream, which does not wait for `stream`.
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaMemcpy(ids.data(), layer.ids, ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    distinct_total += static_cast<double>(std::set<int32_t>(ids.begin(), ids.end()).size());
  }
  const double expert_mb = distinct_total / kLayers * tables[0].expert_bytes / 1e6;

  for (MoePath path : kPaths) {
    if (!measured(path, format, tokens, only)) continue;
    for (Work work :
         {Work::kExperts, Work::kRouterExperts, Work::kFusedRouterExperts, Work::kFusedRouter}) {
      const bool fused = work == Work::kFusedRouterExperts || work == Work::kFusedRouter;
      // The fused router takes one token; alone, it is timed once (on the first path).
      if (fused && (tokens != 1 || (work == Work::kFusedRouter && path != MoePath::kDecode))) {
        continue;
      }
      double us[2];
      for (int pdl = 0; pdl < 2; ++pdl) {
        const Launch launch = {stream, pdl == 1};
        us[pdl] = time_chain(
            kLayers,
            [&](int l) {
              const Layer& layer = layers[l];
              if (fused) {
                QMatrix router;
                router.format = WeightFormat::kBF16;
                router.rows = kExperts;
                router.cols = kHidden;
                router.data = layer.router;
                const cudaError_t status = gemma4::cuda::route_token(
                    router, x, true, kTopK, scale, layer.logits, layer.ids, layer.weights, launch);
                if (status != cudaSuccess || work == Work::kFusedRouter) return status;
              } else if (work == Work::kRouterExperts) {
                const cudaError_t status =
                    gemma4::cuda::route_experts(layer.logits, kExperts, tokens, kExperts, kTopK,
                                                scale, layer.ids, layer.weights, launch);
                if (status != cudaSuccess) return status;
              }
              const MoeExpertTable& table = tables[l % kTables].table;
              const gemma4::cuda::MoeRunArgs args = {
                  table.device(), table.shape(), x,   kHidden, tokens,    kTopK,
                  layer.ids,      layer.weights, out, kHidden, workspace, path};
              return gemma4::cuda::launch_moe(args, launch);
            },
            stream);
      }
      std::printf(
          "moe %-6s T=%-4d %-9s %-20s %7.1f MB experts  plain %8.2f us  pdl %8.2f us  %7.0f "
          "GB/s  %9.0f tok/s/layer\n",
          format == WeightFormat::kNVFP4 ? "nvfp4" : "w4g32", tokens, path_name(path),
          work_name(work), expert_mb, us[0], us[1], expert_mb / us[1] * 1e3, tokens / us[1] * 1e6);
      std::fflush(stdout);
      if (quick) break;
    }
  }

  for (Layer& layer : layers) {
    CHECK(cudaFree(layer.logits));
    CHECK(cudaFree(layer.ids));
    CHECK(cudaFree(layer.weights));
    CHECK(cudaFree(layer.router));
  }
  CHECK(cudaFree(scale));
  CHECK(cudaFree(x));
  CHECK(cudaFree(out));
  CHECK(cudaFree(workspace));
  for (ExpertTable& t : tables) {
    t.table = MoeExpertTable();
    CHECK(cudaFree(t.memory));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::optional<MoePath> only;
  std::vector<int> token_counts;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
      for (const char* p = argv[++i]; *p != '\0';) {
        char* end = nullptr;
        const long count = std::strtol(p, &end, 10);
        if (end == p || count < 1 || count > 512) {
          std::fprintf(stderr, "--tokens: counts from 1 to 512, comma-separated\n");
          return 2;
        }
        token_counts.push_back(static_cast<int>(count));
        p = *end == ',' ? end + 1 : end;
      }
    } else if (std::strcmp(argv[i], "--path") == 0 && i + 1 < argc) {
      const char* name = argv[++i];
      for (MoePath path : kPaths) {
        if (std::strcmp(name, path_name(path)) == 0) only = path;
      }
      if (!only) {
        std::fprintf(stderr, "--path: decode, decode-tc, by-expert or grouped\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: moe_bench [--quick] [--tokens N[,N...]] [--path NAME]\n");
      return 2;
    }
  }
  if (token_counts.empty()) {
    token_counts = quick ? std::vector<int>{1, 512} : std::vector<int>{1, 8, 32, 128, 512};
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("== moe benchmark (hidden %d, inner %d, %d experts, top-%d, %d layers per graph)\n",
              kHidden, kInner, kExperts, kTopK, kLayers);
  for (WeightFormat format : {WeightFormat::kNVFP4, WeightFormat::kW4G32}) {
    for (int tokens : token_counts) bench(format, tokens, quick, only, stream);
  }
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
