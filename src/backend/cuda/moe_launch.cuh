// Host-side launch helpers shared by the MoE paths (moe.cu: decode per pair, moe_by_expert.cu,
// moe_grouped.cu): grid sizes, workspace alignment and the compile-time weight format dispatch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda {

inline unsigned blocks(int64_t n, int64_t per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

// Workspace regions start on 16-byte boundaries (float4 / uint4 accesses).
inline size_t align16(size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

// launch_one(std::integral_constant<PackedFormat, F>) for the formats the MoE kernels read
// (check_experts admits no other).
template <typename LaunchOne>
cudaError_t for_format(PackedFormat format, LaunchOne launch_one) {
  switch (format) {
    case PackedFormat::kW4G32:
      return launch_one(std::integral_constant<PackedFormat, PackedFormat::kW4G32>{});
    case PackedFormat::kNVFP4:
      return launch_one(std::integral_constant<PackedFormat, PackedFormat::kNVFP4>{});
    case PackedFormat::kBF16:
      return launch_one(std::integral_constant<PackedFormat, PackedFormat::kBF16>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace gemma4::cuda
