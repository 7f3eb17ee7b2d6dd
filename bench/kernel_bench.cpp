// Kernel benchmark for scripts/gpu-check: chains of GEMVs with distinct weights per link (so the
// weights come from DRAM, as successive layers' do), captured once in a CUDA graph and replayed;
// plain launches and PDL side by side, every compiled tiling per shape: every weight format (the
// GGUF repacks with the engine's fp32 activations) and the GELU epilogues. Also decode attention
// and prefill attention (a pass's queries against a cache, or against a ring plus the pass's
// staged K/V). And E2B's per-layer-input step (ple_step.h) chained the same way.
// Prints one line per measurement, a summary table last, and writes JSON (--json PATH).
//
// Usage: kernel_bench [--json PATH] [--quick] [--filter TEXT[|TEXT...]] [--mma-tilings ID[,ID...]]
//   --filter       run only the measurements whose "kernel shape M=m" line contains one of the
//                  |-separated alternatives; an alternative A&B needs both texts (e.g.
//                  --filter '31b|26b&M=1' for the 31B shapes and the 26B ones at one row)
//   --mma-tilings  the tensor-core GEMV's sweep measures these tiling ids only (bench_gemv_mma
//                  says how they read; PDL trigger and SM-exclusive variants included), beside
//                  the default, for every activation type
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/gemv_mma.h"
#include "backend/cuda/gemv_w8_mma.h"
#include "backend/cuda/ple_step.h"
#include "backend/cuda/prefill_kernels.h"
#include "backend/cuda/sample_logits.h"
#include "bench_util.h"
#include "fill.h"

namespace {

using gemma4::cuda::ActType;
using gemma4::cuda::GemvEpilogue;
using gemma4::cuda::GemvInput;
using gemma4::cuda::GemvOutput;
using gemma4::cuda::Launch;
using gemma4::quant::QMatrix;
using gemma4::quant::ScaleType;
using gemma4::quant::WeightFormat;

constexpr double kReadCeilingGBs = 4250.0;  // measured H200 read bandwidth (h200-decode-notes.md)

// --filter's alternatives, each a list of texts that must all occur; empty: every measurement.
std::vector<std::vector<std::string>> g_filters;
// --mma-tilings: the tensor-core GEMV tiling ids to sweep; empty: every plain one.
std::vector<int> g_mma_tilings;

// `text` split at `separator`, empty parts dropped.
std::vector<std::string> split(std::string_view text, char separator) {
  std::vector<std::string> parts;
  for (size_t begin = 0; begin <= text.size();) {
    const size_t end = std::min(text.find(separator, begin), text.size());
    if (end > begin) parts.emplace_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return parts;
}

// Whether the measurement named `kernel`, `shape`, m is selected by --filter.
bool selected(const std::string& kernel, const char* shape, int m) {
  if (g_filters.empty()) return true;
  const std::string line = kernel + " " + shape + " M=" + std::to_string(m);
  for (const std::vector<std::string>& texts : g_filters) {
    if (std::all_of(texts.begin(), texts.end(), [&](const std::string& text) {
          return line.find(text) != std::string::npos;
        })) {
      return true;
    }
  }
  return false;
}

void fill(void* p, size_t bytes, uint32_t seed, uint32_t mask = 0xFFFFFFFFu, uint32_t bits = 0) {
  CHECK(fill_random_words(p, bytes / 4, seed, mask, bits));
}

struct Weights {
  std::vector<void*> buffers;
  std::vector<QMatrix> copies;
  double bytes = 0;  // one copy, weights + scales
  ~Weights() {
    for (void* p : buffers) cudaFree(p);
  }
};

// A weight format and its scale layout (kW8: the GGUF Q8_0 / Q6_K variants).
struct Format {
  Format(WeightFormat f, ScaleType s = ScaleType::kBF16, int g = 32)
      : format(f), scale_type(s), group_size(g) {}
  WeightFormat format;
  ScaleType scale_type;
  int group_size;
};

// Enough distinct copies that a chain never finds its weights in the 60 MB L2.
void make_weights(const Format& f, int64_t rows, int64_t cols, Weights& w) {
  const WeightFormat format = f.format;
  size_t data_bytes = 0, scale_bytes = 0;
  uint32_t data_mask = 0xFFFFFFFFu, scale_mask = 0, scale_bits = 0;
  if (format == WeightFormat::kW4G32A) {
    data_bytes = rows * cols / 2;
    scale_bytes = rows * cols / 32 * 8;
    scale_mask = 0x007FFFFF;  // fp32 {scale, min} in [2^-7, 2^-6)
    scale_bits = 0x3C000000;
  } else if (format == WeightFormat::kW8) {
    data_bytes = rows * cols;
    scale_bytes = rows * cols / f.group_size * (f.scale_type == ScaleType::kF32 ? 4 : 2);
    scale_mask = f.scale_type == ScaleType::kF32 ? 0x007FFFFF : 0x03FF03FF;  // around 2^-7
    scale_bits = f.scale_type == ScaleType::kF32 ? 0x3C000000 : 0x20002000;
  } else if (format == WeightFormat::kF16) {
    data_bytes = rows * cols * 2;
    data_mask = 0xBBFFBBFF;  // fp16 pairs with bounded exponents
  } else if (format == WeightFormat::kW4G32) {
    data_bytes = rows * cols / 2;
    scale_bytes = rows * cols / 32 * 2;
    scale_mask = 0x003F003F;  // bf16 pairs around 2^-6
    scale_bits = 0x3C003C00;
  } else if (format == WeightFormat::kNVFP4) {
    data_bytes = rows * cols / 2;
    scale_bytes = rows * cols / 16;
    scale_mask = 0x0F0F0F0F;  // e4m3 around 1
    scale_bits = 0x30303030;
  } else {
    data_bytes = rows * cols * 2;
    data_mask = 0x3F7F3F7F;  // bf16 with bounded exponents
  }
  w.bytes = static_cast<double>(data_bytes + scale_bytes);
  const int copies = static_cast<int>(std::clamp<double>(std::ceil(256e6 / w.bytes), 2, 128));
  for (int c = 0; c < copies; ++c) {
    void* data = nullptr;
    void* scales = nullptr;
    CHECK(cudaMalloc(&data, data_bytes));
    w.buffers.push_back(data);
    fill(data, data_bytes, 17 + c, data_mask);
    if (scale_bytes) {
      CHECK(cudaMalloc(&scales, scale_bytes + 4));
      w.buffers.push_back(scales);
      fill(scales, scale_bytes + 4, 91 + c, scale_mask, scale_bits);
    }
    QMatrix m;
    m.format = format;
    m.rows = rows;
    m.cols = cols;
    m.data = data;
    m.scales = scales;
    m.scale_type = format == WeightFormat::kW4G32A ? ScaleType::kF32 : f.scale_type;
    m.group_size = f.group_size;
    m.nv_global = {3584.0f, true};
    w.copies.push_back(m);
  }
  CHECK(cudaDeviceSynchronize());
}

struct Result {
  bool skipped = false;  // not selected by --filter: neither measured nor reported
  std::string kernel;
  std::string shape;
  int m = 1;
  double mbytes = 0;
  int default_tiling = -1;
  double default_plain_us = 0, default_pdl_us = 0;
  int best_tiling = -1;
  double best_pdl_us = 1e30;
  std::string all;  // "tiling:plain/pdl" pairs

  // One variant's plain and PDL times: appended to `all`, kept as the default's when it is the
  // default variant, and as the best when its PDL time is the lowest so far.
  void add_measurement(int variant, double plain_us, double pdl_us) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%d:%.2f/%.2f", all.empty() ? "" : " ", variant, plain_us,
                  pdl_us);
    all += buf;
    if (variant == default_tiling) {
      default_plain_us = plain_us;
      default_pdl_us = pdl_us;
    }
    if (pdl_us < best_pdl_us) {
      best_pdl_us = pdl_us;
      best_tiling = variant;
    }
  }

  // Times `links` launches of enqueue(i, launch) plain and with PDL, and records them as `variant`.
  template <typename Enqueue>
  void measure(int variant, int links, cudaStream_t stream, Enqueue enqueue) {
    double us[2];
    for (int pdl = 0; pdl < 2; ++pdl) {
      const Launch launch = {stream, pdl == 1};
      us[pdl] = time_chain(
          links, [&](int i) { return enqueue(i, launch); }, stream);
    }
    add_measurement(variant, us[0], us[1]);
  }
};

