// Streaming GGUF v3 writer (synthetic checkpoints, tests).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include "io/gguf.h"
#include "io/partial_file.h"

namespace gemma4::io {
namespace {

constexpr std::string_view kAlignmentKey = "general.alignment";

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

void put_string(std::string& out, std::string_view text) {
  put<uint64_t>(out, text.size());
  out.append(text);
}

// Writes one scalar of `type` from the widened `scalar`; fails when the kinds differ or the
// value does not fit the type.
Status put_scalar(std::string& out, GgufValueType type, const GgufValue::Storage& scalar,
                  std::string_view key) {
  auto mismatch = [&] {
    return make_error(ErrorCode::kInvalidArgument, "metadata key '{}': value does not fit {}", key,
                      gguf_value_type_name(type));
  };
  auto put_unsigned = [&]<typename T>(T) -> Status {
    const auto* v = std::get_if<uint64_t>(&scalar);
    if (v == nullptr || *v > std::numeric_limits<T>::max()) return mismatch();
    put<T>(out, static_cast<T>(*v));
    return {};
  };
  auto put_signed = [&]<typename T>(T) -> Status {
    const auto* v = std::get_if<int64_t>(&scalar);
    if (v == nullptr || *v > std::numeric_limits<T>::max() || *v < std::numeric_limits<T>::min()) {
      return mismatch();
    }
    put<T>(out, static_cast<T>(*v));
    return {};
  };
  switch (type) {
    case GgufValueType::kU8:
      return put_unsigned(uint8_t{});
    case GgufValueType::kU16:
      return put_unsigned(uint16_t{});
    case GgufValueType::kU32:
      return put_unsigned(uint32_t{});
    case GgufValueType::kU64:
      return put_unsigned(uint64_t{});
    case GgufValueType::kI8:
      return put_signed(int8_t{});
    case GgufValueType::kI16:
      return put_signed(int16_t{});
    case GgufValueType::kI32:
      return put_signed(int32_t{});
    case GgufValueType::kI64:
      return put_signed(int64_t{});
    case GgufValueType::kF32:
    case GgufValueType::kF64: {
      const auto* v = std::get_if<double>(&scalar);
      if (v == nullptr) return mismatch();
      if (type == GgufValueType::kF32)
        put<float>(out, static_cast<float>(*v));
      else
        put<double>(out, *v);
      return {};
    }
    case GgufValueType::kBool: {
      const auto* v = std::get_if<bool>(&scalar);
      if (v == nullptr) return mismatch();
      put<uint8_t>(out, *v ? 1 : 0);
      return {};
    }
    case GgufValueType::kString: {
      const auto* v = std::get_if<std::string>(&scalar);
      if (v == nullptr) return mismatch();
      put_string(out, *v);
      return {};
    }
    case GgufValueType::kArray:
      break;
  }
  return mismatch();
}

Status put_value(std::string& out, const GgufValue& value, std::string_view key) {
  put<uint32_t>(out, static_cast<uint32_t>(value.type));
  if (value.type != GgufValueType::kArray) return put_scalar(out, value.type, value.storage, key);
  if (value.element_type == GgufValueType::kArray) {
    return make_error(ErrorCode::kInvalidArgument, "metadata key '{}': nested arrays", key);
  }
  put<uint32_t>(out, static_cast<uint32_t>(value.element_type));
  put<uint64_t>(out, value.array_size());
  return std::visit(
      [&](const auto& elements) -> Status {
        using Stored = std::decay_t<decltype(elements)>;
        if constexpr (requires { typename Stored::value_type; } &&
                      !std::is_same_v<Stored, std::string>) {
          for (const auto& element : elements) {
            GEMMA4_RETURN_IF_ERROR(put_scalar(
                out, value.element_type,
                GgufValue::Storage(static_cast<typename Stored::value_type>(element)), key));
          }
          return {};
        } else {
          return make_error(ErrorCode::kInvalidArgument,
                            "metadata key '{}': array without elements", key);
        }
      },
      value.storage);
}

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

struct GgufWriter::State {
  PartialFile out;
  uint32_t alignment = kGgufDefaultAlignment;
  std::vector<uint64_t> tensor_bytes;
  size_t current = 0;            // tensor receiving bytes
  uint64_t current_written = 0;  // bytes of it written so far

  Status write(const void* data, size_t size) { return out.write(data, size); }

  Status pad(uint64_t written) {
    static constexpr char kZeros[64] = {};
    uint64_t padding = align_up(written, alignment) - written;
    while (padding > 0) {
      const size_t piece = std::min<uint64_t>(padding, sizeof(kZeros));
      GEMMA4_RETURN_IF_ERROR(write(kZeros, piece));
      padding -= piece;
    }
    return {};
  }

