// `memplan bench swap`: the NVMe optimizer step (OptimizerSwapper) against its limits, I/O time at
// the drive's bandwidth and the optimizer's compute time, measured in one run. The measuring is
// bench/swap_bench.h; this file parses flags and formats.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/file.h"
#include "common/byte_size.h"
#include "common/json.h"
#include "bench/nvme_bench.h"
#include "bench/swap_bench.h"
#include "nvme/backend_names.h"
#include "planner/cluster.h"
#include "tools/commands.h"
#include "tools/signals.h"

namespace memplan::tools {
namespace {

struct SwapFlags {
  std::string path;
  uint64_t params = uint64_t{64} << 20;
  uint64_t sub_group = uint64_t{4} << 20;
  uint32_t buffers = 3;
  int threads = 1;
  int steps = 3;
  std::string backend = "auto";
  std::string block_size = "1M";
  uint32_t queue_depth = 32;
  uint32_t io_threads = 1;
  std::string grad_dtype = "fp32";
  bool no_fixed_buffers = false;
  bool no_direct = false;
  std::string nvme_json;
  std::string format = "text";
};

// Bandwidths from a `memplan bench nvme --format json` report: its "best" point, both directions.
Status ReadNvmeJson(const std::string& path, bench::SwapBenchOptions* options) {
  MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, 64 << 20));
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json doc, ParseJson(text, path));
  MEMPLAN_ASSIGN_OR_RETURN(planner::NvmeBenchReading reading,
                           planner::NvmeBenchFromJson(doc, path));
  if (!(reading.read_bytes_per_s > 0) || !(reading.write_bytes_per_s > 0)) {
    return Status::InvalidArgument(path +
                                   ": the swap bench needs both best.read_bytes_per_s and "
                                   "best.write_bytes_per_s; the report measured one");
  }
  options->read_bytes_per_s = reading.read_bytes_per_s;
  options->write_bytes_per_s = reading.write_bytes_per_s;
  return Status::Ok();
}

Result<bench::SwapBenchOptions> ToOptions(const SwapFlags& flags, const std::atomic<bool>* stop) {
  MEMPLAN_RETURN_IF_ERROR(RequireDirectory(flags.path, "--path"));
  bench::SwapBenchOptions options;
  options.stop = stop;
  options.directory = flags.path;
  options.params = flags.params;
  options.sub_group_elements = flags.sub_group;
  options.buffer_count = flags.buffers;
  options.threads = flags.threads;
  options.steps = flags.steps;
  options.direct = !flags.no_direct;
  options.queue_depth = flags.queue_depth;
  options.io_threads = flags.io_threads;
  options.grad_dtype = flags.grad_dtype == "bf16"   ? offload::HalfDtype::kBf16
                       : flags.grad_dtype == "fp16" ? offload::HalfDtype::kFp16
                                                    : offload::HalfDtype::kNone;
  options.register_buffers = !flags.no_fixed_buffers;
  auto backend = nvme::ParseBackendKind(flags.backend);
  if (!backend.ok()) return backend.status().WithPrefix("--backend");
  options.backend = *backend;
  auto block = ParseByteSize(flags.block_size, "--block-size");
  if (!block.ok()) return block.status();
  if (*block > (uint64_t{64} << 20)) return Status::InvalidArgument("--block-size: at most 64M");
  options.block_size = static_cast<uint32_t>(*block);
  if (!flags.nvme_json.empty()) MEMPLAN_RETURN_IF_ERROR(ReadNvmeJson(flags.nvme_json, &options));
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  return options;
}

nlohmann::json ToJson(const bench::SwapBenchResult& r) {
  return {{"optimizer", "adamw"},
          {"params", r.params},
          {"sub_group_elements", r.sub_group_elements},
          {"sub_groups", r.sub_groups},
          {"buffer_count", r.buffer_count},
          {"threads", r.threads},
          {"io_threads", r.io_threads},
          {"grad_dtype", std::string(offload::HalfDtypeName(r.grad_dtype))},
          {"fixed_buffers", r.register_buffers},
          {"registered_ops", r.registered_ops},
          {"steps", r.steps},
          {"backend", r.backend},
          {"direct", r.direct},
          {"pinned_bytes", r.pinned_bytes},
          {"state_bytes", r.state_bytes},
          {"states_over_pinned", static_cast<double>(r.state_bytes) / r.pinned_bytes},
          {"read_bytes_per_step", r.read_bytes_per_step},
          {"write_bytes_per_step", r.write_bytes_per_step},
          {"nvme_read_bytes_per_s", r.read_bytes_per_s},
          {"nvme_write_bytes_per_s", r.write_bytes_per_s},
          {"bandwidth_measured", r.bandwidth_measured},
          {"io_seconds", r.io_seconds},
          {"compute_seconds", r.compute_seconds},
          {"step_seconds", r.step_seconds},
          {"step_seconds_min", r.step_seconds_min},
          {"ratio", r.ratio},
          {"last_step",
           {{"read_s", r.stage_read_s},
            {"write_s", r.stage_write_s},
            {"compute_s", r.stage_compute_s},
            {"compute_wait_s", r.compute_wait_s},
            {"sync_s", r.sync_s}}}};
}

