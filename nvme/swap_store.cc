// SwapStore: one preallocated data file per store, an in-memory extent allocator and index, and
// XXH3-64 checksums per block. See swap_store.h for the contract.
//
// Note [Why one preallocated file]
// DeepSpeed opens one swap file per tensor and per request. One file preallocated at Open() means
// a full disk shows up before training starts, the filesystem never allocates on the hot path,
// and one registered fd serves every request. The price is our own allocator: first fit over a
// sorted free list, extents aligned to max(4096, the O_DIRECT alignment) so that no two keys ever
// share a device block (the engine's read-modify-write of an unaligned tail then only touches the
// key's own extent, and distinct keys can be written in parallel without coordination).
//
// Note [Per-key state instead of per-key locks]
// The index mutex is held only for lookups and allocation, never across I/O. Each entry records
// whether a Put is writing it and how many Gets are reading it; a conflicting operation fails at
// once (FailedPrecondition) instead of waiting. Readers can then use the entry's checksums and
// extent without copying them: nothing may change an entry while its reader count is non-zero.
//
// Note [What Sync() records]
// Sync() copies the index under the lock, THEN fdatasyncs the data file, THEN writes the copy:
// every value the copy describes finished writing before the fdatasync began, so the index on disk
// never points at bytes the device may not hold. Keys whose Put is in flight at the copy are
// recorded as they were before that Put when it rewrites the key's extent in place (after a crash
// the key then reads as its old value or as DataLoss, exactly as for a rewrite after the Sync), and
// left out when it is the key's first Put or moved the key to a new extent (the old extent is
// already free and may belong to another key, so recording it could make two keys share bytes).
// Syncs are serialised by their own mutex, held across their I/O, so that an older copy never
// replaces a newer one; only Sync() and Close() ever wait for it.
// The format of the index file is Note [Swap index format] in swap_index_internal.h.
#include "nvme/swap_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/file.h"
#include "common/checked_math.h"
#include "common/mutex.h"
#include "nvme/block_checksum.h"
#include "nvme/swap_index_internal.h"

namespace memplan::nvme {
namespace {

// Largest capacity accepted: file offsets are signed 64-bit, and rounding up must not overflow.
constexpr uint64_t kMaxCapacityBytes = uint64_t{1} << 62;
constexpr uint32_t kMinBlockBytes = 4096;
// Attempts at taking the lock file when it keeps being replaced under us (see TakeLock).
constexpr int kLockAttempts = 8;

std::string Quote(const std::string& key) { return "'" + key + "'"; }

// Free extents of the data file, as offset -> length, kept merged: no two entries touch. All
// offsets and lengths are multiples of the store's alignment. Not thread-safe (the store's mutex
// guards it).
class ExtentAllocator {
 public:
  explicit ExtentAllocator(uint64_t capacity_bytes) : free_bytes_(capacity_bytes) {
    if (capacity_bytes > 0) free_[0] = capacity_bytes;
  }

  // First fit. A zero length allocates nothing and always succeeds (at offset 0).
  std::optional<uint64_t> Allocate(uint64_t length) {
    if (length == 0) return uint64_t{0};
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < length) continue;
      uint64_t offset = it->first;
      uint64_t rest = it->second - length;
      free_.erase(it);
      if (rest > 0) free_[offset + length] = rest;
      free_bytes_ -= length;
      return offset;
    }
    return std::nullopt;
  }

  // Takes exactly [offset, offset + length), which must be free; false when it is not.
  bool AllocateAt(uint64_t offset, uint64_t length) {
    if (length == 0) return true;
    auto it = free_.upper_bound(offset);
    if (it == free_.begin()) return false;
    --it;
    uint64_t start = it->first;
    uint64_t end = start + it->second;
    if (offset + length > end) return false;
    free_.erase(it);
    if (offset > start) free_[start] = offset - start;
    if (offset + length < end) free_[offset + length] = end - (offset + length);
    free_bytes_ -= length;
    return true;
  }

  // Returns [offset, offset + length) to the free list, merging with free neighbours.
  void Free(uint64_t offset, uint64_t length) {
    if (length == 0) return;
    free_bytes_ += length;
    auto next = free_.lower_bound(offset);
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        length += prev->second;
        free_.erase(prev);
      }
    }
    if (next != free_.end() && offset + length == next->first) {
      length += next->second;
      free_.erase(next);
    }
    free_[offset] = length;
  }

  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free_bytes() const {
    uint64_t largest = 0;
    for (const auto& [offset, length] : free_) largest = std::max(largest, length);
    return largest;
  }

 private:
  std::map<uint64_t, uint64_t> free_;
  uint64_t free_bytes_;
};

// The last kLatencyWindow samples of one operation kind, plus lifetime count and maximum.
class LatencyWindow {
 public:
  void Add(double us) {
    samples_[next_] = us;
    next_ = (next_ + 1) % samples_.size();
    ++count_;
    max_us_ = std::max(max_us_, us);
  }

  // Copies the samples out; the caller sorts them outside the store's lock.
  std::vector<double> Samples() const {
    size_t n = static_cast<size_t>(std::min<uint64_t>(count_, samples_.size()));
    return {samples_.begin(), samples_.begin() + static_cast<std::ptrdiff_t>(n)};
  }
  uint64_t count() const { return count_; }
  double max_us() const { return max_us_; }

 private:
  std::array<double, SwapStore::kLatencyWindow> samples_{};
  size_t next_ = 0;
  uint64_t count_ = 0;
  double max_us_ = 0;
};

LatencyStats Summarize(std::vector<double> samples, uint64_t count, double max_us) {
  LatencyStats out;
  out.count = count;
  out.max_us = max_us;
  if (samples.empty()) return out;
  std::sort(samples.begin(), samples.end());
  // Nearest rank: the smallest sample with at least p of the samples at or below it.
  auto rank = [&](double p) {
    size_t index = static_cast<size_t>(std::ceil(p * static_cast<double>(samples.size())));
    return samples[std::clamp<size_t>(index, 1, samples.size()) - 1];
  };
  out.p50_us = rank(0.50);
  out.p90_us = rank(0.90);
  out.p99_us = rank(0.99);
  return out;
}

double MicrosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
      .count();
}

