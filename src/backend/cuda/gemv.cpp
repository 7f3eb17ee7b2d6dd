// Host side of the decode GEMV (gemv.h): validation, tiling choice, translation of a QMatrix into
// the kernels' parameter block (gemv_kernels.h).
#include "backend/cuda/gemv.h"

#include <algorithm>

#include "backend/cuda/gemv_mma.h"
#include "backend/cuda/gemv_splitk_kernels.h"
#include "backend/cuda/gemv_stream_kernels.h"
#include "backend/cuda/gemv_w8_mma.h"

namespace gemma4::cuda {
namespace {

using quant::WeightFormat;

// The kernels read scale_type as these integers.
static_assert(static_cast<int>(quant::ScaleType::kBF16) == 0 &&
              static_cast<int>(quant::ScaleType::kF16) == 1 &&
              static_cast<int>(quant::ScaleType::kF32) == 2);

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// K elements per 16-byte chunk (kChunkElems in device_math.cuh).
int64_t chunk_elements(WeightFormat format) {
  switch (format) {
    case WeightFormat::kBF16:
    case WeightFormat::kF16:
      return 8;
    case WeightFormat::kW8:
      return 16;
    default:
      return 32;
  }
}

}  // namespace

bool packed_format(WeightFormat format, PackedFormat& out) {
  switch (format) {
    case WeightFormat::kW4G32:
      out = PackedFormat::kW4G32;
      return true;
    case WeightFormat::kNVFP4:
      out = PackedFormat::kNVFP4;
      return true;
    case WeightFormat::kBF16:
      out = PackedFormat::kBF16;
      return true;
    case WeightFormat::kW4G32A:
      out = PackedFormat::kW4G32A;
      return true;
    case WeightFormat::kW8:
      out = PackedFormat::kW8;
      return true;
    case WeightFormat::kF16:
      out = PackedFormat::kF16;
      return true;
    case WeightFormat::kF32:
    case WeightFormat::kW8A:  // no packed kernel yet: the generic matmul reads it
      return false;
  }
  return false;
}

bool packed_scales_ok(const quant::QMatrix& w) {
  switch (w.format) {
    case WeightFormat::kBF16:
    case WeightFormat::kF16:
      return true;
    case WeightFormat::kW4G32A:
      return w.scales != nullptr && w.scale_type == quant::ScaleType::kF32;
    case WeightFormat::kW8:
      return w.scales != nullptr && (w.group_size == 16 || w.group_size == 32);
    default:
      return w.scales != nullptr;
  }
}

namespace {

// The output side: an epilogue's own requirements, and room for M rows of its outputs.
bool output_ok(const GemvOutput& y, int64_t rows, int m) {
  if (y.data == nullptr) return false;
  const int64_t outputs = y.epilogue == GemvEpilogue::kGeluPairs ? rows / 2 : rows;
  if (!companions_fit(y.companions, outputs)) return false;
  switch (y.epilogue) {
    case GemvEpilogue::kNone:
      return m == 1 || y.stride >= rows;
    case GemvEpilogue::kGeluMul:
      return y.multiplier != nullptr &&
             (m == 1 || (y.stride >= rows && y.multiplier_stride >= rows));
    case GemvEpilogue::kGeluPairs:
      return rows % 2 == 0 && (m == 1 || y.stride >= rows / 2);
  }
  return false;
}

}  // namespace

std::span<const GemvTiling> gemv_tilings() {
  return kGemvTilings;
}

namespace {

// The register kernel's tiling (gemv_kernel.cuh) for a shape. Per shape, from the H200
// measurements (bench/RESULTS.md, run 4, graph replays with PDL; the 31B and 26B dense shapes:
// session 5, kernel_bench --filter '31b|26b&M=1'; the E2B w4g32 shapes: session 7, kernel_bench
// at bf16 and fp32-as-bf16 activations): the fastest bf16-activation tiling, which the
// kF32 activations rounded to bf16 share (the same inner loop from shared memory); except, by
// reasoning not yet measured, where staging changes the trade-off (marked).
int default_register_tiling(const quant::QMatrix& w, int m, ActType x_type) {
  const int64_t chunks = w.cols / chunk_elements(w.format);
  if (m > 1) return m == 2 && chunks <= 48 ? 11 : 12;
  // E2B's 1536-row o_proj / down (K 2048, 6144, 12288) and 2560-row QKV, w4g32 (session 7, PDL
  // µs): bf16 activations tiling 9 (o_proj 2.90 -> 2.42, down 5.39 -> 3.95 and 9.65 -> 6.21), fp32
  // rounded to bf16 (staged) tiling 27 (o_proj 3.86 -> 2.60, down 8.33 -> 5.29 and 15.46 ->
  // 8.96); QKV tiling 7 with either (3.34 -> 2.50, 4.57 -> 2.90). kQ8 activations keep the older
  // choices (not re-measured).
  const bool e2b_w4 = w.format == WeightFormat::kW4G32 && x_type != ActType::kQ8;
  if (e2b_w4 && w.rows == 1536 && chunks >= 64) return x_type == ActType::kBF16 ? 9 : 27;
  if (e2b_w4 && w.rows == 2560 && chunks == 48) return 7;
  if (chunks <= 24) return 2;  // 26B expert down (K 704), PLE projection (K 256)
  if (chunks <= 48) {
    if (w.rows >= 131072) return 4;  // lm_head
    // Double-wide gate+up: q8 measured best with 4 (1 warp, two passes over K); with staged x,
    // 1 (2 warps, one pass: every weight load before the wait, the staging split over 64
    // threads, twice the warps per SM) — unmeasured.
    if (w.rows >= 16384) return x_type == ActType::kQ8 ? 4 : 1;
    if (w.rows >= 8192) return 1;  // gate+up
    // PLE gate (256 rows): latency-bound, so half the rows per block (2 loads per lane), twice
    // the blocks of 3 — unmeasured.
    if (w.rows <= 1024) return 2;
    return 3;  // QKV
  }
  if (chunks <= 64) return 8;  // o_proj
  // 4-bit formats (32 elements a chunk) at the 26B and 31B shapes; the 8- and 16-element formats
  // (bf16 lm_head, GGUF f16 / w8) keep the E2B-era choices below, unmeasured at these shapes.
  if (chunk_elements(w.format) == 32) {
    if (chunks <= 96) {
      // 26B QKV 8192x2816 and gate+up 4224x2816: 16 rows per block of 4 warps (NVFP4 11.0 ->
      // 6.7 and 6.2 -> 4.5 µs).
      if (w.rows >= 4096) return 6;
      if (chunks <= 72) return 27;  // 26B down 2816x2112: 8 warps (5.1 -> 3.2 µs)
    } else if (chunks <= 128) {
      return 27;  // 26B o_proj 2816x4096 (5.0 -> 4.2 µs)
    } else if (chunks <= 192 && w.rows >= 8192) {
      // 31B (K 5376): lm_head 262144 rows 320 -> 275 µs, gate+up 43008 rows 51.1 -> 49.5 µs,
      // QKV 16384 rows 21.6 -> 20.3 µs.
      if (w.rows >= 131072) return 4;
      return w.rows >= 32768 ? 6 : 1;
    } else if (chunks > 192 && w.rows >= 4096 && w.rows < 131072) {
      // 31B o_proj 5376x8192 and down 5376x21504: 2 rows per block of 4 warps, two chunks per
      // lane (13.2 -> 11.8 and 31.9 -> 27.0 µs). Fewer rows (E2B down, 1536) keep 8.
      return 9;
    }
  }
  // The logits matrices of the 26B (262144 x 2816) at one row (session 9, kernel_bench PDL µs):
  // bf16 tiling 7 324.6 (8: 358.5); w8 (--lm-head q8) tiling 1 242.1 (8: 303.8; 4: 249.0).
  if (m == 1 && w.rows >= 131072) {
    if (w.format == WeightFormat::kBF16 && chunks > 256 && chunks <= 384) return 7;
    if (w.format == WeightFormat::kW8 && chunks > 96 && chunks <= 192) return 1;
  }
  if (chunks <= 96) return 7;  // 26B expert gate+up (K 2816)
  return 8;                    // down projections
}

// Whether the streaming kernel (gemv_stream_kernels.h) takes this GEMV at `tiling`.
bool stream_takes(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y, int tiling) {
  const int64_t chunks = w.cols / 32;
  return gemv_stream_tiling_compiled(tiling) && w.format == WeightFormat::kW4G32 &&
         w.scale_type != quant::ScaleType::kF32 &&
         gemv_stream_layout_ok(kGemvStreamTilings[tiling - kGemvStreamTilingBase], chunks,
                               reinterpret_cast<uintptr_t>(w.data),
                               reinterpret_cast<uintptr_t>(w.scales)) &&
         x.rows == 1 &&
         (x.type == ActType::kBF16 || (x.type == ActType::kF32 && x.round_to_bf16)) &&
         x.residual_norm.residual == nullptr && y.companions.q8 == nullptr &&
         gemv_stream_shared_bytes(kGemvStreamTilings[tiling - kGemvStreamTilingBase], chunks) <=
             kGemvStreamMaxSharedBytes;
}

// Whether the split-K kernel (gemv_splitk_kernels.h) takes this GEMV at `tiling`.
bool splitk_takes(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y, int tiling) {
  return gemv_splitk_tiling_compiled(tiling) && w.format == WeightFormat::kW4G32 && x.rows == 1 &&
         (x.type == ActType::kBF16 || (x.type == ActType::kF32 && x.round_to_bf16)) &&
         x.residual_norm.residual == nullptr && y.companions.q8 == nullptr;
}

// Whether the tensor-core w8 kernel (gemv_w8_mma.h) takes this GEMV.
bool w8_mma_takes(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y) {
  return w.format == WeightFormat::kW8 && w.group_size == 32 &&
         w.scale_type == quant::ScaleType::kF16 && w.cols % 256 == 0 && w.cols <= 16384 &&
         x.rows == 1 &&
         (x.type == ActType::kBF16 || (x.type == ActType::kF32 && x.round_to_bf16)) &&
         x.residual_norm.residual == nullptr && y.epilogue == GemvEpilogue::kNone &&
         !has_companions(y.companions);
}

}  // namespace

// The streaming kernel where it measured faster than the register kernel: one activation row of
// large w4g32 matrices with bf16 products (gemv() falls back to the register kernel for what it
// does not take).
int default_gemv_tiling(const quant::QMatrix& w, int m, ActType x_type) {
  if (m == 1 && x_type != ActType::kQ8 && w.format == WeightFormat::kW4G32 &&
      w.scale_type != quant::ScaleType::kF32) {
    const int64_t chunks = w.cols / 32;
    // Session 8, kernel_bench M=1, PDL µs, every tiling (MID batch; previous default -> new).
    // The producer-warp kernel: 31B K 5376 QKV 18.3 -> 17.9, gate+up 43.1 -> 35.9 (124 over
    // 113; the lm_head by the same reasoning: its sweep timed out); E2B K 1536 double-wide
    // gate+up 10.4 -> 8.4, lm_head 73.3 -> 56.1 (126 over 100); E2B o_proj 1536x2048 at the
    // engine's fp32 rows as bf16, 2.65 -> 2.40 (123 over register 27). The cp.async kernel over the
    // register kernel: E2B down 1536x6144 / 1536x12288 (fp32 rows) 5.48 -> 4.58 and 9.31 -> 7.40,
    // 31B o_proj 5376x8192 (bf16 rows) 11.83 -> 11.04 (106; down 5376x21504: tiling 9 stays best).
    if (chunks == 168 && w.rows >= 16384) return 124;
    if (chunks == 48 && w.rows >= 24576) return 126;
    if (w.rows == 1536 && x_type == ActType::kF32) {
      if (chunks == 64) return 123;
      if (chunks == 192 || chunks == 384) return 106;
    }
    if (w.rows == 5376 && chunks == 256 && x_type == ActType::kBF16) return 106;
    // The split-K producer kernel (session 9, MID) at the 31B down 5376x21504 and the full
    // layers' o_proj 5376x16384, whose tiles no ring stage holds whole: 27.10 -> 21.76 and
    // 20.80 -> 18.87 (135 over register 9).
    if (w.rows == 5376 && (chunks == 672 || chunks == 512)) return 135;
  }
  // E2B's 1536-row o_proj (K 2048) and down (K 6144) with bf16 activations, the split-K kernel
  // (session 8, kernel_bench, PDL µs): 2.44 -> 2.26 and 3.96 -> 3.66 (tiling 217: four rows a
  // thread, K over two blocks). Not K 12288 (register 9: 6.21 vs 6.44), not fp32 activations
  // rounded to bf16 (217: 3.13 / 5.69, slower than the register kernel's 27 and the streaming
  // kernel's 106 / 136), not the 31B 5,376-row shapes (217: o_proj 12.5, down 27.9 vs register
  // 9's 11.8 / 27.05).
  if (m == 1 && x_type == ActType::kBF16 && w.format == WeightFormat::kW4G32 && w.rows == 1536 &&
      (w.cols == 2048 || w.cols == 6144)) {
    return 217;
  }
  return default_register_tiling(w, m, x_type);
}

cudaError_t gemv(const quant::QMatrix& w, const GemvInput& x, const GemvOutput& y,
                 const Launch& launch, int tiling) {
  PackedFormat format;
  if (!packed_format(w.format, format)) return cudaErrorInvalidValue;
  // kQ8 rows are stride · 5/4 bytes; alignment of the stride is checked in elements.
  const int64_t x_elem = x.type == ActType::kBF16 ? 2 : x.type == ActType::kQ8 ? 1 : 4;
  if (x.type == ActType::kQ8 && (w.format != WeightFormat::kW4G32 || x.stride % 32 != 0)) {
    return cudaErrorInvalidValue;
  }
  if (x.round_to_bf16 && x.type != ActType::kF32) return cudaErrorInvalidValue;
  const bool shape_ok = w.rows > 0 && w.cols > 0 && w.cols % 32 == 0 && x.rows >= 1 &&
                        x.rows <= 64 && (x.rows == 1 || x.stride >= w.cols) &&
                        output_ok(y, w.rows, x.rows);
  const bool pointers_ok = aligned16(w.data) && aligned16(x.data) &&
                           (x.stride * x_elem) % 16 == 0 && packed_scales_ok(w);
  if (!shape_ok || !pointers_ok ||
      (tiling >= kNumGemvTilings && !is_gemv_stream_tiling(tiling) &&
       !is_gemv_splitk_tiling(tiling) && tiling != kGemvW8MmaTiling)) {
    return cudaErrorInvalidValue;
  }
  const GemvResidualNorm& step = x.residual_norm;
  const bool residual_step = step.residual != nullptr;
  if (residual_step &&
      (!x.round_to_bf16 || !aligned16(step.residual) || step.residual_stride % 4 != 0 ||
       (x.rows > 1 && step.residual_stride < w.cols) || !aligned16(step.weight))) {
    return cudaErrorInvalidValue;
  }
  // Batched rows with bf16 products: tensor cores (gemv_mma.h), companions included.
  if (tiling < 0 && !residual_step && gemv_mma_takes(w, x)) {
    return gemv_mma(w, x, y, launch);
  }
  if (y.companions.q8 != nullptr) {
    if (tiling < 0) tiling = kGemvQ8PairsTiling;
    if (y.epilogue != GemvEpilogue::kGeluPairs || is_gemv_stream_tiling(tiling) ||
        !gemv_tiling_emits_q8_pairs(kGemvTilings[tiling])) {
      return cudaErrorInvalidValue;
    }
  }
  if (tiling < 0) {
    tiling = default_gemv_tiling(w, x.rows, x.type);
    if ((is_gemv_stream_tiling(tiling) && !stream_takes(w, x, y, tiling)) ||
        (is_gemv_splitk_tiling(tiling) && !splitk_takes(w, x, y, tiling))) {
      tiling = default_register_tiling(w, x.rows, x.type);
    }
  }
  const bool w8_mma = tiling == kGemvW8MmaTiling;
  if (w8_mma && !w8_mma_takes(w, x, y)) return cudaErrorInvalidValue;
  const bool stream = is_gemv_stream_tiling(tiling);
  if (stream && !stream_takes(w, x, y, tiling)) return cudaErrorInvalidValue;
  const bool splitk = is_gemv_splitk_tiling(tiling);
  if (splitk && !splitk_takes(w, x, y, tiling)) return cudaErrorInvalidValue;

  GemvArgs args = {};
  args.weights = w.data;
  args.scales = w.scales;
  args.scale_type = static_cast<int>(w.scale_type);
  args.group_size = w.group_size;
  args.nv_global = w.nv_global.value;
  args.nv_global_is_divisor = w.nv_global.is_divisor ? 1 : 0;
  args.rows = w.rows;
  args.chunks_per_row = w.cols / chunk_elements(w.format);
  args.x = x.data;
  args.x_stride = x.stride;
  args.m = x.rows;
  args.f32_products = F32Products::kExact;
  if (splitk) {
    // The split-K kernel rounds kF32 activations to bf16 in registers.
    args.f32_products = F32Products::kBF16InRegisters;
  } else if (stream) {
    // The streaming kernel stages every activation row it takes as bf16.
    args.f32_products = F32Products::kBF16Staged;
    args.staged_rows = 1;
  } else if (x.round_to_bf16) {
    // Stage a block's m tile of activations in shared memory when it fits.
    const GemvTiling& t = kGemvTilings[tiling];
    args.staged_rows = std::min(t.m_tile, x.rows);
    args.f32_products = gemv_shared_bytes(t, args.staged_rows, w.cols) <=
                                kGemvMaxSharedBytes - gemv_static_shared_bytes(format)
                            ? F32Products::kBF16Staged
                            : F32Products::kBF16InRegisters;
  }
  // The folded residual step exists only as staged rows.
  if (residual_step && args.f32_products != F32Products::kBF16Staged) return cudaErrorInvalidValue;
  args.residual_norm = step;
  args.y = y.data;
  args.y_stride = y.stride;
  args.epilogue = y.epilogue;
  args.multiplier = y.multiplier;
  args.multiplier_stride = y.multiplier_stride;
  args.y_companions = y.companions;
  if (w8_mma) return launch_gemv_w8_mma(x.type, args, launch);
  if (splitk) return launch_gemv_splitk(x.type, tiling - kGemvSplitKTilingBase, args, launch);
  if (stream) return launch_gemv_stream(x.type, tiling - kGemvStreamTilingBase, args, launch);
  return launch_gemv_kernel(format, x.type, tiling, args, launch);
}

cudaError_t gemv_epilogue(const float* products, int64_t rows, int64_t cols,
                          int64_t products_stride, const GemvOutput& y, const Launch& launch) {
  if (products == nullptr || rows < 1 || rows > 65535 || cols < 1 ||
      (rows > 1 && products_stride < cols) || !output_ok(y, cols, rows) ||
      y.companions.q8 != nullptr) {
    return cudaErrorInvalidValue;
  }
  EpilogueArgs args = {};
  args.products = products;
  args.products_stride = products_stride;
  args.rows = cols;
  args.m = static_cast<int>(rows);
  args.y = y.data;
  args.y_stride = y.stride;
  args.epilogue = y.epilogue;
  args.multiplier = y.multiplier;
  args.multiplier_stride = y.multiplier_stride;
  args.y_companions = y.companions;
  return launch_gemv_epilogue(args, launch);
}

cudaError_t quantize_activations_q8(const float* x, int rows, int64_t cols, int64_t x_stride,
                                    void* out, int64_t out_stride, const Launch& launch) {
  return write_activation_companions(x, rows, cols, x_stride, {nullptr, out, out_stride}, launch);
}

cudaError_t write_activation_companions(const float* x, int rows, int64_t cols, int64_t x_stride,
                                        const ActivationCompanions& companions,
                                        const Launch& launch) {
  if (x == nullptr || rows < 1 || rows > 65535 || cols <= 0 || cols % 32 != 0 || x_stride < cols ||
      !has_companions(companions) || !companions_fit(companions, cols)) {
    return cudaErrorInvalidValue;
  }
  return launch_write_companions({x, x_stride, cols, companions}, rows, launch);
}

}  // namespace gemma4::cuda