std::string format_name(const Format& f) {
  switch (f.format) {
    case WeightFormat::kW4G32:
      return "w4g32";
    case WeightFormat::kNVFP4:
      return "nvfp4";
    case WeightFormat::kW4G32A:
      return "w4g32a";
    case WeightFormat::kW8:
      return std::string("w8g") + std::to_string(f.group_size) +
             (f.scale_type == ScaleType::kF32 ? "f32" : "f16");
    case WeightFormat::kF16:
      return "f16";
    default:
      return "bf16";
  }
}

Result bench_gemv(const Format& format, int64_t rows, int64_t cols, int m, ActType x_type,
                  const char* label, cudaStream_t stream, bool quick,
                  GemvEpilogue epilogue = GemvEpilogue::kNone, bool round_to_bf16 = false) {
  Result r;
  r.kernel = format_name(format) + (x_type == ActType::kBF16 ? "/x-bf16"
                                    : x_type == ActType::kQ8 ? "/x-q8"
                                    : round_to_bf16          ? "/x-f32-as-bf16"
                                                             : "/x-f32");
  if (epilogue == GemvEpilogue::kGeluMul) r.kernel += "/gelu-mul";
  if (epilogue == GemvEpilogue::kGeluPairs) r.kernel += "/gelu-pairs";
  r.shape = label;
  r.m = m;
  r.skipped = !selected(r.kernel, label, m);
  if (r.skipped) return r;
  Weights w;
  make_weights(format, rows, cols, w);
  const int links = std::max<int>(static_cast<int>(w.copies.size()), 8);
  void* x = nullptr;
  float* y = nullptr;
  float* multiplier = nullptr;
  CHECK(cudaMalloc(&x, size_t(m) * cols * 4));
  CHECK(cudaMalloc(&y, size_t(m) * rows * 4));
  CHECK(cudaMalloc(&multiplier, size_t(m) * rows * 4));
  fill(x, size_t(m) * cols * 4, 5, 0x3F7F3F7F);  // finite bf16 pairs / floats
  fill(multiplier, size_t(m) * rows * 4, 6, 0x3F7FFFFF);
  const GemvInput input = {x, x_type, m, cols, round_to_bf16};
  const int64_t width = epilogue == GemvEpilogue::kGeluPairs ? rows / 2 : rows;
  const GemvOutput output = {y, width, epilogue, multiplier, rows};

  r.mbytes = w.bytes / 1e6;
  r.default_tiling = gemma4::cuda::default_gemv_tiling(w.copies[0], m, x_type);
  const auto tilings = gemma4::cuda::gemv_tilings();
  for (int t = 0; t < static_cast<int>(tilings.size()); ++t) {
    if ((tilings[t].m_tile == 1) != (m == 1) || !gemma4::cuda::gemv_tiling_compiled(t)) continue;
    if (quick && t != r.default_tiling) continue;
    r.measure(t, links, stream, [&](int i, const Launch& launch) {
      return gemma4::cuda::gemv(w.copies[i % w.copies.size()], input, output, launch, t);
    });
  }
  // The streaming kernel's tilings (100 + i) and the split-K kernel's (200 + i), where they take
  // the call: one uncaptured launch says (and sets the kernel up before the capture).
  const auto measure_if_taken = [&](int t) {
    if (gemma4::cuda::gemv(w.copies[0], input, output, Launch{stream, false}, t) != cudaSuccess) {
      return;
    }
    CHECK(cudaStreamSynchronize(stream));
    r.measure(t, links, stream, [&](int i, const Launch& launch) {
      return gemma4::cuda::gemv(w.copies[i % w.copies.size()], input, output, launch, t);
    });
  };
  for (int t = gemma4::cuda::kGemvStreamTilingBase;
       t < gemma4::cuda::kGemvStreamTilingBase + gemma4::cuda::kNumGemvStreamTilings; ++t) {
    if (gemma4::cuda::gemv_stream_tiling_compiled(t) && (!quick || t == r.default_tiling)) {
      measure_if_taken(t);
    }
  }
  for (int t = gemma4::cuda::kGemvSplitKTilingBase;
       t < gemma4::cuda::kGemvSplitKTilingBase + gemma4::cuda::kNumGemvSplitKTilings; ++t) {
    if (gemma4::cuda::gemv_splitk_tiling_compiled(t) && (!quick || t == r.default_tiling)) {
      measure_if_taken(t);
    }
  }
  // The tensor-core w8 kernel (300), where it takes the call.
  if (!quick || r.default_tiling == gemma4::cuda::kGemvW8MmaTiling) {
    measure_if_taken(gemma4::cuda::kGemvW8MmaTiling);
  }
  std::printf("%-14s %-22s M=%-2d %8.2f MB  tilings(plain/pdl us): %s\n", r.kernel.c_str(), label,
              m, r.mbytes, r.all.c_str());
  std::fflush(stdout);
  CHECK(cudaFree(x));
  CHECK(cudaFree(y));
  CHECK(cudaFree(multiplier));
  return r;
}

// The tensor-core batched GEMV (gemv_mma.h) at M rows: the default (default_mma_gemv_tiling's
// choice, whatever its options) and, with `sweep`, every warp layout at 1, 2, 4 and 8 splits,
// each with one block per row tile and with resident looping blocks (--mma-tilings: the listed
// ones instead, also with the PDL trigger, SM-exclusive and activation-block variants, at every
// activation type). The tiling column reads looping·1000 + k_warps·100 + (row tile / 32)·10 +
// splits, plus 10000 for warps of one 16-row tile (twice the warps of the two-tile layout of the
// same row tile), plus 100000 · trigger (1 after the staging, 2 after the products), 1000000 for
// sm_exclusive and 10000000 · (activation_blocks - 1) (listed only: 1, 2, 4 or 8); 100000000 for
// the streamed kernel (gemv_mma_streamed.cu: NVFP4 with bf16 rows up to 32, every layout and
// split). The GELU epilogues write the bf16 companion too, as the engine's gate+up and PLE gate
// do (the next GEMV's input).
Result bench_gemv_mma(WeightFormat format, int64_t rows, int64_t cols, int m, ActType x_type,
                      const char* label, cudaStream_t stream, bool sweep,
                      GemvEpilogue epilogue = GemvEpilogue::kNone) {
  Result r;
  r.kernel = std::string(format == WeightFormat::kNVFP4 ? "mma-nvfp4/" : "mma/") +
             (x_type == ActType::kBF16 ? "x-bf16"
              : x_type == ActType::kQ8 ? "x-q8"
                                       : "x-f32-as-bf16");
  if (epilogue == GemvEpilogue::kGeluPairs) r.kernel += "/gelu-pairs";
  r.shape = label;
  r.m = m;
  r.skipped = !selected(r.kernel, label, m);
  if (r.skipped) return r;
  Weights w;
  make_weights(Format(format), rows, cols, w);
  const int links = std::max<int>(static_cast<int>(w.copies.size()), 8);
  void* x = nullptr;
  float* y = nullptr;
  float* multiplier = nullptr;
  CHECK(cudaMalloc(&x, size_t(m) * cols * 4));
  CHECK(cudaMalloc(&y, size_t(m) * rows * 4));
  CHECK(cudaMalloc(&multiplier, size_t(m) * rows * 4));
  fill(x, size_t(m) * cols * 4, 5, 0x3F7F3F7F);
  fill(multiplier, size_t(m) * rows * 4, 6, 0x3F7FFFFF);
  const GemvInput input = {x, x_type, m, cols, x_type == ActType::kF32};
  const int64_t width = epilogue == GemvEpilogue::kGeluPairs ? rows / 2 : rows;
  GemvOutput output = {y, width, epilogue, multiplier, rows};
  uint16_t* companion = nullptr;
  if (epilogue != GemvEpilogue::kNone) {
    CHECK(cudaMalloc(&companion, size_t(m) * width * 2));
    output.companions = {companion, nullptr, width};
  }

  r.mbytes = w.bytes / 1e6;
  const gemma4::cuda::MmaGemvTiling chosen =
      gemma4::cuda::default_mma_gemv_tiling(rows, cols, m, x_type);
  const auto tiling_id = [](const gemma4::cuda::MmaGemvTiling& t) {
    return (t.streamed ? 100000000 : 0) + 10000000 * (t.activation_blocks - 1) +
           (t.sm_exclusive ? 1000000 : 0) + 100000 * static_cast<int>(t.trigger) +
           (t.tiles_per_warp == 1 ? 10000 : 0) + (t.row_blocks != 0 ? 1000 : 0) + 100 * t.k_warps +
           10 * (gemma4::cuda::mma_gemv_tile_rows(t) / 32) + t.splits;
  };
  r.default_tiling = tiling_id(chosen);
  // The default first (measured whatever its options: the sweep below enumerates some of them
  // only), then the swept tilings that fit shared memory.
  std::vector<gemma4::cuda::MmaGemvTiling> measured = {chosen};
  const bool listed = !g_mma_tilings.empty();
  for (const gemma4::cuda::MmaGemvWarpLayout& layout : gemma4::cuda::kMmaGemvWarpLayouts) {
    for (int splits = 1; splits <= gemma4::cuda::kMmaGemvMaxSplits; ++splits) {
      for (int row_blocks : {0, gemma4::cuda::kMmaGemvResidentRowBlocks}) {
        for (int variant = 0; variant < (listed ? 24 : 1); ++variant) {
          gemma4::cuda::MmaGemvTiling tiling =
              gemma4::cuda::mma_gemv_tiling(layout, splits, row_blocks);
          tiling.trigger = static_cast<gemma4::cuda::MmaGemvTrigger>(variant % 3);
          tiling.sm_exclusive = variant % 6 >= 3;
          tiling.activation_blocks = 1 << (variant / 6);
          const int id = tiling_id(tiling);
          const bool swept = listed ? std::find(g_mma_tilings.begin(), g_mma_tilings.end(), id) !=
                                          g_mma_tilings.end()
                                    : sweep && (splits & (splits - 1)) == 0;  // 1, 2, 4, 8
          if (swept && id != r.default_tiling &&
              gemma4::cuda::mma_gemv_shared_bytes(tiling, m, cols / 32) <=
                  gemma4::cuda::kMmaGemvMaxSharedBytes) {
            measured.push_back(tiling);
          }
        }
      }
    }
  }
  // The streamed kernel (NVFP4, bf16 activations, up to 32 rows): every layout and split.
  if (format == WeightFormat::kNVFP4 && x_type == ActType::kBF16 && m <= 32 &&
      (cols / 32) % 2 == 0) {
    for (const gemma4::cuda::MmaGemvWarpLayout& layout : gemma4::cuda::kMmaGemvStreamedLayouts) {
      for (int splits = 1; splits <= gemma4::cuda::kMmaGemvMaxSplits; ++splits) {
        gemma4::cuda::MmaGemvTiling tiling = gemma4::cuda::mma_gemv_tiling(layout, splits);
        tiling.streamed = true;
        const int id = tiling_id(tiling);
        const bool swept = listed ? std::find(g_mma_tilings.begin(), g_mma_tilings.end(), id) !=
                                        g_mma_tilings.end()
                                  : sweep;
        if (swept && gemma4::cuda::mma_gemv_streamed_shared_bytes(tiling, m) <=
                         gemma4::cuda::kMmaGemvMaxSharedBytes) {
          measured.push_back(tiling);
        }
      }
    }
  }
  for (const gemma4::cuda::MmaGemvTiling& tiling : measured) {
    r.measure(tiling_id(tiling), links, stream, [&](int i, const Launch& launch) {
      return gemma4::cuda::gemv_mma(w.copies[i % w.copies.size()], input, output, launch, tiling);
    });
  }
  std::printf("%-14s %-22s M=%-2d %8.2f MB  tilings(plain/pdl us): %s\n", r.kernel.c_str(), label,
              m, r.mbytes, r.all.c_str());
  std::fflush(stdout);
  CHECK(cudaFree(x));
  CHECK(cudaFree(y));
  CHECK(cudaFree(multiplier));
  CHECK(cudaFree(companion));
  return r;
}

