// Streaming safetensors writers (single file and sharded directory).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "io/partial_file.h"
#include "io/safetensors.h"

namespace gemma4::io {
namespace {

using Json = nlohmann::json;

// Checks names and sizes; returns the total data bytes.
Expected<uint64_t> validate_specs(const std::vector<TensorSpec>& specs,
                                  const std::filesystem::path& destination) {
  std::set<std::string_view> names;
  uint64_t total = 0;
  for (const TensorSpec& spec : specs) {
    auto fail = [&](std::string_view why) {
      return make_error(ErrorCode::kInvalidArgument, "writing {}: tensor '{}': {}",
                        destination.string(), spec.name, why);
    };
    if (spec.name.empty() || spec.name == "__metadata__") return fail("reserved or empty name");
    if (!names.insert(spec.name).second) return fail("duplicate name");
    uint64_t bits = static_cast<uint64_t>(dtype_bits(spec.dtype));
    for (int64_t dim : spec.shape) {
      if (dim < 0) return fail(fmt::format("negative dimension in {}", shape_string(spec.shape)));
      if (__builtin_mul_overflow(bits, static_cast<uint64_t>(dim), &bits)) {
        return fail(fmt::format("shape {} overflows", shape_string(spec.shape)));
      }
    }
    if (__builtin_add_overflow(total, bits / 8, &total)) return fail("total size overflows");
  }
  return total;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

struct SafetensorsWriter::State {
  PartialFile out;
  uint64_t remaining = 0;
};

Expected<SafetensorsWriter> SafetensorsWriter::create(const std::filesystem::path& path,
                                                      std::vector<TensorSpec> specs) {
  GEMMA4_ASSIGN_OR_RETURN(const uint64_t total, validate_specs(specs, path));

  Json header = Json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const TensorSpec& spec : specs) {
    const uint64_t end = offset + spec.nbytes();
    header[spec.name] = {
        {"dtype", dtype_name(spec.dtype)}, {"shape", spec.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {  // a name that is not valid UTF-8
    return make_error(ErrorCode::kInvalidArgument, "writing {}: {}", path.string(), e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data buffer starts 8-byte aligned

  auto state = std::make_shared<State>();
  state->remaining = total;
  GEMMA4_ASSIGN_OR_RETURN(state->out, PartialFile::create(path));
  const uint64_t header_bytes = text.size();
  GEMMA4_RETURN_IF_ERROR(state->out.write(&header_bytes, 8));
  GEMMA4_RETURN_IF_ERROR(state->out.write(text.data(), text.size()));
  SafetensorsWriter writer;
  writer.state_ = std::move(state);
  return writer;
}

Status SafetensorsWriter::append(std::span<const std::byte> bytes) {
  State& s = *state_;
  if (!s.out.is_open()) {
    return make_error(ErrorCode::kInvalidArgument, "writing {}: already finished",
                      s.out.path().string());
  }
  if (bytes.size() > s.remaining) {
    return make_error(ErrorCode::kInvalidArgument,
                      "writing {}: {} more bytes than the tensor specs declare",
                      s.out.path().string(), bytes.size() - s.remaining);
  }
  GEMMA4_RETURN_IF_ERROR(s.out.write(bytes.data(), bytes.size()));
  s.remaining -= bytes.size();
  return {};
}

Status SafetensorsWriter::finish() {
  State& s = *state_;
  if (!s.out.is_open()) {
    return make_error(ErrorCode::kInvalidArgument, "writing {}: already finished",
                      s.out.path().string());
  }
  if (s.remaining != 0) {
    return make_error(ErrorCode::kInvalidArgument, "writing {}: {} bytes of tensor data missing",
                      s.out.path().string(), s.remaining);
  }
  return s.out.commit();
}

uint64_t SafetensorsWriter::remaining_bytes() const {
  return state_->remaining;
}

Status write_safetensors(const std::filesystem::path& path, std::span<const TensorData> tensors) {
  std::vector<TensorSpec> specs;
  for (const TensorData& tensor : tensors) specs.push_back(tensor.spec);
  GEMMA4_ASSIGN_OR_RETURN(SafetensorsWriter writer, SafetensorsWriter::create(path, specs));
  for (const TensorData& tensor : tensors) {
    if (tensor.bytes.size() != tensor.spec.nbytes()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "writing {}: tensor '{}' has {} bytes, its spec needs {}", path.string(),
                        tensor.spec.name, tensor.bytes.size(), tensor.spec.nbytes());
    }
    GEMMA4_RETURN_IF_ERROR(writer.append(tensor.bytes));
  }
  return writer.finish();
}

// ---------------------------------------------------------------------------------------------
// ShardedSafetensorsWriter

struct ShardedSafetensorsWriter::State {
  struct Shard {
    std::string file_name;
    std::vector<TensorSpec> specs;
  };
  std::filesystem::path directory;
  std::vector<Shard> shards;
  uint64_t total_bytes = 0;
  size_t next_shard = 0;  // the shard `current` writes is next_shard - 1
  std::optional<SafetensorsWriter> current;

  // Finishes the current shard while it needs no more bytes and opens the next one; after the
  // last shard `current` is empty.
  Status advance_past_full_shards() {
    while (!current || current->remaining_bytes() == 0) {
      if (current) {
        GEMMA4_RETURN_IF_ERROR(current->finish());
        current.reset();
      }
      if (next_shard == shards.size()) return {};
      const Shard& shard = shards[next_shard++];
      GEMMA4_ASSIGN_OR_RETURN(SafetensorsWriter writer,
                              SafetensorsWriter::create(directory / shard.file_name, shard.specs));
      current = std::move(writer);
    }
    return {};
  }
};

Expected<ShardedSafetensorsWriter> ShardedSafetensorsWriter::create(
    const std::filesystem::path& directory, std::vector<TensorSpec> specs,
    uint64_t max_shard_bytes) {
  GEMMA4_ASSIGN_OR_RETURN(const uint64_t total, validate_specs(specs, directory));
  if (max_shard_bytes == 0) {
    return make_error(ErrorCode::kInvalidArgument, "writing {}: max shard size must be positive",
                      directory.string());
  }
  auto state = std::make_shared<State>();
  state->directory = directory;
  state->total_bytes = total;
  uint64_t shard_bytes = 0;
  for (TensorSpec& spec : specs) {
    const uint64_t n = spec.nbytes();
    if (state->shards.empty() || (shard_bytes > 0 && shard_bytes + n > max_shard_bytes)) {
      state->shards.emplace_back();
      shard_bytes = 0;
    }
    state->shards.back().specs.push_back(std::move(spec));
    shard_bytes += n;
  }
  if (state->shards.empty()) state->shards.emplace_back();  // an empty checkpoint
  const size_t count = state->shards.size();
  for (size_t i = 0; i < count; ++i) {
    state->shards[i].file_name =
        count == 1 ? "model.safetensors"
                   : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, count);
  }
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) {
    return make_error(ErrorCode::kIo, "cannot create {}: {}", directory.string(), ec.message());
  }
  // Open the first shard now so that a bad destination fails at create().
  const auto& first = state->shards[0];
  GEMMA4_ASSIGN_OR_RETURN(SafetensorsWriter writer,
                          SafetensorsWriter::create(directory / first.file_name, first.specs));
  state->current = std::move(writer);
  state->next_shard = 1;
  ShardedSafetensorsWriter result;
  result.state_ = std::move(state);
  return result;
}

Status ShardedSafetensorsWriter::append(std::span<const std::byte> bytes) {
  State& s = *state_;
  while (!bytes.empty()) {
    GEMMA4_RETURN_IF_ERROR(s.advance_past_full_shards());
    if (!s.current) {
      return make_error(ErrorCode::kInvalidArgument,
                        "writing {}: {} more bytes than the tensor specs declare",
                        s.directory.string(), bytes.size());
    }
    const size_t piece =
        static_cast<size_t>(std::min<uint64_t>(bytes.size(), s.current->remaining_bytes()));
    GEMMA4_RETURN_IF_ERROR(s.current->append(bytes.first(piece)));
    bytes = bytes.subspan(piece);
  }
  return {};
}

Status ShardedSafetensorsWriter::finish() {
  State& s = *state_;
  if (s.current && s.current->remaining_bytes() != 0) {
    return make_error(ErrorCode::kInvalidArgument, "writing {}: tensor data missing",
                      s.directory.string());
  }
  GEMMA4_RETURN_IF_ERROR(s.advance_past_full_shards());
  if (s.shards.size() == 1) return {};

  Json weight_map = Json::object();
  for (const auto& shard : s.shards) {
    for (const TensorSpec& spec : shard.specs) weight_map[spec.name] = shard.file_name;
  }
  const Json index = {{"metadata", {{"total_size", s.total_bytes}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  GEMMA4_ASSIGN_OR_RETURN(PartialFile out,
                          PartialFile::create(s.directory / "model.safetensors.index.json"));
  GEMMA4_RETURN_IF_ERROR(out.write(text.data(), text.size()));
  return out.commit();
}

std::vector<std::string> ShardedSafetensorsWriter::file_names() const {
  std::vector<std::string> names;
  for (const auto& shard : state_->shards) names.push_back(shard.file_name);
  if (names.size() > 1) names.push_back("model.safetensors.index.json");
  return names;
}

}  // namespace gemma4::io