std::vector<uint64_t> BlockChecksums(std::span<const std::byte> data, uint64_t block_bytes) {
  std::vector<uint64_t> sums;
  sums.reserve(static_cast<size_t>((data.size() + block_bytes - 1) / block_bytes));
  for (uint64_t at = 0; at < data.size(); at += block_bytes) {
    uint64_t n = std::min<uint64_t>(block_bytes, data.size() - at);
    sums.push_back(internal::BlockChecksum(data.data() + at, static_cast<size_t>(n)));
  }
  return sums;
}

// Strips trailing slashes so that lstat() sees a symlink as a symlink ("link/" follows it).
std::string NormalizeDirectory(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

}  // namespace

Status SwapStoreOptions::Validate() const {
  if (directory.empty()) return Status::InvalidArgument("swap store: directory must be given");
  if (capacity_bytes == 0 && !open_existing) {
    return Status::InvalidArgument("swap store " + directory + ": capacity must be > 0 bytes");
  }
  if (capacity_bytes > kMaxCapacityBytes) {
    return Status::OutOfRange("swap store " + directory + ": capacity " +
                              std::to_string(capacity_bytes) + " bytes exceeds the limit of " +
                              std::to_string(kMaxCapacityBytes));
  }
  if (checksum_block_bytes < kMinBlockBytes ||
      (checksum_block_bytes & (checksum_block_bytes - 1)) != 0) {
    return Status::InvalidArgument("swap store " + directory +
                                   ": checksum block must be a power of two of at least 4096 "
                                   "bytes, got " +
                                   std::to_string(checksum_block_bytes));
  }
  MEMPLAN_RETURN_IF_ERROR(backend_options.Validate().WithPrefix("swap store " + directory));
  MEMPLAN_RETURN_IF_ERROR(engine_options.Validate().WithPrefix("swap store " + directory));
  return Status::Ok();
}

struct SwapStore::Impl {
  struct Entry {
    uint64_t offset = 0;              // extent start in the data file
    uint64_t extent_bytes = 0;        // allocated length: size rounded up to the alignment
    uint64_t size = 0;                // bytes of the committed value
    std::vector<uint64_t> checksums;  // of the committed value, one per checksum block
    bool committed = false;           // a value has been written completely at least once
    bool writing = false;             // a Put is writing the extent
    bool relocated = false;           // ... and moved the key to a new extent to do so
    uint32_t readers = 0;             // Gets reading the extent
  };

  explicit Impl(SwapStoreOptions opts) : options(std::move(opts)) {}

  // "store <dir>: <what>", the prefix of every message.
  std::string Msg(const std::string& what) const {
    return "store " + options.directory + ": " + what;
  }
  std::string KeyMsg(const std::string& key, const std::string& what) const {
    return Msg("key " + Quote(key) + ": " + what);
  }

  // The start of a GetRange() / GetCovering() of [offset, offset + size): on success `*entry` is
  // the key's entry with this call counted as its reader (EndRead() ends that), or null for an
  // empty range (nothing to read or end).
  Status BeginRangeRead(const std::string& key, uint64_t offset, uint64_t size,
                        std::chrono::steady_clock::time_point start, Entry** entry) {
    MutexLock lock(&mu);
    if (closed) return Status::FailedPrecondition(Msg("is closed"));
    auto it = index.find(key);
    if (it == index.end()) return Status::NotFound(KeyMsg(key, "not found"));
    Entry& e = it->second;
    if (e.writing) return Busy(key, e);
    if (offset > e.size || size > e.size - offset) {
      return Status::OutOfRange(KeyMsg(
          key, "range of " + std::to_string(size) + " bytes at offset " + std::to_string(offset) +
                   " passes the end of the " + std::to_string(e.size) + "-byte value"));
    }
    *entry = nullptr;
    if (size == 0) {
      get_latency.Add(MicrosSince(start));
      return Status::Ok();
    }
    ++e.readers;
    ++active_ops;
    *entry = &e;
    return Status::Ok();
  }
  // Reads the value's bytes [begin, end) (whole checksum blocks, or up to the value's end) into
  // `out` and verifies their checksums. The caller is one of the entry's readers.
  Status ReadBlocks(const std::string& key, const Entry& e, uint64_t begin, uint64_t end,
                    std::byte* out) {
    Status status = engine->Read(file, e.offset + begin, out, end - begin);
    if (status.code() == StatusCode::kOutOfRange) {
      // The index places the value inside the data file: a file that ends before it was cut
      // short behind the store's back, which is data lost, not a caller's range.
      return Status::DataLoss(
          KeyMsg(key, "the data file ends before the value (truncated?): " + status.message()));
    }
    if (!status.ok()) return status.WithPrefix(KeyMsg(key, "read failed"));
    const uint64_t block = options.checksum_block_bytes;
    for (uint64_t at = begin; at < end; at += block) {
      const uint64_t n = std::min(block, end - at);
      if (internal::BlockChecksum(out + (at - begin), static_cast<size_t>(n)) !=
          e.checksums[static_cast<size_t>(at / block)]) {
        return Status::DataLoss(KeyMsg(key, "checksum mismatch in block at byte offset " +
                                                std::to_string(at) + " (data file " + data_path +
                                                ", offset " + std::to_string(e.offset + at) + ")"));
      }
    }
    return Status::Ok();
  }
  // Ends a read begun by BeginRangeRead(), counting `bytes` when it succeeded.
  void EndRead(Entry* e, const Status& status, uint64_t bytes,
               std::chrono::steady_clock::time_point start) {
    MutexLock lock(&mu);
    --e->readers;
    --active_ops;
    if (status.ok()) {
      get_bytes += bytes;
      get_latency.Add(MicrosSince(start));
    }
  }
  Status Busy(const std::string& key, const Entry& e) const {
    if (e.writing) {
      return Status::FailedPrecondition(KeyMsg(key, "is being written by another thread"));
    }
    return Status::FailedPrecondition(
        KeyMsg(key, "is being read by " + std::to_string(e.readers) + " other thread(s)"));
  }

