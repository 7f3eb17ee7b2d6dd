// Kernel launch plumbing shared by every CUDA kernel: programmatic dependent launch (PDL) and
// error values. Host-only header (plain C++), so engine code and tests include it without nvcc.
#pragma once

#include <cuda_runtime_api.h>

namespace gemma4::cuda {

// How a kernel is put on its stream. With `pdl` the launch carries the programmatic stream
// serialization attribute: the kernel may start while its predecessor is still running, loads
// what does not depend on it (weights) and then waits (griddepcontrol.wait) before touching
// activations. Every kernel here waits before reading or writing anything a predecessor may
// touch, so PDL never changes results. Launches are graph-capturable: no host syncs, and every
// per-step value (positions, lengths) is read from device memory.
struct Launch {
  cudaStream_t stream = nullptr;
  bool pdl = false;
};

}  // namespace gemma4::cuda
