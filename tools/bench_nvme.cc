// `memplan bench nvme`: the bandwidth of a directory's drive through memplan's own I/O path, over
// the block size x queue depth x backend sweep DeepSpeed's ds_nvme_tune runs, and the DeepSpeed
// `aio` block for the best settings. The measuring is bench/nvme_bench.h; this file parses flags,
// prints progress and routes SIGINT/SIGTERM to a clean stop (tools/signals.h: a bench file made in
// --path is always removed; a --file is always kept).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/byte_size.h"
#include "common/json.h"
#include "bench/nvme_bench.h"
#include "nvme/backend_names.h"
#include "tools/commands.h"
#include "tools/signals.h"

namespace memplan::tools {
namespace {

struct BenchFlags {
  std::string path;
  std::string file;
  std::string size = "1G";
  std::string block_size;               // empty: swept
  uint32_t queue_depth = 0;             // 0: swept
  std::string backend;                  // empty: swept
  std::vector<uint32_t> threads = {1};  // intra_op_parallelism values swept
  std::string rw = "both";
  bool direct = false;  // --direct: the default, accepted for explicitness
  bool no_direct = false;
  double seconds_per_point = 2.0;
  std::string format = "text";
  std::string emit_aio;
  bool progress = false;
};

// The options for RunNvmeBench, or the flag at fault.
Result<bench::NvmeBenchOptions> ToOptions(const BenchFlags& flags, const std::atomic<bool>* stop) {
  bench::NvmeBenchOptions options;
  if (flags.path.empty() == flags.file.empty()) {
    return Status::InvalidArgument(
        "give exactly one of --path DIR (a temporary bench file is made there) or --file FILE "
        "(an existing file to bench on)");
  }
  options.directory = flags.path;
  options.file = flags.file;
  auto size = ParseByteSize(flags.size, "--size");
  if (!size.ok()) return size.status();
  options.size_bytes = *size;
  MEMPLAN_ASSIGN_OR_RETURN(options.rw, bench::ParseBenchRw(flags.rw));
  options.direct = !flags.no_direct;
  options.seconds_per_point = flags.seconds_per_point;
  options.stop = stop;
  // Naming any of the three runs one configuration; the others take these defaults.
  bool single = !flags.block_size.empty() || flags.queue_depth != 0 || !flags.backend.empty();
  if (single) {
    options.backends = {nvme::BackendKind::kAuto};
    options.block_sizes = {1u << 20};
    options.queue_depths = {32};
  }
  if (!flags.block_size.empty()) {
    auto block = ParseByteSize(flags.block_size, "--block-size");
    if (!block.ok()) return block.status();
    if (*block > UINT32_MAX) {
      return Status::InvalidArgument("--block-size: " + flags.block_size + " is too large");
    }
    options.block_sizes = {static_cast<uint32_t>(*block)};
  }
  if (flags.queue_depth != 0) options.queue_depths = {flags.queue_depth};
  options.threads = flags.threads;
  if (!flags.backend.empty()) {
    auto kind = nvme::ParseBackendKind(flags.backend);
    if (!kind.ok()) return kind.status().WithPrefix("--backend");
    options.backends = {*kind};
  }
  Status valid = options.Validate();
  if (!valid.ok()) return valid;
  if (!flags.emit_aio.empty()) {
    // Found out now, not after a sweep of minutes.
    std::filesystem::path parent = std::filesystem::path(flags.emit_aio).parent_path();
    std::error_code error;
    if (!parent.empty() && !std::filesystem::is_directory(parent, error)) {
      return Status::InvalidArgument("--emit-aio " + flags.emit_aio + ": no directory " +
                                     parent.string());
    }
  }
  return options;
}

std::string MegabytesPerSecond(bool measured, double bytes_per_s) {
  if (!measured) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", bytes_per_s / 1e6);
  return text;
}

// One line per configuration on stderr.
void PrintProgress(const bench::NvmeBenchProgress& event) {
  if (event.stage == "point" && event.result != nullptr) {
    const bench::NvmeBenchResult& r = *event.result;
    int width = std::snprintf(nullptr, 0, "%zu", event.total);
    std::fprintf(stderr,
                 "[%*zu/%zu] %-5s block %-7s qd %-4u threads %-2u write %9s MB/s  read %9s "
                 "MB/s%s\n",
                 width, event.index, event.total,
                 std::string(nvme::BackendKindName(r.backend)).c_str(),
                 FormatByteSize(r.block_size).c_str(), r.queue_depth, r.threads,
                 MegabytesPerSecond(r.write_measured, r.write_bytes_per_s()).c_str(),
                 MegabytesPerSecond(r.read_measured, r.read_bytes_per_s()).c_str(),
                 r.time_limited() ? " (time limit)" : "");
  } else {
    std::fprintf(stderr, "%s\n", event.message.c_str());
  }
  std::fflush(stderr);
}

// The flags of `memplan bench nvme`, into `flags`.
void AddBenchNvmeFlags(CLI::App* cmd, BenchFlags* flags) {
  CLI::Option* path = cmd->add_option(
      "-p,--path", flags->path,
      "Directory on the drive to measure; a temporary bench file (--size bytes) is created there "
      "and always removed. Give --path or --file");
  cmd->add_option("--file", flags->file,
                  "Existing regular file (not a symlink) of at least --size bytes to bench on "
                  "instead of a temporary one in --path, e.g. one fio laid out, to measure the "
                  "same blocks: its contents are overwritten (the first --size bytes, unless "
                  "--rw read); it is not created, preallocated, truncated or removed")
      ->excludes(path);
  cmd->add_option("-s,--size", flags->size,
                  "Bytes written then read per configuration: a number with an optional K, M, G, "
                  "T or KiB, MiB, GiB, TiB (powers of 1024); a multiple of 4 KiB")
      ->capture_default_str();
  cmd->add_option("--seconds-per-point", flags->seconds_per_point,
                  "Stop each direction of a configuration after this many seconds even if --size "
                  "bytes are not done (0: no limit)")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  cmd->add_option("-b,--block-size", flags->block_size,
                  "Bytes per request (e.g. 1M; DeepSpeed's aio block_size). Naming --block-size, "
                  "--queue-depth or --backend runs one configuration; the others default to 1M, "
                  "32 and auto. Default: sweep 128K, 1M, 8M");
  cmd->add_option("-q,--queue-depth", flags->queue_depth,
                  "Requests in flight (DeepSpeed's aio queue_depth). Default: sweep 16, 32, 128")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("-t,--threads", flags->threads,
                  "I/O threads one transfer is split across, each with its own io_uring ring or "
                  "libaio context (DeepSpeed's aio intra_op_parallelism); several values sweep "
                  "them, e.g. --threads 1,2,4")
      ->delimiter(',')
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--backend", flags->backend,
                  "I/O backend: " + nvme::BackendFlagChoices(/*described=*/true) +
                      ". Default: sweep every one available")
      ->check(CLI::IsMember(nvme::BackendFlagValues()));
  cmd->add_option("--rw", flags->rw, "Directions to measure: read, write or both")
      ->check(CLI::IsMember({"read", "write", "both"}))
      ->capture_default_str();
  CLI::Option* direct = cmd->add_flag(
      "--direct", flags->direct,
      "O_DIRECT, bypassing the page cache (the default; where the filesystem refuses it, "
      "buffered I/O is measured and a note says so)");
  cmd->add_flag("--no-direct", flags->no_direct,
                "Buffered I/O through the page cache (timed to fdatasync; the cache is dropped "
                "before reads)")
      ->excludes(direct);
  AddFormatOption(cmd, &flags->format, "Output format: text (a table) or json");
  cmd->add_option("--emit-aio", flags->emit_aio,
                  "Write DeepSpeed's `aio` config block for the best settings to this file "
                  "(atomically; the best libaio settings when libaio was measured)");
  cmd->add_flag("--progress", flags->progress,
                "One line per configuration on stderr even when stderr is not a terminal");
}

// The command's run: the sweep the flags ask for, its report on stdout (and the `aio` block in
// --emit-aio); a clean stop on SIGINT/SIGTERM.
void RunBenchNvme(const BenchFlags& flags, Outcome* outcome) {
  StopScope stop;
  auto options = ToOptions(flags, stop.flag());
  if (!options.ok()) return Fail(outcome, options.status());
  bench::NvmeBenchProgressFn progress;
  if (flags.progress || ::isatty(STDERR_FILENO) == 1) progress = PrintProgress;
  Result<bench::NvmeBenchReport> report = bench::RunNvmeBench(*options, progress);
  if (stop.stopped()) {
    outcome->exit_code = stop.ExitCode();
    outcome->error = flags.file.empty() ? "interrupted; the bench file was removed"
                                        : "interrupted; " + flags.file + " was kept";
    return;
  }
  if (!report.ok()) return Fail(outcome, report.status());
  if (!flags.emit_aio.empty()) {
    const bench::NvmeBenchResult* choice = bench::AioChoice(*report);
    if (choice == nullptr) {
      return Fail(outcome, Status::Internal("no configuration was measured"));
    }
    outcome->files.push_back({flags.emit_aio, bench::AioConfigText(*choice)});
  }
  outcome->stdout_text = flags.format == "json" ? JsonOutput(bench::ToJson(*report))
                                                : bench::FormatNvmeBenchText(*report);
}

}  // namespace

