// NVMe bench: see nvme_bench.h.
//
// Note [Bench method]
// ~~~~~~~~~~~~~~~~~~~
// What the offload engine needs from a disk is sequential bandwidth on large transfers, both
// ways, through its own I/O path. So the bench drives the IoEngine exactly as the engine does:
// one thread, one aligned buffer, large Read/Write calls that the engine splits into block_size
// requests and keeps `queue_depth` of in flight.
//
// Note [Chunk sizes]
// ~~~~~~~~~~~~~~~~~~
// The queue drains at the end of every call: the last queue_depth requests finish with ever
// fewer in flight, and at 1 MiB x 16 on a 2 GB/s drive that costs about 4 ms per call, 3% of a
// GiB if it were cut into 256 MiB calls. fio drains once, at the end. So calls are as large as
// the buffer allows (NvmeBenchOptions::chunk_bytes, 1 GiB) and never smaller than block x queue
// depth. Under a time limit the first call is 64 MiB and each next one is sized, at the rate so
// far, to end at the limit: a fast drive still does a GiB in two calls, a slow one overshoots
// the limit by little.
//
// The file is filled once, unmeasured, before the first point: reads then always return data the
// filesystem has on the device (a hole would read as zeros from memory, faster than any disk),
// and every measured write overwrites written blocks, so the first point does not pay for
// converting the preallocated (unwritten) extents that later points get for free. The data is a
// xorshift pattern with no zero word; the first and last words of every read chunk are zeroed
// before the read and checked after it, so a read that transferred nothing, or read a hole, is
// caught rather than measured.
//
// Note [Existing bench file]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With NvmeBenchOptions::file the bench runs on a file someone else laid out (bench/nvme_vs_fio.sh
// passes the file fio wrote, so both tools measure the same blocks). That file is used as it is:
// no fill, no preallocation, no truncation, never removed; only its first size_bytes are
// overwritten, by the measured write passes. Its content is therefore known only where this run
// wrote it: the read check covers the prefix [0, pattern_bytes) the write passes have covered so
// far (all of it from the first write pass on, without a time limit), and a read that goes beyond
// (--rw read, or a read pass outrunning a time-limited write pass) is checked only for its full
// length, which the engine enforces (OutOfRange at end of file). Data read from beyond the prefix
// may hold zero words, so the buffer gets its pattern back before the next write pass. A hole in
// the file is reported in a note: reads of it would measure memory, not the drive.
//
// A write is timed to the end of a final fdatasync: without it a buffered write measures memcpy
// into the page cache, and even O_DIRECT leaves data in the drive's volatile cache. With buffered
// I/O (--no-direct, or a filesystem refusing O_DIRECT) the page cache is dropped before each read
// pass (POSIX_FADV_DONTNEED), so reads come from the device too.
//
// The best point maximises read + write bandwidth, as DeepSpeed's ds_nvme_tune does
// (deepspeed/nvme/perf_generate_param.py sums the read and write GB/s of each setting).
#include "bench/nvme_bench.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <utility>

#include "common/byte_size.h"
#include "common/checked_math.h"
#include "common/enum_names.h"
#include "nvme/io_engine.h"

namespace memplan::bench {

using nvme::BackendKind;
using nvme::BackendOptions;
using nvme::BackendSet;
using nvme::IoEngine;
using nvme::IoEngineOptions;
using nvme::OpenFile;
using nvme::OpenOptions;
using nvme::OpType;

namespace {

constexpr uint32_t kAlignment = 4096;
constexpr uint32_t kMinBlock = 4096;
constexpr uint32_t kMaxBlock = 64u << 20;
// Settings of the unmeasured fill (any reasonable ones do: it only has to finish).
constexpr uint32_t kFillBlock = 1u << 20;
constexpr uint32_t kFillQueueDepth = 32;
// The first call of a timed pass, before its rate is known: small enough for a slow disk to
// finish well inside any sensible limit.
constexpr uint64_t kFirstTimedChunk = uint64_t{64} << 20;

std::string FilesystemName(const std::string& directory) {
  struct statfs fs {};
  if (::statfs(directory.c_str(), &fs) != 0) return "unknown";
  switch (static_cast<uint64_t>(fs.f_type)) {
    case 0xEF53: return "ext4";  // ext2/3/4 share the magic
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0xF2F52010: return "f2fs";
    case 0x2FC12FC1: return "zfs";
    case 0x01021994: return "tmpfs";
    case 0x858458F6: return "ramfs";
    case 0x794C7630: return "overlayfs";
    case 0x6969: return "nfs";
    case 0xFF534D42: return "cifs";
    case 0x65735546: return "fuse";
    case 0x47504653: return "gpfs";
    case 0x0BD00BD0: return "lustre";
    default: break;
  }
  char hex[32];
  std::snprintf(hex, sizeof(hex), "unknown (0x%" PRIx64 ")", static_cast<uint64_t>(fs.f_type));
  return hex;
}

bool IsMemoryFilesystem(const std::string& name) { return name == "tmpfs" || name == "ramfs"; }

// `path` as an existing bench file must be: a regular file of at least `size_bytes`.
Status CheckExistingFile(const std::string& path, const struct stat& st, uint64_t size_bytes) {
  if (S_ISLNK(st.st_mode)) {
    return Status::InvalidArgument(path + ": a symlink (not followed: name the file itself)");
  }
  if (!S_ISREG(st.st_mode)) return Status::InvalidArgument(path + ": not a regular file");
  const auto file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < size_bytes) {
    return Status::InvalidArgument(
        path + ": the file has " + FormatByteSize(file_bytes) + " (" + std::to_string(file_bytes) +
        " bytes), less than the bench size " + FormatByteSize(size_bytes) + " (" +
        std::to_string(size_bytes) + " bytes)");
  }
  return Status::Ok();
}

// Checks an existing bench file before anything is opened (a FIFO or device is never opened).
Status CheckFile(const std::string& path, uint64_t size_bytes) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no such file");
    return Status::FromErrno(errno, path);
  }
  return CheckExistingFile(path, st, size_bytes);
}

