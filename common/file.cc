#include "common/file.h"

#include "common/strings.h"
#include "common/file_internal.h"
#include "common/printable.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <tuple>

namespace memplan {
namespace {

// The errno travels with the Status (Status::sys_errno: the Python binding's OSError.errno).
Status ErrnoStatus(const std::string& path, const char* what, int err) {
  const std::string msg = path + ": " + what;
  if (err == ENOENT || err == ENOSPC || err == EDQUOT) return Status::FromErrno(err, msg);
  Status io = Status::FromErrno(err, msg);
  if (io.code() == StatusCode::kIoError) return io;
  return Status::IoError(msg + ": " + std::strerror(err));  // EINVAL, EAGAIN...: still I/O here
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
  // Closes now, reporting close()'s result (-1 with errno set on failure).
  int Close() {
    const int fd = fd_;
    fd_ = -1;
    return ::close(fd);
  }

 private:
  int fd_;
};

const char* KindName(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symlink";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Opens a user's input file. O_NONBLOCK: opening a FIFO no one writes to would otherwise block
// forever; the fstat then refuses it (and devices, sockets, directories) before any read.
Result<int> OpenForRead(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
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
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + ": is " + KindName(st.st_mode) +
                                   ", expected a regular file");
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

// --- Staged temporary files, for the signal handler -------------------------------------------

// Note [Staged files]: a fixed table, so that the handler needs no allocation and no lock. A slot
// is 0 (free), 1 (being filled) or 2 (holds a path to remove).
constexpr int kStagedSlots = 32;
struct StagedSlot {
  std::atomic<int> state{0};
  char path[4096];
};
StagedSlot g_staged[kStagedSlots];

void (*g_before_rename)(const std::string& path) = nullptr;

int RegisterStaged(const std::string& path) {
  if (path.size() >= sizeof(g_staged[0].path)) return -1;
  for (int i = 0; i < kStagedSlots; ++i) {
    int expected = 0;
    if (!g_staged[i].state.compare_exchange_strong(expected, 1)) continue;
    std::memcpy(g_staged[i].path, path.c_str(), path.size() + 1);
    g_staged[i].state.store(2);
    return i;
  }
  return -1;  // best effort: more than 32 files staged at once are not removed on a signal
}

void UnregisterStaged(int slot) {
  if (slot >= 0) g_staged[slot].state.store(0);
}

// A name beside `path` that does not exist yet: "<path><infix>XXXXXX".
std::string RandomSibling(const std::string& path, const char* infix) {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  unsigned char bytes[6];
  if (::getrandom(bytes, sizeof(bytes), 0) != static_cast<ssize_t>(sizeof(bytes))) {
    static std::atomic<uint64_t> counter{0};
    uint64_t x = counter.fetch_add(1) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(::getpid());
    for (unsigned char& b : bytes) {
      b = static_cast<unsigned char>(x);
      x >>= 8;
    }
  }
  std::string out = path + infix;
  for (unsigned char b : bytes) out += kChars[b % (sizeof(kChars) - 1)];
  return out;
}

// Holds the signals that end a process (and would run tools/' clean-up) while alive.
class HoldSignals {
 public:
  HoldSignals() {
    sigset_t hold;
    sigemptyset(&hold);
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&hold, s);
    held_ = ::pthread_sigmask(SIG_BLOCK, &hold, &old_) == 0;
  }
  ~HoldSignals() {
    if (held_) ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  HoldSignals(const HoldSignals&) = delete;
  HoldSignals& operator=(const HoldSignals&) = delete;

 private:
  sigset_t old_;
  bool held_ = false;
};

// One file of a group on its way in.
struct Staged {
  std::string path;
  std::string tmp;     // written and fsynced; empty once renamed
  std::string backup;  // a hard link to the old file while the group commits; empty: none
  bool existed = false;
  int slot = -1;
};

void RemoveStaged(std::vector<Staged>& staged) {
  for (Staged& s : staged) {
    if (!s.tmp.empty()) ::unlink(s.tmp.c_str());
    UnregisterStaged(s.slot);
    s.slot = -1;
    if (!s.backup.empty()) ::unlink(s.backup.c_str());
  }
}

// Creates, fills and (`flush`) fsyncs the temporary file of `path`.
Status Stage(const std::string& path, const std::string& contents, std::optional<uint32_t> mode,
             const struct stat* old, bool flush, Staged* out) {
  int raw = -1;
  std::string tmp;
  for (int attempt = 0; attempt < 100 && raw < 0; ++attempt) {
    tmp = RandomSibling(path, ".tmp.");
    // 0666: the kernel applies the umask (and a default ACL), as for any new file.
    raw = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (raw < 0 && errno != EEXIST) break;
  }
  if (raw < 0) return ErrnoStatus(path, "cannot create temporary file", errno);
  Fd fd(raw);
  out->tmp = tmp;
  out->slot = RegisterStaged(tmp);
  if (mode || old != nullptr) {
    const mode_t want = static_cast<mode_t>((mode ? *mode : old->st_mode) & 07777);
    if (::fchmod(fd.get(), want) != 0) return ErrnoStatus(path, "chmod failed", errno);
  }
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd.get(), contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(path, "write failed", errno);
    }
    done += static_cast<size_t>(n);
  }
  if (flush && ::fsync(fd.get()) != 0) return ErrnoStatus(path, "fsync failed", errno);
  if (fd.Close() != 0) return ErrnoStatus(path, "close failed", errno);
  return Status::Ok();
}

}  // namespace

