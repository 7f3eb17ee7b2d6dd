// A whole file mapped read-only (mmap PROT_READ, MAP_PRIVATE): checkpoints are read in place,
// never copied into process memory.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>

#include "core/status.h"

namespace gemma4::io {

class MappedFile {
 public:
  // How the caller is about to read the mapping (madvise hints; failures are ignored because
  // a hint can never make a correct read wrong).
  enum class Access { kNormal, kSequential, kRandom, kWillNeed, kDontNeed };

  // Maps `path` (a regular file). An empty file gives an empty mapping.
  static Expected<std::shared_ptr<MappedFile>> open(const std::filesystem::path& path);

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const std::filesystem::path& path() const { return path_; }
  void advise(Access access) const;

 private:
  MappedFile(std::filesystem::path path, const std::byte* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace gemma4::io