// The bench file: either created O_EXCL inside the directory, closed and unlinked on destruction,
// or an existing file opened as it is and only closed. See Note [Existing bench file].
class BenchFile {
 public:
  BenchFile() = default;
  BenchFile(const BenchFile&) = delete;
  BenchFile& operator=(const BenchFile&) = delete;
  ~BenchFile() {
    if (fd_ >= 0) ::close(fd_);
    if (remove_) ::unlink(path_.c_str());
  }

  Status Create(const std::string& directory, bool direct) {
    std::random_device random;
    uint64_t tag = (uint64_t{random()} << 32) ^ random();
    char name[96];
    std::snprintf(name, sizeof(name), "memplan-bench.%d.%016" PRIx64 ".tmp",
                  static_cast<int>(::getpid()), tag);
    std::string path = directory;
    if (path.empty() || path.back() != '/') path += '/';
    path += name;
    OpenOptions open;
    open.create = true;
    open.exclusive = true;
    open.write = true;
    open.direct = direct;
    MEMPLAN_ASSIGN_OR_RETURN(fd_, OpenFile(path, open, &direct_));
    path_ = std::move(path);  // only now is it ours to remove
    remove_ = true;
    return Status::Ok();
  }

  // Opens an existing regular file (O_NOFOLLOW; never created or truncated) of at least
  // `size_bytes`, checking the file actually opened, not only the name looked at before.
  Status OpenExisting(const std::string& path, uint64_t size_bytes, bool direct) {
    OpenOptions open;
    open.write = true;
    open.direct = direct;
    MEMPLAN_ASSIGN_OR_RETURN(fd_, OpenFile(path, open, &direct_));
    path_ = path;  // the caller's file: never removed
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return Status::FromErrno(errno, path_);
    return CheckExistingFile(path_, st, size_bytes);
  }

  // The offset of the first hole (or unwritten extent, on filesystems that report those as
  // holes) before `bytes`, or `bytes` when there is none or the filesystem cannot tell.
  uint64_t FirstHoleBefore(uint64_t bytes) const {
    const off_t hole = ::lseek(fd_, 0, SEEK_HOLE);
    if (hole < 0) return bytes;
    return std::min(bytes, static_cast<uint64_t>(hole));
  }

  // Reserves `bytes` on the device, so a full disk fails here rather than mid-measurement.
  Status Preallocate(uint64_t bytes) {
    if (::fallocate(fd_, 0, 0, static_cast<off_t>(bytes)) == 0) return Status::Ok();
    int err = errno;
    if (err != EOPNOTSUPP && err != ENOSYS) {
      return Status::FromErrno(err, path_ + ": cannot preallocate " + FormatByteSize(bytes));
    }
    // No fallocate here (some network filesystems): the fill writes every byte anyway.
    if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      return Status::FromErrno(errno, path_ + ": cannot size to " + FormatByteSize(bytes));
    }
    return Status::Ok();
  }

  int fd() const { return fd_; }
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  bool remove_ = false;  // created here: unlinked on destruction
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<unsigned char, FreeDeleter>;

// A non-repeating pattern, so neither a compressing drive nor a filesystem sees zeros; xorshift
// never yields a zero word.
void FillPattern(unsigned char* buffer, uint64_t bytes) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i < bytes / sizeof(uint64_t); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(buffer + i * sizeof(uint64_t), &x, sizeof(x));
  }
}

Result<AlignedBuffer> AllocateBuffer(uint64_t bytes) {
  void* raw = nullptr;
  int err = ::posix_memalign(&raw, kAlignment, bytes);
  if (err != 0) {
    return Status::ResourceExhausted("cannot allocate a " + FormatByteSize(bytes) +
                                     " I/O buffer: " + std::strerror(err));
  }
  FillPattern(static_cast<unsigned char*>(raw), bytes);
  return AlignedBuffer(static_cast<unsigned char*>(raw));
}

