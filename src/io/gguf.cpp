#include "io/gguf.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <set>
#include <unordered_set>

namespace gemma4::io {
namespace {

static_assert(std::endian::native == std::endian::little, "GGUF v3 files here are little-endian");

constexpr uint32_t kVersion = 3;

struct TypeEntry {
  GgufType type;
  GgufTypeTraits traits;
};

// Block sizes as ggml defines them (ggml-common.h; the same table as gguf-py's
// GGML_QUANT_SIZES).
constexpr std::array kTypes = {
    TypeEntry{GgufType::kF32, {"F32", 1, 4}},
    TypeEntry{GgufType::kF16, {"F16", 1, 2}},
    TypeEntry{GgufType::kQ4_0, {"Q4_0", 32, 18}},
    TypeEntry{GgufType::kQ4_1, {"Q4_1", 32, 20}},
    TypeEntry{GgufType::kQ5_0, {"Q5_0", 32, 22}},
    TypeEntry{GgufType::kQ5_1, {"Q5_1", 32, 24}},
    TypeEntry{GgufType::kQ8_0, {"Q8_0", 32, 34}},
    TypeEntry{GgufType::kQ8_1, {"Q8_1", 32, 40}},
    TypeEntry{GgufType::kQ2_K, {"Q2_K", 256, 84}},
    TypeEntry{GgufType::kQ3_K, {"Q3_K", 256, 110}},
    TypeEntry{GgufType::kQ4_K, {"Q4_K", 256, 144}},
    TypeEntry{GgufType::kQ5_K, {"Q5_K", 256, 176}},
    TypeEntry{GgufType::kQ6_K, {"Q6_K", 256, 210}},
    TypeEntry{GgufType::kQ8_K, {"Q8_K", 256, 292}},
    TypeEntry{GgufType::kIQ2_XXS, {"IQ2_XXS", 256, 66}},
    TypeEntry{GgufType::kIQ2_XS, {"IQ2_XS", 256, 74}},
    TypeEntry{GgufType::kIQ3_XXS, {"IQ3_XXS", 256, 98}},
    TypeEntry{GgufType::kIQ1_S, {"IQ1_S", 256, 50}},
    TypeEntry{GgufType::kIQ4_NL, {"IQ4_NL", 32, 18}},
    TypeEntry{GgufType::kIQ3_S, {"IQ3_S", 256, 110}},
    TypeEntry{GgufType::kIQ2_S, {"IQ2_S", 256, 82}},
    TypeEntry{GgufType::kIQ4_XS, {"IQ4_XS", 256, 136}},
    TypeEntry{GgufType::kI8, {"I8", 1, 1}},
    TypeEntry{GgufType::kI16, {"I16", 1, 2}},
    TypeEntry{GgufType::kI32, {"I32", 1, 4}},
    TypeEntry{GgufType::kI64, {"I64", 1, 8}},
    TypeEntry{GgufType::kF64, {"F64", 1, 8}},
    TypeEntry{GgufType::kIQ1_M, {"IQ1_M", 256, 56}},
    TypeEntry{GgufType::kBF16, {"BF16", 1, 2}},
    TypeEntry{GgufType::kTQ1_0, {"TQ1_0", 256, 54}},
    TypeEntry{GgufType::kTQ2_0, {"TQ2_0", 256, 66}},
    TypeEntry{GgufType::kMXFP4, {"MXFP4", 32, 17}},
    TypeEntry{GgufType::kNVFP4, {"NVFP4", 64, 36}},
    TypeEntry{GgufType::kQ1_0, {"Q1_0", 128, 18}},
};

// Bytes a value of a scalar type occupies (strings: their length prefix only).
std::optional<size_t> scalar_bytes(uint32_t type) {
  switch (static_cast<GgufValueType>(type)) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kU16:
    case GgufValueType::kI16:
      return 2;
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kF32:
      return 4;
    case GgufValueType::kU64:
    case GgufValueType::kI64:
    case GgufValueType::kF64:
    case GgufValueType::kString:
      return 8;
    case GgufValueType::kArray:
      return std::nullopt;
  }
  return std::nullopt;
}

bool is_unsigned(GgufValueType t) {
  return t == GgufValueType::kU8 || t == GgufValueType::kU16 || t == GgufValueType::kU32 ||
         t == GgufValueType::kU64;
}
bool is_signed(GgufValueType t) {
  return t == GgufValueType::kI8 || t == GgufValueType::kI16 || t == GgufValueType::kI32 ||
         t == GgufValueType::kI64;
}
bool is_float(GgufValueType t) {
  return t == GgufValueType::kF32 || t == GgufValueType::kF64;
}

// Reads little-endian fields with a bounds check before every read.
class Cursor {
 public:
  explicit Cursor(std::span<const std::byte> bytes) : bytes_(bytes) {}

