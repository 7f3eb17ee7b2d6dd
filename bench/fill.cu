#include "fill.h"

namespace {

__global__ void fill_kernel(uint32_t* p, size_t count, uint32_t seed, uint32_t mask,
                            uint32_t bits) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = (h & mask) | bits;
  }
}

}  // namespace

cudaError_t fill_random_words(void* words, size_t count, uint32_t seed, uint32_t mask,
                              uint32_t bits) {
  fill_kernel<<<1024, 256>>>(static_cast<uint32_t*>(words), count, seed, mask, bits);
  return cudaGetLastError();
}
