// nvfp4_decode.cuh's bit placements (host side: pure integer operations) against core/numeric.h:
// every e2m1 code at every nibble of a word, among random neighbours, lands in the pair and half
// the tensor-core kernels expect (pair s = nibbles (s, s + 4)) as exactly e2m1 · 2^-14 (fp16) or
// e2m1 · 2^-126 (bf16), sign of zero included. The multiplies by the block scale are the
// device's (MoeExperts.* and GemvMma.* check them against the CPU reference).
#include "backend/cuda/nvfp4_decode.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/numeric.h"
#include "cuda_test_util.h"

namespace gemma4::cuda {
namespace {

// Words whose nibble `position` is `code`, the other nibbles random.
std::vector<uint32_t> words_with(int position, uint32_t code, uint32_t seed) {
  std::vector<uint32_t> words = testing::random_words(64, seed);
  for (uint32_t& w : words) w = (w & ~(0xFu << (4 * position))) | (code << (4 * position));
  return words;
}

void expect_same_value(float got, float expected, uint32_t word, int position) {
  EXPECT_EQ(got, expected) << "word 0x" << std::hex << word << std::dec << " nibble " << position;
  EXPECT_EQ(std::signbit(got), std::signbit(expected))
      << "word 0x" << std::hex << word << std::dec << " nibble " << position;
}

TEST(Nvfp4Decode, HalfPairsHoldEveryCodeTimes2PowMinus14) {
  uint32_t seed = 1;
  for (int position = 0; position < 8; ++position) {
    for (uint32_t code = 0; code < 16; ++code) {
      for (uint32_t word : words_with(position, code, seed++)) {
        uint32_t pairs[4];
        e2m1_half2_bits(word, pairs);
        const uint32_t half = (pairs[position % 4] >> (16 * (position / 4))) & 0xFFFFu;
        expect_same_value(fp16_to_float(static_cast<uint16_t>(half)),
                          std::ldexp(e2m1_to_float(static_cast<uint8_t>(code)), -14), word,
                          position);
      }
    }
  }
}

TEST(Nvfp4Decode, Bf16PairsHoldEveryCodeTimes2PowMinus126) {
  uint32_t seed = 1000;
  for (int position = 0; position < 8; ++position) {
    for (uint32_t code = 0; code < 16; ++code) {
      for (uint32_t word : words_with(position, code, seed++)) {
        const uint32_t half =
            (e2m1_bf16_bits(word, position % 4) >> (16 * (position / 4))) & 0xFFFFu;
        expect_same_value(bf16_to_float(static_cast<uint16_t>(half)),
                          std::ldexp(e2m1_to_float(static_cast<uint8_t>(code)), -126), word,
                          position);
      }
    }
  }
}

}  // namespace
}  // namespace gemma4::cuda