  Status NoRoom(const std::string& key, uint64_t needed) const REQUIRES(mu) {
    return Status::ResourceExhausted(
        KeyMsg(key, "no room: needs " + std::to_string(needed) + " bytes, " +
                        std::to_string(allocator->free_bytes()) + " of " +
                        std::to_string(capacity_bytes) + " bytes free (largest free extent " +
                        std::to_string(allocator->largest_free_bytes()) + " bytes)"));
  }

  // OK while options.directory still names the directory Open() opened; FailedPrecondition naming
  // what it is now (a symbolic link, another directory, nothing) otherwise.
  Status DirectoryUnchanged() const;
  // Open() steps; each records what it created so Teardown removes exactly that.
  Status PrepareDirectory();
  Status TakeLock();
  Status CreateDataFile() REQUIRES(mu);
  Status OpenDataFile();            // open_existing: the data file an earlier store kept
  Status LoadIndex() REQUIRES(mu);  // open_existing: the index the last Sync() wrote
  // The index file's bytes for every entry Sync() records (Note [What Sync() records]).
  std::string EncodeIndex() const REQUIRES(mu);
  Status WriteIndex(const std::string& bytes, Durability durability = Durability::kPowerLoss);
  Status StartEngine(std::unique_ptr<Backend> given);  // null: CreateBackend() picks
  // Releases everything. `closing`: a normal Close (the files are ours to remove unless
  // keep_files; with keep_files, `index_bytes` is written once the data file is fsynced);
  // otherwise an Open() failure (remove only what this Open created).
  Status Teardown(bool closing, const std::string* index_bytes = nullptr);

  // Fixed at Open(); read without the lock afterwards (Close() changes them only once no
  // operation is in flight and `closed` stops new ones).
  const SwapStoreOptions options;
  std::string data_path, lock_path, index_path;
  // The directory as Open() found it (Note [Store directory by descriptor]).
  int dir_fd = -1;
  dev_t dir_dev = 0;
  ino_t dir_ino = 0;
  bool created_dir = false;
  bool lock_created = false;
  bool lock_held = false;
  bool data_created = false;  // by this Open(): removed if the Open() fails
  bool data_ours = false;     // created or reopened: removed by Close() unless keep_files
  bool index_ours = false;    // loaded or written: removed by Close() unless keep_files
  int lock_fd = -1;
  int data_fd = -1;
  bool direct_used = false;
  uint64_t alignment = kMinBlockBytes;
  uint64_t capacity_bytes = 0;  // allocatable bytes
  uint64_t data_file_bytes = 0;
  std::vector<std::unique_ptr<Backend>> backends;  // one per I/O thread (or one, shared)
  std::string backend_name, backend_note;
  uint32_t backend_count = 0;
  std::unique_ptr<IoEngine> engine;              // destroyed before `backends`
  int file = -1;                                 // engine file index of the data file
  uint64_t registered_bytes GUARDED_BY(mu) = 0;  // what RegisterBuffers gave the backends

  mutable Mutex mu;
  bool closed GUARDED_BY(mu) = false;
  uint64_t active_ops GUARDED_BY(mu) = 0;
  std::optional<ExtentAllocator> allocator GUARDED_BY(mu);
  std::unordered_map<std::string, Entry> index GUARDED_BY(mu);  // entries never move
  uint64_t put_bytes GUARDED_BY(mu) = 0;
  uint64_t get_bytes GUARDED_BY(mu) = 0;
  LatencyWindow put_latency GUARDED_BY(mu);
  LatencyWindow get_latency GUARDED_BY(mu);
  IoStats final_io GUARDED_BY(mu);  // engine stats at Close
  // Held by Sync() across its I/O so Syncs run one at a time (Note [What Sync() records]).
  Mutex sync_mu;
};

Status SwapStore::Impl::PrepareDirectory() {
  const std::string& dir = options.directory;
  if (options.open_existing) {
    // Never created here: a missing directory means a wrong path, not a store to start afresh.
  } else if (::mkdir(dir.c_str(), 0700) == 0) {
    created_dir = true;
    // mkdir's mode is masked by the umask; the owner must still be able to use the directory.
    if (::chmod(dir.c_str(), 0700) != 0) return Status::FromErrno(errno, Msg("cannot chmod"));
  } else if (errno != EEXIST) {
    return Status::FromErrno(errno, Msg("cannot create the directory"));
  }
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT && options.open_existing) {
      return Status::FromErrno(ENOENT,
                               Msg("the directory does not exist (open_existing reopens a store "
                                   "an earlier run kept there)"));
    }
    return Status::FromErrno(errno, Msg("cannot stat"));
  }
  if (S_ISLNK(st.st_mode)) {
    return Status::FailedPrecondition(
        Msg("is a symbolic link; give the directory it points to, which must be owned by this "
            "user"));
  }
  if (!S_ISDIR(st.st_mode)) return Status::FailedPrecondition(Msg("exists and is not a directory"));
  if (st.st_uid != ::geteuid()) {
    return Status::FailedPrecondition(Msg("is owned by uid " + std::to_string(st.st_uid) +
                                          ", not by this process (uid " +
                                          std::to_string(::geteuid()) + ")"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::FailedPrecondition(
        Msg(std::string("is group- or world-writable (mode ") + mode +
            "); a store directory must not be writable by others (chmod go-w)"));
  }
  // Note [Store directory by descriptor]: the files are created, checked and removed relative to
  // this descriptor, not by name, so a directory renamed, removed or swapped for a symbolic link
  // while the store is open (by anyone who can write its parent) cannot make Close() delete
  // another store's files, or a live run's lock, through the new name. What must go by name (the
  // index written atomically by Sync(), the final rmdir) first checks DirectoryUnchanged().
  dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir_fd < 0) return Status::FromErrno(errno, Msg("cannot open the directory"));
  struct stat opened;
  if (::fstat(dir_fd, &opened) != 0) return Status::FromErrno(errno, Msg("cannot stat"));
  if (opened.st_dev != st.st_dev || opened.st_ino != st.st_ino) {
    return Status::FailedPrecondition(Msg("was replaced while the store was being opened"));
  }
  dir_dev = opened.st_dev;
  dir_ino = opened.st_ino;
  data_path = dir + "/" + kDataFileName;
  lock_path = dir + "/" + kLockFileName;
  index_path = dir + "/" + kIndexFileName;
  return Status::Ok();
}