// The bytes one IoEngine call may transfer at one point: at least block x queue depth (else the
// queue could never fill), at most the larger of that and NvmeBenchOptions::chunk_bytes, never more
// than the file; a whole number of blocks.
struct ChunkLimits {
  uint64_t min_bytes = 0;
  uint64_t max_bytes = 0;
  uint32_t block_size = 0;
};

ChunkLimits PlanChunks(const NvmeBenchOptions& options, uint32_t block_size, uint32_t queue_depth,
                       uint32_t threads = 1) {
  // With T threads each fills its own queue with its slice of the call.
  const uint64_t full_queue = uint64_t{block_size} * queue_depth * threads;
  uint64_t max_bytes = std::min(std::max(full_queue, options.chunk_bytes), options.size_bytes);
  if (max_bytes >= block_size) max_bytes -= max_bytes % block_size;
  return {std::min(full_queue, max_bytes), max_bytes, block_size};
}

// The buffer holds a xorshift pattern, which has no zero word: a word that reads back as zero
// was not transferred, or came from a hole.
bool NonZeroWord(const unsigned char* buffer, uint64_t at) {
  uint64_t word = 0;
  std::memcpy(&word, buffer + at, sizeof(word));
  return word != 0;
}

void ZeroWord(unsigned char* buffer, uint64_t at) { std::memset(buffer + at, 0, sizeof(uint64_t)); }

// One direction's timed loop.
struct Phase {
  uint64_t bytes = 0;
  double seconds = 0;
  bool stopped = false;  // `stop` was raised
};

bool StopRequested(const std::atomic<bool>* stop) {
  return stop != nullptr && stop->load(std::memory_order_relaxed);
}

// Transfers up to `size` bytes from offset 0; stops early after `limit_seconds` (0: never) or
// when `stop` is raised. Writes end with fdatasync (timed). Reads check that the first and last
// words of each chunk hold written data where they lie in [0, pattern_bytes), the prefix this run
// wrote (see Note [Existing bench file]). See Note [Chunk sizes].
Result<Phase> RunPhase(IoEngine& engine, int file, const BenchFile& bench_file, OpType op,
                       uint64_t size, const ChunkLimits& chunks, unsigned char* buffer,
                       double limit_seconds, const std::atomic<bool>* stop, uint64_t pattern_bytes,
                       uint64_t* largest_chunk) {
  Phase phase;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  auto clamp_chunk = [&](uint64_t bytes) {
    bytes -= bytes % chunks.block_size;
    return std::clamp(bytes, chunks.min_bytes, chunks.max_bytes);
  };
  uint64_t chunk = limit_seconds > 0 ? clamp_chunk(kFirstTimedChunk) : chunks.max_bytes;
  uint64_t offset = 0;
  while (offset < size) {
    if (StopRequested(stop)) {
      phase.stopped = true;
      break;
    }
    uint64_t length = std::min(chunk, size - offset);
    *largest_chunk = std::max(*largest_chunk, length);
    if (op == OpType::kWrite) {
      MEMPLAN_RETURN_IF_ERROR(engine.Write(file, offset, buffer, length));
    } else {
      const uint64_t last = length - sizeof(uint64_t);
      const bool check_first = offset + sizeof(uint64_t) <= pattern_bytes;
      const bool check_last = offset + length <= pattern_bytes;
      ZeroWord(buffer, 0);
      ZeroWord(buffer, last);
      MEMPLAN_RETURN_IF_ERROR(engine.Read(file, offset, buffer, length));
      if ((check_first && !NonZeroWord(buffer, 0)) || (check_last && !NonZeroWord(buffer, last))) {
        return Status::DataLoss(bench_file.path() + ": read at offset " + std::to_string(offset) +
                                " did not return the data written");
      }
    }
    offset += length;
    if (limit_seconds > 0) {
      const double seconds = elapsed();
      if (seconds >= limit_seconds) break;
      // What should fit in the time left at the rate so far.
      chunk = clamp_chunk(static_cast<uint64_t>(offset / seconds * (limit_seconds - seconds)));
    }
  }
  // A stopped run throws its data away: syncing gigabytes of it would only delay the stop.
  if (op == OpType::kWrite && offset > 0 && !phase.stopped && ::fdatasync(bench_file.fd()) != 0) {
    return Status::FromErrno(errno, bench_file.path() + ": fdatasync failed");
  }
  phase.seconds = elapsed();
  phase.bytes = offset;
  return phase;
}

// Drops the file's pages from the page cache so buffered reads come from the device.
void DropCache(const BenchFile& file) {
  if (!file.direct()) ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_DONTNEED);
}

