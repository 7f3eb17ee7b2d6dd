// The GEMV kernels' own interface: plain parameter blocks, no checkpoint types, so the .cu side
// needs no project headers beyond launch.h (nvcc cannot parse fmt, which quant/qmatrix.h pulls
// in). gemv.h is the API the engine uses; gemv.cpp validates and translates to this.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/cuda/launch.h"

namespace gemma4::cuda {

// kQ8: activations quantized to int8 per 32 K elements (quantize_activations_q8 in gemv.h),
// multiplied with dp4a; w4g32 weights only. Row m starts at byte m · stride · 5/4 and holds
// `stride` int8 values (each group of 8 stored as elements 0,2,4,6,1,3,5,7, matching the nibble
// order of a packed word), then stride/32 fp32 scales, then stride/32 int32 sums of the values.
enum class ActType : uint8_t { kF32, kBF16, kQ8 };

// Low-precision copies of fp32 activation rows that a producing kernel writes next to them, so
// that the GEMV reading those rows loads its own input type instead of converting fp32 per block:
// bf16 (round to nearest even) at bf16 + r · stride elements, and/or the kQ8 layout at
// q8 + r · stride · 5/4 bytes. Either pointer may be null (not written). stride is a multiple of
// 32 and at least the row width; both arrays are 16-byte aligned.
struct ActivationCompanions {
  uint16_t* bf16 = nullptr;
  void* q8 = nullptr;
  int64_t stride = 0;
};

inline bool has_companions(const ActivationCompanions& c) {
  return c.bf16 != nullptr || c.q8 != nullptr;
}

// Whether a kernel can write companions `c` of rows of `width` values: none asked, or a width
// that is a multiple of 32 (whole kQ8 chunks, the GEMV's K), a stride that holds it, aligned
// arrays.
inline bool companions_fit(const ActivationCompanions& c, int64_t width) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return !has_companions(c) || (width % 32 == 0 && c.stride >= width && c.stride % 32 == 0 &&
                                aligned(c.bf16) && aligned(c.q8));
}

// The packed layouts the kernels read (quant::WeightFormat minus fp32).
enum class PackedFormat : uint8_t { kW4G32, kNVFP4, kBF16, kW4G32A, kW8, kF16 };

// What the GEMV does with a row's dot product acc[m][n] before storing it.
enum class GemvEpilogue : uint8_t {
  kNone,       // y[m][n] = acc
  kGeluMul,    // y[m][n] = gelu_tanh(acc) · multiplier[m][n]
  kGeluPairs,  // rows 2i, 2i+1 are a gate/up pair: y[m][i] = gelu_tanh(acc_2i) · acc_2i+1
};

// The shape of the work one thread block does. A "chunk" is what one 16-byte weight load holds:
// 32 K elements of kW4G32/kW4G32A/kNVFP4 (with their scales), 16 of kW8, 8 of kBF16/kF16. A team of
// lanes_per_row lanes shares rows_per_thread rows; `warps` warps split K further (shared-memory
// reduction, no atomics); each thread issues rows_per_thread · chunks_per_thread weight loads
// before it needs the activations; m_tile activation rows are accumulated per pass over the
// weights. With prefetch_next_pass (single-row tilings of rows longer than one pass), a thread
// issues the loads of its next pass before it multiplies the current one (twice the weight
// registers), so that a block keeps weights in flight through its compute.
// K elements per 16-byte chunk of a packed format.
constexpr int packed_chunk_elements(PackedFormat format) {
  return format == PackedFormat::kBF16 || format == PackedFormat::kF16 ? 8
         : format == PackedFormat::kW8                                 ? 16
                                                                       : 32;
}

struct GemvTiling {
  int rows_per_thread;
  int lanes_per_row;
  int warps;
  int chunks_per_thread;
  int m_tile;
  bool prefetch_next_pass = false;
};

