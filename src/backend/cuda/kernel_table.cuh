// Host-side tables of a kernel family's instantiations by tiling index, shared by the GEMV
// families that pick a kernel per (activation type, tiling) at run time (gemv_stream.cu,
// gemv_splitk.cu).
#pragma once

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "backend/cuda/gemv_kernels.h"

namespace gemma4::cuda {

// {kernel_for(0), ..., kernel_for(N - 1)} at compile time, each index passed as a
// std::integral_constant (a template argument inside kernel_for), which returns that tiling's
// kernel or nullptr where none is compiled.
template <int N, typename KernelFor>
constexpr auto kernel_table(KernelFor kernel_for) {
  return [&]<int... I>(std::integer_sequence<int, I...>) {
    return std::array{kernel_for(std::integral_constant<int, I>())...};
  }
  (std::make_integer_sequence<int, N>());
}

// The kernel of tiling `index` from the table of x_type, for families built for bf16 and fp32
// activations only: nullptr for other types or an index outside the tables.
template <typename Kernel, size_t N>
Kernel bf16_or_f32_kernel(const std::array<Kernel, N>& bf16, const std::array<Kernel, N>& f32,
                          ActType x_type, int index) {
  if (index < 0 || index >= static_cast<int>(N)) return nullptr;
  if (x_type == ActType::kBF16) return bf16[index];
  if (x_type == ActType::kF32) return f32[index];
  return nullptr;
}

}  // namespace gemma4::cuda
