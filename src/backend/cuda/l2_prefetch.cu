#include "backend/cuda/l2_prefetch.h"
#include "backend/cuda/launch.cuh"

namespace gemma4::cuda {

namespace {

// Bytes one thread asks for at a time: small enough that a layer's ~30 MB spreads over the
// grid's threads, well under the instruction's 64 KiB limit (a 16-bit count of 16-byte units).
constexpr uint64_t kPieceBytes = 16 * 1024;
constexpr int kThreads = 64;

__device__ __forceinline__ uint64_t evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(L2PrefetchRanges ranges) {
  pdl_trigger_dependents();
  const uint64_t policy = ranges.evict_last ? evict_last_policy() : 0;
  const uint64_t thread = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  const uint64_t threads = uint64_t{gridDim.x} * blockDim.x;
  // Piece p of the concatenated ranges goes to thread p % threads.
  uint64_t range_first_piece = 0;
  for (int r = 0; r < ranges.count; ++r) {
    const uintptr_t first = (reinterpret_cast<uintptr_t>(ranges.begin[r]) + 15) & ~uintptr_t{15};
    const uintptr_t last =
        (reinterpret_cast<uintptr_t>(ranges.begin[r]) + ranges.bytes[r]) & ~uintptr_t{15};
    const uint64_t pieces = last > first ? (last - first + kPieceBytes - 1) / kPieceBytes : 0;
    // This thread's first piece at or after range_first_piece.
    uint64_t p = range_first_piece + (thread + threads - range_first_piece % threads) % threads;
    for (; p < range_first_piece + pieces; p += threads) {
      const uintptr_t at = first + (p - range_first_piece) * kPieceBytes;
      const uint32_t bytes =
          static_cast<uint32_t>(last - at < kPieceBytes ? last - at : kPieceBytes);
      if (ranges.evict_last) {
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(at),
                     "r"(bytes), "l"(policy)
                     : "memory");
      } else {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(bytes) : "memory");
      }
    }
    range_first_piece += pieces;
  }
  pdl_wait_for_predecessors();
}

}  // namespace

cudaError_t prefetch_l2(const L2PrefetchRanges& ranges, int blocks, const Launch& launch) {
  if (ranges.count <= 0) return cudaSuccess;
  return launch_kernel(l2_prefetch_kernel, dim3(blocks > 0 ? blocks : 1), dim3(kThreads), 0, launch,
                       ranges);
}

}  // namespace gemma4::cuda
