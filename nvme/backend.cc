// Backend selection (CreateBackend), file opening with the O_DIRECT -> buffered fallback, and the
// helpers every kernel-backed backend shares (backend_internal.h).
#include "nvme/backend.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <utility>

#include "common/strings.h"
#include "nvme/backend_internal.h"

namespace memplan::nvme {

namespace {

constexpr uint32_t kDefaultDirectAlignment = 4096;

std::string_view DisplayName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kUring: return "io_uring";
    case BackendKind::kAio: return "libaio";
    case BackendKind::kPosix: return "posix";
    case BackendKind::kMemory: return "memory";
    case BackendKind::kAuto: return "auto";
  }
  return "?";
}

Result<std::unique_ptr<Backend>> CreateOfKind(BackendKind kind, const BackendOptions& options) {
  switch (kind) {
    case BackendKind::kUring: return CreateUringBackend(options);
    case BackendKind::kAio: return CreateAioBackend(options);
    case BackendKind::kPosix: return CreatePosixBackend(options);
    case BackendKind::kMemory: return CreateMemoryBackend(options);
    case BackendKind::kAuto: break;
  }
  return Status::Internal("CreateOfKind called with kAuto");
}

// "using io_uring", plus what the backend could not grant ("(SQPOLL refused: ...)").
std::string UsingNote(const Backend& backend) {
  std::string note = "using " + backend.capabilities().name;
  if (!backend.capabilities().note.empty()) note += " (" + backend.capabilities().note + ")";
  return note;
}

int OpenRetryingEintr(const std::string& path, int flags) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags, 0600);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

Status OpenError(int err, const std::string& path, const OpenOptions& options) {
  std::string what = "open '" + path + "'";
  // With O_NOFOLLOW a symlink at the last component reads as the cryptic ELOOP; say so.
  if (err == ELOOP && options.nofollow) what += " (O_NOFOLLOW: is it a symlink?)";
  return Status::FromErrno(err, what);
}

// Turns O_DIRECT on or off on an open fd. Returns 0 or an errno. Filesystems without direct I/O
// refuse F_SETFL(O_DIRECT) with EINVAL, exactly as they refuse open(O_DIRECT).
int SetDirect(int fd, bool on, bool fault) {
  if (on && fault) return EINVAL;
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) return errno;
  flags = on ? (flags | O_DIRECT) : (flags & ~O_DIRECT);
  return ::fcntl(fd, F_SETFL, flags) == 0 ? 0 : errno;
}

// Note [O_DIRECT probe]: some filesystems (FUSE mounts, some network and overlay setups) accept
// O_DIRECT at open and then fail every aligned read or write with EINVAL. When the file has data,
// one aligned read of one alignment unit (at least 4096 bytes) at offset 0 tells us before the
// engine depends on it. An empty file cannot be probed without writing to it, so it is accepted
// as is; the first real I/O would report EINVAL in its completion. Only EINVAL means "refused";
// any other error is left for the real I/O to report with its context. Returns 0 or EINVAL.
int ProbeDirectRead(int fd, bool fault) {
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) return 0;
  if (fault) return EINVAL;
  const size_t align = std::max(kDefaultDirectAlignment, DirectIoAlignment(fd, /*direct=*/true));
  void* buffer = std::aligned_alloc(align, align);
  if (buffer == nullptr) return 0;  // cannot probe; accept
  ssize_t n;
  do {
    n = ::pread(fd, buffer, align, 0);
  } while (n < 0 && errno == EINTR);
  const int err = n < 0 ? errno : 0;
  std::free(buffer);
  return err == EINVAL ? EINVAL : 0;
}

}  // namespace

#if !MEMPLAN_HAVE_URING
Result<std::unique_ptr<Backend>> CreateUringBackend(const BackendOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  return Status::Unimplemented("not built (liburing was not found when memplan was configured)");
}
#endif

#if !MEMPLAN_HAVE_AIO
Result<std::unique_ptr<Backend>> CreateAioBackend(const BackendOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  return Status::Unimplemented("not built (libaio was not found when memplan was configured)");
}
#endif