void RegisterBenchNvme(CLI::App* bench, Outcome* outcome) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* cmd = bench->add_subcommand(
      "nvme",
      "Sequential write and read bandwidth of the drive under --path (or holding --file) through "
      "memplan's I/O engine, over block size x queue depth x backend (DeepSpeed's ds_nvme_tune "
      "sweep in bounded time), and the DeepSpeed `aio` block for the best settings");
  AddBenchNvmeFlags(cmd, flags.get());
  cmd->footer(
      "\nExamples:\n"
      "  memplan bench nvme --path /mnt/nvme --emit-aio aio.json\n"
      "  memplan bench nvme --path /mnt/nvme --backend uring --block-size 1M --queue-depth 16 "
      "--format json\n"
      "  memplan bench nvme --file /mnt/nvme/fio.dat --size 1G --backend aio --block-size 1M "
      "--queue-depth 16\n"
      "  memplan bench nvme --path /mnt/raid0 --backend uring --block-size 1M --queue-depth 16 "
      "--threads 1,2,4\n"
      "\nExit status: 0 on success, 2 on bad input or a failed measurement (one line on stderr), "
      "130 on SIGINT and 143 on SIGTERM (a bench file made in --path is removed either way; a "
      "--file is kept).");
  cmd->callback([flags, outcome] { RunBenchNvme(*flags, outcome); });
}

}  // namespace memplan::tools
