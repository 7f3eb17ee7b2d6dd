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

// copy_async16, or 16 zero bytes (nothing read) where !valid.
__device__ __forceinline__ void copy_async16_or_zeros(void* shared, const void* global,
                                                      bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)),
               "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}

// copy_async16 that has L2 fetch the whole aligned 256 bytes around the address from DRAM (a
// hint: the neighbouring bytes are read soon).
__device__ __forceinline__ void copy_async16_l2_256(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(shared_address(shared)),
               "l"(global)
               : "memory");
}

// copy_async16_l2_256, or 16 zero bytes (nothing read) where !valid.
__device__ __forceinline__ void copy_async16_l2_256_or_zeros(void* shared, const void* global,
                                                             bool valid) {
  asm volatile(
      "cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)),
      "l"(global), "r"(valid ? 16 : 0)
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

// copy_async4, or 4 zero bytes (nothing read) where !valid.
__device__ __forceinline__ void copy_async4_or_zeros(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(shared)),
               "l"(global), "r"(valid ? 4 : 0)
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

// Bulk copies (cp.async.bulk, sm_90): one thread moves `bytes` (a multiple of 16; both addresses
// 16-byte aligned) through the TMA unit, completing as transaction bytes on an mbarrier in shared
// memory. A phase of such a barrier (arrival count 1) completes once its one arrival, which
// announces the bytes (arrive_expect_bytes), and all those bytes have landed.

__device__ __forceinline__ void init_barrier(uint64_t* barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(barrier)) : "memory");
}

// Makes initialized barriers visible to the async proxy (the copies' completions).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's earlier generic-proxy accesses of shared memory before its later
// async-proxy ones (a bulk copy into a buffer the thread's warp has read).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void arrive_expect_bytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)),
      "r"(bytes)
      : "memory");
}

__device__ __forceinline__ void copy_bulk(void* shared, const void* global, uint32_t bytes,
                                          uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(shared)),
      "l"(global), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
}

// Waits for the phase of `barrier` with parity `parity` to complete. A phase that never completes
// (bytes announced that no copy delivers) traps after ~2^28 polls instead of hanging the GPU.
__device__ __forceinline__ void wait_barrier(uint64_t* barrier, uint32_t parity) {
  for (uint32_t polls = 0;; ++polls) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(parity)
        : "memory");
    if (done) return;
    if (polls == (1u << 28)) __trap();
  }
}

}  // namespace gemma4::cuda
