// Host-side occupancy query shared by the kernels that size their grids to the GPU (looping /
// resident-cluster launches: gemv_mma.cu, gemv_stream.cu).
#pragma once

#include <cuda_runtime.h>

namespace gemma4::cuda {

// Clusters of `config` (blocks, for one-block clusters: splits 1) that the GPU holds at once, from
// the occupancy calculator; 0 where it refuses (the refusal is the answer, not an error left for
// the caller).
template <typename Kernel>
int occupancy_clusters(Kernel kernel, const cudaLaunchConfig_t& config, int splits, int device) {
  int clusters = 0;
  cudaError_t status;
  if (splits > 1) {
    status = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
  } else {
    int per_sm = 0, sms = 0;
    status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, config.blockDim.x,
                                                           config.dynamicSmemBytes);
    if (status == cudaSuccess) {
      status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    }
    clusters = per_sm * sms;
  }
  if (status != cudaSuccess) {
    clusters = 0;
    cudaGetLastError();
  }
  return clusters;
}

}  // namespace gemma4::cuda
