#include "core/dtype.h"

#include <array>
#include <cstddef>

namespace gemma4 {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  int bits;
};

constexpr std::array kDTypes = {
    DTypeInfo{DType::kBool, "BOOL", 8},      DTypeInfo{DType::kU8, "U8", 8},
    DTypeInfo{DType::kI8, "I8", 8},          DTypeInfo{DType::kI16, "I16", 16},
    DTypeInfo{DType::kU16, "U16", 16},       DTypeInfo{DType::kF16, "F16", 16},
    DTypeInfo{DType::kBF16, "BF16", 16},     DTypeInfo{DType::kI32, "I32", 32},
    DTypeInfo{DType::kU32, "U32", 32},       DTypeInfo{DType::kF32, "F32", 32},
    DTypeInfo{DType::kI64, "I64", 64},       DTypeInfo{DType::kU64, "U64", 64},
    DTypeInfo{DType::kF64, "F64", 64},       DTypeInfo{DType::kF8E4M3, "F8_E4M3", 8},
    DTypeInfo{DType::kF8E5M2, "F8_E5M2", 8}, DTypeInfo{DType::kF8E8M0, "F8_E8M0", 8},
};

const DTypeInfo& info(DType dtype) {
  // The table is ordered like the enum.
  return kDTypes[static_cast<size_t>(dtype)];
}

}  // namespace

int dtype_bits(DType dtype) { return info(dtype).bits; }

std::string_view dtype_name(DType dtype) { return info(dtype).name; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

}  // namespace gemma4