Status SwapStore::Impl::DirectoryUnchanged() const {
  struct stat st;
  if (::lstat(options.directory.c_str(), &st) != 0) {
    // An I/O failure with its errno (ENOENT, ...), as any other file of the store that is gone:
    // the caller's data is lost, not a precondition it broke.
    return Status::FromErrno(
        errno, Msg("the directory was removed or renamed since the store was opened"));
  }
  if (S_ISLNK(st.st_mode)) {
    return Status::FailedPrecondition(
        Msg("the directory was replaced by a symbolic link since the store was opened"));
  }
  if (st.st_dev != dir_dev || st.st_ino != dir_ino) {
    return Status::FailedPrecondition(
        Msg("the directory was replaced by another since the store was opened"));
  }
  return Status::Ok();
}

// flock() locks an open file, not a name: if a closing store unlinks the lock file between our
// open() and flock(), we would hold a lock on a file no one else can see. So after locking, check
// that the name still refers to the file we locked, and start over when it does not.
Status SwapStore::Impl::TakeLock() {
  for (int attempt = 0; attempt < kLockAttempts; ++attempt) {
    int fd =
        ::openat(dir_fd, kLockFileName, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    const bool created = fd >= 0;
    if (fd < 0 && errno == EEXIST) {
      fd = ::openat(dir_fd, kLockFileName, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0 && errno == ENOENT) continue;  // removed since; create it afresh
    }
    if (fd < 0) return Status::FromErrno(errno, Msg("cannot open the lock file " + lock_path));
    lock_created = created;
    lock_fd = fd;
    struct stat st;
    if (::fstat(fd, &st) != 0) return Status::FromErrno(errno, Msg("cannot stat " + lock_path));
    if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
      return Status::FailedPrecondition(
          Msg("lock file " + lock_path + " is not a regular file owned by this user"));
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) return Status::FromErrno(errno, Msg("cannot lock " + lock_path));
      char buf[32] = {};
      ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
      int pid = 0;
      if (n > 0) std::from_chars(buf, buf + n, pid);
      return Status::FailedPrecondition(
          "store " + options.directory + " is in use by " +
          (pid > 0 ? "pid " + std::to_string(pid) : std::string("another process")) +
          " (lock file " + lock_path + ")");
    }
    lock_held = true;
    struct stat by_name;
    if (::fstatat(dir_fd, kLockFileName, &by_name, AT_SYMLINK_NOFOLLOW) == 0 &&
        by_name.st_dev == st.st_dev && by_name.st_ino == st.st_ino) {
      std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 ||
          ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
        return Status::FromErrno(errno, Msg("cannot write the pid into " + lock_path));
      }
      return Status::Ok();
    }
    // Replaced under us: let go of the stale file and try again.
    ::close(fd);
    lock_fd = -1;
    lock_held = false;
    lock_created = false;
  }
  return Status::Unavailable(Msg("the lock file " + lock_path + " keeps being replaced"));
}

Status SwapStore::Impl::CreateDataFile() {
  struct stat st;
  if (::fstatat(dir_fd, kDataFileName, &st, AT_SYMLINK_NOFOLLOW) == 0) {
    return Status::FailedPrecondition(
        Msg("data file " + data_path +
            " exists (kept by an earlier store?); remove it or use a new directory"));
  }
  // Space first: a failed fallocate may leave the filesystem briefly full for everyone else.
  uint64_t file_bytes = RoundUp(options.capacity_bytes, kMinBlockBytes);
  struct statvfs vfs;
  if (::statvfs(options.directory.c_str(), &vfs) != 0) {
    return Status::FromErrno(errno, Msg("cannot query free space"));
  }
  uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  auto no_space = [&](uint64_t free_now) {
    return Status::ResourceExhausted(Msg("needs " + std::to_string(file_bytes) +
                                         " bytes for its capacity but the filesystem has " +
                                         std::to_string(free_now) + " bytes free"));
  };
  if (file_bytes > free_bytes) return no_space(free_bytes);

  OpenOptions open_options;
  open_options.create = true;
  open_options.exclusive = true;
  open_options.write = true;
  open_options.direct = options.direct;
  open_options.nofollow = true;
  MEMPLAN_ASSIGN_OR_RETURN(data_fd, OpenFile(data_path, open_options, &direct_used));
  data_created = true;
  data_ours = true;
  // An index left by an earlier store described a data file that is gone; it must not be loaded
  // against this one if this store is reopened before its first Sync().
  if (::unlinkat(dir_fd, kIndexFileName, 0) != 0 && errno != ENOENT) {
    return Status::FromErrno(errno, Msg("cannot remove the stale index " + index_path));
  }
  int err = ::posix_fallocate(data_fd, 0, static_cast<off_t>(file_bytes));
  if (err == ENOSPC || err == EDQUOT) {
    uint64_t free_now = ::statvfs(options.directory.c_str(), &vfs) == 0
                            ? static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize
                            : free_bytes;
    return no_space(free_now);
  }
  if (err != 0) return Status::FromErrno(err, Msg("cannot preallocate " + data_path));

  alignment = std::max<uint64_t>(kMinBlockBytes, DirectIoAlignment(data_fd, direct_used));
  data_file_bytes = file_bytes;
  capacity_bytes = file_bytes / alignment * alignment;
  allocator.emplace(capacity_bytes);
  return Status::Ok();
}

