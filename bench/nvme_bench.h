// nvme bench: measures sequential write and read bandwidth of a directory's device through the
// IoEngine, over a sweep of block size x queue depth x backend (what DeepSpeed's `ds_nvme_tune`
// sweeps, in bounded time), and picks the settings for DeepSpeed's `aio` config block.
//
// Method (see Note [Bench method] in nvme_bench.cc):
//   - One bench file of `size_bytes` is created inside `directory` with a unique name (O_EXCL,
//     0600, O_DIRECT unless refused), preallocated, and written in full once before anything is
//     measured, so every measured read returns real data (never a hole) and every measured write
//     overwrites allocated blocks, as the offload engine's swap files do. The file is removed when
//     RunNvmeBench returns, whatever happened (error, or `stop` raised by a signal handler).
//   - Or, with `file` instead of `directory`, an existing regular file of at least `size_bytes`
//     (one fio laid out, say, so both tools measure the same blocks) is used as it is: not
//     created, preallocated, filled, truncated or removed. Its first `size_bytes` are overwritten
//     by the write passes; its length never changes.
//   - Per point: fresh Backends (queue depth = the point's; one per I/O thread) and an IoEngine
//     (block size and threads = the point's: with T threads each call is split across T threads,
//     DeepSpeed's intra_op_parallelism). One thread writes `size_bytes` sequentially then
//     fdatasyncs, then reads them back sequentially, through IoEngine::Write/Read on large chunks
//     (at least block x queue depth, up to `chunk_bytes`), so the engine keeps the queue full. Each
//     direction is timed separately (wall time of the transfer loop) and stops early at
//     `seconds_per_point`.
//   - The best point maximises read + write bandwidth (as DeepSpeed's ds_nvme_tune does).
//
// Nothing here prints: progress goes through a callback, results come back as plain structs.
// Thread safety: RunNvmeBench may run on any thread; the progress callback runs on the calling
// thread. `stop` may be set from any thread or a signal handler.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "nvme/backend.h"

namespace memplan::bench {

enum class BenchRw { kRead, kWrite, kBoth };
std::string_view BenchRwName(BenchRw rw);  // "read", "write", "both"
Result<BenchRw> ParseBenchRw(std::string_view text);

// The sweep ds_nvme_tune runs (block {1M, 8M} x queue depth {32, 128}), plus 128 KiB blocks and
// queue depth 16 for devices that peak early.
inline const std::vector<uint32_t> kBenchBlockSizes = {128u << 10, 1u << 20, 8u << 20};
inline const std::vector<uint32_t> kBenchQueueDepths = {16, 32, 128};
// The backends a sweep tries, in this order; those this build or kernel lacks are skipped.
inline const std::vector<nvme::BackendKind> kBenchBackends = {
    nvme::BackendKind::kUring, nvme::BackendKind::kAio, nvme::BackendKind::kPosix};

struct NvmeBenchOptions {
  // Exactly one of these two: `directory`, where a temporary bench file is made (must exist), or
  // `file`, an existing regular file (not a symlink) of at least `size_bytes` to bench on instead.
  std::string directory;
  std::string file;
  uint64_t size_bytes = uint64_t{1} << 30;  // bytes per direction per point; multiple of 4 KiB
  double seconds_per_point = 2.0;           // per direction; 0: no limit (always `size_bytes`)
  BenchRw rw = BenchRw::kBoth;
  bool direct = true;  // O_DIRECT; buffered when the filesystem refuses it
  // The sweep: every backend x block size x queue depth. kAuto probes as CreateBackend does.
  std::vector<nvme::BackendKind> backends = kBenchBackends;
  std::vector<uint32_t> block_sizes = kBenchBlockSizes;    // multiples of 4 KiB, 4 KiB..64 MiB
  std::vector<uint32_t> queue_depths = kBenchQueueDepths;  // 1..4096
  // I/O threads one call is split across (DeepSpeed's intra_op_parallelism), 1..64; each value
  // is a point of its own (for the posix backend too, whose worker pool then serves T callers).
  std::vector<uint32_t> threads = {1};
  // Most bytes one IoEngine call transfers, and so the I/O buffer's size (never more than
  // size_bytes; never less than block x queue depth, or the queue could not fill). Larger calls
  // drain the queue less often: see Note [Chunk sizes] in nvme_bench.cc.
  uint64_t chunk_bytes = uint64_t{1} << 30;
  // When set (by a signal handler, say), RunNvmeBench stops between chunks and returns what it has,
  // with NvmeBenchReport::interrupted set. Not owned.
  const std::atomic<bool>* stop = nullptr;

