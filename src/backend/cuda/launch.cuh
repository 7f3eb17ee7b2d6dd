// Device-side half of launch.h: the PDL hooks every kernel calls and the launcher.
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

template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                          const Launch& launch, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = launch.stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = launch.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(std::forward<Args>(args))...);
}

}  // namespace gemma4::cuda
