// A file written as "<path>.partial" and renamed to <path> only once complete, so an error or a
// crash never leaves a truncated file under the final name. Removed again if never committed.
#pragma once

#include <cstddef>
#include <cstdio>
#include <filesystem>

#include "core/status.h"

namespace gemma4::io {

class PartialFile {
 public:
  PartialFile() = default;  // not open
  static Expected<PartialFile> create(const std::filesystem::path& path);
  PartialFile(PartialFile&& other) noexcept;
  PartialFile& operator=(PartialFile&& other) noexcept;
  PartialFile(const PartialFile&) = delete;
  PartialFile& operator=(const PartialFile&) = delete;
  ~PartialFile();

  bool is_open() const { return file_ != nullptr; }
  // The final path.
  const std::filesystem::path& path() const { return path_; }

  Status write(const void* data, size_t size);
  // Closes the file and renames it to its final path.
  Status commit();

 private:
  void discard();

  std::filesystem::path path_;
  std::filesystem::path partial_path_;
  std::FILE* file_ = nullptr;
};

}  // namespace gemma4::io