std::string PointName(BackendKind backend, uint32_t block_size, uint32_t queue_depth,
                      uint32_t threads) {
  return std::string(BackendKindName(backend)) + " block " + FormatByteSize(block_size) +
         " queue depth " + std::to_string(queue_depth) +
         (threads > 1 ? " threads " + std::to_string(threads) : "");
}

BackendOptions BackendOptionsFor(uint32_t queue_depth) {
  BackendOptions options;
  options.queue_depth = queue_depth;
  // A synchronous backend keeps one request in flight per worker thread.
  options.posix_threads = std::min<uint32_t>(queue_depth, 256);
  return options;
}

// Backends and an engine on the bench file for one point.
struct Rig {
  BackendSet set;
  std::unique_ptr<IoEngine> engine;  // destroyed before the backends it uses
  int file = -1;

  ~Rig() {
    if (engine && file >= 0) (void)engine->RemoveFile(file);
  }
};

Result<std::unique_ptr<Rig>> MakeRig(BackendKind kind, uint32_t block_size, uint32_t queue_depth,
                                     uint32_t threads, const BenchFile& bench_file) {
  auto rig = std::make_unique<Rig>();
  MEMPLAN_ASSIGN_OR_RETURN(rig->set, CreateBackends(kind, BackendOptionsFor(queue_depth), threads));
  IoEngineOptions engine_options;
  engine_options.block_size = block_size;
  engine_options.threads = threads;
  MEMPLAN_ASSIGN_OR_RETURN(rig->engine, IoEngine::Create(rig->set.pointers(), engine_options));
  MEMPLAN_ASSIGN_OR_RETURN(
      rig->file, rig->engine->AddFile(bench_file.fd(), bench_file.path(), bench_file.direct()));
  return rig;
}