// The compiled tilings. Single-row tilings (m_tile 1) first, then batched ones (m_tile 8): a
// batched tiling keeps all of a row's chunks in registers when its pass coverage
// lanes_per_row · warps · chunks_per_thread covers the row, so the weights are read once for
// every m tile.
inline constexpr GemvTiling kGemvTilings[] = {
    {2, 8, 2, 3, 1},   // 0: coverage 48
    {4, 8, 2, 3, 1},   // 1: coverage 48
    {2, 16, 3, 1, 1},  // 2: coverage 48
    {4, 16, 3, 1, 1},  // 3: coverage 48
    {4, 8, 1, 3, 1},   // 4: coverage 24
    {8, 8, 1, 3, 1},   // 5: coverage 24
    {4, 8, 4, 3, 1},   // 6: coverage 96
    {2, 16, 4, 3, 1},  // 7: coverage 192
    {4, 32, 2, 3, 1},  // 8: coverage 192
    {2, 32, 4, 2, 1},  // 9: coverage 256
    {4, 8, 2, 3, 8},   // 10: coverage 48, batched
    {4, 8, 4, 3, 8},   // 11: coverage 96, batched
    {4, 16, 4, 3, 8},  // 12: coverage 192, batched
    {4, 8, 1, 3, 8},   // 13: coverage 24, batched
    {4, 2, 8, 3, 1},   // 14: coverage 48, 64 rows per block: kGeluPairs can emit kQ8 companions
    // Wider blocks whose coverage matches the 31B / 26B rows exactly (K / 32 chunks: 31B 168,
    // 256, 672; 26B 88, 66, 128) or nearly, and taller blocks for tall matrices: more warps per
    // block split K over shared memory instead of leaving a third of the lanes without a chunk.
    {2, 8, 7, 3, 1},   // 15: coverage 168 (31B K 5376; K 21504 in 4 passes), 8 rows
    {4, 8, 7, 3, 1},   // 16: coverage 168, 16 rows
    {2, 4, 14, 3, 1},  // 17: coverage 168, 16 rows, 448 threads
    {2, 32, 7, 3, 1},  // 18: coverage 672 (31B K 21504 in one pass), 2 rows
    {2, 16, 7, 3, 1},  // 19: coverage 336 (K 21504 in 2 passes), 4 rows
    {2, 8, 8, 4, 1},   // 20: coverage 256 (31B K 8192), 8 rows
    {4, 16, 8, 2, 1},  // 21: coverage 256, 8 rows
    {2, 8, 11, 1, 1},  // 22: coverage 88 (26B K 2816), 8 rows, 352 threads
    {4, 4, 11, 2, 1},  // 23: coverage 88, 32 rows
    {2, 8, 4, 3, 1},   // 24: coverage 96 (K 2816 at 92 %), 8 rows
    {2, 2, 11, 3, 1},  // 25: coverage 66 (26B K 2112), 32 rows
    {2, 8, 3, 3, 1},   // 26: coverage 72 (K 2112 at 92 %), 8 rows
    {2, 8, 8, 2, 1},   // 27: coverage 128 (26B K 4096), 8 rows
    {4, 4, 4, 3, 1},   // 28: coverage 48 (E2B K 1536), 32 rows
    {4, 8, 3, 2, 1},   // 29: coverage 48, 16 rows
    // Long rows in several passes, the next pass's weights loaded during the current one's
    // products: 31B K 5376 (2 passes of 96), 8192 (3), 21504 (7).
    {2, 8, 4, 3, 1, true},   // 30: coverage 96, 8 rows
    {4, 32, 2, 3, 1, true},  // 31: tiling 8 with prefetch: coverage 192, 4 rows
    {2, 32, 2, 3, 1, true},  // 32: coverage 192, 2 rows, 64 threads
    {2, 8, 7, 3, 1, true},   // 33: tiling 15 with prefetch: coverage 168, 8 rows
    {4, 8, 2, 3, 1, true},   // 34: coverage 48, 16 rows
    {2, 16, 4, 2, 1, true},  // 35: coverage 128, 4 rows
    // E2B's 1536-row down projections in one pass with more warps per block than tiling 8
    // (whose 64-thread blocks leave ~6 warps per SM): K 12288 (384 chunks), K 6144 (192).
    {4, 32, 4, 3, 1},  // 36: coverage 384, 4 rows, 128 threads
    {2, 32, 4, 3, 1},  // 37: coverage 384, 2 rows
    {4, 32, 6, 2, 1},  // 38: coverage 384, 4 rows, 192 threads, 8 loads a lane
    {4, 32, 3, 2, 1},  // 39: coverage 192, 4 rows, 96 threads, 8 loads a lane
};
inline constexpr int kNumGemvTilings = sizeof(kGemvTilings) / sizeof(kGemvTilings[0]);

