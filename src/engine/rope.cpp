#include <algorithm>
#include <cmath>

#include "engine/backend.h"

namespace gemma4::engine {

std::vector<float> rope_inverse_frequencies(const model::RopeParams& rope, int head_dim) {
  const int half = head_dim / 2;
  std::vector<float> inv_freq(std::max(half, 0), 0.0f);
  for (int i = 0; i < std::min(half, rope.rotated_pairs); ++i) {
    const float exponent =
        static_cast<float>(2 * i) / static_cast<float>(rope.exponent_denominator);
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(rope.theta), exponent);
  }
  return inv_freq;
}

}  // namespace gemma4::engine