Status CheckDirectory(const std::string& directory, uint64_t size_bytes) {
  struct stat st {};
  if (::stat(directory.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::NotFound(directory + ": no such directory");
    return Status::FromErrno(errno, directory);
  }
  if (!S_ISDIR(st.st_mode)) return Status::InvalidArgument(directory + ": not a directory");
  struct statvfs vfs {};
  if (::statvfs(directory.c_str(), &vfs) != 0) {
    return Status::FromErrno(errno, directory + ": cannot read free space");
  }
  uint64_t free_bytes = CheckedMul(vfs.f_bavail, vfs.f_frsize).value_or(UINT64_MAX);
  if (free_bytes < size_bytes) {
    return Status::ResourceExhausted(directory + ": the bench file needs " +
                                     FormatByteSize(size_bytes) + " but the filesystem has " +
                                     FormatByteSize(free_bytes) + " free");
  }
  return Status::Ok();
}

struct Planned {
  BackendKind backend;
  uint32_t block_size;
  uint32_t queue_depth;
  uint32_t threads;
};

int BestIndex(const std::vector<NvmeBenchResult>& results, bool aio_only) {
  int best = -1;
  for (size_t i = 0; i < results.size(); ++i) {
    if (aio_only && results[i].backend != BackendKind::kAio) continue;
    if (best < 0 || results[i].score() > results[static_cast<size_t>(best)].score()) {
      best = static_cast<int>(i);
    }
  }
  return best;
}

std::string Join(const std::vector<std::string>& parts, std::string_view separator) {
  std::string out;
  for (const auto& part : parts) {
    if (!out.empty()) out += separator;
    out += part;
  }
  return out;
}

std::string MegabytesPerSecond(bool measured, double bytes_per_s) {
  if (!measured) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", bytes_per_s / 1e6);
  return text;
}

void ReportProgress(const NvmeBenchProgressFn& progress, NvmeBenchProgress event) {
  if (progress) progress(event);
}

// Which of the options' backends this machine can run, each once (kAuto resolved). With one
// backend named, failing to set it up is the user's error; in a sweep it is a note (and a "skip"
// progress event). FailedPrecondition when none can be set up.
Result<std::vector<BackendKind>> ProbeBackends(const NvmeBenchOptions& options,
                                               const NvmeBenchProgressFn& progress,
                                               NvmeBenchReport* report) {
  std::vector<BackendKind> backends;
  const uint32_t probe_depth = options.queue_depths.front();
  for (BackendKind kind : options.backends) {
    auto probe = CreateBackend(kind, BackendOptionsFor(probe_depth));
    if (!probe.ok()) {
      if (options.backends.size() == 1) {
        return probe.status().WithPrefix(std::string(BackendKindName(kind)) + " backend");
      }
      std::string note = std::string(BackendKindName(kind)) +
                         ": unavailable, skipped: " + probe.status().message();
      ReportProgress(progress, {"skip", 0, 0, nullptr, note});
      report->notes.push_back(std::move(note));
      continue;
    }
    if (kind == BackendKind::kAuto && !probe->note.empty()) {
      report->notes.push_back("auto: " + probe->note);
    }
    if (std::find(backends.begin(), backends.end(), probe->kind) == backends.end()) {
      backends.push_back(probe->kind);
    }
  }
  if (backends.empty()) {
    return Status::FailedPrecondition("no I/O backend could be set up: " +
                                      Join(report->notes, "; "));
  }
  return backends;
}

// Every point of the sweep, backend by block size by queue depth by threads; `*buffer_bytes`: the
// I/O buffer they and the unmeasured fill need.
std::vector<Planned> PlanPoints(const NvmeBenchOptions& options,
                                const std::vector<BackendKind>& backends, uint64_t* buffer_bytes) {
  std::vector<Planned> plan;
  *buffer_bytes = PlanChunks(options, kFillBlock, kFillQueueDepth).max_bytes;
  for (BackendKind backend : backends) {
    for (uint32_t block : options.block_sizes) {
      for (uint32_t depth : options.queue_depths) {
        for (uint32_t threads : options.threads) {
          plan.push_back({backend, block, depth, threads});
          *buffer_bytes =
              std::max(*buffer_bytes, PlanChunks(options, block, depth, threads).max_bytes);
        }
      }
    }
  }
  return plan;
}

// The options' existing file, opened as it is; or a new bench file in their directory, its
// `size_bytes` reserved.
Status OpenBenchFile(const NvmeBenchOptions& options, BenchFile* bench_file) {
  if (!options.file.empty()) {
    return bench_file->OpenExisting(options.file, options.size_bytes, options.direct);
  }
  MEMPLAN_RETURN_IF_ERROR(bench_file->Create(options.directory, options.direct));
  return bench_file->Preallocate(options.size_bytes);
}

// The notes on how the figures were taken: buffered or direct I/O, a memory filesystem, an
// existing file (and its holes), the POSIX backend's threads. `where`: the file or directory.
void AddMethodNotes(const NvmeBenchOptions& options, const std::vector<BackendKind>& backends,
                    const BenchFile& bench_file, const std::string& where,
                    NvmeBenchReport* report) {
  if (!options.direct) {
    report->notes.push_back(
        "buffered I/O: writes are timed to the end of fdatasync and the page "
        "cache is dropped before each read pass");
  } else if (!bench_file.direct()) {
    report->notes.push_back("O_DIRECT refused by the filesystem (" + report->filesystem +
                            "); measured buffered I/O");
  }
  if (IsMemoryFilesystem(report->filesystem)) {
    report->notes.push_back(where + " is on " + report->filesystem +
                            " (memory, not a disk): these figures say nothing about a drive");
  }
  if (!options.file.empty()) {
    report->notes.push_back(options.rw != BenchRw::kRead
                                ? "existing file: its first " + FormatByteSize(options.size_bytes) +
                                      " were overwritten; it was not preallocated or filled"
                                : "existing file, read only: its contents were not checked, "
                                  "only that every read returned its full length");
    const uint64_t hole = bench_file.FirstHoleBefore(options.size_bytes);
    if (hole < options.size_bytes) {
      report->notes.push_back(options.file + " has a hole or unwritten blocks at offset " +
                              std::to_string(hole) +
                              ": reads of it measure memory, not the drive, and the first "
                              "write allocates it (write the file in full first)");
    }
  }
  if (std::find(backends.begin(), backends.end(), BackendKind::kPosix) != backends.end()) {
    report->notes.push_back("posix: one worker thread per queue slot (pread/pwrite)");
  }
}

// What the points of a sweep share as they run: the I/O buffer and what is known of its and the
// file's contents (Note [Existing bench file]).
struct Sweep {
  unsigned char* buffer = nullptr;
  uint64_t buffer_bytes = 0;
  // The bytes from offset 0 that this run wrote with the pattern: where reads are checked.
  uint64_t pattern_bytes = 0;
  // Whether the buffer may hold data not written by this run (with zero words): it gets its
  // pattern back before the next write.
  bool buffer_foreign = false;
};

// Before the first point: a new bench file is written in full, unmeasured (Note [Bench method]),
// with `fill_backend`; an existing one is used as it is. Sets report->interrupted when `stop` is
// raised during the fill.
Status PrepareBenchFile(const NvmeBenchOptions& options, BackendKind fill_backend,
                        const BenchFile& bench_file, size_t points,
                        const NvmeBenchProgressFn& progress, Sweep* sweep,
                        NvmeBenchReport* report) {
  if (!options.file.empty()) {
    ReportProgress(progress, {"prepare", 0, points, nullptr,
                              "using the existing file " + bench_file.path() +
                                  (options.rw != BenchRw::kRead
                                       ? " (its first " + FormatByteSize(options.size_bytes) +
                                             " are overwritten)"
                                       : " (read only)")});
    return Status::Ok();
  }
  ReportProgress(progress, {"prepare", 0, points, nullptr,
                            "writing the " + FormatByteSize(options.size_bytes) + " bench file " +
                                bench_file.path()});
  auto rig = MakeRig(fill_backend, kFillBlock, kFillQueueDepth, 1, bench_file);
  if (!rig.ok()) return rig.status().WithPrefix("preparing the bench file");
  uint64_t largest_chunk = 0;
  auto fill = RunPhase(*(*rig)->engine, (*rig)->file, bench_file, OpType::kWrite,
                       options.size_bytes, PlanChunks(options, kFillBlock, kFillQueueDepth),
                       sweep->buffer, 0, options.stop, 0, &largest_chunk);
  if (!fill.ok()) return fill.status().WithPrefix("preparing the bench file");
  if (fill->stopped) {
    report->interrupted = true;
    return Status::Ok();
  }
  sweep->pattern_bytes = options.size_bytes;
  return Status::Ok();
}

// Measures one point, named `name` in its errors: writes then reads, as the options' rw says.
// Nothing (no result) when `stop` was raised during it.
Result<std::optional<NvmeBenchResult>> MeasurePoint(const NvmeBenchOptions& options,
                                                    const Planned& point,
                                                    const BenchFile& bench_file,
                                                    const std::string& name, Sweep* sweep) {
  auto rig = MakeRig(point.backend, point.block_size, point.queue_depth, point.threads, bench_file);
  if (!rig.ok()) return rig.status().WithPrefix(name);
  NvmeBenchResult result;
  result.backend = (*rig)->set.kind;
  result.direct = bench_file.direct();
  result.block_size = point.block_size;
  result.queue_depth = point.queue_depth;
  result.threads = point.threads;
  result.size_bytes = options.size_bytes;
  const ChunkLimits chunks =
      PlanChunks(options, point.block_size, point.queue_depth, point.threads);
  const bool do_write = options.rw != BenchRw::kRead;
  const bool do_read = options.rw != BenchRw::kWrite;
  for (OpType op : {OpType::kWrite, OpType::kRead}) {
    if (op == OpType::kWrite ? !do_write : !do_read) continue;
    if (op == OpType::kWrite && sweep->buffer_foreign) {
      FillPattern(sweep->buffer, sweep->buffer_bytes);
      sweep->buffer_foreign = false;
    }
    if (op == OpType::kRead) DropCache(bench_file);
    auto phase = RunPhase(*(*rig)->engine, (*rig)->file, bench_file, op, options.size_bytes, chunks,
                          sweep->buffer, options.seconds_per_point, options.stop,
                          sweep->pattern_bytes, &result.chunk_bytes);
    if (!phase.ok()) return phase.status().WithPrefix(name);
    if (phase->stopped) return std::optional<NvmeBenchResult>();
    if (op == OpType::kWrite) {
      result.write_measured = true;
      result.write_bytes = phase->bytes;
      result.write_seconds = phase->seconds;
      sweep->pattern_bytes = std::max(sweep->pattern_bytes, phase->bytes);
    } else {
      result.read_measured = true;
      result.read_bytes = phase->bytes;
      result.read_seconds = phase->seconds;
      if (phase->bytes > sweep->pattern_bytes) sweep->buffer_foreign = true;
    }
  }
  return std::optional<NvmeBenchResult>(result);
}

// The best points (overall, and libaio's for DeepSpeed) and the notes on what the results mean:
// points cut short by the time limit, a best point that is not libaio's, threads not swept.
void Summarize(const NvmeBenchOptions& options, NvmeBenchReport* report) {
  report->best = BestIndex(report->results, /*aio_only=*/false);
  report->best_aio = BestIndex(report->results, /*aio_only=*/true);
  size_t limited =
      static_cast<size_t>(std::count_if(report->results.begin(), report->results.end(),
                                        [](const NvmeBenchResult& r) { return r.time_limited(); }));
  if (limited > 0) {
    report->notes.push_back(std::to_string(limited) +
                            " point(s) stopped at the time limit "
                            "before transferring the full size (marked *)");
  }
  if (report->best >= 0 && report->best_aio >= 0 && report->best != report->best_aio) {
    const NvmeBenchResult& best = report->results[static_cast<size_t>(report->best)];
    report->notes.push_back(
        "the aio block holds the best libaio settings, since DeepSpeed's "
        "engine is libaio; memplan's engine is fastest with " +
        PointName(best.backend, best.block_size, best.queue_depth, best.threads));
  }
  if (report->best >= 0 && options.threads.size() == 1) {
    report->notes.push_back(
        "intra_op_parallelism " + std::to_string(options.threads.front()) + ": " +
        (options.threads.front() == 1
             ? std::string("one thread issued every request")
             : std::to_string(options.threads.front()) + " threads split every call") +
        " (threads not swept; --threads 1,2,4 sweeps them)");
  }
}

constexpr EnumName<BenchRw> kBenchRws[] = {
    {BenchRw::kRead, "read"}, {BenchRw::kWrite, "write"}, {BenchRw::kBoth, "both"}};

}  // namespace

