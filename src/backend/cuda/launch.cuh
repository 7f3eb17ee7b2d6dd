// Device-side half of launch.h: the PDL hooks every kernel calls, the launch attributes (PDL,
// clusters) and the launcher.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/launch.h"

namespace gemma4::cuda {

// Lets the next kernel of the stream be scheduled now (it still waits for our completion
// before reading what we write). The notes measured "trigger at kernel start" best over a
// whole token. No-op without PDL.
__device__ __forceinline__ void pdl_trigger_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Blocks until every predecessor grid has completed and its writes are visible. No-op without
// PDL.
__device__ __forceinline__ void pdl_wait_for_predecessors() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The attributes of a launch: a cluster of `cluster_blocks` blocks along y (no attribute for 1)
// and, with PDL, programmatic stream serialization. apply() hands a configuration all of them,
// apply_cluster() the cluster alone (an occupancy query's configuration, which has no stream: a
// stream being captured is left out of it). A configuration given them must not outlive this.
class LaunchAttributes {
 public:
  LaunchAttributes(int cluster_blocks, bool pdl) {
    if (cluster_blocks > 1) {
      cudaLaunchAttribute& cluster = attributes_[count_++];
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = 1;
      cluster.val.clusterDim.y = static_cast<unsigned>(cluster_blocks);
      cluster.val.clusterDim.z = 1;
      cluster_count_ = 1;
    }
    if (pdl) {
      cudaLaunchAttribute& serialization = attributes_[count_++];
      serialization.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      serialization.val.programmaticStreamSerializationAllowed = 1;
    }
  }
  LaunchAttributes(const LaunchAttributes&) = delete;
  LaunchAttributes& operator=(const LaunchAttributes&) = delete;

  void apply(cudaLaunchConfig_t& config) {
    config.attrs = attributes_;
    config.numAttrs = count_;
  }
  void apply_cluster(cudaLaunchConfig_t& config) {
    config.attrs = attributes_;
    config.numAttrs = cluster_count_;
  }

 private:
  cudaLaunchAttribute attributes_[2] = {};
  unsigned count_ = 0;          // attributes_ in use
  unsigned cluster_count_ = 0;  // 1 with the cluster attribute (always attributes_[0])
};

template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                          const Launch& launch, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = launch.stream;
  LaunchAttributes attributes(1, launch.pdl);
  attributes.apply(config);
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(std::forward<Args>(args))...);
}

}  // namespace gemma4::cuda