Result<uint64_t> FileSize(const std::string& path) {
  MEMPLAN_ASSIGN_OR_RETURN(int raw_fd, OpenForRead(path));
  Fd fd(raw_fd);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(path, "cannot stat", errno);
  return static_cast<uint64_t>(st.st_size);
}

Result<std::string> ReadFileToString(const std::string& path, uint64_t max_bytes) {
  MEMPLAN_ASSIGN_OR_RETURN(int raw_fd, OpenForRead(path));
  Fd fd(raw_fd);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(path, "cannot stat", errno);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    return Status::ResourceExhausted(path + ": file is " + std::to_string(size) +
                                     " bytes, larger than the " + std::to_string(max_bytes) +
                                     "-byte limit for this kind of file");
  }
  // Read until EOF (a file may grow while it is read), still bounded by max_bytes.
  std::string out;
  out.reserve(static_cast<size_t>(size));
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

Status RequireDirectory(const std::string& path, std::string_view what) {
  const std::string name = std::string(what) + (what.empty() ? "" : " ") + path;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::NotFound(name + ": no such directory");
    return Status::FromErrno(errno, name);
  }
  if (!S_ISDIR(st.st_mode)) return Status::InvalidArgument(name + ": not a directory");
  return Status::Ok();
}

Status CheckRelativePath(std::string_view relative, std::string_view what) {
  auto refuse = [&](std::string_view why) {
    return Status::InvalidArgument(std::string(what) + " '" + Printable(relative) + "' " +
                                   std::string(why));
  };
  if (relative.empty()) return refuse("is empty");
  if (relative.size() > 4096) return refuse("is longer than 4096 bytes");
  if (relative.find('\0') != std::string_view::npos) return refuse("contains a NUL byte");
  if (FindControlCharacter(relative) != std::string_view::npos) {
    return refuse("contains a control character or bytes that are not UTF-8");
  }
  if (relative.find('\\') != std::string_view::npos) {
    return refuse("contains a backslash (a path separator on Windows)");
  }
  if (relative.front() == '/') return refuse("is absolute");
  size_t start = 0;
  while (start <= relative.size()) {
    size_t end = relative.find('/', start);
    if (end == std::string_view::npos) end = relative.size();
    const std::string_view part = relative.substr(start, end - start);
    if (part == "..") return refuse("leaves its directory ('..')");
    if (part.empty() || part == ".") return refuse("has an empty or '.' component");
    start = end + 1;
  }
  return Status::Ok();
}