  // Checks the values above (not the directory or file on disk): InvalidArgument naming the
  // option.
  Status Validate() const;
};

// One measured configuration. A direction not measured has `*_bytes` 0 and `*_seconds` 0.
struct NvmeBenchResult {
  nvme::BackendKind backend = nvme::BackendKind::kAuto;  // the backend used (never kAuto)
  bool direct = false;                                   // O_DIRECT was in effect
  uint32_t block_size = 0;
  uint32_t queue_depth = 0;
  uint32_t threads = 1;      // intra_op_parallelism
  uint64_t size_bytes = 0;   // requested bytes per direction (NvmeBenchOptions::size_bytes)
  uint64_t chunk_bytes = 0;  // the largest IoEngine call made
  bool write_measured = false;
  uint64_t write_bytes = 0;  // bytes written in the timed loop (< size_bytes: time limit hit)
  double write_seconds = 0;  // the loop plus the final fdatasync
  bool read_measured = false;
  uint64_t read_bytes = 0;
  double read_seconds = 0;

  double write_bytes_per_s() const { return write_seconds > 0 ? write_bytes / write_seconds : 0; }
  double read_bytes_per_s() const { return read_seconds > 0 ? read_bytes / read_seconds : 0; }
  // What "best" maximises: read + write bandwidth (the directions measured).
  double score() const { return read_bytes_per_s() + write_bytes_per_s(); }
  bool time_limited() const {
    return (write_measured && write_bytes < size_bytes) ||
           (read_measured && read_bytes < size_bytes);
  }
};

struct NvmeBenchReport {
  std::string directory;   // NvmeBenchOptions::directory (empty with `file`)
  std::string file;        // NvmeBenchOptions::file (empty with `directory`)
  std::string filesystem;  // "ext4", "xfs", "tmpfs", ... or "unknown (0x...)"
  BenchRw rw = BenchRw::kBoth;
  uint64_t size_bytes = 0;
  std::vector<NvmeBenchResult> results;  // in the order run
  int best = -1;                         // index into results of the highest score(); -1 when none
  int best_aio = -1;  // the best libaio point: what DeepSpeed (libaio only) should use; -1: none
  std::vector<std::string> notes;  // backend choices, fallbacks, time limits: for the user
  bool interrupted = false;        // `stop` was raised; results holds the points completed
  size_t points_planned = 0;
};

// Progress: called before the file is filled or, with NvmeBenchOptions::file, used ("prepare",
// result null) and after each point
// ("point", with its result) or each backend skipped ("skip", message says why).
struct NvmeBenchProgress {
  std::string_view stage;  // "prepare", "point", "skip"
  size_t index = 0;        // points done so far, including this one
  size_t total = 0;        // points planned
  const NvmeBenchResult* result = nullptr;
  std::string message;
};
using NvmeBenchProgressFn = std::function<void(const NvmeBenchProgress&)>;

// Runs the sweep. Fails (file removed) when the options are invalid (InvalidArgument), the
// directory is missing or not a directory (NotFound / InvalidArgument naming it), its filesystem
// has less than `size_bytes` free (ResourceExhausted), no backend of the sweep can be set up, an
// explicitly named backend cannot be set up, or an I/O error occurs (the engine's Status).
// With `file`: fails when it is missing (NotFound), a symlink, not a regular file, or smaller
// than `size_bytes` (InvalidArgument naming it and both sizes); it is kept whatever happens.
// Backends of a multi-backend sweep that are unavailable are skipped with a note.
Result<NvmeBenchReport> RunNvmeBench(const NvmeBenchOptions& options,
                                     const NvmeBenchProgressFn& progress = {});

// DeepSpeed's `aio` block for `result`: {"aio": {"block_size", "queue_depth",
// "intra_op_parallelism" (the result's threads), "single_submit": false, "overlap_events": true,
// "use_gds": false}} in that key order.
nlohmann::ordered_json AioConfig(const NvmeBenchResult& result);
// AioConfig as the text --emit-aio writes: two-space indented, trailing newline.
std::string AioConfigText(const NvmeBenchResult& result);

// The result as {"backend", "direct", "block_size", "queue_depth", "threads", "size_bytes",
// "read_bytes_per_s", "write_bytes_per_s", "read_bytes", "write_bytes", "read_seconds",
// "write_seconds", "time_limited"}; a direction not measured has null bytes_per_s.
nlohmann::ordered_json ToJson(const NvmeBenchResult& result);
// {"path", "filesystem", "rw", "size_bytes", "results": [...], "best": {...} or null,
//  "aio": {...} (the block --emit-aio writes) or null, "note": "...", "interrupted"}; "path" is
// the directory, or the file with NvmeBenchOptions::file.
nlohmann::ordered_json ToJson(const NvmeBenchReport& report);
// A table for people: one row per point, the best settings, the aio block and the notes.
std::string FormatNvmeBenchText(const NvmeBenchReport& report);

// The result whose settings --emit-aio writes: the best libaio point when libaio was measured
// (DeepSpeed's engine is libaio), else the overall best; null when there are no results.
const NvmeBenchResult* AioChoice(const NvmeBenchReport& report);

}  // namespace memplan::bench