// E2B's per-layer-input step of one decode row (ple_step.h) as CudaBackend runs it: a chain of
// launches with distinct gate and projection weights per link (successive layers'), each updating
// the same residual row in place and writing next with its bf16 companion (the next GEMV's
// input). One variant per cluster size (the "tiling" column); MB: both matrices. Then the same
// after a down GEMV each (ple_step/after-down).
std::vector<Result> bench_ple_step(cudaStream_t stream) {
  constexpr int64_t kHidden = 1536, kPle = 256;
  Result r;
  r.kernel = "ple_step";
  r.shape = "e2b 256x1536+1536x256";
  r.skipped = !selected(r.kernel, r.shape.c_str(), r.m);
  if (r.skipped) return {r};
  Weights gate, projection;
  make_weights(Format(WeightFormat::kW4G32), kPle, kHidden, gate);
  make_weights(Format(WeightFormat::kW4G32), kHidden, kPle, projection);
  const auto view_of = [](const QMatrix& m) {
    return gemma4::cuda::MatrixView{
        gemma4::cuda::MatrixFormat::kW4G32, m.rows, m.cols, m.data, m.scales,
        static_cast<int>(m.scale_type)};
  };
  // Rows of the hidden width: acc, x, projected, next, the three norm weights; then the ple
  // width: multiplier, gated; then next's bf16 companion.
  float* rows = nullptr;
  CHECK(cudaMalloc(&rows, (7 * kHidden + 2 * kPle) * 4 + kHidden * 2));
  const auto row = [&](int i) { return rows + i * kHidden; };
  float* multiplier = row(7);
  float* gated = multiplier + kPle;
  auto* next_bf16 = reinterpret_cast<uint16_t*>(gated + kPle);
  fill(rows, 7 * kHidden * 4, 7, 0x3F7FFFFF);  // finite floats below 2
  fill(multiplier, kPle * 4, 8, 0x3F7FFFFF);
  gemma4::cuda::AddNormSpec spec;
  spec.weight = row(5);
  spec.next_weight = row(6);
  spec.scalar = 0.5f;  // keeps the chained residual bounded
  spec.next_companions = {next_bf16, nullptr, kHidden};
  const auto one_row = [&](float* data) {
    return gemma4::cuda::RowsView{data, 1, kHidden, kHidden};
  };
  const int links = static_cast<int>(std::min(gate.copies.size(), projection.copies.size()));
  r.mbytes = (gate.bytes + projection.bytes) / 1e6;
  r.default_tiling = gemma4::cuda::kPleStepDefaultClusterBlocks;
  const auto args_of = [&](int i) {
    return gemma4::cuda::PleStepArgs{one_row(row(0)),
                                     one_row(row(1)),
                                     row(4),
                                     view_of(gate.copies[i]),
                                     multiplier,
                                     gated,
                                     view_of(projection.copies[i]),
                                     row(2),
                                     one_row(row(3)),
                                     spec};
  };
  for (int cluster_blocks : {8, 16}) {
    // Once outside the graph capture: the 16-block variant sets its function attribute there.
    CHECK(gemma4::cuda::ple_step(args_of(0), Launch{stream, false}, cluster_blocks));
    CHECK(cudaStreamSynchronize(stream));
    r.measure(cluster_blocks, links, stream, [&](int i, const Launch& launch) {
      return gemma4::cuda::ple_step(args_of(i), launch, cluster_blocks);
    });
  }
  std::printf("%-14s %-22s M=%-2d %8.2f MB  clusters(plain/pdl us): %s\n", r.kernel.c_str(),
              r.shape.c_str(), r.m, r.mbytes, r.all.c_str());
  // As in the E2B token: each step after the feed-forward's down GEMV (1536x6144 from bf16
  // activations) that writes its x. Reported: a pair's time minus the GEMV's alone in the same
  // chain, the step's cost on the critical path (where the GEMV's blocks fill the GPU when the
  // step's cluster wants to start).
  Result after_down = r;
  after_down.kernel = "ple_step/after-down";
  after_down.all.clear();
  after_down.best_pdl_us = 1e30;
  Weights down;
  make_weights(Format(WeightFormat::kW4G32), kHidden, 6144, down);
  void* down_x = nullptr;
  CHECK(cudaMalloc(&down_x, 6144 * 2));
  fill(down_x, 6144 * 2, 9, 0x3B7F3B7F);  // small finite bf16 pairs
  const GemvInput down_input = {down_x, ActType::kBF16, 1, 6144};
  const GemvOutput down_output = {row(1), kHidden};
  const int down_links = std::min(links, static_cast<int>(down.copies.size()));
  double down_us[2];
  for (int pdl = 0; pdl < 2; ++pdl) {
    down_us[pdl] = time_chain(
        down_links,
        [&](int i) {
          return gemma4::cuda::gemv(down.copies[i], down_input, down_output, {stream, pdl == 1});
        },
        stream);
  }
  for (int cluster_blocks : {8, 16}) {
    double pair_us[2];
    for (int pdl = 0; pdl < 2; ++pdl) {
      const Launch launch = {stream, pdl == 1};
      pair_us[pdl] =
          2 *
          time_chain(
              2 * down_links,
              [&](int i) {
                return i % 2 == 0
                           ? gemma4::cuda::gemv(down.copies[i / 2], down_input, down_output, launch)
                           : gemma4::cuda::ple_step(args_of(i / 2), launch, cluster_blocks);
              },
              stream);
    }
    after_down.add_measurement(cluster_blocks, pair_us[0] - down_us[0], pair_us[1] - down_us[1]);
  }
  std::printf("%-14s %-22s M=%-2d down alone %.2f/%.2f us, step's cost (plain/pdl us): %s\n",
              after_down.kernel.c_str(), r.shape.c_str(), r.m, down_us[0], down_us[1],
              after_down.all.c_str());
  std::fflush(stdout);
  CHECK(cudaFree(down_x));
  CHECK(cudaFree(rows));
  return {r, after_down};
}

