#include "io/safetensors.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>
#include <unordered_set>

namespace gemma4::io {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

using Json = nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";

// SAX handler that only looks for a key repeated within one object (nlohmann keeps the last one
// silently; the spec says such a header is invalid). It runs as a second pass because nlohmann's
// DOM parser with a callback rescans the parent object at every object end: quadratic in the
// tensor count, 86 % of `gemma4 inspect`'s time on the 35k-tensor 26B-A4B checkpoint.
class DuplicateKeyFinder final : public nlohmann::json_sax<Json> {
 public:
  std::optional<std::string> duplicate;

  bool start_object(std::size_t) override {
    keys_per_open_object_.emplace_back();
    return true;
  }
  bool end_object() override {
    keys_per_open_object_.pop_back();
    return true;
  }
  bool key(string_t& key) override {
    if (!keys_per_open_object_.back().insert(key).second) duplicate = key;
    return !duplicate;  // the first duplicate ends the pass
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;  // the DOM parse reports syntax errors
  }

 private:
  std::vector<std::unordered_set<std::string>> keys_per_open_object_;
};

// Parses JSON text, rejecting duplicate keys in any object.
Expected<Json> parse_json_without_duplicates(std::string_view text) {
  Json json;
  try {
    json = Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return make_error(ErrorCode::kInvalidArgument, "invalid JSON: {}", e.what());
  }
  DuplicateKeyFinder finder;
  Json::sax_parse(text.begin(), text.end(), &finder);
  if (finder.duplicate) {
    return make_error(ErrorCode::kInvalidArgument, "duplicate key '{}'", *finder.duplicate);
  }
  return json;
}

// One header entry before the buffer checks.
struct RawEntry {
  TensorView view;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Reads a JSON non-negative integer that fits `limit`.
std::optional<uint64_t> as_unsigned(const Json& value, uint64_t limit) {
  if (!value.is_number_unsigned()) return std::nullopt;
  const auto v = value.get<uint64_t>();
  if (v > limit) return std::nullopt;
  return v;
}

Expected<RawEntry> parse_entry(const std::string& name, const Json& entry) {
  auto fail = [&](std::string_view why) {
    return make_error(ErrorCode::kInvalidArgument, "tensor '{}': {}", name, why);
  };
  if (!entry.is_object()) return fail("entry is not a JSON object");
  RawEntry raw;
  raw.view.name = name;

  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) return fail("missing string 'dtype'");
  const auto& dtype_text = dtype_it->get_ref<const std::string&>();
  const auto dtype = dtype_from_name(dtype_text);
  if (!dtype) {
    return make_error(ErrorCode::kUnsupported, "tensor '{}': unsupported dtype '{}'", name,
                      dtype_text);
  }
  raw.view.dtype = *dtype;

  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) return fail("missing array 'shape'");
  // numel * bits must fit in 64 bits (the reference checks the same with checked_mul).
  uint64_t numel_bits = static_cast<uint64_t>(dtype_bits(*dtype));
  for (const Json& dim_json : *shape_it) {
    const auto dim = as_unsigned(dim_json, std::numeric_limits<int64_t>::max());
    if (!dim) {
      return fail(fmt::format("shape entry {} is not a non-negative integer", dim_json.dump()));
    }
    if (__builtin_mul_overflow(numel_bits, *dim, &numel_bits)) {
      return fail(fmt::format("shape {} overflows the byte size", shape_it->dump()));
    }
    raw.view.shape.push_back(static_cast<int64_t>(*dim));
  }
  if (numel_bits % 8 != 0) return fail("sub-byte tensor does not fill whole bytes");

  const auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return fail("missing 'data_offsets' [begin, end]");
  }
  const auto begin = as_unsigned((*offsets_it)[0], std::numeric_limits<uint64_t>::max());
  const auto end = as_unsigned((*offsets_it)[1], std::numeric_limits<uint64_t>::max());
  if (!begin || !end) return fail("data_offsets are not non-negative integers");
  if (*end < *begin) {
    return fail(fmt::format("data_offsets [{}, {}] end before they begin", *begin, *end));
  }
  raw.begin = *begin;
  raw.end = *end;
  if (*end - *begin != numel_bits / 8) {
    return fail(fmt::format("{} {} needs {} bytes but data_offsets [{}, {}] hold {}", dtype_text,
                            shape_it->dump(), numel_bits / 8, *begin, *end, *end - *begin));
  }
  raw.view.nbytes = static_cast<size_t>(numel_bits / 8);
  return raw;
}

