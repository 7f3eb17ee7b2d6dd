// GGUF v3 files (weight-formats.md section 4): header, metadata (incl. arrays), tensor infos,
// alignment, read in place from a read-only mapping with every count, length and offset
// bounds-checked against the file; plus a streaming writer for synthetic files.
//
// Lifetime: GgufTensorInfo::data points into the mapping owned (shared) by the GgufFile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "core/status.h"
#include "io/mapped_file.h"

namespace gemma4::io {

// ggml tensor types (ggml_type ids, spec 4.1).
enum class GgufType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
};

struct GgufTypeTraits {
  std::string_view name;  // "Q4_K"
  int64_t block_elements = 1;
  int64_t block_bytes = 0;
};
// nullopt for ids this build does not know (the error then names the id).
std::optional<GgufTypeTraits> gguf_type_traits(uint32_t type);
std::string gguf_type_name(uint32_t type);  // "Q4_K", or "type 99"

// Metadata value types (spec 4.1).
enum class GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
std::string_view gguf_value_type_name(GgufValueType type);

// One metadata value. Integers are widened to uint64_t (unsigned types) or int64_t (signed),
// floats to double; `type` keeps the stored type (the writer writes it back unchanged). Arrays
// hold a vector of the widened element kind and their element type.
struct GgufValue {
  using Storage = std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<uint64_t>,
                               std::vector<int64_t>, std::vector<double>, std::vector<bool>,
                               std::vector<std::string>>;
  GgufValueType type = GgufValueType::kU32;
  GgufValueType element_type = GgufValueType::kU32;  // arrays only
  Storage storage = uint64_t{0};

  // Constructors for the writer and tests.
  static GgufValue u32(uint32_t v) {
    return {GgufValueType::kU32, GgufValueType::kU32, uint64_t{v}};
  }
  static GgufValue i32(int32_t v) { return {GgufValueType::kI32, GgufValueType::kU32, int64_t{v}}; }
  static GgufValue f32(float v) { return {GgufValueType::kF32, GgufValueType::kU32, double{v}}; }
  static GgufValue boolean(bool v) { return {GgufValueType::kBool, GgufValueType::kU32, v}; }
  static GgufValue string(std::string v) {
    return {GgufValueType::kString, GgufValueType::kU32, std::move(v)};
  }
  static GgufValue array(GgufValueType element_type, Storage elements) {
    return {GgufValueType::kArray, element_type, std::move(elements)};
  }

  // Typed reads; nullopt / nullptr when the value has another kind or does not fit.
  std::optional<uint64_t> as_uint() const;  // any non-negative integer
  std::optional<int64_t> as_int() const;    // any integer that fits int64
  std::optional<double> as_float() const;   // F32 / F64
  std::optional<bool> as_bool() const;
  const std::string* as_string() const;
  size_t array_size() const;  // 0 for scalars
  const std::vector<std::string>* as_string_array() const;
  std::optional<std::vector<int64_t>> as_int_array() const;   // integer arrays of any width
  std::optional<std::vector<double>> as_float_array() const;  // F32 / F64 arrays
  const std::vector<bool>* as_bool_array() const;
};

struct GgufTensorInfo {
  std::string name;
  uint32_t type = 0;        // a GgufType id
  std::vector<int64_t> ne;  // dims, fastest-varying first: {K, N} == PyTorch [N, K]
  uint64_t offset = 0;      // relative to the data section
  const std::byte* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t dim : ne) n *= dim;
    return n;
  }
  // Bytes of one row of ne[0] elements.
  size_t row_bytes() const { return ne.empty() || ne[0] == 0 ? 0 : nbytes / (numel() / ne[0]); }
};

inline constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF"
inline constexpr uint32_t kGgufDefaultAlignment = 32;
inline constexpr size_t kGgufMaxNameBytes = 63;  // ggml's GGML_MAX_NAME - 1
inline constexpr int kGgufMaxDims = 4;

// A GGUF v3 file. open() validates everything before returning: magic, version 3, counts
// against the bytes that remain, string and array lengths, unique keys and tensor names,
// general.alignment (UINT32, a power of two), 1..4 dims per tensor, known tensor types,
// ne[0] a multiple of the type's block, no size overflow, offsets aligned and laid out back to
// back as ggml writes them, every tensor inside the file.
class GgufFile {
 public:
  static Expected<GgufFile> open(const std::filesystem::path& path);
  // As open() over bytes the caller keeps alive (the fuzz target's entry).
  static Expected<GgufFile> parse(std::span<const std::byte> bytes, std::string origin);

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  // Metadata in file order.
  std::span<const std::pair<std::string, GgufValue>> metadata() const { return metadata_; }
  const GgufValue* find_metadata(std::string_view key) const;
  // Tensors in file order.
  std::span<const GgufTensorInfo> tensors() const { return tensors_; }
  const GgufTensorInfo* find(std::string_view name) const;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::shared_ptr<MappedFile> mapping_;
  uint32_t version_ = 0;
  uint32_t alignment_ = kGgufDefaultAlignment;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::vector<GgufTensorInfo> tensors_;
};

struct GgufTensorSpec {
  std::string name;
  GgufType type = GgufType::kF32;
  std::vector<int64_t> ne;  // fastest first
};

// Bytes of a tensor of `type` with dims `ne`; an error when ne[0] is not a multiple of the block
// or the size overflows.
Expected<uint64_t> gguf_tensor_bytes(uint32_t type, std::span<const int64_t> ne);

// Streams a GGUF v3 file: header, metadata, tensor infos, padding, then tensor data appended in
// spec order (a tensor may arrive in pieces; the writer pads each tensor to the alignment).
// Written as `<path>.partial`, renamed by finish(). general.alignment in `metadata` (UINT32)
// sets the alignment; default 32.
class GgufWriter {
 public:
  static Expected<GgufWriter> create(const std::filesystem::path& path,
                                     std::vector<std::pair<std::string, GgufValue>> metadata,
                                     std::vector<GgufTensorSpec> tensors);
  Status append(std::span<const std::byte> bytes);
  Status finish();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace gemma4::io
