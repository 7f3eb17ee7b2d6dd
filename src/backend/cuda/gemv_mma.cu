// Launch of the tensor-core batched GEMV (gemv_mma_kernels.h; the kernel template is in
// gemv_mma_kernel.cuh, its instantiations in gemv_mma_<format>.cu).
#include "backend/cuda/gemv_mma_kernel.cuh"
#include "backend/cuda/occupancy.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

namespace gemma4::cuda {
namespace {

using gemv_mma_detail::mma_gemv_n_tile_index;
using gemv_mma_detail::MmaKernel;
using gemv_mma_detail::select_mma_kernel;

// Clusters of `config` (its cluster attribute, block and shared memory) the GPU holds at once;
// 0 where the occupancy calculator refuses. Asked once per (kernel, shape of launch): the answer
// does not change while the process runs.
int resident_clusters(MmaKernel kernel, const cudaLaunchConfig_t& config, int splits) {
  struct Key {
    MmaKernel kernel;
    size_t shared;
    int splits;
    int device;
    bool operator<(const Key& o) const {
      return std::tie(kernel, shared, splits, device) <
             std::tie(o.kernel, o.shared, o.splits, o.device);
    }
  };
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const Key key = {kernel, config.dynamicSmemBytes, splits, device};
  static std::mutex mutex;
  static std::map<Key, int> known;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto found = known.find(key); found != known.end()) return found->second;
  const int clusters = occupancy_clusters(kernel, config, splits, device);
  known.emplace(key, clusters);
  return clusters;
}

}  // namespace

cudaError_t launch_gemv_mma(PackedFormat format, const MmaGemvArgs& given, ActType x_type,
                            const MmaGemvTiling& tiling, const Launch& launch) {
  MmaGemvArgs args = given;
  // A block's activation rows: whole n tiles of its kernel, the last block's possibly partial.
  const int block_n_tiles = mma_gemv_n_tiles(mma_gemv_block_m(tiling, args.m));
  const int n_tiles = mma_gemv_n_tile_index(block_n_tiles);
  const int activation_blocks = (args.m + 8 * block_n_tiles - 1) / (8 * block_n_tiles);
  const int layout = mma_gemv_warp_layout(tiling);
  if (n_tiles < 0 || layout < 0 ||
      (format != PackedFormat::kW4G32 && format != PackedFormat::kNVFP4)) {
    return cudaErrorInvalidValue;
  }
  const int index = kNumMmaGemvWarpLayouts * n_tiles + layout;
  const MmaKernel kernel = format == PackedFormat::kNVFP4
                               ? select_mma_kernel<PackedFormat::kNVFP4>(x_type, index)
                               : select_mma_kernel<PackedFormat::kW4G32>(x_type, index);
  if (kernel == nullptr) return cudaErrorInvalidValue;

  // Above 48 KB of shared memory a kernel must opt in (a function attribute, not a stream
  // operation: allowed while a graph is captured).
  const cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kMmaGemvMaxSharedBytes));
  if (status != cudaSuccess) return status;

  cudaLaunchConfig_t config = {};
  const int64_t rows_per_tile = mma_gemv_tile_rows(tiling);
  const int64_t row_tiles = (args.rows + rows_per_tile - 1) / rows_per_tile;
  config.blockDim = dim3(32 * tiling.warps * tiling.k_warps);
  config.stream = launch.stream;
  LaunchAttributes attributes(tiling.splits, launch.pdl);
  attributes.apply(config);

  // Blocks along the rows; looping blocks keep two partial-sum buffers past the activations.
  MmaGemvTiling looping_tiling = tiling;
  looping_tiling.row_blocks = kMmaGemvResidentRowBlocks;
  MmaGemvTiling one_tile_tiling = tiling;
  one_tile_tiling.row_blocks = 0;
  int64_t row_blocks = tiling.row_blocks > 0 ? tiling.row_blocks : row_tiles;
  if (tiling.row_blocks == kMmaGemvResidentRowBlocks) {
    // The query's configuration: the cluster alone, no stream (the current context's GPU; a
    // stream being captured is left out of it).
    cudaLaunchConfig_t query = config;
    query.stream = nullptr;
    query.gridDim = dim3(1, static_cast<unsigned>(tiling.splits));
    query.dynamicSmemBytes =
        static_cast<size_t>(mma_gemv_shared_bytes(looping_tiling, args.m, args.groups));
    attributes.apply_cluster(query);
    // The clusters that fit at once, shared by the blocks along the activation rows (gridDim.z):
    // one wave of them all.
    const int clusters = resident_clusters(kernel, query, tiling.splits) / activation_blocks;
    if (clusters > 0) {
      // The fewest blocks for the least tiles per block.
      const int64_t tiles_per_block = (row_tiles + clusters - 1) / clusters;
      row_blocks = (row_tiles + tiles_per_block - 1) / tiles_per_block;
    }
  }
  row_blocks = std::min(row_blocks, row_tiles);
  const int64_t groups_per_split = mma_gemv_groups_per_split(args.groups, tiling.splits);
  args.partial_offset =
      row_blocks < row_tiles
          ? mma_gemv_staged_bytes(mma_gemv_block_m(tiling, args.m), groups_per_split)
          : 0;
  args.trigger = tiling.trigger;
  config.gridDim = dim3(static_cast<unsigned>(row_blocks), static_cast<unsigned>(tiling.splits),
                        static_cast<unsigned>(activation_blocks));
  config.dynamicSmemBytes = static_cast<size_t>(mma_gemv_shared_bytes(
      args.partial_offset != 0 ? looping_tiling : one_tile_tiling, args.m, args.groups));
  return cudaLaunchKernelEx(&config, kernel, args);
}

}  // namespace gemma4::cuda
