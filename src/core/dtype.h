// Element types of tensors as checkpoints name them (safetensors dtype strings, GGUF types map
// onto these where they are plain element types).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace gemma4 {

enum class DType : uint8_t {
  kBool, kU8, kI8, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kI64, kU64, kF64,
  kF8E4M3, kF8E5M2, kF8E8M0,
};

// Bits per element (all dtypes here are whole bytes).
int dtype_bits(DType dtype);
// The safetensors spelling ("BF16", "F8_E4M3", ...).
std::string_view dtype_name(DType dtype);
std::optional<DType> dtype_from_name(std::string_view name);

}  // namespace gemma4