  size_t position() const { return position_; }
  size_t remaining() const { return bytes_.size() - position_; }

  template <typename T>
  Expected<T> read(std::string_view what) {
    if (remaining() < sizeof(T)) {
      return make_error(ErrorCode::kOutOfRange,
                        "truncated: {} at offset {} needs {} bytes, {} left", what, position_,
                        sizeof(T), remaining());
    }
    T value;
    std::memcpy(&value, bytes_.data() + position_, sizeof(T));
    position_ += sizeof(T);
    return value;
  }

  Expected<std::string> read_string(std::string_view what) {
    GEMMA4_ASSIGN_OR_RETURN(const uint64_t length, read<uint64_t>(what));
    if (length > remaining()) {
      return make_error(ErrorCode::kOutOfRange,
                        "{}: string length {} at offset {} runs past the end of the file", what,
                        length, position_ - 8);
    }
    std::string text(reinterpret_cast<const char*>(bytes_.data() + position_), length);
    position_ += length;
    return text;
  }

 private:
  std::span<const std::byte> bytes_;
  size_t position_ = 0;
};

// Reads a `Stored` and widens it to the variant's `Wide` kind.
template <typename Stored, typename Wide>
Expected<GgufValue::Storage> read_widened(Cursor& cursor, std::string_view what) {
  auto value = cursor.read<Stored>(what);
  if (!value.ok()) return value.error();
  return GgufValue::Storage(static_cast<Wide>(*value));
}

// One scalar of `type` widened into the variant.
Expected<GgufValue::Storage> read_scalar(Cursor& cursor, GgufValueType type,
                                         std::string_view what) {
  switch (type) {
    case GgufValueType::kU8:
      return read_widened<uint8_t, uint64_t>(cursor, what);
    case GgufValueType::kU16:
      return read_widened<uint16_t, uint64_t>(cursor, what);
    case GgufValueType::kU32:
      return read_widened<uint32_t, uint64_t>(cursor, what);
    case GgufValueType::kU64:
      return read_widened<uint64_t, uint64_t>(cursor, what);
    case GgufValueType::kI8:
      return read_widened<int8_t, int64_t>(cursor, what);
    case GgufValueType::kI16:
      return read_widened<int16_t, int64_t>(cursor, what);
    case GgufValueType::kI32:
      return read_widened<int32_t, int64_t>(cursor, what);
    case GgufValueType::kI64:
      return read_widened<int64_t, int64_t>(cursor, what);
    case GgufValueType::kF32:
      return read_widened<float, double>(cursor, what);
    case GgufValueType::kF64:
      return read_widened<double, double>(cursor, what);
    case GgufValueType::kBool: {
      GEMMA4_ASSIGN_OR_RETURN(const uint8_t byte, cursor.read<uint8_t>(what));
      if (byte > 1) {
        return make_error(ErrorCode::kInvalidArgument, "{}: bool byte {} is not 0 or 1", what,
                          byte);
      }
      return GgufValue::Storage(byte == 1);
    }
    case GgufValueType::kString: {
      GEMMA4_ASSIGN_OR_RETURN(std::string text, cursor.read_string(what));
      return GgufValue::Storage(std::move(text));
    }
    case GgufValueType::kArray:
      break;
  }
  return make_error(ErrorCode::kInternal, "{}: not a scalar type", what);
}

// An empty array of the widened kind of `element_type` (a scalar type).
GgufValue::Storage empty_array(GgufValueType element_type) {
  if (is_unsigned(element_type)) return std::vector<uint64_t>();
  if (is_signed(element_type)) return std::vector<int64_t>();
  if (is_float(element_type)) return std::vector<double>();
  if (element_type == GgufValueType::kBool) return std::vector<bool>();
  return std::vector<std::string>();
}

Expected<GgufValue> read_value(Cursor& cursor, std::string_view key) {
  const std::string what = fmt::format("metadata key '{}'", key);
  GEMMA4_ASSIGN_OR_RETURN(const uint32_t type_id, cursor.read<uint32_t>(what));
  if (type_id > static_cast<uint32_t>(GgufValueType::kF64)) {
    return make_error(ErrorCode::kInvalidArgument, "{}: unknown value type {}", what, type_id);
  }
  const auto type = static_cast<GgufValueType>(type_id);
  GgufValue value;
  value.type = type;
  if (type != GgufValueType::kArray) {
    GEMMA4_ASSIGN_OR_RETURN(value.storage, read_scalar(cursor, type, what));
    return value;
  }
  GEMMA4_ASSIGN_OR_RETURN(const uint32_t element_id, cursor.read<uint32_t>(what));
  const auto element_bytes = scalar_bytes(element_id);
  if (!element_bytes) {
    return make_error(ErrorCode::kInvalidArgument, "{}: array element type {} is {}", what,
                      element_id,
                      element_id == static_cast<uint32_t>(GgufValueType::kArray)
                          ? "a nested array (unsupported, as in ggml)"
                          : "unknown");
  }
  GEMMA4_ASSIGN_OR_RETURN(const uint64_t count, cursor.read<uint64_t>(what));
  if (count > cursor.remaining() / *element_bytes) {
    return make_error(ErrorCode::kOutOfRange,
                      "{}: array of {} elements at offset {} runs past the end of the file", what,
                      count, cursor.position());
  }
  const auto element_type = static_cast<GgufValueType>(element_id);
  value.element_type = element_type;
  value.storage = empty_array(element_type);
  for (uint64_t i = 0; i < count; ++i) {
    GEMMA4_ASSIGN_OR_RETURN(GgufValue::Storage element, read_scalar(cursor, element_type, what));
    std::visit(
        [&](auto&& scalar) {
          using Scalar = std::decay_t<decltype(scalar)>;
          if constexpr (std::is_same_v<Scalar, uint64_t> || std::is_same_v<Scalar, int64_t> ||
                        std::is_same_v<Scalar, double> || std::is_same_v<Scalar, bool> ||
                        std::is_same_v<Scalar, std::string>) {
            std::get<std::vector<Scalar>>(value.storage).push_back(std::move(scalar));
          }
        },
        std::move(element));
  }
  return value;
}

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

std::optional<GgufTypeTraits> gguf_type_traits(uint32_t type) {
  for (const auto& entry : kTypes) {
    if (static_cast<uint32_t>(entry.type) == type) return entry.traits;
  }
  return std::nullopt;
}

std::string gguf_type_name(uint32_t type) {
  const auto traits = gguf_type_traits(type);
  return traits ? std::string(traits->name) : fmt::format("type {}", type);
}

std::string_view gguf_value_type_name(GgufValueType type) {
  static constexpr std::array<std::string_view, 13> kNames = {
      "UINT8", "INT8",   "UINT16", "INT16",  "UINT32", "INT32",  "FLOAT32",
      "BOOL",  "STRING", "ARRAY",  "UINT64", "INT64",  "FLOAT64"};
  const auto index = static_cast<size_t>(type);
  return index < kNames.size() ? kNames[index] : "unknown";
}

Expected<uint64_t> gguf_tensor_bytes(uint32_t type, std::span<const int64_t> ne) {
  const auto traits = gguf_type_traits(type);
  if (!traits) {
    return make_error(ErrorCode::kUnsupported, "unsupported tensor type id {}", type);
  }
  if (ne.empty() || ne[0] % traits->block_elements != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "ne[0] = {} is not a multiple of the {}-element {} block",
                      ne.empty() ? 0 : ne[0], traits->block_elements, traits->name);
  }
  uint64_t bytes = static_cast<uint64_t>(ne[0] / traits->block_elements) * traits->block_bytes;
  for (size_t i = 1; i < ne.size(); ++i) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(ne[i]), &bytes)) {
      return make_error(ErrorCode::kInvalidArgument, "tensor size overflows");
    }
  }
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// GgufValue accessors