Status SwapStore::Impl::OpenDataFile() {
  OpenOptions open_options;
  open_options.write = true;
  open_options.direct = options.direct;
  open_options.nofollow = true;
  Result<int> fd = OpenFile(data_path, open_options, &direct_used);
  if (!fd.ok()) {
    if (fd.status().code() == StatusCode::kNotFound) {
      return Status::FromErrno(ENOENT, Msg("data file " + data_path +
                                           " does not exist (open_existing reopens a store an "
                                           "earlier run kept with keep_files)"));
    }
    return fd.status().WithPrefix(Msg("cannot open the data file"));
  }
  data_fd = *fd;
  struct stat st;
  if (::fstat(data_fd, &st) != 0) return Status::FromErrno(errno, Msg("cannot stat " + data_path));
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::FailedPrecondition(
        Msg("data file " + data_path + " is not a private regular file owned by this user (uid " +
            std::to_string(st.st_uid) + ", mode " + mode + ")"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes == 0 || file_bytes % kMinBlockBytes != 0 ||
      file_bytes > RoundUp(kMaxCapacityBytes, kMinBlockBytes)) {
    return Status::DataLoss(Msg("data file " + data_path + " is " + std::to_string(file_bytes) +
                                " bytes, not a size this store creates (a positive multiple of "
                                "4096)"));
  }
  if (options.capacity_bytes != 0 &&
      RoundUp(options.capacity_bytes, kMinBlockBytes) != file_bytes) {
    return Status::InvalidArgument(
        Msg("capacity_bytes is " + std::to_string(options.capacity_bytes) + " but the data file " +
            data_path + " holds " + std::to_string(file_bytes) +
            " bytes; give the capacity the store was created with, or 0 to take it from the file"));
  }
  data_file_bytes = file_bytes;
  // Recorded only now: an Open() that fails leaves a file it did not create alone, but Close()
  // removes a reopened store's files unless keep_files, as it would a new store's.
  data_ours = true;
  return Status::Ok();
}

Status SwapStore::Impl::LoadIndex() {
  const std::string never_synced =
      " (the store was never synced: Sync() and Close() with keep_files write it)";
  int fd = ::openat(dir_fd, kIndexFileName, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      return Status::FromErrno(ENOENT,
                               Msg("index file " + index_path + " does not exist" + never_synced));
    }
    return Status::FromErrno(errno, Msg("cannot open the index file " + index_path));
  }
  std::string bytes;
  Status read = [&]() -> Status {
    struct stat st;
    if (::fstat(fd, &st) != 0) return Status::FromErrno(errno, Msg("cannot stat " + index_path));
    if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
      return Status::FailedPrecondition(
          Msg("index file " + index_path + " is not a regular file owned by this user"));
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size > internal::kMaxSwapIndexBytes) {
      return Status::DataLoss(Msg("index file " + index_path + " is " + std::to_string(size) +
                                  " bytes, larger than any index this store writes"));
    }
    bytes.resize(static_cast<size_t>(size));
    size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n = ::pread(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::FromErrno(errno, Msg("cannot read " + index_path));
      if (n == 0) break;  // shrank under us: the decoder reports the truncation
      done += static_cast<size_t>(n);
    }
    bytes.resize(done);
    return Status::Ok();
  }();
  ::close(fd);
  MEMPLAN_RETURN_IF_ERROR(read);

  MEMPLAN_ASSIGN_OR_RETURN(internal::SwapIndex loaded,
                           internal::DecodeSwapIndex(bytes, Msg("index file " + index_path)));
  bytes.clear();
  bytes.shrink_to_fit();
  struct stat st;
  if (::fstat(data_fd, &st) != 0) return Status::FromErrno(errno, Msg("cannot stat " + data_path));
  if (loaded.data_file_bytes != static_cast<uint64_t>(st.st_size)) {
    return Status::DataLoss(Msg("index file " + index_path + " describes a data file of " +
                                std::to_string(loaded.data_file_bytes) + " bytes, but " +
                                data_path + " is " + std::to_string(st.st_size) + " bytes"));
  }
  if (loaded.checksum_block_bytes != options.checksum_block_bytes) {
    return Status::InvalidArgument(
        Msg("checksum_block_bytes is " + std::to_string(options.checksum_block_bytes) +
            " but the index file " + index_path + " was written with " +
            std::to_string(loaded.checksum_block_bytes) + "; reopen with the same value"));
  }
  // The extents were laid out for the alignment of the run that wrote them; keep it, provided it
  // also satisfies this run's O_DIRECT alignment (so no two keys share a device block).
  const uint64_t needed =
      std::max<uint64_t>(kMinBlockBytes, DirectIoAlignment(data_fd, direct_used));
  if (loaded.alignment_bytes % needed != 0) {
    return Status::FailedPrecondition(
        Msg("the index file " + index_path + " lays extents out on " +
            std::to_string(loaded.alignment_bytes) + "-byte boundaries, but O_DIRECT on " +
            data_path + " now needs " + std::to_string(needed) + "; reopen with direct = false"));
  }
  alignment = loaded.alignment_bytes;
  capacity_bytes = loaded.data_file_bytes / alignment * alignment;
  allocator.emplace(capacity_bytes);
  index.reserve(loaded.entries.size());
  for (internal::SwapIndexEntry& e : loaded.entries) {
    // The decoder has checked bounds and overlaps; a refusal here would be a bug in one of us.
    if (!allocator->AllocateAt(e.offset, e.extent_bytes)) {
      return Status::Internal(
          Msg("index file " + index_path + ": the extent of key " + Quote(e.key) + " is not free"));
    }
    Entry entry;
    entry.offset = e.offset;
    entry.extent_bytes = e.extent_bytes;
    entry.size = e.size;
    entry.checksums = std::move(e.checksums);
    entry.committed = true;
    index.emplace(std::move(e.key), std::move(entry));
  }
  index_ours = true;
  return Status::Ok();
}

std::string SwapStore::Impl::EncodeIndex() const {
  internal::SwapIndexEncoder encoder(data_file_bytes, options.checksum_block_bytes,
                                     static_cast<uint32_t>(alignment));
  for (const auto& [key, e] : index) {
    if (!e.committed || (e.writing && e.relocated)) continue;
    encoder.Add(key, e.offset, e.extent_bytes, e.size, e.checksums);
  }
  return encoder.Finish();
}

Status SwapStore::Impl::WriteIndex(const std::string& bytes, Durability durability) {
  if (bytes.size() > internal::kMaxSwapIndexBytes) {
    return Status::ResourceExhausted(Msg("the index would be " + std::to_string(bytes.size()) +
                                         " bytes, more than the " +
                                         std::to_string(internal::kMaxSwapIndexBytes) +
                                         "-byte limit; use a larger checksum_block_bytes"));
  }
  // By name (a temporary file and a rename): only into the directory the store opened.
  MEMPLAN_RETURN_IF_ERROR(DirectoryUnchanged().WithPrefix("cannot write the index"));
  return WriteFileAtomically(index_path, bytes, 0600, durability)
      .WithPrefix(Msg("cannot write the index"));
}

