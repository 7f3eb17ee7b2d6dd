// The GEMV kernels' own interface: plain parameter blocks, no checkpoint types, so the .cu side
// needs no project headers beyond launch.h (nvcc cannot parse fmt, which quant/qmatrix.h pulls
// in). gemv.h is the API the engine uses; gemv.cpp validates and translates to this.
#pragma once

#include <cstdint>

#include "backend/cuda/launch.h"

namespace gemma4::cuda {

// kQ8: activations quantized to int8 per 32 K elements (quantize_activations_q8 in gemv.h),
// multiplied with dp4a; w4g32 weights only. Row m starts at byte m · stride · 5/4 and holds
// `stride` int8 values (each group of 8 stored as elements 0,2,4,6,1,3,5,7, matching the nibble
// order of a packed word), then stride/32 fp32 scales, then stride/32 int32 sums of the values.
enum class ActType : uint8_t { kF32, kBF16, kQ8 };

// The packed layouts the kernels read (quant::WeightFormat minus fp32).
enum class PackedFormat : uint8_t { kW4G32, kNVFP4, kBF16 };

// The shape of the work one thread block does. A "chunk" is what one 16-byte weight load holds:
// 32 K elements of kW4G32/kNVFP4 (with their scales), 8 of kBF16. A team of lanes_per_row lanes
// shares rows_per_thread rows; `warps` warps split K further (shared-memory reduction, no
// atomics); each thread issues rows_per_thread · chunks_per_thread weight loads before it needs
// the activations; m_tile activation rows are accumulated per pass over the weights.
struct GemvTiling {
  int rows_per_thread;
  int lanes_per_row;
  int warps;
  int chunks_per_thread;
  int m_tile;
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
};
inline constexpr int kNumGemvTilings = sizeof(kGemvTilings) / sizeof(kGemvTilings[0]);

// The tilings default_gemv_tiling (gemv.cpp) picks: the only ones a normal build compiles. A build
// with GEMMA4_GEMV_ALL_TILINGS (the kernel benchmark's, scripts/gpu-check) compiles every tiling
// so that the choice can be re-measured. Keep this list in step with default_gemv_tiling.
inline constexpr int kDefaultGemvTilings[] = {1, 2, 3, 4, 5, 7, 8, 11, 12};

constexpr bool gemv_tiling_compiled(int tiling) {
#ifdef GEMMA4_GEMV_ALL_TILINGS
  return tiling >= 0 && tiling < kNumGemvTilings;
#else
  for (int t : kDefaultGemvTilings) {
    if (t == tiling) return true;
  }
  return false;
#endif
}

struct GemvArgs {
  const void* weights;  // 16-byte chunks, row-major: row n starts at chunk n · chunks_per_row
  const void* scales;
  int scale_type;   // quant::ScaleType value (kW4G32)
  float nv_global;  // quant::NvGlobalScale (kNVFP4)
  int nv_global_is_divisor;
  int64_t rows;
  int64_t chunks_per_row;
  const void* x;
  int64_t x_stride;
  int m;
  float* y;
  int64_t y_stride;
};

// x[r] (fp32, K = `cols`) → the kQ8 layout at out + r · out_stride · 5/4 bytes.
struct QuantizeArgs {
  const float* x;
  int64_t x_stride;
  int64_t cols;
  void* out;
  int64_t out_stride;
};
cudaError_t launch_quantize_q8(const QuantizeArgs& args, int rows, const Launch& launch);

// Enqueues the kernel of (format, x type, tiling); arguments already validated. Returns
// cudaErrorInvalidValue for a combination with no kernel (kQ8 with other than w4g32).
cudaError_t launch_gemv_kernel(PackedFormat format, ActType x_type, int tiling,
                               const GemvArgs& args, const Launch& launch);

}  // namespace gemma4::cuda