  // Pads and moves past every tensor that has all its bytes (incl. zero-size ones).
  Status close_complete_tensors() {
    while (current < tensor_bytes.size() && current_written == tensor_bytes[current]) {
      GEMMA4_RETURN_IF_ERROR(pad(current_written));
      ++current;
      current_written = 0;
    }
    return {};
  }
};

Expected<GgufWriter> GgufWriter::create(const std::filesystem::path& path,
                                        std::vector<std::pair<std::string, GgufValue>> metadata,
                                        std::vector<GgufTensorSpec> tensors) {
  auto state = std::make_shared<State>();
  auto fail = [&](const Error& error) { return error.with_context("writing " + path.string()); };

  std::string header;
  put<uint32_t>(header, kGgufMagic);
  put<uint32_t>(header, 3);
  put<uint64_t>(header, tensors.size());
  put<uint64_t>(header, metadata.size());
  std::set<std::string_view> keys;
  for (const auto& [key, value] : metadata) {
    if (!keys.insert(key).second) {
      return fail(make_error(ErrorCode::kInvalidArgument, "duplicate metadata key '{}'", key));
    }
    if (key == kAlignmentKey) {
      const auto a = value.as_uint();
      if (value.type != GgufValueType::kU32 || !a || *a == 0 || !std::has_single_bit(*a)) {
        return fail(make_error(ErrorCode::kInvalidArgument,
                               "'general.alignment' must be a UINT32 power of two"));
      }
      state->alignment = static_cast<uint32_t>(*a);
    }
    put_string(header, key);
    const Status written = put_value(header, value, key);
    if (!written.ok()) return fail(written.error());
  }
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const GgufTensorSpec& spec : tensors) {
    auto tensor_fail = [&](std::string_view why) {
      return fail(make_error(ErrorCode::kInvalidArgument, "tensor '{}': {}", spec.name, why));
    };
    if (spec.name.empty() || spec.name.size() > kGgufMaxNameBytes) {
      return tensor_fail("name must have 1 to 63 bytes");
    }
    if (!names.insert(spec.name).second) return tensor_fail("duplicate name");
    if (spec.ne.empty() || spec.ne.size() > static_cast<size_t>(kGgufMaxDims)) {
      return tensor_fail("needs 1 to 4 dims");
    }
    for (int64_t dim : spec.ne) {
      if (dim < 0) return tensor_fail("negative dimension");
    }
    auto nbytes = gguf_tensor_bytes(static_cast<uint32_t>(spec.type), spec.ne);
    if (!nbytes.ok())
      return fail(nbytes.error().with_context(fmt::format("tensor '{}'", spec.name)));
    put_string(header, spec.name);
    put<uint32_t>(header, static_cast<uint32_t>(spec.ne.size()));
    for (int64_t dim : spec.ne) put<uint64_t>(header, static_cast<uint64_t>(dim));
    put<uint32_t>(header, static_cast<uint32_t>(spec.type));
    put<uint64_t>(header, offset);
    state->tensor_bytes.push_back(*nbytes);
    offset += align_up(*nbytes, state->alignment);
  }

  GEMMA4_ASSIGN_OR_RETURN(state->out, PartialFile::create(path));
  GEMMA4_RETURN_IF_ERROR(state->write(header.data(), header.size()));
  GEMMA4_RETURN_IF_ERROR(state->pad(header.size()));
  GEMMA4_RETURN_IF_ERROR(state->close_complete_tensors());
  GgufWriter writer;
  writer.state_ = std::move(state);
  return writer;
}

Status GgufWriter::append(std::span<const std::byte> bytes) {
  State& s = *state_;
  if (!s.out.is_open()) {
    return make_error(ErrorCode::kInvalidArgument, "writing {}: already finished",
                      s.out.path().string());
  }
  while (!bytes.empty()) {
    if (s.current == s.tensor_bytes.size()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "writing {}: {} more bytes than the tensor specs declare",
                        s.out.path().string(), bytes.size());
    }
    const size_t piece = static_cast<size_t>(
        std::min<uint64_t>(bytes.size(), s.tensor_bytes[s.current] - s.current_written));
    GEMMA4_RETURN_IF_ERROR(s.write(bytes.data(), piece));
    s.current_written += piece;
    bytes = bytes.subspan(piece);
    GEMMA4_RETURN_IF_ERROR(s.close_complete_tensors());
  }
  return {};
}

Status GgufWriter::finish() {
  State& s = *state_;
  if (!s.out.is_open()) {
    return make_error(ErrorCode::kInvalidArgument, "writing {}: already finished",
                      s.out.path().string());
  }
  if (s.current != s.tensor_bytes.size()) {
    return make_error(ErrorCode::kInvalidArgument, "writing {}: tensor data missing (tensor #{})",
                      s.out.path().string(), s.current);
  }
  return s.out.commit();
}

}  // namespace gemma4::io