// The kGeluPairs epilogue needs both rows of a pair in one thread: a thread's rows are
// rows_per_thread consecutive rows starting at a multiple of rows_per_thread, so that must be even.
constexpr bool gemv_tilings_keep_pairs() {
  for (const GemvTiling& t : kGemvTilings) {
    if (t.rows_per_thread % 2 != 0) return false;
  }
  return true;
}
static_assert(gemv_tilings_keep_pairs(), "every GEMV tiling must give a thread whole row pairs");

// Prefetching the next pass is for single-row tilings (a batched tiling revisits pass 0 per m
// tile).
constexpr bool gemv_prefetch_single_row() {
  for (const GemvTiling& t : kGemvTilings) {
    if (t.prefetch_next_pass && t.m_tile != 1) return false;
  }
  return true;
}
static_assert(gemv_prefetch_single_row(), "only single-row GEMV tilings prefetch the next pass");

// Whether this build compiles tiling index `tiling` of a GEMV kernel family whose `count` tilings
// are indices base .. base + count − 1: with GEMMA4_GEMV_ALL_TILINGS (the kernel benchmark's
// build, scripts/gpu-check) every one, so that the choice can be re-measured; else only those in
// `defaults`, the ones default_gemv_tiling (gemv.cpp) picks.
template <size_t kDefaults>
constexpr bool gemv_family_tiling_compiled(int tiling, int base, int count,
                                           const int (&defaults)[kDefaults]) {
#ifdef GEMMA4_GEMV_ALL_TILINGS
  (void)defaults;
  return tiling >= base && tiling < base + count;
#else
  (void)base, (void)count;
  for (int t : defaults) {
    if (t == tiling) return true;
  }
  return false;
#endif
}

// The register tilings default_gemv_tiling picks. Keep this list in step with it.
inline constexpr int kDefaultGemvTilings[] = {1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 14, 27};

constexpr bool gemv_tiling_compiled(int tiling) {
  return gemv_family_tiling_compiled(tiling, 0, kNumGemvTilings, kDefaultGemvTilings);
}

// Rows of a block's tiling.
constexpr int gemv_rows_per_block(const GemvTiling& t) {
  return (32 / t.lanes_per_row) * t.rows_per_thread;
}

// The kGeluPairs epilogue can write a kQ8 companion (one 32-output chunk per block, quantized by
// warp 0 after the split-K reduction) when a block owns 64 consecutive rows of one activation
// row, through the shared-memory reduction.
constexpr bool gemv_tiling_emits_q8_pairs(const GemvTiling& t) {
  return gemv_rows_per_block(t) == 64 && t.warps > 1 && t.m_tile == 1;
}
// The tiling that does (used for kGeluPairs with a kQ8 companion).
inline constexpr int kGemvQ8PairsTiling = 14;
static_assert(gemv_tiling_emits_q8_pairs(kGemvTilings[kGemvQ8PairsTiling]));

// How kF32 activations enter the products: exactly, or rounded to bf16 (ties to even) as a bf16
// model multiplies them. Rounded activations are staged once per block into shared memory
// (converted after the PDL wait; the inner loop then reads bf16 words from shared memory) when a
// block's m tile fits gemv_shared_bytes, else rounded in registers per chunk: the same values.
enum class F32Products : uint8_t { kExact, kBF16Staged, kBF16InRegisters };

// Shared memory a block may use without the opt-in attribute.
inline constexpr int64_t kGemvMaxSharedBytes = 48 * 1024;

// The NVFP4 kernels' static table of group factors, one per e4m3 code: what their dynamic shared
// memory must leave of kGemvMaxSharedBytes.
inline constexpr int kNvfp4FactorCodes = 256;
constexpr int64_t gemv_static_shared_bytes(PackedFormat format) {
  return format == PackedFormat::kNVFP4 ? 4 * kNvfp4FactorCodes : 0;
}