// The one-row residual step (add_rms_norm: residual updated in place, next written with its bf16
// companion, as CudaBackend runs it at one row) of width `width`: a chain of steps alone, then
// each after the GEMV (rows = width, `cols` from bf16 activations, distinct weights per link)
// that writes its x: a pair's time minus the GEMV's alone, the step's cost on the critical path
// (add_rms_norm/after-gemv).
std::vector<Result> bench_add_rms_norm(int64_t width, int64_t cols, const char* label,
                                       cudaStream_t stream) {
  Result r;
  r.kernel = "add_rms_norm";
  r.shape = label;
  r.skipped = !selected(r.kernel, label, 1);
  if (r.skipped) return {r};
  // Rows of the width: x, residual, next, the two norm weights; then next's bf16 companion.
  float* rows = nullptr;
  CHECK(cudaMalloc(&rows, 5 * width * 4 + width * 2));
  const auto row = [&](int i) { return gemma4::cuda::RowsView{rows + i * width, 1, width, width}; };
  fill(rows, 5 * width * 4, 17, 0x3F7FFFFF);  // finite floats below 2
  gemma4::cuda::AddNormSpec spec;
  spec.weight = row(3).data;
  spec.next_weight = row(4).data;
  spec.scalar = 0.5f;  // keeps the chained residual bounded
  spec.next_companions = {reinterpret_cast<uint16_t*>(rows + 5 * width), nullptr, width};
  const auto step = [&](const Launch& launch) {
    return gemma4::cuda::add_rms_norm(row(0), row(1), row(2), spec, launch);
  };
  constexpr int kLinks = 64;
  r.default_tiling = 0;
  r.measure(0, kLinks, stream, [&](int, const Launch& launch) { return step(launch); });
  std::printf("%-14s %-22s M=1  alone (plain/pdl us): %s\n", r.kernel.c_str(), label,
              r.all.c_str());
  Result after = r;
  after.kernel = "add_rms_norm/after-gemv";
  after.all.clear();
  after.best_pdl_us = 1e30;
  Weights w;
  make_weights(Format(WeightFormat::kW4G32), width, cols, w);
  const int links = static_cast<int>(w.copies.size());
  void* gemv_x = nullptr;
  CHECK(cudaMalloc(&gemv_x, cols * 2));
  fill(gemv_x, cols * 2, 18, 0x3B7F3B7F);  // small finite bf16 pairs
  const GemvInput input = {gemv_x, ActType::kBF16, 1, cols};
  const GemvOutput output = {row(0).data, width};
  double gemv_us[2], pair_us[2];
  for (int pdl = 0; pdl < 2; ++pdl) {
    const Launch launch = {stream, pdl == 1};
    gemv_us[pdl] = time_chain(
        links, [&](int i) { return gemma4::cuda::gemv(w.copies[i], input, output, launch); },
        stream);
    pair_us[pdl] = 2 * time_chain(
                           2 * links,
                           [&](int i) {
                             return i % 2 == 0
                                        ? gemma4::cuda::gemv(w.copies[i / 2], input, output, launch)
                                        : step(launch);
                           },
                           stream);
  }
  after.add_measurement(0, pair_us[0] - gemv_us[0], pair_us[1] - gemv_us[1]);
  std::printf(
      "%-14s %-22s M=1  gemv %lldx%lld alone %.2f/%.2f us, step's cost (plain/pdl us): %s\n",
      after.kernel.c_str(), label, static_cast<long long>(width), static_cast<long long>(cols),
      gemv_us[0], gemv_us[1], after.all.c_str());
  std::fflush(stdout);
  CHECK(cudaFree(gemv_x));
  CHECK(cudaFree(rows));
  return {r, after};
}

// The decode attention kernels measured: a cache type, and for bf16 the tensor-core kernel or
// the CUDA-core one (AttentionQuery::cuda_core_kernel), the tensor-core one also with its tiles
// loaded by thread copies instead of bulk copies (AttentionQuery::thread_copies), or without the
// split-merge counters (the merge kernel merges every split count), or with the fused prologue
// the engine uses (AttentionQuery::prepare: q, k, v normed and rotated in the launch, the new K/V
// stored), that also on a k_eq_v cache as 26B's and 31B's full layers hold (proportional RoPE of
// 64 pairs: K read in its rotated dims only, KvCacheView::keys_from_values).
struct AttentionVariant {
  gemma4::cuda::KvType type;
  bool cuda_core_kernel;
  const char* name;
  bool thread_copies = false;
  bool merge_kernel = false;
  bool prepare = false;
  bool k_eq_v = false;
};