Result<std::string> PathUnder(std::string_view root, std::string_view relative,
                              std::string_view what) {
  MEMPLAN_RETURN_IF_ERROR(CheckRelativePath(relative, what));
  std::string joined(root);
  if (joined.empty() || joined.back() != '/') joined += '/';
  joined += relative;
  // The rule above already implies it; checked on the joined path as well, so that a change to
  // one cannot silently open a way out through the other.
  const std::filesystem::path base = std::filesystem::path(std::string(root)).lexically_normal();
  const std::filesystem::path rel =
      std::filesystem::path(joined).lexically_normal().lexically_relative(base);
  if (rel.empty() || *rel.begin() == "..") {
    return Status::InvalidArgument(std::string(what) + " '" + Printable(relative) +
                                   "' is not under " + Printable(root));
  }
  return joined;
}

Status MakeDirectoriesUnder(const std::string& root, std::string_view relative) {
  MEMPLAN_RETURN_IF_ERROR(CheckRelativePath(relative, "directory"));
  std::string path = root;
  size_t start = 0;
  while (start <= relative.size()) {
    size_t end = relative.find('/', start);
    if (end == std::string_view::npos) end = relative.size();
    if (path.empty() || path.back() != '/') path += '/';
    path += relative.substr(start, end - start);
    start = end + 1;
    if (::mkdir(path.c_str(), 0777) != 0 && errno != EEXIST) {
      return ErrnoStatus(path, "cannot create the directory", errno);
    }
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return ErrnoStatus(path, "cannot stat", errno);
    if (!S_ISDIR(st.st_mode)) {
      return Status::FailedPrecondition(
          path + ": is " +
          (S_ISLNK(st.st_mode) ? std::string("a symbolic link") : KindName(st.st_mode)) +
          ", not a directory; memplan does not write through links under " + root +
          " (remove it, and the cache entry is fetched again)");
    }
  }
  return Status::Ok();
}

void AtomicFileGroup::Add(std::string path, std::string contents, std::optional<uint32_t> mode) {
  files_.push_back({std::move(path), std::move(contents), mode});
}

