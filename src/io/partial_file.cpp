#include "io/partial_file.h"

#include <cerrno>
#include <cstring>
#include <utility>

namespace gemma4::io {
namespace {

Error io_error(std::string_view what, const std::filesystem::path& path, int err) {
  return make_error(ErrorCode::kIo, "cannot {} {}: {}", what, path.string(), std::strerror(err));
}

}  // namespace

Expected<PartialFile> PartialFile::create(const std::filesystem::path& path) {
  PartialFile out;
  out.path_ = path;
  out.partial_path_ = path;
  out.partial_path_ += ".partial";
  out.file_ = std::fopen(out.partial_path_.c_str(), "wb");
  if (out.file_ == nullptr) return io_error("create", out.partial_path_, errno);
  return out;
}

PartialFile::PartialFile(PartialFile&& other) noexcept {
  *this = std::move(other);
}

PartialFile& PartialFile::operator=(PartialFile&& other) noexcept {
  if (this != &other) {
    discard();
    path_ = std::move(other.path_);
    partial_path_ = std::move(other.partial_path_);
    file_ = std::exchange(other.file_, nullptr);
  }
  return *this;
}

PartialFile::~PartialFile() {
  discard();
}

void PartialFile::discard() {
  if (file_ == nullptr) return;
  std::fclose(file_);
  file_ = nullptr;
  std::error_code ignored;
  std::filesystem::remove(partial_path_, ignored);
}

Status PartialFile::write(const void* data, size_t size) {
  // (An empty span may carry a null pointer, which fwrite must not see.)
  if (size > 0 && std::fwrite(data, 1, size, file_) != size) {
    return io_error("write", partial_path_, errno);
  }
  return {};
}

Status PartialFile::commit() {
  const bool closed = std::fclose(file_) == 0;
  const int close_errno = errno;
  file_ = nullptr;
  std::error_code ec;
  if (!closed) {
    std::filesystem::remove(partial_path_, ec);
    return io_error("write", partial_path_, close_errno);
  }
  std::filesystem::rename(partial_path_, path_, ec);
  if (ec) {
    return make_error(ErrorCode::kIo, "cannot rename {} to {}: {}", partial_path_.string(),
                      path_.string(), ec.message());
  }
  return {};
}

}  // namespace gemma4::io