Status parse_metadata(const Json& json, std::map<std::string, std::string>& metadata) {
  if (!json.is_object()) {
    return make_error(ErrorCode::kInvalidArgument, "'{}' is not a JSON object", kMetadataKey);
  }
  for (const auto& [key, value] : json.items()) {
    if (!value.is_string()) {
      return make_error(ErrorCode::kInvalidArgument, "'{}' key '{}' is not a string", kMetadataKey,
                        key);
    }
    metadata[key] = value.get<std::string>();
  }
  return {};
}

Status parse_impl(std::span<const std::byte> bytes, std::vector<TensorView>& tensors,
                  std::map<std::string, std::string>& metadata) {
  if (bytes.size() < 8) {
    return make_error(ErrorCode::kOutOfRange,
                      "file is {} bytes, shorter than the 8-byte header length", bytes.size());
  }
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return make_error(ErrorCode::kInvalidArgument, "header length {} exceeds the {}-byte limit",
                      header_bytes, kMaxSafetensorsHeaderBytes);
  }
  if (header_bytes > bytes.size() - 8) {
    return make_error(ErrorCode::kOutOfRange,
                      "header length {} runs past the end of the file ({} bytes)", header_bytes,
                      bytes.size());
  }
  const std::string_view header(reinterpret_cast<const char*>(bytes.data()) + 8, header_bytes);
  if (header.empty() || header.front() != '{') {
    return make_error(ErrorCode::kInvalidArgument, "header does not start with '{{'");
  }
  auto json = parse_json_without_duplicates(header);
  if (!json.ok()) return json.error().with_context("header");
  if (!json->is_object()) {
    return make_error(ErrorCode::kInvalidArgument, "header is not a JSON object");
  }

  std::vector<RawEntry> entries;
  for (const auto& [key, value] : json->items()) {
    if (key == kMetadataKey) {
      GEMMA4_RETURN_IF_ERROR(parse_metadata(value, metadata));
      continue;
    }
    GEMMA4_ASSIGN_OR_RETURN(RawEntry entry, parse_entry(key, value));
    entries.push_back(std::move(entry));
  }

  // Tensors must tile the data buffer: sorted by offsets, each begins where the previous ended.
  std::stable_sort(entries.begin(), entries.end(), [](const RawEntry& a, const RawEntry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const RawEntry& entry : entries) {
    if (entry.begin != covered) {
      return make_error(ErrorCode::kInvalidArgument,
                        "tensor '{}': data_offsets [{}, {}] {} (the previous tensor ends at {})",
                        entry.view.name, entry.begin, entry.end,
                        entry.begin > covered ? "leave a hole" : "overlap another tensor", covered);
    }
    covered = entry.end;
  }
  const uint64_t data_start = 8 + header_bytes;
  const uint64_t buffer_bytes = bytes.size() - data_start;
  if (covered != buffer_bytes) {
    const std::string last = entries.empty() ? "(none)" : entries.back().view.name;
    return make_error(covered > buffer_bytes ? ErrorCode::kOutOfRange : ErrorCode::kInvalidArgument,
                      "tensors cover {} bytes of data but the file holds {} after the header "
                      "(last tensor '{}')",
                      covered, buffer_bytes, last);
  }

  tensors.reserve(entries.size());
  for (RawEntry& entry : entries) {
    entry.view.data = bytes.data() + data_start + entry.begin;
    tensors.push_back(std::move(entry.view));
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
  return {};
}

}  // namespace