std::optional<uint64_t> GgufValue::as_uint() const {
  if (const auto* u = std::get_if<uint64_t>(&storage)) return *u;
  if (const auto* i = std::get_if<int64_t>(&storage); i && *i >= 0)
    return static_cast<uint64_t>(*i);
  return std::nullopt;
}

std::optional<int64_t> GgufValue::as_int() const {
  if (const auto* i = std::get_if<int64_t>(&storage)) return *i;
  if (const auto* u = std::get_if<uint64_t>(&storage);
      u && *u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return static_cast<int64_t>(*u);
  }
  return std::nullopt;
}

std::optional<double> GgufValue::as_float() const {
  if (const auto* f = std::get_if<double>(&storage)) return *f;
  return std::nullopt;
}

std::optional<bool> GgufValue::as_bool() const {
  if (const auto* b = std::get_if<bool>(&storage)) return *b;
  return std::nullopt;
}

const std::string* GgufValue::as_string() const {
  return std::get_if<std::string>(&storage);
}

size_t GgufValue::array_size() const {
  if (type != GgufValueType::kArray) return 0;
  return std::visit(
      [](const auto& v) -> size_t {
        if constexpr (requires { v.size(); } &&
                      !std::is_same_v<std::decay_t<decltype(v)>, std::string>) {
          return v.size();
        } else {
          return 0;
        }
      },
      storage);
}