// Note [Durability levels]
// A rename is atomic for every process at once: once it returns, the file holds the new contents
// for anyone who opens it, and a process killed at any point leaves the old or the new contents
// (the kernel's page cache holds the written bytes, whoever dies). What the fsyncs add is that the
// rename and the bytes behind it survive a power loss or a kernel crash, which costs a flush of the
// drive's write cache: on a virtio disk whose host cache holds the data file's recent writes, that
// flush is hundreds of milliseconds. kProcessCrash is for writers that commit often and already
// detect what a power loss could leave (a checksummed index over checksummed data: the swap
// store), and give the stronger level at the points that must outlive the machine (Close).
Status AtomicFileGroup::Commit() {
  const bool flush = durability_ == Durability::kPowerLoss;
  std::vector<File> files = std::move(files_);
  files_.clear();
  // 1. Every target is a new path or a regular file, and none is given twice.
  std::vector<std::optional<struct stat>> old(files.size());
  std::set<std::tuple<dev_t, ino_t, std::string>> seen;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string& path = files[i].path;
    if (path.empty()) return Status::InvalidArgument("an output path is empty");
    if (path.back() == '/') return Status::InvalidArgument(path + ": names a directory");
    struct stat st;
    if (::lstat(path.c_str(), &st) == 0) {
      if (!S_ISREG(st.st_mode)) {
        return Status::InvalidArgument(path + ": is " + KindName(st.st_mode) +
                                       "; only a regular file is replaced");
      }
      old[i] = st;
    } else if (errno != ENOENT) {
      return ErrnoStatus(path, "cannot stat", errno);
    }
    struct stat dir;
    const std::string parent = DirName(path);
    if (::stat(parent.c_str(), &dir) != 0) return ErrnoStatus(path, "cannot create", errno);
    const std::string base(BaseName(path));
    if (!seen.insert({dir.st_dev, dir.st_ino, base}).second) {
      return Status::InvalidArgument(path + ": the same output file is given twice");
    }
  }
  // 2. Each written to its temporary file.
  std::vector<Staged> staged(files.size());
  for (size_t i = 0; i < files.size(); ++i) {
    staged[i].path = files[i].path;
    staged[i].existed = old[i].has_value();
    Status st = Stage(files[i].path, files[i].contents, files[i].mode, old[i] ? &*old[i] : nullptr,
                      flush, &staged[i]);
    if (!st.ok()) {
      RemoveStaged(staged);
      return st;
    }
    files[i].contents.clear();
    files[i].contents.shrink_to_fit();
  }
  // 3. Renamed into place, all or none.
  {
    HoldSignals hold;
    if (staged.size() > 1) {
      for (Staged& s : staged) {
        if (!s.existed) continue;
        for (int attempt = 0; attempt < 100; ++attempt) {
          std::string backup = RandomSibling(s.path, ".old.");
          if (::link(s.path.c_str(), backup.c_str()) == 0) {
            s.backup = backup;
            break;
          }
          if (errno != EEXIST) break;  // no hard links here: this file cannot be rolled back
        }
      }
    }
    for (size_t i = 0; i < staged.size(); ++i) {
      if (g_before_rename != nullptr) g_before_rename(staged[i].path);
      if (::rename(staged[i].tmp.c_str(), staged[i].path.c_str()) == 0) {
        staged[i].tmp.clear();
        UnregisterStaged(staged[i].slot);
        staged[i].slot = -1;
        continue;
      }
      const int err = errno;
      bool restored = true;
      for (size_t j = 0; j < i; ++j) {
        Staged& done = staged[j];
        const bool back = done.existed ? !done.backup.empty() &&
                                             ::rename(done.backup.c_str(), done.path.c_str()) == 0
                                       : ::unlink(done.path.c_str()) == 0;
        // A backup that could not be put back is kept: the only name left of the old contents.
        done.backup.clear();
        restored &= back;
      }
      RemoveStaged(staged);
      return ErrnoStatus(staged[i].path,
                         restored ? "rename failed (no file of the group was written)"
                                  : "rename failed, and earlier files of the group could not all "
                                    "be restored (look for *.old.* beside them)",
                         err);
    }
    RemoveStaged(staged);  // the backups
  }
  // 4. The new names live in their directories: without this a power loss may bring back the old
  // files.
  if (!flush) return Status::Ok();
  std::set<std::string> dirs;
  for (const Staged& s : staged) dirs.insert(DirName(s.path));
  for (const std::string& dir : dirs) {
    int dir_raw = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_raw < 0) {
      return ErrnoStatus(dir, "written, but cannot open the directory to fsync it", errno);
    }
    Fd dir_fd(dir_raw);
    if (::fsync(dir_fd.get()) != 0 && errno != EINVAL) {
      return ErrnoStatus(dir, "written, but the fsync of the directory failed", errno);
    }
  }
  return Status::Ok();
}

Status WriteFileAtomically(const std::string& path, const std::string& contents,
                           std::optional<uint32_t> mode, Durability durability) {
  AtomicFileGroup group(durability);
  group.Add(path, contents, mode);
  return group.Commit();
}

namespace internal {
void SetBeforeRenameHookForTesting(void (*hook)(const std::string& path)) {
  g_before_rename = hook;
}
}  // namespace internal

void RemoveStagedFilesForSignal() noexcept {
  for (StagedSlot& slot : g_staged) {
    if (slot.state.load() == 2) ::unlink(slot.path);
  }
}

}  // namespace memplan