std::string shape_string(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

Expected<SafetensorsFile> SafetensorsFile::parse(std::span<const std::byte> bytes,
                                                 std::string origin) {
  SafetensorsFile file;
  file.path_ = std::move(origin);
  const Status parsed = parse_impl(bytes, file.tensors_, file.metadata_);
  if (!parsed.ok()) return parsed.error().with_context(file.path_.string());
  return file;
}

Expected<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  GEMMA4_ASSIGN_OR_RETURN(auto mapping, MappedFile::open(path));
  GEMMA4_ASSIGN_OR_RETURN(SafetensorsFile file, parse(mapping->bytes(), path.string()));
  file.mapping_ = std::move(mapping);
  return file;
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  const auto it = std::lower_bound(
      tensors_.begin(), tensors_.end(), name,
      [](const TensorView& tensor, std::string_view key) { return tensor.name < key; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

void SafetensorsFile::advise(MappedFile::Access access) const {
  if (mapping_) mapping_->advise(access);
}

size_t TensorSpec::nbytes() const {
  size_t n = static_cast<size_t>(dtype_bits(dtype));
  for (int64_t dim : shape) n *= static_cast<size_t>(dim);
  return n / 8;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {

constexpr std::string_view kSingleFileName = "model.safetensors";
constexpr std::string_view kIndexFileName = "model.safetensors.index.json";

Expected<Json> read_json_file(const std::filesystem::path& path) {
  GEMMA4_ASSIGN_OR_RETURN(auto mapping, MappedFile::open(path));
  const auto bytes = mapping->bytes();
  auto json = parse_json_without_duplicates(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  if (!json.ok()) return json.error().with_context(path.string());
  return json;
}

// A shard name from weight_map must be a plain file name inside the checkpoint directory.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

Expected<Checkpoint> Checkpoint::open(const std::filesystem::path& path) {
  Checkpoint checkpoint;
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec)) {
    checkpoint.directory_ = path.parent_path();
    GEMMA4_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
    checkpoint.shards_.push_back(std::move(file));
    for (const TensorView& tensor : checkpoint.shards_.back().tensors()) {
      checkpoint.by_name_.emplace(tensor.name, &tensor);
    }
    return checkpoint;
  }
  if (!std::filesystem::is_directory(path, ec)) {
    return make_error(ErrorCode::kNotFound, "checkpoint {} is neither a directory nor a file",
                      path.string());
  }
  checkpoint.directory_ = path;
  const auto index_path = path / kIndexFileName;
  const auto single_path = path / kSingleFileName;
  if (!std::filesystem::exists(index_path, ec)) {
    if (!std::filesystem::exists(single_path, ec)) {
      return make_error(ErrorCode::kNotFound, "{} holds neither {} nor {}", path.string(),
                        kSingleFileName, kIndexFileName);
    }
    GEMMA4_ASSIGN_OR_RETURN(Checkpoint single, open(single_path));
    single.directory_ = path;
    return single;
  }

  GEMMA4_ASSIGN_OR_RETURN(Json index, read_json_file(index_path));
  auto index_error = [&](std::string_view why) {
    return make_error(ErrorCode::kInvalidArgument, "{}: {}", index_path.string(), why);
  };
  if (!index.is_object()) return index_error("not a JSON object");
  const auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    return index_error("missing object 'weight_map'");
  }
  // shard file name -> tensor names the index puts there
  std::map<std::string, std::vector<std::string>> names_per_shard;
  for (const auto& [tensor_name, shard_json] : map_it->items()) {
    if (!shard_json.is_string()) {
      return index_error(fmt::format("weight_map['{}'] is not a string", tensor_name));
    }
    const auto& shard_name = shard_json.get_ref<const std::string&>();
    if (!is_plain_file_name(shard_name)) {
      return index_error(fmt::format("weight_map['{}'] = '{}' is not a file name in the directory",
                                     tensor_name, shard_name));
    }
    names_per_shard[shard_name].push_back(tensor_name);
  }

  checkpoint.shards_.reserve(names_per_shard.size());
  std::map<std::string, std::string, std::less<>> shard_of_any_tensor;
  for (const auto& [shard_name, tensor_names] : names_per_shard) {
    GEMMA4_ASSIGN_OR_RETURN(SafetensorsFile shard, SafetensorsFile::open(path / shard_name));
    for (const TensorView& tensor : shard.tensors()) {
      const auto [it, inserted] = shard_of_any_tensor.emplace(tensor.name, shard_name);
      if (!inserted) {
        return make_error(ErrorCode::kInvalidArgument, "{}: tensor '{}' is in both {} and {}",
                          path.string(), tensor.name, it->second, shard_name);
      }
    }
    checkpoint.shards_.push_back(std::move(shard));
    const SafetensorsFile& stored = checkpoint.shards_.back();
    for (const std::string& tensor_name : tensor_names) {
      const TensorView* tensor = stored.find(tensor_name);
      if (tensor == nullptr) {
        return make_error(ErrorCode::kNotFound,
                          "{}: tensor '{}' is listed in {} but missing from {}", path.string(),
                          tensor_name, kIndexFileName, shard_name);
      }
      checkpoint.by_name_.emplace(tensor_name, tensor);
    }
  }
  return checkpoint;
}

const TensorView* Checkpoint::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<const TensorView*> Checkpoint::tensors() const {
  std::vector<const TensorView*> result;
  result.reserve(by_name_.size());
  for (const auto& [name, tensor] : by_name_) result.push_back(tensor);
  return result;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, tensor] : by_name_) total += tensor->nbytes;
  return total;
}

}  // namespace gemma4::io
