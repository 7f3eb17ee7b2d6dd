// The split-K single-row GEMV (gemv_splitk_kernels.h describes the method).
#include <cooperative_groups.h>

#include "backend/cuda/gemv_kernel.cuh"
#include "backend/cuda/gemv_splitk_kernels.h"
#include "backend/cuda/kernel_table.cuh"

namespace gemma4::cuda {
namespace gemv_splitk_detail {

namespace cg = cooperative_groups;
using gemv_detail::store_rows;

// R rows a thread, teams of T lanes, W warps, G chunks a lane, P blocks along K (the cluster).
template <ActType XT, int R, int T, int W, int G, int P>
__global__ void __launch_bounds__(W * 32) gemv_splitk_kernel(GemvArgs a) {
  static_assert(R % 2 == 0, "a thread stores whole gate/up pairs");
  static_assert(T == 8 || T == 16 || T == 32, "a team is a power-of-two part of a warp");
  static_assert(P >= 1 && P <= 8, "a portable cluster");
  constexpr int kRowsPerBlock = (32 / T) * R;
  constexpr int kCoverage = T * W * G;  // chunks of the block's part one pass loads
  pdl_trigger_dependents();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int team = lane / T;
  const int lane_in_team = lane % T;
  const int64_t block_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t first_row = block_row + team * R;
  // This block's part of K: rank `split` of the cluster (blockIdx.y), parts differing by at most
  // one chunk.
  const int split = P > 1 ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int64_t cpr = a.chunks_per_row;
  const int64_t k_begin = cpr * split / P;
  const int64_t k_end = cpr * (split + 1) / P;
  const int passes = static_cast<int>((k_end - k_begin + kCoverage - 1) / kCoverage);

  uint4 weights[G][R];
  uint32_t scale_bits[G][R];
  auto chunk_of = [&](int pass, int j) {
    return k_begin + pass * kCoverage + (j * W + warp) * T + lane_in_team;
  };
  auto load_pass = [&](int pass) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = chunk_of(pass, j);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = first_row + r;
        if (row < a.rows && chunk < k_end) {
          weights[j][r] = load_weights_nc(static_cast<const uint4*>(a.weights) + row * cpr + chunk);
          scale_bits[j][r] = load_scale_bits<PackedFormat::kW4G32>(a, row, chunk);
        } else {
          weights[j][r] = make_uint4(0, 0, 0, 0);
          scale_bits[j][r] = 0;
        }
      }
    }
  };

  // Weights never depend on the previous kernel: the first pass's loads (all of them where the
  // tiling covers the part) go out before the wait.
  load_pass(0);
  pdl_wait_for_predecessors();

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int pass = 0; pass < passes; ++pass) {
    if (pass > 0) load_pass(pass);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = chunk_of(pass, j);
      if (chunk >= k_end) continue;
      XChunk<32> x;
      if constexpr (XT == ActType::kBF16) {
        load_x_chunk<XT>(a.x, chunk * 32, x);
      } else {
        load_x_chunk<XT>(a.x, chunk * 32, x, true);  // kF32 rounded to bf16
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[r] += dot_chunk<PackedFormat::kW4G32>(weights[j][r], scale_bits[j][r], a, x);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int offset = T / 2; offset > 0; offset /= 2) {
      acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], offset);
    }
  }

  // The warps' team sums, then the block's row sums (warp order) into rank 0's
  // rank_sums[split] (distributed shared memory for the other ranks).
  __shared__ float warp_sums[W][kRowsPerBlock];
  __shared__ float rank_sums[P][kRowsPerBlock];
  if (lane_in_team == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) warp_sums[warp][team * R + r] = acc[r];
  }
  __syncthreads();
  if (threadIdx.x < kRowsPerBlock) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) sum += warp_sums[w][threadIdx.x];
    float* to = &rank_sums[split][threadIdx.x];
    if constexpr (P > 1) to = cg::this_cluster().map_shared_rank(to, 0);
    *to = sum;
  }
  // Rank 0 reads its own shared memory after this barrier; the other ranks are done with it.
  if constexpr (P > 1) {
    cg::this_cluster().sync();
  } else {
    __syncthreads();
  }
  // One thread per pair of rows (kRowsPerBlock is even), so the pairs epilogue sees both.
  if (split == 0 && threadIdx.x < kRowsPerBlock / 2) {
    const int row_in_block = 2 * static_cast<int>(threadIdx.x);
    float pair[2] = {0.0f, 0.0f};
#pragma unroll
    for (int rank = 0; rank < P; ++rank) {
      pair[0] += rank_sums[rank][row_in_block];
      pair[1] += rank_sums[rank][row_in_block + 1];
    }
    store_rows<2>(a, 0, block_row + row_in_block, pair);
  }
}

using KernelFn = void (*)(GemvArgs);

// The kernels of XT by tiling index (cuda::kernel_table).
template <ActType XT>
constexpr auto kernels() {
  return kernel_table<kNumGemvSplitKTilings>([](auto index) -> KernelFn {
    if constexpr (gemv_splitk_tiling_compiled(kGemvSplitKTilingBase + decltype(index)::value)) {
      constexpr GemvSplitKTiling t = kGemvSplitKTilings[decltype(index)::value];
      return gemv_splitk_kernel<XT, t.rows_per_thread, t.lanes_per_row, t.warps,
                                t.chunks_per_thread, t.splits>;
    } else {
      return nullptr;
    }
  });
}

KernelFn select_kernel(ActType x_type, int index) {
  static constexpr auto kBF16 = kernels<ActType::kBF16>();
  static constexpr auto kF32 = kernels<ActType::kF32>();
  return bf16_or_f32_kernel(kBF16, kF32, x_type, index);
}

}  // namespace gemv_splitk_detail

cudaError_t launch_gemv_splitk(ActType x_type, int index, const GemvArgs& args,
                               const Launch& launch) {
  const gemv_splitk_detail::KernelFn kernel = gemv_splitk_detail::select_kernel(x_type, index);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const GemvSplitKTiling& t = kGemvSplitKTilings[index];
  const int rows_per_block = gemv_splitk_rows_per_block(t);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>((args.rows + rows_per_block - 1) / rows_per_block),
                        static_cast<unsigned>(t.splits));
  config.blockDim = dim3(32 * t.warps);
  config.stream = launch.stream;
  LaunchAttributes attributes(t.splits, launch.pdl);
  attributes.apply(config);
  return cudaLaunchKernelEx(&config, kernel, args);
}

}  // namespace gemma4::cuda