// Note [Memory filesystems]: tmpfs and ramfs have no asynchronous I/O path; the kernel copies
// each request's bytes synchronously. libaio does that copy inside io_submit, in the submitting
// thread. io_uring cannot issue such a request without blocking, so it hands every one to a kernel
// worker (perf shows the copy in an iou-wrk thread) and the submitting thread then sleeps until it
// completes: the same copy plus a hand-over and a wake-up per request. Measured on a 1 GiB
// /dev/shm file (1 MiB blocks, queue depth 16, one thread, medians of 6 interleaved rounds):
// write 4.29 GB/s through io_uring, 4.66 through libaio (DeepSpeed's aio op 4.58); read 4.54 and
// 4.81 (4.75). On a drive, O_DIRECT requests are issued without blocking and io_uring keeps its
// lead, so only a path on a memory filesystem changes kAuto's order.
bool OnMemoryFilesystem(const std::string& path) {
  constexpr uint64_t kTmpfsMagic = 0x01021994;  // linux/magic.h
  constexpr uint64_t kRamfsMagic = 0x858458f6;
  struct statfs fs = {};
  int rc = ::statfs(path.c_str(), &fs);
  if (rc != 0 && errno == ENOENT) {
    const std::string parent = DirName(path);
    rc = ::statfs(parent.c_str(), &fs);
  }
  const auto type = static_cast<uint64_t>(fs.f_type);
  return rc == 0 && (type == kTmpfsMagic || type == kRamfsMagic);
}

Result<BackendChoice> CreateBackend(BackendKind kind, const BackendOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  BackendChoice choice;
  if (kind != BackendKind::kAuto) {
    Result<std::unique_ptr<Backend>> backend = CreateOfKind(kind, options);
    if (!backend.ok()) {
      return backend.status().WithPrefix(std::string(DisplayName(kind)) + " backend");
    }
    choice.backend = std::move(backend).value();
    choice.kind = kind;
    choice.note = UsingNote(*choice.backend) + " as requested";
    return choice;
  }
  // kAuto: the fastest that works here, saying what was skipped and why.
  std::string skipped;
  const bool memory_fs = !options.path.empty() && OnMemoryFilesystem(options.path);
  const BackendKind first = memory_fs ? BackendKind::kAio : BackendKind::kUring;
  const BackendKind second = memory_fs ? BackendKind::kUring : BackendKind::kAio;
  if (memory_fs) skipped = "memory filesystem: libaio first (it copies in the caller); ";
  for (BackendKind candidate : {first, second, BackendKind::kPosix}) {
    Result<std::unique_ptr<Backend>> backend = CreateOfKind(candidate, options);
    if (backend.ok()) {
      choice.backend = std::move(backend).value();
      choice.kind = candidate;
      choice.note = skipped + UsingNote(*choice.backend);
      return choice;
    }
    skipped +=
        std::string(DisplayName(candidate)) + " unavailable: " + backend.status().message() + "; ";
  }
  // Even the thread pool failed (threads refused): nothing left to fall back to.
  return Status::ResourceExhausted("no I/O backend could be set up: " +
                                   skipped.substr(0, skipped.size() - 2));
}

std::vector<Backend*> BackendSet::pointers() const {
  std::vector<Backend*> out;
  for (const auto& b : backends) out.push_back(b.get());
  return out;
}

Result<BackendSet> CreateBackends(BackendKind kind, const BackendOptions& options,
                                  uint32_t threads) {
  if (threads < 1 || threads > 64) {
    return Status::InvalidArgument(
        "I/O threads (intra_op_parallelism) must be between 1 and 64, "
        "got " +
        std::to_string(threads));
  }
  MEMPLAN_ASSIGN_OR_RETURN(BackendChoice first, CreateBackend(kind, options));
  BackendSet set;
  set.kind = first.kind;
  set.note = std::move(first.note);
  set.backends.push_back(std::move(first.backend));
  const uint32_t count = set.kind == BackendKind::kMemory ? 1 : threads;
  while (set.backends.size() < count) {
    Result<std::unique_ptr<Backend>> more = CreateOfKind(set.kind, options);
    if (!more.ok()) {
      return more.status().WithPrefix(std::string(DisplayName(set.kind)) + " backend " +
                                      std::to_string(set.backends.size() + 1) + " of " +
                                      std::to_string(count));
    }
    set.backends.push_back(std::move(more).value());
  }
  if (count > 1) set.note += "; " + std::to_string(count) + " of them, one per I/O thread";
  return set;
}

Result<int> OpenFile(const std::string& path, const OpenOptions& options, bool* direct_used) {
  return internal::OpenFileWithFaults(path, options, direct_used, internal::OpenFaults{});
}

