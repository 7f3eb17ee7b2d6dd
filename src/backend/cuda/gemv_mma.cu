// Launch of the tensor-core batched GEMV (gemv_mma_kernels.h; the kernel template is in
// gemv_mma_kernel.cuh, its instantiations in gemv_mma_<format>.cu).
#include "backend/cuda/gemv_mma_kernel.cuh"

namespace gemma4::cuda {
namespace {

using gemv_mma_detail::kNTileOptions;
using gemv_mma_detail::MmaKernel;
using gemv_mma_detail::select_mma_kernel;

int option_index(const int* options, int count, int value) {
  for (int i = 0; i < count; ++i) {
    if (options[i] == value) return i;
  }
  return -1;
}

}  // namespace

cudaError_t launch_gemv_mma(PackedFormat format, const MmaGemvArgs& args, ActType x_type,
                            const MmaGemvTiling& tiling, const Launch& launch) {
  const int n_tiles = option_index(kNTileOptions, 4, mma_gemv_n_tiles(args.m));
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
  const int64_t rows_per_block = 32 * tiling.warps;
  config.gridDim = dim3(static_cast<unsigned>((args.rows + rows_per_block - 1) / rows_per_block),
                        static_cast<unsigned>(tiling.splits));
  config.blockDim = dim3(32 * tiling.warps * tiling.k_warps);
  config.dynamicSmemBytes =
      static_cast<size_t>(mma_gemv_shared_bytes(tiling, args.m, args.groups, x_type));
  config.stream = launch.stream;
  cudaLaunchAttribute attributes[2] = {};
  int count = 0;
  if (launch.pdl) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (tiling.splits > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = 1;
    attributes[count].val.clusterDim.y = static_cast<unsigned>(tiling.splits);
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, args);
}

}  // namespace gemma4::cuda