Status SwapStore::Impl::StartEngine(std::unique_ptr<Backend> given) {
  std::vector<Backend*> pointers;
  if (given != nullptr) {
    // One backend, shared by the engine's threads.
    backend_note = "using " + given->capabilities().name + " as given by the caller";
    pointers.push_back(given.get());
    backends.push_back(std::move(given));
  } else {
    BackendOptions backend_options = options.backend_options;
    if (backend_options.path.empty()) backend_options.path = data_path;
    MEMPLAN_ASSIGN_OR_RETURN(BackendSet set, CreateBackends(options.backend, backend_options,
                                                            options.engine_options.threads));
    pointers = set.pointers();
    backends = std::move(set.backends);
    backend_note = std::move(set.note);
  }
  backend_name = backends[0]->capabilities().name;
  backend_count = static_cast<uint32_t>(backends.size());
  MEMPLAN_ASSIGN_OR_RETURN(engine, IoEngine::Create(pointers, options.engine_options));
  MEMPLAN_ASSIGN_OR_RETURN(file, engine->AddFile(data_fd, data_path, direct_used));
  return Status::Ok();
}

Status SwapStore::Impl::Teardown(bool closing, const std::string* index_bytes) {
  Status first;
  auto note = [&first](Status s) {
    if (first.ok() && !s.ok()) first = std::move(s);
  };
  const bool remove = !(closing && options.keep_files);
  if (engine != nullptr && file >= 0) {
    // Only kept files need their bytes on the device; fsyncing a file about to be unlinked would
    // only write back what is then thrown away.
    if (closing && options.keep_files) {
      Status synced = engine->Sync(file).WithPrefix(Msg("fsync"));
      // An index written after a failed fsync could describe bytes the device does not hold;
      // the previous index (if any) stays, as after a failed Sync().
      if (synced.ok() && index_bytes != nullptr) {
        synced = WriteIndex(*index_bytes);
        if (synced.ok()) index_ours = true;
      }
      note(std::move(synced));
    }
    note(engine->RemoveFile(file));
    file = -1;
  }
  engine.reset();
  backends.clear();
  if (data_fd >= 0) {
    if (::close(data_fd) != 0) note(Status::FromErrno(errno, Msg("closing " + data_path)));
    data_fd = -1;
  }
  // The index first: an index left without its data file (by a crash in between) would be the
  // more confusing leftover.
  // Relative to the directory Open() opened (Note [Store directory by descriptor]).
  if (remove && closing && index_ours) {
    if (::unlinkat(dir_fd, kIndexFileName, 0) != 0 && errno != ENOENT) {
      note(Status::FromErrno(errno, Msg("cannot remove " + index_path)));
    }
    index_ours = false;
  }
  if (remove && (closing ? data_ours : data_created)) {
    if (::unlinkat(dir_fd, kDataFileName, 0) != 0 && errno != ENOENT) {
      note(Status::FromErrno(errno, Msg("cannot remove " + data_path)));
    }
    data_created = false;
    data_ours = false;
  }
  if (lock_fd >= 0) {
    // Unlink while still holding the lock, so no one can lock the name we are about to delete.
    if (remove && lock_held && (closing || lock_created)) {
      if (::unlinkat(dir_fd, kLockFileName, 0) != 0 && errno != ENOENT) {
        note(Status::FromErrno(errno, Msg("cannot remove " + lock_path)));
      }
    }
    ::close(lock_fd);  // releases the flock
    lock_fd = -1;
    lock_held = false;
  }
  // rmdir goes by name: only when the name still is the directory this store made (a link or
  // another directory there now is someone else's, and is left alone).
  const Status unchanged = dir_fd >= 0 ? DirectoryUnchanged() : Status::Ok();
  if (remove && created_dir && unchanged.ok()) {
    // Files someone else left there keep the directory; that is theirs to clean up.
    if (::rmdir(options.directory.c_str()) != 0 && errno != ENOTEMPTY && errno != EEXIST &&
        errno != ENOENT) {
      note(Status::FromErrno(errno, Msg("cannot remove the directory")));
    }
  }
  created_dir = false;
  // A directory swapped under a closing store is worth knowing of: what the store made was removed
  // where it was made, and nothing under the new name was touched.
  // Its code and errno are kept: a directory that is gone is an I/O failure (ENOENT; Python's
  // OSError, as Sync() reports it), one replaced by another or a link a precondition broken.
  if (closing && !unchanged.ok()) {
    note(unchanged.WithPrefix(remove ? "closing: the store's files were removed from the "
                                       "directory it opened, and nothing under the new name was "
                                       "touched"
                                     : "closing: the store's files stay in the directory it "
                                       "opened"));
  }
  if (dir_fd >= 0) {
    ::close(dir_fd);
    dir_fd = -1;
  }
  return first;
}

SwapStore::SwapStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SwapStore::~SwapStore() { (void)Close(); }

Result<std::unique_ptr<SwapStore>> SwapStore::Open(const SwapStoreOptions& options) {
  return Open(options, nullptr);
}

Result<std::unique_ptr<SwapStore>> SwapStore::Open(const SwapStoreOptions& options,
                                                   std::unique_ptr<Backend> backend) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  SwapStoreOptions normalized = options;
  normalized.directory = NormalizeDirectory(options.directory);
  auto impl = std::make_unique<Impl>(std::move(normalized));
  Status status = impl->PrepareDirectory();
  if (status.ok()) status = impl->TakeLock();
  if (status.ok()) {
    // No other thread can see the store yet: the lock costs nothing, and lets the analysis check
    // that the allocator and index are set up under it like everywhere else.
    MutexLock lock(&impl->mu);
    status = options.open_existing ? impl->OpenDataFile() : impl->CreateDataFile();
    if (status.ok() && options.open_existing) status = impl->LoadIndex();
  }
  if (status.ok()) status = impl->StartEngine(std::move(backend));
  if (!status.ok()) {
    (void)impl->Teardown(/*closing=*/false);  // the Open error is the one worth reporting
    return status;
  }
  return std::unique_ptr<SwapStore>(new SwapStore(std::move(impl)));
}