uint32_t DirectIoAlignment(int fd, bool direct) {
  if (!direct) return 1;
  struct stat st;
  if (::fstat(fd, &st) != 0) return kDefaultDirectAlignment;
  if (S_ISBLK(st.st_mode)) {
    int logical_block_bytes = 0;
    if (::ioctl(fd, BLKSSZGET, &logical_block_bytes) == 0 && logical_block_bytes > 0) {
      return static_cast<uint32_t>(logical_block_bytes);
    }
    return kDefaultDirectAlignment;
  }
#ifdef STATX_DIOALIGN
  // Linux 6.1+ reports what this file on this filesystem needs; older kernels leave the bit
  // clear in stx_mask, and a 0 offset alignment means "no direct I/O here": use the default.
  struct statx stx = {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN) != 0 && stx.stx_dio_offset_align > 0) {
    // Buffers, offsets and lengths share one alignment in our contract: the stricter one.
    const uint32_t align = std::max(stx.stx_dio_offset_align, stx.stx_dio_mem_align);
    if ((align & (align - 1)) == 0) return align;
  }
#endif
  return kDefaultDirectAlignment;
}

namespace internal {

Result<int> FileTable::Add(int fd) {
  // F_GETFD is the cheapest "is this an open descriptor" question.
  if (fd < 0 || ::fcntl(fd, F_GETFD) < 0) {
    return Status::FromErrno(fd < 0 ? EBADF : errno,
                             "RegisterFile: fd " + std::to_string(fd) + " is not usable");
  }
  for (size_t i = 0; i < fds_.size(); ++i) {
    if (fds_[i] < 0) {
      fds_[i] = fd;
      return static_cast<int>(i);
    }
  }
  fds_.push_back(fd);
  return static_cast<int>(fds_.size() - 1);
}

Status FileTable::Remove(int index) {
  if (Fd(index) < 0) {
    return Status::InvalidArgument("UnregisterFile: file " + std::to_string(index) +
                                   " is not registered");
  }
  fds_[index] = -1;
  return Status::Ok();
}

Status CheckRequests(std::span<Request* const> requests) {
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i] == nullptr) {
      return Status::InvalidArgument("Submit: request " + std::to_string(i) + " is null");
    }
  }
  return Status::Ok();
}

// Note [O_DIRECT fallback]: EINVAL from open(O_DIRECT) means "this filesystem has no direct I/O"
// (tmpfs before Linux 6.6, some FUSE and network filesystems); we then open buffered. When the
// caller asks to create the file, the buffered open comes first and O_DIRECT is switched on with
// F_SETFL: the kernel creates the file before it checks O_DIRECT, so a failed O_DIRECT|O_CREAT|
// O_EXCL open leaves a file behind that a second O_EXCL open would then refuse as EEXIST.
Result<int> OpenFileWithFaults(const std::string& path, const OpenOptions& options,
                               bool* direct_used, const OpenFaults& faults) {
  if (direct_used != nullptr) *direct_used = false;
  if (options.truncate && !options.write) {
    return Status::InvalidArgument("open '" + path + "': truncate needs write access");
  }
  int flags = (options.write ? O_RDWR : O_RDONLY) | O_CLOEXEC;
  if (options.nofollow) flags |= O_NOFOLLOW;
  if (options.create) flags |= O_CREAT;
  if (options.create && options.exclusive) flags |= O_EXCL;
  if (options.truncate) flags |= O_TRUNC;

  int fd = -1;
  bool direct = false;
  if (options.direct && !options.create) {
    if (faults.refuse_direct_open) {
      errno = EINVAL;
    } else {
      fd = OpenRetryingEintr(path, flags | O_DIRECT);
    }
    if (fd >= 0) {
      direct = true;
    } else if (errno != EINVAL) {
      return OpenError(errno, path, options);
    }
  }
  if (fd < 0) {
    fd = OpenRetryingEintr(path, flags);
    if (fd < 0) return OpenError(errno, path, options);
    if (options.direct && options.create) {
      const int err = SetDirect(fd, true, faults.refuse_direct_open);
      if (err == 0) {
        direct = true;
      } else if (err != EINVAL) {
        ::close(fd);
        return Status::FromErrno(err, "open '" + path + "': fcntl(O_DIRECT)");
      }
    }
  }
  if (direct && ProbeDirectRead(fd, faults.refuse_direct_io) == EINVAL) {
    const int err = SetDirect(fd, false, false);
    if (err != 0) {
      ::close(fd);
      return Status::FromErrno(err, "open '" + path + "': clearing O_DIRECT after a refused read");
    }
    direct = false;
  }
  if (direct_used != nullptr) *direct_used = direct;
  return fd;
}

}  // namespace internal

}  // namespace memplan::nvme
