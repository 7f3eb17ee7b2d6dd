// Asynchronous global -> shared copies (cp.async, sm_80+): a thread issues copies, commits them as
// a group, and later waits for all but its newest groups. A copy is visible to the issuing thread
// after its wait, to the other threads of the warp / block after a __syncwarp / __syncthreads that
// follows the wait.
#pragma once

#include <cstdint>

namespace gemma4::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes, bypassing L1 (streamed data, read once). Both addresses 16-byte aligned.
__device__ __forceinline__ void copy_async16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)),
               "l"(global)
               : "memory");
}

// 8 bytes (through L1: cp.async.cg takes 16 only). Both addresses 8-byte aligned.
__device__ __forceinline__ void copy_async8(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(shared_address(shared)),
               "l"(global)
               : "memory");
}

// 4 bytes. Both addresses 4-byte aligned.
__device__ __forceinline__ void copy_async4(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(shared)),
               "l"(global)
               : "memory");
}

// Closes the group of the copies issued since the last commit (an empty group is fine).
__device__ __forceinline__ void commit_copies() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `Pending` of this thread's committed copy groups are still in flight.
template <int Pending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

}  // namespace gemma4::cuda