std::string_view BenchRwName(BenchRw rw) { return NameOf(kBenchRws, rw); }

Result<BenchRw> ParseBenchRw(std::string_view text) { return ParseName(kBenchRws, text, "--rw"); }

Status NvmeBenchOptions::Validate() const {
  if (directory.empty() && file.empty()) {
    return Status::InvalidArgument("no directory for a temporary bench file and no existing file");
  }
  if (!directory.empty() && !file.empty()) {
    return Status::InvalidArgument("give a directory or an existing file for the bench, not both");
  }
  if (size_bytes == 0 || size_bytes % kAlignment != 0) {
    return Status::InvalidArgument("size must be a positive multiple of 4 KiB, got " +
                                   std::to_string(size_bytes) + " bytes");
  }
  if (!(seconds_per_point >= 0) || seconds_per_point > 86400) {
    return Status::InvalidArgument("seconds per point must be between 0 (no limit) and 86400");
  }
  if (backends.empty() || block_sizes.empty() || queue_depths.empty()) {
    return Status::InvalidArgument(
        "the sweep needs at least one backend, block size and "
        "queue depth");
  }
  for (BackendKind backend : backends) {
    if (backend == BackendKind::kMemory) {
      return Status::InvalidArgument(
          "the memory backend does not touch the disk; bench uring, "
          "aio, posix or auto");
    }
  }
  for (uint32_t block : block_sizes) {
    if (block < kMinBlock || block > kMaxBlock || block % kAlignment != 0) {
      return Status::InvalidArgument(
          "block size must be a multiple of 4 KiB from 4 KiB to "
          "64 MiB, got " +
          std::to_string(block) + " bytes");
    }
    if (block > size_bytes) {
      return Status::InvalidArgument("size " + FormatByteSize(size_bytes) +
                                     " is smaller than the block size " + FormatByteSize(block));
    }
  }
  for (uint32_t depth : queue_depths) {
    MEMPLAN_RETURN_IF_ERROR(BackendOptionsFor(depth).Validate());
  }
  if (threads.empty()) return Status::InvalidArgument("the sweep needs at least one thread count");
  for (uint32_t t : threads) {
    IoEngineOptions engine_options;
    engine_options.threads = t;
    MEMPLAN_RETURN_IF_ERROR(engine_options.Validate());
  }
  if (chunk_bytes == 0) return Status::InvalidArgument("chunk size must be positive");
  return Status::Ok();
}

