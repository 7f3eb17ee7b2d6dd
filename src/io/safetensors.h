// safetensors checkpoints (weight-formats.md section 1): mmapped, every offset and shape
// bounds-checked at open, single files and sharded model.safetensors.index.json directories;
// plus a streaming writer for synthetic checkpoints.
//
// Lifetime: TensorView::data points into a read-only mapping owned (shared) by the
// SafetensorsFile / Checkpoint that produced it. Keep that object alive while any view, or any
// QMatrix built from a view, is in use. Moving a SafetensorsFile / Checkpoint keeps views valid.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "io/mapped_file.h"

namespace gemma4::io {

// The reference implementation's limit on the JSON header (spec 1.1).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// One tensor of an open checkpoint: little-endian, C order. `data` may be unaligned (spec 1.3:
// only files from the reference writer align tensors to their element size); read through
// memcpy or copy when alignment matters.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // [] for a scalar
  const std::byte* data = nullptr;
  size_t nbytes = 0;

  // Product of the dims (1 for a scalar). Cannot overflow: open() checked it.
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t dim : shape) n *= dim;
    return n;
  }
  std::span<const std::byte> bytes() const { return {data, nbytes}; }
};

// "[262144, 1536]": for error messages and `gemma4 inspect`.
std::string shape_string(std::span<const int64_t> shape);

// One .safetensors file. open() validates the whole header before returning (spec 1.1):
// header length <= 100 MB and inside the file, the header is a JSON object without duplicate
// keys, every dtype is known, dims are non-negative and their byte size does not overflow,
// nbytes == numel * bits / 8, tensors tile the data buffer from 0 with no hole or overlap, and
// the buffer ends exactly at the end of the file.
class SafetensorsFile {
 public:
  static Expected<SafetensorsFile> open(const std::filesystem::path& path);
  // Validates and parses `bytes` (a whole file) without mapping: the fuzz target's entry. Views
  // point into `bytes`, which the caller keeps alive. `origin` names the input in errors.
  static Expected<SafetensorsFile> parse(std::span<const std::byte> bytes, std::string origin);

  std::span<const TensorView> tensors() const { return tensors_; }  // sorted by name
  const TensorView* find(std::string_view name) const;
  // `__metadata__` (transformers writes {"format": "pt"}).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The file path, or parse()'s origin.
  const std::filesystem::path& path() const { return path_; }
  // Reading-pattern hint for the mapping (no-op for parse()d files).
  void advise(MappedFile::Access access) const;

 private:
  std::filesystem::path path_;
  std::shared_ptr<MappedFile> mapping_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: a directory holding model.safetensors or a sharded
// model.safetensors.index.json (spec 1.4), or the path of a single .safetensors file.
// config.json is not read here (model::ModelConfig does that). With an index, weight_map is
// authoritative: a listed tensor missing from its shard, a shard name that leaves the directory,
// or a tensor name present in two shards is an error; tensors a shard holds but the index does
// not list are ignored.
class Checkpoint {
 public:
  static Expected<Checkpoint> open(const std::filesystem::path& path);

  const std::filesystem::path& directory() const { return directory_; }
  const TensorView* find(std::string_view name) const;
  // Every tensor of every shard, sorted by name.
  std::vector<const TensorView*> tensors() const;
  std::span<const SafetensorsFile> shards() const { return shards_; }
  // Total bytes of tensor data.
  uint64_t total_bytes() const;

 private:
  std::filesystem::path directory_;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, const TensorView*, std::less<>> by_name_;
};

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  // numel * bits / 8; assumes a valid spec (the writers validate specs before using this).
  size_t nbytes() const;
};

// Streams a .safetensors file the way the reference (Rust) writer lays it out: header padded
// with spaces to a multiple of 8, `__metadata__` {"format":"pt"}, tensor data in spec order.
// Streaming matters: a real-shape synthetic checkpoint is many GB and is never held in memory.
// The file is written as `<path>.partial` and renamed to `path` by finish(); a writer destroyed
// before finish() removes the partial file.
class SafetensorsWriter {
 public:
  // Validates the specs (names unique, non-empty and not "__metadata__", dims non-negative, sizes
  // not overflowing) and writes the header.
  static Expected<SafetensorsWriter> create(const std::filesystem::path& path,
                                            std::vector<TensorSpec> specs);
  // Appends the next bytes of tensor data (tensors in spec order; a tensor may arrive in several
  // pieces). Fails if more bytes arrive than the specs declare.
  Status append(std::span<const std::byte> bytes);
  // Fails unless exactly the declared bytes were written.
  Status finish();

  // Bytes of tensor data still expected.
  uint64_t remaining_bytes() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// A whole small tensor (tests, tiny checkpoints).
struct TensorData {
  TensorSpec spec;
  std::span<const std::byte> bytes;  // exactly spec.nbytes()
};
Status write_safetensors(const std::filesystem::path& path, std::span<const TensorData> tensors);

// Streams a checkpoint directory split into shards of at most `max_shard_bytes` of tensor data
// (a single larger tensor gets a shard of its own), in spec order. One shard is written as
// model.safetensors; several as model-0000k-of-0000n.safetensors plus
// model.safetensors.index.json ({"metadata": {"total_size": ...}, "weight_map": {...}}).
class ShardedSafetensorsWriter {
 public:
  static Expected<ShardedSafetensorsWriter> create(const std::filesystem::path& directory,
                                                   std::vector<TensorSpec> specs,
                                                   uint64_t max_shard_bytes);
  // As SafetensorsWriter::append; bytes flow across shard boundaries.
  Status append(std::span<const std::byte> bytes);
  // Finishes the last shard and writes the index.
  Status finish();

  // The file names the checkpoint will hold (shards, then the index if any).
  std::vector<std::string> file_names() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace gemma4::io
