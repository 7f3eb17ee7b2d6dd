// safetensors checkpoints (weight-formats.md section 1): mmapped, every offset and shape
// bounds-checked at open, single files and sharded model.safetensors.index.json directories.
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

namespace gemma4::io {

// One tensor of an open checkpoint. `data` points into the read-only mapping and stays valid as
// long as the SafetensorsFile / Checkpoint that returned it lives.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
};

class MappedFile;  // defined in io/mapped_file.h

// One .safetensors file. open() validates the whole header before returning.
class SafetensorsFile {
 public:
  static Expected<SafetensorsFile> open(const std::filesystem::path& path);
  // Validates and parses `bytes` (the whole file) without mapping: the fuzz target's entry.
  static Expected<SafetensorsFile> parse(std::span<const std::byte> bytes, std::string origin);

  std::span<const TensorView> tensors() const { return tensors_; }
  const TensorView* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::shared_ptr<MappedFile> mapping_;
  std::vector<TensorView> tensors_;  // sorted by name
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: config.json plus model.safetensors or a sharded index.
class Checkpoint {
 public:
  static Expected<Checkpoint> open(const std::filesystem::path& directory);

  const std::filesystem::path& directory() const { return directory_; }
  // Every tensor of every shard, by name.
  const TensorView* find(std::string_view name) const;
  std::vector<const TensorView*> tensors() const;
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
  size_t nbytes() const;
};

// Streams a .safetensors file the way the reference (Rust) writer lays it out: header padded
// with spaces to a multiple of 8, `__metadata__` {"format":"pt"}, tensor data in spec order.
// Streaming matters: a real-shape synthetic checkpoint is many GB and is never held in memory.
class SafetensorsWriter {
 public:
  static Expected<SafetensorsWriter> create(const std::filesystem::path& path,
                                            std::vector<TensorSpec> specs);
  // Appends the next bytes of tensor data (tensors in spec order; a tensor may arrive in several
  // pieces). Fails if more bytes arrive than the specs declare.
  Status append(std::span<const std::byte> bytes);
  // Fails unless exactly the declared bytes were written.
  Status finish();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace gemma4::io