Result<NvmeBenchReport> RunNvmeBench(const NvmeBenchOptions& options,
                                     const NvmeBenchProgressFn& progress) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  const bool existing_file = !options.file.empty();
  if (existing_file) {
    MEMPLAN_RETURN_IF_ERROR(CheckFile(options.file, options.size_bytes));
  } else {
    MEMPLAN_RETURN_IF_ERROR(CheckDirectory(options.directory, options.size_bytes));
  }
  const std::string& where = existing_file ? options.file : options.directory;

  NvmeBenchReport report;
  report.directory = options.directory;
  report.file = options.file;
  report.filesystem = FilesystemName(where);
  report.rw = options.rw;
  report.size_bytes = options.size_bytes;
  MEMPLAN_ASSIGN_OR_RETURN(const std::vector<BackendKind> backends,
                           ProbeBackends(options, progress, &report));
  uint64_t buffer_bytes = 0;
  const std::vector<Planned> plan = PlanPoints(options, backends, &buffer_bytes);
  report.points_planned = plan.size();

  MEMPLAN_ASSIGN_OR_RETURN(AlignedBuffer buffer, AllocateBuffer(buffer_bytes));
  BenchFile bench_file;
  MEMPLAN_RETURN_IF_ERROR(OpenBenchFile(options, &bench_file));
  AddMethodNotes(options, backends, bench_file, where, &report);
  Sweep sweep;
  sweep.buffer = buffer.get();
  sweep.buffer_bytes = buffer_bytes;
  MEMPLAN_RETURN_IF_ERROR(PrepareBenchFile(options, backends.front(), bench_file, plan.size(),
                                           progress, &sweep, &report));
  if (report.interrupted) return report;

  for (const Planned& point : plan) {
    if (StopRequested(options.stop)) {
      report.interrupted = true;
      break;
    }
    const std::string name =
        PointName(point.backend, point.block_size, point.queue_depth, point.threads);
    MEMPLAN_ASSIGN_OR_RETURN(const std::optional<NvmeBenchResult> result,
                             MeasurePoint(options, point, bench_file, name, &sweep));
    if (!result) {
      report.interrupted = true;
      break;
    }
    report.results.push_back(*result);
    ReportProgress(progress,
                   {"point", report.results.size(), plan.size(), &report.results.back(), name});
  }
  Summarize(options, &report);
  return report;
}

const NvmeBenchResult* AioChoice(const NvmeBenchReport& report) {
  int index = report.best_aio >= 0 ? report.best_aio : report.best;
  return index >= 0 ? &report.results[static_cast<size_t>(index)] : nullptr;
}