const std::vector<std::string>* GgufValue::as_string_array() const {
  return std::get_if<std::vector<std::string>>(&storage);
}

std::optional<std::vector<int64_t>> GgufValue::as_int_array() const {
  if (const auto* i = std::get_if<std::vector<int64_t>>(&storage)) return *i;
  if (const auto* u = std::get_if<std::vector<uint64_t>>(&storage)) {
    std::vector<int64_t> result;
    result.reserve(u->size());
    for (uint64_t v : *u) {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
      result.push_back(static_cast<int64_t>(v));
    }
    return result;
  }
  return std::nullopt;
}

std::optional<std::vector<double>> GgufValue::as_float_array() const {
  if (const auto* f = std::get_if<std::vector<double>>(&storage)) return *f;
  return std::nullopt;
}

const std::vector<bool>* GgufValue::as_bool_array() const {
  return std::get_if<std::vector<bool>>(&storage);
}

// ---------------------------------------------------------------------------------------------
// GgufFile

namespace {

Status parse_gguf(std::span<const std::byte> bytes, uint32_t& version, uint32_t& alignment,
                  std::vector<std::pair<std::string, GgufValue>>& metadata,
                  std::vector<GgufTensorInfo>& tensors) {
  Cursor cursor(bytes);
  GEMMA4_ASSIGN_OR_RETURN(const uint32_t magic, cursor.read<uint32_t>("magic"));
  if (magic != kGgufMagic) {
    return make_error(ErrorCode::kInvalidArgument, "not a GGUF file (magic 0x{:08x})", magic);
  }
  GEMMA4_ASSIGN_OR_RETURN(version, cursor.read<uint32_t>("version"));
  if (version != kVersion) {
    return make_error(ErrorCode::kUnsupported, "GGUF version {} (only version 3 is supported)",
                      version);
  }
  GEMMA4_ASSIGN_OR_RETURN(const uint64_t tensor_count, cursor.read<uint64_t>("tensor count"));
  GEMMA4_ASSIGN_OR_RETURN(const uint64_t kv_count, cursor.read<uint64_t>("metadata count"));
  // Smallest encodings: a key/value is a key length + type + 1 byte; a tensor info is a name
  // length + n_dims + one dim + type + offset.
  constexpr uint64_t kMinKvBytes = 8 + 4 + 1;
  constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;
  if (kv_count > cursor.remaining() / kMinKvBytes) {
    return make_error(ErrorCode::kOutOfRange, "metadata count {} exceeds what the file can hold",
                      kv_count);
  }
  if (tensor_count > cursor.remaining() / kMinTensorInfoBytes) {
    return make_error(ErrorCode::kOutOfRange, "tensor count {} exceeds what the file can hold",
                      tensor_count);
  }

  std::set<std::string, std::less<>> keys;
  metadata.reserve(kv_count);
  for (uint64_t i = 0; i < kv_count; ++i) {
    GEMMA4_ASSIGN_OR_RETURN(std::string key,
                            cursor.read_string(fmt::format("metadata key #{}", i)));
    if (!keys.insert(key).second) {
      return make_error(ErrorCode::kInvalidArgument, "duplicate metadata key '{}'", key);
    }
    GEMMA4_ASSIGN_OR_RETURN(GgufValue value, read_value(cursor, key));
    metadata.emplace_back(std::move(key), std::move(value));
  }
  alignment = kGgufDefaultAlignment;
  for (const auto& [key, value] : metadata) {
    if (key != "general.alignment") continue;
    const auto a = value.as_uint();
    if (value.type != GgufValueType::kU32 || !a || *a == 0 || !std::has_single_bit(*a)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "metadata key 'general.alignment' must be a UINT32 power of two");
    }
    alignment = static_cast<uint32_t>(*a);
  }