Status SwapStore::Put(const std::string& key, std::span<const std::byte> data) {
  auto start = std::chrono::steady_clock::now();
  Impl& s = *impl_;
  const uint64_t size = data.size();
  if (key.size() > kMaxKeyBytes) {
    return Status::InvalidArgument(s.Msg("a key of " + std::to_string(key.size()) +
                                         " bytes is longer than the limit of " +
                                         std::to_string(kMaxKeyBytes)));
  }
  // Hashing is the CPU-heavy part; do it before taking the lock.
  std::vector<uint64_t> sums = BlockChecksums(data, s.options.checksum_block_bytes);

  Impl::Entry* entry = nullptr;
  uint64_t offset = 0;
  {
    MutexLock lock(&s.mu);
    if (s.closed) return Status::FailedPrecondition(s.Msg("is closed"));
    if (size > s.capacity_bytes) return s.NoRoom(key, size);
    const uint64_t extent = RoundUp(size, s.alignment);
    auto it = s.index.find(key);
    if (it != s.index.end()) {
      Impl::Entry& e = it->second;
      if (e.writing || e.readers > 0) return s.Busy(key, e);
      if (e.extent_bytes != extent) {
        // Free first so the new extent may reuse (and merge with) the old one; put the old one
        // back if there is still no room, so a failed Put keeps the earlier value.
        s.allocator->Free(e.offset, e.extent_bytes);
        std::optional<uint64_t> got = s.allocator->Allocate(extent);
        if (!got) {
          bool restored = s.allocator->AllocateAt(e.offset, e.extent_bytes);
          if (!restored) return Status::Internal(s.KeyMsg(key, "allocator lost an extent"));
          return s.NoRoom(key, extent);
        }
        e.offset = *got;
        e.extent_bytes = extent;
        e.relocated = true;
      }
      e.writing = true;
      entry = &e;
    } else {
      std::optional<uint64_t> got = s.allocator->Allocate(extent);
      if (!got) return s.NoRoom(key, extent);
      Impl::Entry e;
      e.offset = *got;
      e.extent_bytes = extent;
      e.writing = true;
      entry = &s.index.emplace(key, std::move(e)).first->second;
    }
    offset = entry->offset;
    ++s.active_ops;
  }

  Status io = size == 0 ? Status::Ok() : s.engine->Write(s.file, offset, data.data(), size);

  MutexLock lock(&s.mu);
  --s.active_ops;
  if (!io.ok()) {
    // Part of the extent may hold the new bytes and part the old: neither value is whole.
    s.allocator->Free(entry->offset, entry->extent_bytes);
    s.index.erase(key);
    return io.WithPrefix(s.KeyMsg(key, "write failed; the key is removed"));
  }
  entry->size = size;
  entry->checksums = std::move(sums);
  entry->committed = true;
  entry->writing = false;
  entry->relocated = false;
  s.put_bytes += size;
  s.put_latency.Add(MicrosSince(start));
  return Status::Ok();
}

Status SwapStore::Get(const std::string& key, std::span<std::byte> out) {
  auto start = std::chrono::steady_clock::now();
  Impl& s = *impl_;
  Impl::Entry* entry = nullptr;
  {
    MutexLock lock(&s.mu);
    if (s.closed) return Status::FailedPrecondition(s.Msg("is closed"));
    auto it = s.index.find(key);
    if (it == s.index.end()) return Status::NotFound(s.KeyMsg(key, "not found"));
    Impl::Entry& e = it->second;
    if (e.writing) return s.Busy(key, e);
    if (out.size() != e.size) {
      return Status::InvalidArgument(
          s.KeyMsg(key, "the buffer holds " + std::to_string(out.size()) +
                            " bytes but the value is " + std::to_string(e.size) + " bytes"));
    }
    ++e.readers;
    ++s.active_ops;
    entry = &e;
  }

  // The entry cannot change while we are one of its readers (see Note [Per-key state ...]).
  const uint64_t size = entry->size;
  Status status = size == 0 ? Status::Ok() : s.ReadBlocks(key, *entry, 0, size, out.data());
  s.EndRead(entry, status, size, start);
  return status;
}

// Reads whole checksum blocks: straight into `out` when the range starts and ends on block
// boundaries (or at the value's end), else the covered blocks into a scratch buffer of at most
// out.size() + 2 blocks, from which the range is copied.
Status SwapStore::GetRange(const std::string& key, uint64_t offset, std::span<std::byte> out) {
  auto start = std::chrono::steady_clock::now();
  Impl& s = *impl_;
  Impl::Entry* entry = nullptr;
  MEMPLAN_RETURN_IF_ERROR(s.BeginRangeRead(key, offset, out.size(), start, &entry));
  if (entry == nullptr) return Status::Ok();  // an empty range

  // The entry cannot change while we are one of its readers (see Note [Per-key state ...]).
  const uint64_t block = s.options.checksum_block_bytes;
  const uint64_t end = offset + out.size();
  const uint64_t cover_begin = offset / block * block;
  const uint64_t cover_end = std::min(RoundUp(end, block), entry->size);
  std::vector<std::byte> scratch;
  std::byte* covered = out.data();
  if (cover_begin != offset || cover_end != end) {
    scratch.resize(static_cast<size_t>(cover_end - cover_begin));
    covered = scratch.data();
  }
  Status status = s.ReadBlocks(key, *entry, cover_begin, cover_end, covered);
  if (status.ok() && covered != out.data()) {
    std::memcpy(out.data(), covered + (offset - cover_begin), out.size());
  }
  s.EndRead(entry, status, out.size(), start);
  return status;
}

Result<SwapStore::CoveredRange> SwapStore::GetCovering(const std::string& key, uint64_t offset,
                                                       uint64_t max_bytes,
                                                       std::span<std::byte> buffer) {
  auto start = std::chrono::steady_clock::now();
  Impl& s = *impl_;
  Impl::Entry* entry = nullptr;
  MEMPLAN_RETURN_IF_ERROR(s.BeginRangeRead(key, offset, max_bytes, start, &entry));
  if (entry == nullptr) return CoveredRange{};  // an empty range
  const uint64_t block = s.options.checksum_block_bytes;
  const uint64_t cover_begin = offset / block * block;
  // Whole blocks from cover_begin that fit in the buffer, and no further than the range needs.
  const uint64_t fit = buffer.size() / block * block;
  const uint64_t cover_end =
      std::min({RoundUp(offset + max_bytes, block), entry->size, cover_begin + fit});
  CoveredRange got;
  Status status;
  if (cover_end > offset) {
    status = s.ReadBlocks(key, *entry, cover_begin, cover_end, buffer.data());
    got.in_buffer = offset - cover_begin;
    got.bytes = std::min(max_bytes, cover_end - offset);
  }
  s.EndRead(entry, status, got.bytes, start);
  if (!status.ok()) return status;
  return got;
}

