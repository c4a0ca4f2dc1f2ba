#include "common/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace memplan {
namespace {

Status ErrnoStatus(const std::string& path, const char* what, int err) {
  std::string msg = path + ": " + what + ": " + std::strerror(err);
  if (err == ENOENT) return Status::NotFound(msg);
  if (err == ENOSPC || err == EDQUOT) return Status::ResourceExhausted(msg);
  return Status::IoError(msg);
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

Result<int> OpenForRead(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(path, "cannot open", errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(path, "cannot stat", err);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + ": is a directory, expected a file");
  }
  return fd;
}

Status ReadFull(int fd, const std::string& path, uint64_t offset, char* out, uint64_t length) {
  uint64_t done = 0;
  while (done < length) {
    ssize_t n = ::pread(fd, out + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(path, "read failed", errno);
    }
    if (n == 0) {
      return Status::InvalidArgument(path + ": file ends at byte " + std::to_string(offset + done) +
                                     ", expected at least " + std::to_string(offset + length));
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

}  // namespace

Result<uint64_t> FileSize(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoStatus(path, "cannot stat", errno);
  if (!S_ISREG(st.st_mode)) return Status::InvalidArgument(path + ": not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

Result<std::string> ReadFileToString(const std::string& path, uint64_t max_bytes) {
  MEMPLAN_ASSIGN_OR_RETURN(int raw_fd, OpenForRead(path));
  Fd fd(raw_fd);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(path, "cannot stat", errno);
  if (S_ISREG(st.st_mode)) {
    uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size > max_bytes) {
      return Status::ResourceExhausted(path + ": file is " + std::to_string(size) +
                                       " bytes, larger than the " + std::to_string(max_bytes) +
                                       "-byte limit for this kind of file");
    }
  }
  // Read until EOF (also works for pipes such as /dev/stdin), still bounded by max_bytes.
  std::string out;
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(path, "read failed", errno);
    }
    if (n == 0) break;
    if (out.size() + static_cast<uint64_t>(n) > max_bytes) {
      return Status::ResourceExhausted(path + ": larger than the " + std::to_string(max_bytes) +
                                       "-byte limit for this kind of file");
    }
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

Result<std::string> ReadFileRange(const std::string& path, uint64_t offset, uint64_t length) {
  MEMPLAN_ASSIGN_OR_RETURN(int raw_fd, OpenForRead(path));
  Fd fd(raw_fd);
  std::string out(length, '\0');
  MEMPLAN_RETURN_IF_ERROR(ReadFull(fd.get(), path, offset, out.data(), length));
  return out;
}

Status WriteFileAtomically(const std::string& path, const std::string& contents, uint32_t mode) {
  std::string tmp = path + ".tmp.XXXXXX";
  int raw = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (raw < 0) return ErrnoStatus(path, "cannot create temporary file", errno);
  Fd fd(raw);
  auto fail = [&](const char* what, int err) {
    ::unlink(tmp.c_str());
    return ErrnoStatus(path, what, err);
  };
  if (::fchmod(fd.get(), static_cast<mode_t>(mode & 07777)) != 0) {
    return fail("chmod failed", errno);
  }
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd.get(), contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail("write failed", errno);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) return fail("fsync failed", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename failed", errno);
  // The new name lives in the directory: without this a power loss may bring back the old file.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string(".")
                          : slash == 0               ? std::string("/")
                                                     : path.substr(0, slash);
  int dir_raw = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_raw < 0) {
    return ErrnoStatus(path, "written, but cannot open its directory to fsync it", errno);
  }
  Fd dir_fd(dir_raw);
  if (::fsync(dir_fd.get()) != 0 && errno != EINVAL) {
    return ErrnoStatus(path, "written, but the fsync of its directory failed", errno);
  }
  return Status::Ok();
}

}  // namespace memplan