  std::unordered_set<std::string> names;
  tensors.reserve(tensor_count);
  uint64_t expected_offset = 0;  // ggml lays tensors out back to back, each padded
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo info;
    GEMMA4_ASSIGN_OR_RETURN(info.name, cursor.read_string(fmt::format("tensor #{} name", i)));
    auto fail = [&](ErrorCode code, std::string_view why) {
      return make_error(code, "tensor '{}': {}", info.name, why);
    };
    if (info.name.size() > kGgufMaxNameBytes) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("name longer than {} bytes", kGgufMaxNameBytes));
    }
    if (!names.insert(info.name).second) return fail(ErrorCode::kInvalidArgument, "duplicate name");
    GEMMA4_ASSIGN_OR_RETURN(const uint32_t n_dims, cursor.read<uint32_t>("tensor dims"));
    if (n_dims < 1 || n_dims > kGgufMaxDims) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("{} dims (1 to {} allowed)", n_dims, kGgufMaxDims));
    }
    for (uint32_t d = 0; d < n_dims; ++d) {
      GEMMA4_ASSIGN_OR_RETURN(const uint64_t dim, cursor.read<uint64_t>("tensor dim"));
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return fail(ErrorCode::kInvalidArgument, fmt::format("dimension {} is too large", dim));
      }
      info.ne.push_back(static_cast<int64_t>(dim));
    }
    GEMMA4_ASSIGN_OR_RETURN(info.type, cursor.read<uint32_t>("tensor type"));
    GEMMA4_ASSIGN_OR_RETURN(info.offset, cursor.read<uint64_t>("tensor offset"));
    if (!gguf_type_traits(info.type)) {
      return fail(ErrorCode::kUnsupported, fmt::format("unsupported tensor type id {}", info.type));
    }
    auto nbytes = gguf_tensor_bytes(info.type, info.ne);
    if (!nbytes.ok()) return nbytes.error().with_context(fmt::format("tensor '{}'", info.name));
    if (info.offset != expected_offset) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("offset {} (expected {}: tensors are stored in order, each padded "
                              "to {} bytes)",
                              info.offset, expected_offset, alignment));
    }
    const uint64_t padded = align_up(*nbytes, alignment);
    if (padded < *nbytes || __builtin_add_overflow(expected_offset, padded, &expected_offset)) {
      return fail(ErrorCode::kInvalidArgument, "data size overflows");
    }
    info.nbytes = static_cast<size_t>(*nbytes);
    tensors.push_back(std::move(info));
  }

  const uint64_t data_start = align_up(cursor.position(), alignment);
  for (GgufTensorInfo& info : tensors) {
    if (data_start > bytes.size() || info.offset > bytes.size() - data_start ||
        info.nbytes > bytes.size() - data_start - info.offset) {
      return make_error(ErrorCode::kOutOfRange,
                        "tensor '{}': data [{}, {}) runs past the end of the file ({} bytes)",
                        info.name, data_start + info.offset, data_start + info.offset + info.nbytes,
                        bytes.size());
    }
    info.data = bytes.data() + data_start + info.offset;
  }
  return {};
}

}  // namespace

Expected<GgufFile> GgufFile::parse(std::span<const std::byte> bytes, std::string origin) {
  GgufFile file;
  file.path_ = std::move(origin);
  const Status parsed =
      parse_gguf(bytes, file.version_, file.alignment_, file.metadata_, file.tensors_);
  if (!parsed.ok()) return parsed.error().with_context(file.path_.string());
  return file;
}

Expected<GgufFile> GgufFile::open(const std::filesystem::path& path) {
  GEMMA4_ASSIGN_OR_RETURN(auto mapping, MappedFile::open(path));
  GEMMA4_ASSIGN_OR_RETURN(GgufFile file, parse(mapping->bytes(), path.string()));
  file.mapping_ = std::move(mapping);
  return file;
}

const GgufValue* GgufFile::find_metadata(std::string_view key) const {
  for (const auto& [k, v] : metadata_) {
    if (k == key) return &v;
  }
  return nullptr;
}

const GgufTensorInfo* GgufFile::find(std::string_view name) const {
  for (const auto& tensor : tensors_) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

}  // namespace gemma4::io
