// Deterministic pseudo-random device fill for the benchmark's weights and activations.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

// words[i] = (hash(i, seed) & mask) | bits: mask/bits keep the words valid scales or finite
// activations.
cudaError_t fill_random_words(void* words, size_t count, uint32_t seed, uint32_t mask,
                              uint32_t bits);
