#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace gemma4::io {

Expected<std::shared_ptr<MappedFile>> MappedFile::open(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return make_error(err == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo, "cannot open {}: {}",
                      path.string(), std::strerror(err));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int err = errno;
    ::close(fd);
    return make_error(ErrorCode::kIo, "cannot stat {}: {}", path.string(), std::strerror(err));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return make_error(ErrorCode::kInvalidArgument, "{} is not a regular file", path.string());
  }
  const auto size = static_cast<size_t>(info.st_size);
  const std::byte* data = nullptr;
  if (size > 0) {
    void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return make_error(ErrorCode::kIo, "cannot mmap {} ({} bytes): {}", path.string(), size,
                        std::strerror(err));
    }
    data = static_cast<const std::byte*>(mapping);
  }
  ::close(fd);  // the mapping keeps the file alive
  return std::shared_ptr<MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

void MappedFile::advise(Access access) const {
  if (data_ == nullptr) return;
  int advice = MADV_NORMAL;
  switch (access) {
    case Access::kNormal:
      advice = MADV_NORMAL;
      break;
    case Access::kSequential:
      advice = MADV_SEQUENTIAL;
      break;
    case Access::kRandom:
      advice = MADV_RANDOM;
      break;
    case Access::kWillNeed:
      advice = MADV_WILLNEED;
      break;
    case Access::kDontNeed:
      advice = MADV_DONTNEED;
      break;
  }
  ::madvise(const_cast<std::byte*>(data_), size_, advice);
}

}  // namespace gemma4::io