Result<uint64_t> SwapStore::Size(const std::string& key) const {
  const Impl& s = *impl_;
  MutexLock lock(&s.mu);
  if (s.closed) return Status::FailedPrecondition(s.Msg("is closed"));
  auto it = s.index.find(key);
  if (it == s.index.end() || !it->second.committed) {
    return Status::NotFound(s.KeyMsg(key, "not found"));
  }
  return it->second.size;
}

Status SwapStore::Erase(const std::string& key) {
  Impl& s = *impl_;
  MutexLock lock(&s.mu);
  if (s.closed) return Status::FailedPrecondition(s.Msg("is closed"));
  auto it = s.index.find(key);
  if (it == s.index.end()) return Status::NotFound(s.KeyMsg(key, "not found"));
  if (it->second.writing || it->second.readers > 0) return s.Busy(key, it->second);
  s.allocator->Free(it->second.offset, it->second.extent_bytes);
  s.index.erase(it);
  return Status::Ok();
}

std::vector<std::string> SwapStore::Keys() const {
  const Impl& s = *impl_;
  std::vector<std::string> keys;
  {
    MutexLock lock(&s.mu);
    keys.reserve(s.index.size());
    for (const auto& [key, entry] : s.index) {
      if (entry.committed) keys.push_back(key);
    }
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

Status SwapStore::Sync(Durability durability) {
  Impl& s = *impl_;
  MutexLock one_at_a_time(&s.sync_mu);
  std::string bytes;
  {
    MutexLock lock(&s.mu);
    if (s.closed) return Status::FailedPrecondition(s.Msg("is closed"));
    bytes = s.EncodeIndex();
    ++s.active_ops;  // so Close() cannot release the engine under us
  }
  Status status;
  if (durability == Durability::kPowerLoss) {
    status = s.engine->Sync(s.file).WithPrefix(s.Msg("fdatasync of " + s.data_path));
  }
  if (status.ok()) status = s.WriteIndex(bytes, durability);

  MutexLock lock(&s.mu);
  --s.active_ops;
  if (status.ok()) s.index_ours = true;
  return status;
}

Status SwapStore::RegisterBuffers(std::span<const iovec> buffers) {
  Impl& s = *impl_;
  MutexLock lock(&s.mu);
  if (s.closed) return Status::FailedPrecondition("swap store " + s.options.directory + ": closed");
  if (s.active_ops > 0) {
    return Status::FailedPrecondition("swap store " + s.options.directory +
                                      ": RegisterBuffers with operations in flight");
  }
  s.registered_bytes = 0;
  MEMPLAN_RETURN_IF_ERROR(
      s.engine->RegisterBuffers(buffers).WithPrefix("swap store " + s.options.directory));
  if (s.backends[0]->capabilities().registered_buffers) {
    for (const iovec& b : buffers) s.registered_bytes += b.iov_len;
  }
  return Status::Ok();
}

SwapStoreStats SwapStore::stats() const {
  const Impl& s = *impl_;
  SwapStoreStats out;
  std::vector<double> put_samples, get_samples;
  {
    MutexLock lock(&s.mu);
    out.capacity_bytes = s.capacity_bytes;
    out.used_bytes = s.capacity_bytes - s.allocator->free_bytes();
    for (const auto& [key, entry] : s.index) out.keys += entry.committed ? 1 : 0;
    out.put_bytes = s.put_bytes;
    out.get_bytes = s.get_bytes;
    out.puts = s.put_latency.count();
    out.gets = s.get_latency.count();
    put_samples = s.put_latency.Samples();
    get_samples = s.get_latency.Samples();
    out.put_latency.count = s.put_latency.count();
    out.put_latency.max_us = s.put_latency.max_us();
    out.get_latency.count = s.get_latency.count();
    out.get_latency.max_us = s.get_latency.max_us();
    out.io = s.closed ? s.final_io : s.engine->stats();
  }
  out.put_latency =
      Summarize(std::move(put_samples), out.put_latency.count, out.put_latency.max_us);
  out.get_latency =
      Summarize(std::move(get_samples), out.get_latency.count, out.get_latency.max_us);
  out.backend = s.backend_name;
  out.backend_note = s.backend_note;
  out.direct = s.direct_used;
  out.alignment_bytes = static_cast<uint32_t>(s.alignment);
  out.io_threads = s.options.engine_options.threads;
  out.io_backends = s.backend_count;
  {
    MutexLock lock(&s.mu);
    out.registered_buffer_bytes = s.registered_bytes;
  }
  return out;
}

Status SwapStore::Close() {
  Impl& s = *impl_;
  MutexLock lock(&s.mu);
  if (s.closed) return Status::Ok();
  if (s.active_ops > 0) {
    return Status::FailedPrecondition(
        s.Msg("cannot close: " + std::to_string(s.active_ops) + " operation(s) in flight"));
  }
  s.closed = true;
  s.final_io = s.engine->stats();
  // Nothing is in flight, so this is every committed key.
  std::string index_bytes;
  if (s.options.keep_files) index_bytes = s.EncodeIndex();
  // Held across the teardown so that stats() never sees a half-released store.
  return s.Teardown(/*closing=*/true, s.options.keep_files ? &index_bytes : nullptr);
}

Result<uint64_t> SwapStore::DebugFileOffset(const std::string& key) const {
  const Impl& s = *impl_;
  MutexLock lock(&s.mu);
  auto it = s.index.find(key);
  if (it == s.index.end()) return Status::NotFound(s.KeyMsg(key, "not found"));
  return it->second.offset;
}

}  // namespace memplan::nvme