std::string ToText(const bench::SwapBenchResult& r) {
  char text[1024];
  std::snprintf(
      text, sizeof(text),
      "NVMe optimizer step (AdamW): %llu params in %llu sub-groups of %llu, %u pinned buffers "
      "(%.1f MiB), %d thread(s), %u I/O thread(s), backend %s%s\n"
      "  states on NVMe  %.1f MiB (%.1fx the pinned buffers)\n"
      "  per step        read %.1f MiB, write %.1f MiB\n"
      "  drive           read %.3g B/s, write %.3g B/s (%s)\n"
      "  I/O time        %.3f s   (bytes / bandwidth)\n"
      "  compute time    %.3f s   (the same AdamW in memory)\n"
      "  step time       %.3f s   (mean of %d; best %.3f s)\n"
      "  step / max(I/O, compute) = %.3f\n",
      static_cast<unsigned long long>(r.params), static_cast<unsigned long long>(r.sub_groups),
      static_cast<unsigned long long>(r.sub_group_elements), r.buffer_count,
      r.pinned_bytes / 1048576.0, r.threads, r.io_threads, r.backend.c_str(),
      r.direct ? ", O_DIRECT" : "", r.state_bytes / 1048576.0,
      static_cast<double>(r.state_bytes) / r.pinned_bytes, r.read_bytes_per_step / 1048576.0,
      r.write_bytes_per_step / 1048576.0, r.read_bytes_per_s, r.write_bytes_per_s,
      r.bandwidth_measured ? "measured here" : "given", r.io_seconds, r.compute_seconds,
      r.step_seconds, r.steps, r.step_seconds_min, r.ratio);
  return text;
}

}  // namespace

void RegisterBenchSwap(CLI::App* bench, Outcome* outcome) {
  auto flags = std::make_shared<SwapFlags>();
  CLI::App* cmd = bench->add_subcommand(
      "swap",
      "The NVMe optimizer step: AdamW over fp32 weights and states kept on the drive under "
      "--path, pipelined through pinned buffers (read i+1 | step i | write i-1), timed against "
      "its limits measured in the same run: I/O time at the drive's bandwidth and the same AdamW "
      "in memory");
  cmd->add_option("-p,--path", flags->path,
                  "Existing directory on the drive; a temporary store is made there and removed")
      ->required();
  cmd->add_option("-n,--params", flags->params, "Parameters in the partition")
      ->check(CLI::Range(uint64_t{1024}, uint64_t{1} << 36))
      ->capture_default_str();
  cmd->add_option("--sub-group", flags->sub_group,
                  "Elements per sub-group (a multiple of 1024; DeepSpeed's sub_group_size)")
      ->capture_default_str();
  cmd->add_option("--buffers", flags->buffers, "Pinned buffers in the pipeline (>= 2)")
      ->check(CLI::Range(2, 64))
      ->capture_default_str();
  cmd->add_option("-t,--threads", flags->threads, "CPU optimizer threads")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--steps", flags->steps, "Timed steps, after one warm-up")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--backend", flags->backend,
                  "I/O backend: " + nvme::BackendFlagChoices(/*described=*/false))
      ->check(CLI::IsMember(nvme::BackendFlagValues()))
      ->capture_default_str();
  cmd->add_option("-b,--block-size", flags->block_size, "Bytes per I/O request")
      ->capture_default_str();
  cmd->add_option("-q,--queue-depth", flags->queue_depth, "Requests in flight")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--io-threads", flags->io_threads,
                  "Threads each I/O transfer is split across (DeepSpeed's intra_op_parallelism)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--grad-dtype", flags->grad_dtype,
                  "Gradients as fp32, or bf16 / fp16 stepped by the fused kernel (2 bytes a "
                  "gradient stored and read)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  cmd->add_flag("--no-fixed-buffers", flags->no_fixed_buffers,
                "Do not register the pinned buffers with io_uring (to measure what it gains)");
  cmd->add_flag("--no-direct", flags->no_direct, "Buffered I/O instead of O_DIRECT");
  cmd->add_option("--nvme-json", flags->nvme_json,
                  "Take the drive's bandwidth from this `memplan bench nvme --format json` "
                  "report (its best point) instead of measuring it");
  AddFormatOption(cmd, &flags->format, "Output format: text or json");
  cmd->footer(
      "\nExamples:\n"
      "  memplan bench swap --path /mnt/nvme --threads 2\n"
      "  memplan bench nvme --path /mnt/nvme --backend uring --block-size 1M --queue-depth 32 "
      "--format json > nvme.json\n"
      "  memplan bench swap --path /mnt/nvme --nvme-json nvme.json --format json\n"
      "\nExit status: 0 on success, 2 on bad input or a failed measurement (one line on "
      "stderr), 130 on SIGINT and 143 on SIGTERM. The temporary store is removed either way.");
  cmd->callback([flags, outcome] {
    StopScope stop;
    auto options = ToOptions(*flags, stop.flag());
    if (!options.ok()) return Fail(outcome, options.status());
    auto result = bench::RunSwapBench(*options);
    if (stop.stopped()) {
      outcome->exit_code = stop.ExitCode();
      outcome->error = "interrupted; the temporary store was removed";
      return;
    }
    if (!result.ok()) return Fail(outcome, result.status());
    outcome->stdout_text = flags->format == "json" ? JsonOutput(ToJson(*result)) : ToText(*result);
  });
}

}  // namespace memplan::tools