// Decode attention over an fp32, bf16 or e4m3 cache at `depth` tokens, for each split count of
// `split_options` (the first one is reported as the default); the fastest with PDL is "best".
// `cold`: each link of the chain reads its own copy of the cache, so that (as in the engine, where
// the other layers' weights pass between two reads of a layer's cache) it comes from DRAM, not L2.
Result bench_attention(const AttentionVariant& variant, int q_heads, int kv_heads, int head_dim,
                       int64_t depth, int window, const std::vector<int>& split_options,
                       const char* label, cudaStream_t stream, bool cold = false) {
  const gemma4::cuda::KvType type = variant.type;
  Result r;
  r.kernel = variant.name;
  r.shape = label;
  r.skipped = !selected(r.kernel, label, 1);
  if (r.skipped) return r;
  const int splits = *std::max_element(split_options.begin(), split_options.end());
  const int64_t slots = window > 0 ? window : depth;
  const size_t kv_elems = size_t(slots) * kv_heads * head_dim;
  const int element_bytes = type == gemma4::cuda::KvType::kF32    ? 4
                            : type == gemma4::cuda::KvType::kBF16 ? 2
                                                                  : 1;
  const size_t kv_bytes = kv_elems * element_bytes;
  constexpr int kLinks = 16;
  const int copies = cold ? kLinks : 1;
  void *keys, *values;
  float *q, *out, *partials;
  int32_t *slot_positions, *position;
  CHECK(cudaMalloc(&keys, kv_bytes * copies));
  CHECK(cudaMalloc(&values, kv_bytes * copies));
  CHECK(cudaMalloc(&q, size_t(q_heads) * head_dim * 4));
  CHECK(cudaMalloc(&out, size_t(q_heads) * head_dim * 4));
  const size_t partial_floats =
      gemma4::cuda::attention_partials_floats(1, q_heads, head_dim, splits);
  CHECK(cudaMalloc(&partials, partial_floats * 4));
  // The engine's split-merge counters (zero, left at zero by every launch).
  int* merge_counters;
  CHECK(cudaMalloc(&merge_counters, q_heads * sizeof(int)));
  CHECK(cudaMemset(merge_counters, 0, q_heads * sizeof(int)));
  CHECK(cudaMalloc(&slot_positions, slots * 4));
  CHECK(cudaMalloc(&position, 4));
  // Small finite values: fp32 words, bf16 pairs or e4m3 quads of about the same magnitude.
  const uint32_t kv_mask = element_bytes == 4   ? 0x3C7FFFFF
                           : element_bytes == 2 ? 0x3B7F3B7F
                                                : 0x37373737;
  fill(keys, kv_bytes * copies, 1, kv_mask);
  fill(values, kv_bytes * copies, 2, kv_mask);
  fill(q, size_t(q_heads) * head_dim * 4, 3, 0x3C7FFFFF);
  std::vector<int32_t> host_positions(slots);
  const int32_t query_position = static_cast<int32_t>(depth - 1);
  for (int64_t s = 0; s < slots; ++s) {
    host_positions[s] = static_cast<int32_t>(query_position - (query_position - s) % slots);
  }
  CHECK(cudaMemcpy(slot_positions, host_positions.data(), slots * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(position, &query_position, 4, cudaMemcpyHostToDevice));
  gemma4::cuda::KvCacheView kv;
  kv.keys = keys;
  kv.values = values;
  kv.slot_positions = slot_positions;
  kv.type = type;
  kv.slots = slots;
  kv.kv_heads = kv_heads;
  kv.head_dim = head_dim;
  kv.sequence_stride = static_cast<int64_t>(kv_elems);
  gemma4::cuda::AttentionQuery query = {q, int64_t(q_heads) * head_dim, q_heads, position, 1};
  query.cuda_core_kernel = variant.cuda_core_kernel;
  query.thread_copies = variant.thread_copies;
  // The prologue's raw k and v rows, norm scales and RoPE frequencies (Gemma's 1/10000^(2i/d)).
  float *new_kv = nullptr, *norms = nullptr;
  gemma4::cuda::DecodePrepare prepare;
  if (variant.prepare) {
    const size_t row_floats = size_t(kv_heads) * head_dim;
    CHECK(cudaMalloc(&new_kv, 2 * row_floats * 4));
    CHECK(cudaMalloc(&norms, size_t(5) * head_dim / 2 * 4));
    fill(new_kv, 2 * row_floats * 4, 4, 0x3C7FFFFF);
    fill(norms, size_t(2) * head_dim * 4, 5, 0x3C7FFFFF);
    constexpr int kKEqVRotatedPairs = 64;
    const int rotated_pairs = variant.k_eq_v ? kKEqVRotatedPairs : head_dim / 2;
    std::vector<float> inv_freq(head_dim / 2, 0.0f);
    for (int i = 0; i < rotated_pairs; ++i) {
      inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / head_dim));
    }
    CHECK(cudaMemcpy(norms + 2 * head_dim, inv_freq.data(), inv_freq.size() * 4,
                     cudaMemcpyHostToDevice));
    prepare = {new_kv, 0,     new_kv + row_floats, 0, norms, norms + head_dim, true,
               1.0f,   1e-6f, norms + 2 * head_dim};
    query.prepare = &prepare;
    if (variant.k_eq_v) kv.keys_from_values = {prepare.k_norm, 1.0f, rotated_pairs};
  }
  r.mbytes = 2.0 * std::min<int64_t>(depth, slots) * kv_heads * head_dim * element_bytes / 1e6;
  r.default_tiling = split_options.front();
  const gemma4::cuda::AttentionWorkspace workspace = {
      partials, splits, variant.merge_kernel ? nullptr : merge_counters, q_heads};
  for (int option : split_options) {
    r.measure(option, kLinks, stream, [&](int link, const Launch& launch) {
      gemma4::cuda::KvCacheView link_kv = kv;
      link_kv.keys = static_cast<char*>(keys) + (link % copies) * kv_bytes;
      link_kv.values = static_cast<char*>(values) + (link % copies) * kv_bytes;
      return gemma4::cuda::decode_attention(query, link_kv, window, 1.0f, out, q_heads * head_dim,
                                            workspace, option, launch);
    });
  }
  std::printf("%-14s %-22s      %8.2f MB  splits(plain/pdl us): %s\n", r.kernel.c_str(), label,
              r.mbytes, r.all.c_str());
  for (void* p :
       {keys, values, static_cast<void*>(q), static_cast<void*>(out), static_cast<void*>(partials),
        static_cast<void*>(merge_counters), static_cast<void*>(new_kv), static_cast<void*>(norms),
        static_cast<void*>(slot_positions), static_cast<void*>(position)}) {
    CHECK(cudaFree(p));
  }
  return r;
}

// Prefill attention over a bf16 cache: `rows` queries of one sequence at positions depth ...
// depth + rows - 1, against a cache of `slots` slots holding the latest positions up to the last
// query's (prefill_attention), or with `staged` against a ring holding those before depth plus the
// queries' own K/V staged (prefill_chunk_attention, as CudaBackend attends a pass longer than its
// ring). One variant per split count: prefill_attention_splits' pick (the default), 1, 2, 4.
// Reports the tensor-core rate over the visible (query, q head, key) products: 4 · head_dim flops
// each (Q·Kᵀ and P·V).
Result bench_prefill_attention(int q_heads, int kv_heads, int head_dim, int64_t slots, int window,
                               int32_t depth, int64_t rows, bool staged, const char* label,
                               cudaStream_t stream) {
  Result r;
  r.kernel = staged ? "prefill_attn/staged" : "prefill_attn/bf16";
  r.shape = label;
  r.m = static_cast<int>(rows);
  r.skipped = !selected(r.kernel, label, r.m);
  if (r.skipped) return r;
  const int64_t width = int64_t{kv_heads} * head_dim;
  const int64_t q_width = int64_t{q_heads} * head_dim;
  const int32_t last = depth + static_cast<int32_t>(rows) - 1;
  // The slots' positions: slot s holds the latest position <= newest with p % count == s.
  auto positions_of = [](int64_t count, int32_t oldest, int32_t newest) {
    std::vector<int32_t> positions(count, -1);
    for (int32_t p = std::max<int32_t>(oldest, newest - static_cast<int32_t>(count) + 1);
         p <= newest; ++p) {
      positions[p % count] = p;
    }
    return positions;
  };
  struct Source {
    void *keys = nullptr, *values = nullptr;
    int32_t* positions = nullptr;
  };
  auto make_source = [&](int64_t count, const std::vector<int32_t>& positions, uint32_t seed) {
    Source source;
    const size_t bytes = size_t(count) * width * 2;
    CHECK(cudaMalloc(&source.keys, bytes));
    CHECK(cudaMalloc(&source.values, bytes));
    CHECK(cudaMalloc(&source.positions, count * 4));
    fill(source.keys, bytes, seed, 0x3B7F3B7F);  // small finite bf16 pairs
    fill(source.values, bytes, seed + 1, 0x3B7F3B7F);
    CHECK(cudaMemcpy(source.positions, positions.data(), count * 4, cudaMemcpyHostToDevice));
    return source;
  };
  auto view_of = [&](const Source& source, int64_t count) {
    gemma4::cuda::KvCacheView kv;
    kv.keys = source.keys;
    kv.values = source.values;
    kv.slot_positions = source.positions;
    kv.type = gemma4::cuda::KvType::kBF16;
    kv.slots = count;
    kv.kv_heads = kv_heads;
    kv.head_dim = head_dim;
    return kv;
  };
  const Source cache = make_source(slots, positions_of(slots, 0, staged ? depth - 1 : last), 1);
  const Source chunk = staged ? make_source(rows, positions_of(rows, depth, last), 3) : Source{};
  float *q, *out, *partials;
  int32_t* query_positions;
  CHECK(cudaMalloc(&q, size_t(rows) * q_width * 4));
  CHECK(cudaMalloc(&out, size_t(rows) * q_width * 4));
  CHECK(cudaMalloc(&query_positions, rows * 4));
  fill(q, size_t(rows) * q_width * 4, 5, 0x3C7FFFFF);
  std::vector<int32_t> host_positions(rows);
  double products = 0;  // visible (query, key) pairs per q head
  for (int64_t t = 0; t < rows; ++t) {
    host_positions[t] = depth + static_cast<int32_t>(t);
    products += window > 0 ? std::min<int64_t>(window, host_positions[t] + 1)
                           : std::min<int64_t>(slots, host_positions[t] + 1);
  }
  CHECK(cudaMemcpy(query_positions, host_positions.data(), rows * 4, cudaMemcpyHostToDevice));
  const gemma4::cuda::KvCacheView kv = view_of(cache, slots);
  const gemma4::cuda::KvCacheView staged_kv = staged ? view_of(chunk, rows) : kv;
  const int picked = gemma4::cuda::prefill_attention_splits(rows, q_heads, kv);
  std::vector<int> split_options = {picked};
  for (int option : {1, 2, 4}) {
    if (option != picked) split_options.push_back(option);
  }
  CHECK(cudaMalloc(
      &partials, gemma4::cuda::prefill_attention_partials_floats(rows, q_heads, head_dim, 4) * 4));
  const gemma4::cuda::RowsView q_rows{q, rows, q_width, q_width};
  const gemma4::cuda::RowsView out_rows{out, rows, q_width, q_width};
  r.mbytes = 2.0 * double(staged ? slots + rows : slots) * width * 2 / 1e6;
  r.default_tiling = picked;
  for (int option : split_options) {
    r.measure(option, 4, stream, [&](int, const Launch& launch) {
      return staged ? gemma4::cuda::prefill_chunk_attention(q_rows, query_positions, kv, staged_kv,
                                                            window, 1.0f, out_rows, partials,
                                                            option, launch)
                    : gemma4::cuda::prefill_attention(q_rows, query_positions, kv, window, 1.0f,
                                                      out_rows, partials, option, launch);
    });
  }
  const double tflops = 4.0 * head_dim * q_heads * products / (r.best_pdl_us * 1e-6) / 1e12;
  std::printf("%-19s %-26s M=%-5d splits(plain/pdl us): %s  best %.0f TFLOPS\n", r.kernel.c_str(),
              label, r.m, r.all.c_str(), tflops);
  std::fflush(stdout);
  for (const Source& source : {cache, chunk}) {
    for (void* p : {source.keys, source.values, static_cast<void*>(source.positions)}) {
      if (p != nullptr) CHECK(cudaFree(p));
    }
  }
  for (void* p : {static_cast<void*>(q), static_cast<void*>(out), static_cast<void*>(partials),
                  static_cast<void*>(query_positions)}) {
    CHECK(cudaFree(p));
  }
  return r;
}