// Floats of a block's split-K partial sums ([warps][m_tile][rows per block], warps > 1), rounded
// up to 16 bytes: the staged activations follow them.
constexpr int64_t gemv_partial_floats(const GemvTiling& t) {
  const int64_t floats =
      t.warps > 1 ? int64_t{t.warps} * t.m_tile * (32 / t.lanes_per_row) * t.rows_per_thread : 0;
  return (floats + 3) / 4 * 4;
}

// A block's dynamic shared memory: the partial sums, then `staged_rows` activation rows of
// `cols` bf16 values (0 rows: nothing staged).
constexpr int64_t gemv_shared_bytes(const GemvTiling& t, int64_t staged_rows, int64_t cols) {
  return 4 * gemv_partial_floats(t) + 2 * staged_rows * cols;
}

// A residual step folded into the GEMV's input (the PLE gate reads the residual right after the
// feed-forward step adds to it): every block stages, for its activation rows m,
//   residual[m] + rms_norm(x[m]; weight)      (weight_offset + weight; no factor for a null weight)
// rounded to bf16, instead of x[m] itself, and writes nothing back: add_rms_norm_deferred
// (elementwise.h) performs the step later. Products kBF16Staged only.
struct GemvResidualNorm {
  const float* residual = nullptr;  // null: no step, the GEMV multiplies x
  int64_t residual_stride = 0;
  const float* weight = nullptr;
  float weight_offset = 0.0f;
  float eps = 1e-6f;
};

struct GemvArgs {
  const void* weights;  // 16-byte chunks, row-major: row n starts at chunk n · chunks_per_row
  const void* scales;   // kW4G32A: fp32 {scale, min} pairs
  int scale_type;       // quant::ScaleType value (kW4G32, kW8)
  int group_size;       // K elements per kW8 scale (16 or 32)
  float nv_global;      // quant::NvGlobalScale (kNVFP4)
  int nv_global_is_divisor;
  int64_t rows;
  int64_t chunks_per_row;
  const void* x;
  int64_t x_stride;
  int m;
  F32Products f32_products;  // kF32 activations only
  int staged_rows;           // kBF16Staged: activation rows staged per m tile, min(m_tile, m)
  float* y;                  // kGeluPairs: rows / 2 outputs per activation row
  int64_t y_stride;
  GemvEpilogue epilogue;
  const float* multiplier;  // kGeluMul: [m][rows] at multiplier_stride
  int64_t multiplier_stride;
  // Companions of y (what the epilogue stored); q8 only with a gemv_tiling_emits_q8_pairs tiling
  // and kGeluPairs.
  ActivationCompanions y_companions;
  GemvResidualNorm residual_norm;  // x is the step's input (fp32)
};

// x[r] (fp32, K = `cols`) → its companions (bf16 and/or kQ8).
struct CompanionArgs {
  const float* x;
  int64_t x_stride;
  int64_t cols;
  ActivationCompanions out;
};
cudaError_t launch_write_companions(const CompanionArgs& args, int rows, const Launch& launch);

// Enqueues the kernel of (format, x type, tiling); arguments already validated. Returns
// cudaErrorInvalidValue for a combination with no kernel (kQ8 with other than w4g32; the GGUF
// formats kW4G32A / kW8 / kF16 take fp32 activations only, the only ones the engine passes).
cudaError_t launch_gemv_kernel(PackedFormat format, ActType x_type, int tiling,
                               const GemvArgs& args, const Launch& launch);

// The epilogue alone, over products already computed elsewhere (the generic matmul's output):
// `products` holds m rows of `rows` fp32 values at products_stride; y, multiplier as in GemvArgs.
struct EpilogueArgs {
  const float* products;
  int64_t products_stride;
  int64_t rows;
  int m;
  float* y;
  int64_t y_stride;
  GemvEpilogue epilogue;
  const float* multiplier;
  int64_t multiplier_stride;
  ActivationCompanions y_companions;  // bf16 only
};
cudaError_t launch_gemv_epilogue(const EpilogueArgs& args, const Launch& launch);

}  // namespace gemma4::cuda