nlohmann::ordered_json AioConfig(const NvmeBenchResult& result) {
  nlohmann::ordered_json aio;
  aio["block_size"] = result.block_size;
  aio["queue_depth"] = result.queue_depth;
  aio["intra_op_parallelism"] = result.threads;
  aio["single_submit"] = false;
  aio["overlap_events"] = true;
  aio["use_gds"] = false;
  nlohmann::ordered_json out;
  out["aio"] = std::move(aio);
  return out;
}

std::string AioConfigText(const NvmeBenchResult& result) {
  return AioConfig(result).dump(2) + "\n";
}

nlohmann::ordered_json ToJson(const NvmeBenchResult& result) {
  nlohmann::ordered_json out;
  out["backend"] = BackendKindName(result.backend);
  out["direct"] = result.direct;
  out["block_size"] = result.block_size;
  out["queue_depth"] = result.queue_depth;
  out["threads"] = result.threads;
  out["size_bytes"] = result.size_bytes;
  out["read_bytes_per_s"] =
      result.read_measured ? nlohmann::ordered_json(result.read_bytes_per_s()) : nullptr;
  out["write_bytes_per_s"] =
      result.write_measured ? nlohmann::ordered_json(result.write_bytes_per_s()) : nullptr;
  out["read_bytes"] = result.read_bytes;
  out["write_bytes"] = result.write_bytes;
  out["read_seconds"] = result.read_seconds;
  out["write_seconds"] = result.write_seconds;
  out["time_limited"] = result.time_limited();
  return out;
}

nlohmann::ordered_json ToJson(const NvmeBenchReport& report) {
  nlohmann::ordered_json out;
  out["path"] = report.file.empty() ? report.directory : report.file;
  out["filesystem"] = report.filesystem;
  out["rw"] = BenchRwName(report.rw);
  out["size_bytes"] = report.size_bytes;
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const NvmeBenchResult& result : report.results) results.push_back(ToJson(result));
  out["results"] = std::move(results);
  out["best"] = report.best >= 0 ? ToJson(report.results[static_cast<size_t>(report.best)])
                                 : nlohmann::ordered_json(nullptr);
  const NvmeBenchResult* aio = AioChoice(report);
  out["aio"] = aio != nullptr ? AioConfig(*aio)["aio"] : nlohmann::ordered_json(nullptr);
  out["note"] = Join(report.notes, "; ");
  out["interrupted"] = report.interrupted;
  return out;
}

std::string FormatNvmeBenchText(const NvmeBenchReport& report) {
  std::string out;
  char line[256];
  bool direct = !report.results.empty() && report.results.front().direct;
  // Built, not printed into `line`: a path may be longer than any fixed buffer.
  out +=
      "NVMe bench: " + (report.file.empty() ? report.directory : report.file + ", existing file") +
      " (" + report.filesystem + "), " + (direct ? "O_DIRECT" : "buffered") + ", sequential " +
      (report.rw == BenchRw::kBoth ? std::string("write then read")
                                   : std::string(BenchRwName(report.rw))) +
      " of " + FormatByteSize(report.size_bytes) + " per point\n";
  std::snprintf(line, sizeof(line), "%-8s %10s %12s %8s %12s %12s\n", "backend", "block_size",
                "queue_depth", "threads", "write MB/s", "read MB/s");
  out += line;
  for (const NvmeBenchResult& r : report.results) {
    std::snprintf(line, sizeof(line), "%-8s %10s %12u %8u %12s %12s%s\n",
                  std::string(BackendKindName(r.backend)).c_str(),
                  FormatByteSize(r.block_size).c_str(), r.queue_depth, r.threads,
                  MegabytesPerSecond(r.write_measured, r.write_bytes_per_s()).c_str(),
                  MegabytesPerSecond(r.read_measured, r.read_bytes_per_s()).c_str(),
                  r.time_limited() ? " *" : "");
    out += line;
  }
  if (report.best >= 0) {
    const NvmeBenchResult& b = report.results[static_cast<size_t>(report.best)];
    std::snprintf(line, sizeof(line),
                  "Best (read + write): %s, block_size %s, queue_depth %u, threads %u: write %s "
                  "MB/s, read %s MB/s\n",
                  std::string(BackendKindName(b.backend)).c_str(),
                  FormatByteSize(b.block_size).c_str(), b.queue_depth, b.threads,
                  MegabytesPerSecond(b.write_measured, b.write_bytes_per_s()).c_str(),
                  MegabytesPerSecond(b.read_measured, b.read_bytes_per_s()).c_str());
    out += line;
  }
  if (const NvmeBenchResult* aio = AioChoice(report)) {
    out += "DeepSpeed aio block:\n" + AioConfigText(*aio);
  }
  if (!report.notes.empty()) {
    out += "Notes:\n";
    for (const auto& note : report.notes) out += "  - " + note + "\n";
  }
  return out;
}

}  // namespace memplan::bench