// Ranking `rows` rows of Gemma 4's 262,144 logits to their top `candidates` (sample_logits.h:
// two launches, no edits), as summarize_logits runs it after a decode step.
Result bench_rank(int rows, int candidates, cudaStream_t stream) {
  constexpr int kVocab = 262144;
  float* logits;
  int64_t* row_index;
  void* scratch;
  uint64_t* keys;
  double* normalisers;
  CHECK(cudaMalloc(&logits, size_t(rows) * kVocab * 4));
  CHECK(cudaMalloc(&row_index, size_t(rows) * 8));
  CHECK(cudaMalloc(&scratch, gemma4::cuda::rank_scratch_bytes(rows, kVocab, candidates)));
  CHECK(cudaMalloc(&keys, size_t(rows) * candidates * 8));
  CHECK(cudaMalloc(&normalisers, size_t(rows) * 8));
  fill(logits, size_t(rows) * kVocab * 4, 5, 0x41FFFFFF);  // finite, |x| < 32
  std::vector<int64_t> host_rows(rows);
  for (int r = 0; r < rows; ++r) host_rows[r] = r;
  CHECK(cudaMemcpy(row_index, host_rows.data(), size_t(rows) * 8, cudaMemcpyHostToDevice));
  gemma4::cuda::RankRows ranked;
  ranked.logits = logits;
  ranked.rows = row_index;
  ranked.count = rows;
  ranked.stride = kVocab;
  ranked.vocab = kVocab;
  ranked.candidates = candidates;
  Result r;
  r.kernel = "rank_logits";
  r.shape = "vocab 262144 top-" + std::to_string(candidates);
  r.m = rows;
  r.mbytes = rows * kVocab * 4.0 / 1e6;
  r.default_tiling = 0;
  r.best_tiling = 0;
  for (int pdl = 0; pdl < 2; ++pdl) {
    const Launch launch = {stream, pdl == 1};
    (pdl ? r.default_pdl_us : r.default_plain_us) = time_chain(
        8,
        [&](int) {
          return gemma4::cuda::rank_logits(ranked, nullptr, 0, scratch, keys, normalisers, launch);
        },
        stream);
  }
  r.best_pdl_us = r.default_pdl_us;
  for (void* p : {static_cast<void*>(logits), static_cast<void*>(row_index), scratch,
                  static_cast<void*>(keys), static_cast<void*>(normalisers)}) {
    CHECK(cudaFree(p));
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--filter") && i + 1 < argc) {
      for (const std::string& alternative : split(argv[++i], '|')) {
        g_filters.push_back(split(alternative, '&'));
      }
    } else if (!std::strcmp(argv[i], "--mma-tilings") && i + 1 < argc) {
      for (const std::string& id : split(argv[++i], ',')) g_mma_tilings.push_back(std::stoi(id));
    }
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  struct Shape {
    int64_t rows, cols;
    const char* label;
  };
  const Shape dense[] = {
      {2560, 1536, "e2b qkv 2560x1536"},         {12288, 1536, "e2b gate+up 12288x1536"},
      {24576, 1536, "e2b gate+up 24576x1536"},   {1536, 6144, "e2b down 1536x6144"},
      {1536, 12288, "e2b down 1536x12288"},      {1536, 2048, "e2b o_proj 1536x2048"},
      {262144, 1536, "e2b lm_head 262144x1536"}, {1408, 2816, "26b expert gu 1408x2816"},
      {2816, 704, "26b expert dn 2816x704"},
  };
  std::vector<Result> results;
  for (const Shape& s : dense) {
    results.push_back(bench_gemv(WeightFormat::kW4G32, s.rows, s.cols, 1, ActType::kBF16, s.label,
                                 stream, quick));
  }
  results.push_back(bench_gemv(WeightFormat::kW4G32, 2560, 1536, 1, ActType::kF32, dense[0].label,
                               stream, quick));
  // The engine's default: fp32 activations rounded to bf16, staged in shared memory per block.
  std::vector<Shape> rounded_shapes(std::begin(dense), std::end(dense));
  rounded_shapes.push_back({256, 1536, "e2b ple gate 256x1536"});
  rounded_shapes.push_back({1536, 256, "e2b ple proj 1536x256"});
  for (const Shape& s : rounded_shapes) {
    results.push_back(bench_gemv(WeightFormat::kW4G32, s.rows, s.cols, 1, ActType::kF32, s.label,
                                 stream, quick, GemvEpilogue::kNone, true));
  }
  for (int m : {2, 8, 64}) {
    for (const Shape& s : {dense[1], dense[3]}) {
      results.push_back(bench_gemv(WeightFormat::kW4G32, s.rows, s.cols, m, ActType::kF32, s.label,
                                   stream, quick, GemvEpilogue::kNone, true));
    }
  }
  results.push_back(bench_gemv(WeightFormat::kW4G32, 262144, 1536, 1, ActType::kF32, dense[6].label,
                               stream, quick));
  // int8 activations (dp4a) beside bf16 activations, same shapes.
  for (const Shape& s : dense) {
    results.push_back(
        bench_gemv(WeightFormat::kW4G32, s.rows, s.cols, 1, ActType::kQ8, s.label, stream, quick));
  }
  for (int m : {8, 64}) {
    results.push_back(bench_gemv(WeightFormat::kW4G32, 12288, 1536, m, ActType::kQ8, dense[1].label,
                                 stream, quick));
  }
  for (int m : {2, 8, 64}) {
    results.push_back(bench_gemv(WeightFormat::kW4G32, 2560, 1536, m, ActType::kBF16,
                                 dense[0].label, stream, quick));
    results.push_back(bench_gemv(WeightFormat::kW4G32, 12288, 1536, m, ActType::kBF16,
                                 dense[1].label, stream, quick));
    results.push_back(bench_gemv(WeightFormat::kW4G32, 1536, 6144, m, ActType::kBF16,
                                 dense[3].label, stream, quick));
  }
  for (const Shape& s : {dense[0], dense[1], dense[3], dense[6], dense[7], dense[8]}) {
    results.push_back(bench_gemv(WeightFormat::kNVFP4, s.rows, s.cols, 1, ActType::kBF16, s.label,
                                 stream, quick));
  }
  results.push_back(bench_gemv(WeightFormat::kNVFP4, 1408, 2816, 8, ActType::kBF16, dense[7].label,
                               stream, quick));
  results.push_back(bench_gemv(WeightFormat::kBF16, 2560, 1536, 1, ActType::kBF16, dense[0].label,
                               stream, quick));
  results.push_back(bench_gemv(WeightFormat::kBF16, 262144, 1536, 1, ActType::kBF16,
                               "lm_head bf16 262144x1536", stream, quick));

  // Batched decode on tensor cores beside the CUDA-core batched tilings above: the engine's
  // bf16 rows (the producers' companions; every tiling), fp32 rows rounded to bf16 and q8 rows
  // (random bytes: the timing does not depend on the values; default tiling), E2B shapes; the
  // GELU pairs of gate+up as the engine runs them (bf16 rows in, the bf16 companion out).
  for (int m : {8, 16, 32, 64}) {
    for (const Shape& s : {dense[0], dense[1], dense[2], dense[3], dense[4], dense[5]}) {
      for (ActType x_type : {ActType::kF32, ActType::kBF16, ActType::kQ8}) {
        results.push_back(bench_gemv_mma(WeightFormat::kW4G32, s.rows, s.cols, m, x_type, s.label,
                                         stream, !quick && x_type == ActType::kBF16));
      }
    }
    for (const Shape& s : {dense[1], dense[2]}) {
      results.push_back(bench_gemv_mma(WeightFormat::kW4G32, s.rows, s.cols, m, ActType::kBF16,
                                       s.label, stream, false, GemvEpilogue::kGeluPairs));
    }
  }
  // E2B's other attention shapes at 8, 32 and 64 streams (default tiling, or --mma-tilings): the
  // KV-shared layers' q of sliding and full layers, the full layers' qkv and o_proj.
  const Shape e2b_attention[] = {{2048, 1536, "e2b q 2048x1536"},
                                 {4096, 1536, "e2b q 4096x1536"},
                                 {5120, 1536, "e2b qkv 5120x1536"},
                                 {1536, 4096, "e2b o_proj 1536x4096"}};
  for (int m : {8, 32, 64}) {
    for (const Shape& s : e2b_attention) {
      for (ActType x_type : {ActType::kF32, ActType::kBF16}) {
        results.push_back(bench_gemv_mma(WeightFormat::kW4G32, s.rows, s.cols, m, x_type, s.label,
                                         stream, false));
      }
    }
  }
  // E2B's per-layer-input GEMVs at 32 and 64 streams as the engine runs them there: the gate
  // (GELU times the layer's per-layer input, over the residual's bf16 companion) and the
  // projection back (over the gate's bf16 companion).
  for (int m : {32, 64}) {
    results.push_back(bench_gemv_mma(WeightFormat::kW4G32, 256, 1536, m, ActType::kBF16,
                                     "e2b ple gate 256x1536", stream, !quick,
                                     GemvEpilogue::kGeluMul));
    results.push_back(bench_gemv_mma(WeightFormat::kW4G32, 1536, 256, m, ActType::kBF16,
                                     "e2b ple proj 1536x256", stream, !quick));
  }
  // E2B's lm_head at 32 and 64 streams (the final norm's bf16 rows): the shape with the most row
  // tiles.
  for (int m : {32, 64}) {
    results.push_back(bench_gemv_mma(WeightFormat::kW4G32, 262144, 1536, m, ActType::kBF16,
                                     dense[6].label, stream, !quick));
  }
  // 26B-A4B NVFP4 dense layers at 8, 16 and 32 streams (bf16 rows, as the engine passes them):
  // tensor cores beside the CUDA-core tilings.
  const Shape nvfp4_dense[] = {{8192, 2816, "26b qkv 8192x2816"},
                               {4224, 2816, "26b gate+up 4224x2816"},
                               {2816, 2112, "26b down 2816x2112"},
                               {2816, 4096, "26b o_proj 2816x4096"}};
  for (int m : {8, 16, 32}) {
    for (const Shape& s : nvfp4_dense) {
      results.push_back(bench_gemv_mma(WeightFormat::kNVFP4, s.rows, s.cols, m, ActType::kBF16,
                                       s.label, stream, !quick));
      results.push_back(bench_gemv(WeightFormat::kNVFP4, s.rows, s.cols, m, ActType::kF32, s.label,
                                   stream, quick, GemvEpilogue::kNone, true));
    }
  }

  // Single-row decode of the 31B (w4g32, hidden 5376) and 26B-A4B dense layers (NVFP4, hidden
  // 2816) with the engine's bf16 activation companions: every CUDA-core tiling, the tensor-core
  // kernel at one row (every layout and split) beside it, and the other 4-bit format at the same
  // shapes (NVFP4's decode costs more instructions than w4g32's: is it the limit?).
  const Shape big_dense[] = {
      {16384, 5376, "31b qkv 16384x5376"},       {43008, 5376, "31b gate+up 43008x5376"},
      {5376, 8192, "31b o_proj 5376x8192"},      {5376, 21504, "31b down 5376x21504"},
      {262144, 5376, "31b lm_head 262144x5376"}, {5376, 16384, "31b full o_proj 5376x16384"},
  };
  for (const Shape& s : big_dense) {
    results.push_back(bench_gemv(WeightFormat::kW4G32, s.rows, s.cols, 1, ActType::kBF16, s.label,
                                 stream, quick));
    results.push_back(bench_gemv_mma(WeightFormat::kW4G32, s.rows, s.cols, 1, ActType::kBF16,
                                     s.label, stream, !quick));
  }
  // The 31B at 8 streams (the engine's fp32 rows) on tensor cores, every tiling.
  for (const Shape& s : big_dense) {
    if (s.rows >= 262144) continue;  // lm_head: one call a step
    results.push_back(bench_gemv_mma(WeightFormat::kW4G32, s.rows, s.cols, 8, ActType::kF32,
                                     s.label, stream, !quick));
  }
  results.push_back(bench_gemv(WeightFormat::kNVFP4, 43008, 5376, 1, ActType::kBF16,
                               big_dense[1].label, stream, quick));
  for (const Shape& s : nvfp4_dense) {
    for (WeightFormat format : {WeightFormat::kNVFP4, WeightFormat::kW4G32}) {
      results.push_back(
          bench_gemv(format, s.rows, s.cols, 1, ActType::kBF16, s.label, stream, quick));
    }
    results.push_back(bench_gemv_mma(WeightFormat::kNVFP4, s.rows, s.cols, 1, ActType::kBF16,
                                     s.label, stream, !quick));
  }
  // E2B's double-wide gate+up at one row on tensor cores (the CUDA-core tilings are above).
  results.push_back(bench_gemv_mma(WeightFormat::kW4G32, 24576, 1536, 1, ActType::kBF16,
                                   dense[2].label, stream, !quick));

  // The fused GELU epilogues against the plain GEMV of the same weights: E2B's interleaved
  // gate+up and PLE gate.
  for (GemvEpilogue e : {GemvEpilogue::kNone, GemvEpilogue::kGeluPairs}) {
    for (int m : {1, 8}) {
      results.push_back(bench_gemv(WeightFormat::kW4G32, 12288, 1536, m, ActType::kF32,
                                   dense[1].label, stream, quick, e));
    }
  }
  for (GemvEpilogue e : {GemvEpilogue::kNone, GemvEpilogue::kGeluMul}) {
    results.push_back(bench_gemv(WeightFormat::kW4G32, 256, 1536, 1, ActType::kF32,
                                 "e2b ple gate 256x1536", stream, quick, e));
  }

  for (const Result& r : bench_ple_step(stream)) results.push_back(r);
  // The one-row residual step alone and after the o_proj GEMV that writes its x: E2B, 31B.
  for (const Result& r : bench_add_rms_norm(1536, 2048, "e2b 1536", stream)) results.push_back(r);
  for (const Result& r : bench_add_rms_norm(5376, 8192, "31b 5376", stream)) results.push_back(r);

  // The GGUF repacks with fp32 activations (the engine's): Gemma 3 270M (Q4_K_M: w4g32a, w8 g16
  // f32 from Q6_K, w8 g32 f16 from Q8_0) and E2B shapes.
  const Shape gguf_shapes[] = {
      {1536, 640, "270m qkv 1536x640"},   {4096, 640, "270m gate+up 4096x640"},
      {640, 2048, "270m down 640x2048"},  {262144, 640, "270m lm_head 262144x640"},
      {2560, 1536, "e2b qkv 2560x1536"},  {12288, 1536, "e2b gate+up 12288x1536"},
      {1536, 6144, "e2b down 1536x6144"},
  };
  const Format gguf_formats[] = {
      {WeightFormat::kW4G32A},
      {WeightFormat::kW8, ScaleType::kF16, 32},
      {WeightFormat::kW8, ScaleType::kF32, 16},
      {WeightFormat::kF16},
  };
  for (const Format& f : gguf_formats) {
    for (const Shape& s : gguf_shapes) {
      if (f.format == WeightFormat::kF16 && s.rows == 262144) continue;  // no f16 lm_head
      results.push_back(bench_gemv(f, s.rows, s.cols, 1, ActType::kF32, s.label, stream, quick));
    }
    results.push_back(bench_gemv(f, 12288, 1536, 8, ActType::kF32, dense[1].label, stream, quick));
  }

  // 26B-A4B's logits matrix: bf16 as NVFP4 checkpoints keep it (bf16 companions, what the
  // engine reads by default) against the int8 copy of `--lm-head q8` (w8 g32, fp16 scales: the
  // engine's fp32 rows rounded to bf16, the only activations w8 kernels take).
  results.push_back(bench_gemv(WeightFormat::kBF16, 262144, 2816, 1, ActType::kBF16,
                               "26b lm_head 262144x2816", stream, quick));
  results.push_back(bench_gemv(Format(WeightFormat::kW8, ScaleType::kF16, 32), 262144, 2816, 1,
                               ActType::kF32, "26b lm_head 262144x2816", stream, quick,
                               GemvEpilogue::kNone, true));

  // Split counts: the first (what CudaBackend picks for a single sequence of a context at least
  // that deep: one per 32 keys up to kDecodeAttentionBlocks / kv heads) is the "default" column.
  // The engine's cache is bf16 by default (fp32 and fp8 on request); bf16 and fp8 have a
  // tensor-core kernel ("attention/bf16") beside the CUDA-core one ("attention/bf16-cc") that
  // fp32 uses; "-tc" is the tensor-core kernel on thread copies instead of bulk copies.
  const AttentionVariant attention_variants[] = {
      {gemma4::cuda::KvType::kF32, true, "attention/fp32"},
      {gemma4::cuda::KvType::kBF16, false, "attention/bf16"},
      {gemma4::cuda::KvType::kBF16, false, "attention/bf16-tc", true},
      {gemma4::cuda::KvType::kBF16, true, "attention/bf16-cc"},
      {gemma4::cuda::KvType::kBF16, false, "attention/bf16-mk", false, true},
      {gemma4::cuda::KvType::kBF16, false, "attention/bf16-prep", false, false, true},
      {gemma4::cuda::KvType::kBF16, false, "attention/bf16-keqv", false, false, true, true},
      {gemma4::cuda::KvType::kFP8, false, "attention/fp8"},
      {gemma4::cuda::KvType::kFP8, false, "attention/fp8-tc", true},
      {gemma4::cuda::KvType::kFP8, true, "attention/fp8-cc"},
  };
  for (const AttentionVariant& variant : attention_variants) {
    results.push_back(
        bench_attention(variant, 8, 1, 256, 4096, 512, {16, 2, 4, 8}, "e2b sliding w512", stream));
    results.push_back(bench_attention(variant, 16, 8, 256, 32768, 1024, {32, 8, 16},
                                      "26b sliding w1024", stream));
    results.push_back(bench_attention(variant, 16, 8, 256, 32768, 1024, {32, 8, 16},
                                      "26b sliding cold w1024", stream, true));
    results.push_back(bench_attention(variant, 8, 1, 512, 4096, 0, {128, 16, 32, 64},
                                      "e2b full depth 4K", stream));
    results.push_back(bench_attention(variant, 8, 1, 512, 32768, 0, {264, 66, 128, 132, 528},
                                      "e2b full depth 32K", stream));
    results.push_back(bench_attention(variant, 8, 1, 512, 131072, 0, {264, 132, 512, 528, 1056},
                                      "e2b full depth 128K", stream));
    results.push_back(
        bench_attention(variant, 16, 2, 512, 4096, 0, {128, 66, 132}, "26b full depth 4K", stream));
    results.push_back(bench_attention(variant, 16, 2, 512, 32768, 0, {132, 66, 128, 264},
                                      "26b full depth 32K", stream));
    // Short contexts, where the fixed cost is all: the splits the engine records for a 32K
    // context (most of them idle: their blocks take q heads instead), then for a context of a
    // few tokens (one split; `gemma4 bench --depths 0` without deeper depths).
    results.push_back(
        bench_attention(variant, 8, 1, 256, 8, 512, {16, 1}, "e2b sliding depth 8", stream));
    results.push_back(
        bench_attention(variant, 16, 8, 256, 8, 1024, {32, 1}, "26b sliding depth 8", stream));
    results.push_back(
        bench_attention(variant, 8, 1, 512, 8, 0, {264, 1}, "e2b full depth 8", stream));
    results.push_back(
        bench_attention(variant, 32, 16, 256, 8, 1024, {16, 1}, "31b sliding depth 8", stream));
    results.push_back(
        bench_attention(variant, 32, 4, 512, 8, 0, {66, 1}, "31b full depth 8", stream));
    // `gemma4 bench --depths 0` decodes its tokens at positions up to ~70: 1 to 3 key splits.
    results.push_back(
        bench_attention(variant, 8, 1, 256, 64, 512, {16, 1}, "e2b sliding depth 64", stream));
    results.push_back(
        bench_attention(variant, 8, 1, 512, 64, 0, {264, 1}, "e2b full depth 64", stream));
    results.push_back(
        bench_attention(variant, 8, 1, 512, 1024, 0, {264}, "e2b full depth 1K", stream));
    results.push_back(
        bench_attention(variant, 16, 2, 512, 1024, 0, {132}, "26b full depth 1K", stream));
  }
  // Prefill attention of passes of 2048 rows (the GPU default), a second pass deep in the prompt
  // and a first one: 26B-A4B's sliding layers (a 1056-slot ring: staged) and full layers, E2B's
  // (rings of window + pass - 1 slots hold a pass); and one 33-row piece, what the 26B's sliding
  // layers ran 62 of per pass before staging.
  for (const int32_t depth : {2048, 0}) {
    const char* deep = depth > 0 ? " @2048" : " @0";
    results.push_back(bench_prefill_attention(16, 8, 256, 1056, 1024, depth, 2048, true,
                                              (std::string("26b sliding") + deep).c_str(), stream));
    results.push_back(bench_prefill_attention(16, 2, 512, 4096, 0, depth, 2048, false,
                                              (std::string("26b full") + deep).c_str(), stream));
    results.push_back(bench_prefill_attention(8, 1, 256, 2559, 512, depth, 2048, false,
                                              (std::string("e2b sliding") + deep).c_str(), stream));
    results.push_back(bench_prefill_attention(8, 1, 512, 4096, 0, depth, 2048, false,
                                              (std::string("e2b full") + deep).c_str(), stream));
  }
  results.push_back(bench_prefill_attention(16, 8, 256, 1056, 1024, 2048, 33, false,
                                            "26b sliding piece @2048", stream));
  for (int rows : {1, 8, 64}) {
    for (int candidates : {1, 64}) results.push_back(bench_rank(rows, candidates, stream));
  }
  const int sms = prop.multiProcessorCount;
  std::erase_if(results, [](const Result& r) { return r.skipped; });

  if (json_path) {
    FILE* f = std::fopen(json_path, "w");
    if (f) {
      std::fprintf(f,
                   "{\n  \"gpu\": \"%s\",\n  \"sms\": %d,\n  \"read_ceiling_gbs\": %.0f,\n  "
                   "\"results\": [\n",
                   prop.name, sms, kReadCeilingGBs);
      for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        std::fprintf(f,
                     "    {\"kernel\": \"%s\", \"shape\": \"%s\", \"m\": %d, \"mbytes\": %.3f, "
                     "\"default\": %d, \"default_plain_us\": %.3f, \"default_pdl_us\": %.3f, "
                     "\"best\": %d, \"best_pdl_us\": %.3f, \"all\": \"%s\"}%s\n",
                     r.kernel.c_str(), r.shape.c_str(), r.m, r.mbytes, r.default_tiling,
                     r.default_plain_us, r.default_pdl_us, r.best_tiling, r.best_pdl_us,
                     r.all.c_str(), i + 1 < results.size() ? "," : "");
      }
      std::fprintf(f, "  ]\n}\n");
      std::fclose(f);
    }
  }

  std::printf("\n== kernel benchmark: %s, graph replays, distinct weights per link ==\n",
              prop.name);
  std::printf("%-15s %-25s %3s %8s | %-8s %9s %9s %7s %5s | %-5s %9s\n", "kernel", "shape", "M",
              "MB", "default", "plain us", "PDL us", "GB/s", "%ceil", "best", "PDL us");
  for (const Result& r : results) {
    const double gbs = r.mbytes * 1e6 / (r.default_pdl_us * 1e-6) / 1e9;
    std::printf("%-15s %-25s %3d %8.2f | %-8d %9.2f %9.2f %7.0f %5.1f | %-5d %9.2f\n",
                r.kernel.c_str(), r.shape.c_str(), r.m, r.mbytes, r.default_tiling,
                r.default_plain_us, r.default_pdl_us, gbs, 100.0 * gbs / kReadCeilingGBs,
                r.best_tiling, r.best_pdl_us);
  }
  return 0;
}
