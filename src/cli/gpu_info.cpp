#include "cli/gpu_info.h"

#if GEMMA4_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gemma4::cli {

#if GEMMA4_HAS_CUDA

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: clear the sticky error for later calls
    return 0;
  }
  return count;
}

std::string cuda_device_name(int device) {
  cudaDeviceProp properties{};
  if (device < 0 || device >= cuda_device_count() ||
      cudaGetDeviceProperties(&properties, device) != cudaSuccess)
    return {};
  return properties.name;
}

std::optional<int64_t> cuda_memory_used_bytes(int device) {
  if (device < 0 || device >= cuda_device_count()) return std::nullopt;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess)
    return std::nullopt;
  size_t free = 0, total = 0;
  const bool ok = cudaMemGetInfo(&free, &total) == cudaSuccess;
  cudaSetDevice(previous);
  if (!ok) return std::nullopt;
  return static_cast<int64_t>(total - free);
}

#else

int cuda_device_count() {
  return 0;
}

std::string cuda_device_name(int) {
  return {};
}

std::optional<int64_t> cuda_memory_used_bytes(int) {
  return std::nullopt;
}

#endif

}  // namespace gemma4::cli
