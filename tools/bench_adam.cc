// `memplan bench adam`: throughput of memplan's CPU AdamW step on this machine, in parameters and
// bytes per second. The measuring is bench/adam_bench.h; this file parses flags and formats.
// bench/adam_vs_torch.py compares the figure with torch.optim.AdamW and a STREAM triad.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/adam_bench.h"
#include "tools/commands.h"

namespace memplan::tools {
namespace {

struct AdamFlags {
  uint64_t params = 50'000'000;
  int threads = 1;
  std::string param_dtype = "fp32";
  std::string isa = "auto";
  double seconds = 2.0;
  std::string format = "text";
  bool triad = false;
};

Result<bench::AdamBenchOptions> ToOptions(const AdamFlags& flags) {
  bench::AdamBenchOptions options;
  options.params = flags.params;
  options.threads = flags.threads;
  options.seconds = flags.seconds;
  if (flags.param_dtype == "bf16") {
    options.half_dtype = offload::HalfDtype::kBf16;
  } else if (flags.param_dtype == "fp16") {
    options.half_dtype = offload::HalfDtype::kFp16;
  }
  if (flags.isa != "auto") {
    auto isa = offload::ParseIsa(flags.isa);
    if (!isa.ok()) return isa.status().WithPrefix("--isa");
    options.isa = *isa;
  }
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  return options;
}

nlohmann::json ToJson(const bench::AdamBenchResult& r) {
  return {{"optimizer", "adamw"},
          {"isa", std::string(offload::IsaName(r.isa))},
          {"threads", r.threads},
          {"params", r.params},
          {"param_dtype", std::string(offload::HalfDtypeName(r.half_dtype))},
          {"steps", r.steps},
          {"seconds", r.seconds},
          {"bytes_per_param", r.bytes_per_step / r.params},
          {"params_per_s", r.params_per_s},
          {"bytes_per_s", r.bytes_per_s}};
}

nlohmann::json TriadJson(const bench::TriadBenchResult& t, double adam_bytes_per_s) {
  return {{"elements", t.elements},
          {"threads", t.threads},
          {"repeats", t.repeats},
          {"bytes_per_element", 24},
          {"best_bytes_per_s", t.best_bytes_per_s},
          {"mean_bytes_per_s", t.mean_bytes_per_s},
          {"adam_fraction_of_best", adam_bytes_per_s / t.best_bytes_per_s}};
}

std::string TriadText(const bench::TriadBenchResult& t, double adam_bytes_per_s) {
  char text[512];
  std::snprintf(text, sizeof(text),
                "STREAM triad (fp64, %llu elements, %d thread(s), best of %d)\n"
                "  best_bytes_per_s  %.4g   mean %.4g  (24 bytes per element)\n"
                "  AdamW bytes_per_s is %.1f%% of the triad's best\n",
                static_cast<unsigned long long>(t.elements), t.threads, t.repeats,
                t.best_bytes_per_s, t.mean_bytes_per_s,
                100.0 * adam_bytes_per_s / t.best_bytes_per_s);
  return text;
}

std::string ToText(const bench::AdamBenchResult& r) {
  char text[512];
  std::snprintf(text, sizeof(text),
                "CPU AdamW: %llu params, %d thread(s), isa %s, params also "
                "written as %s\n"
                "  %d steps in %.3f s\n"
                "  params_per_s  %.4g\n"
                "  bytes_per_s   %.4g  (%llu bytes per param)\n",
                static_cast<unsigned long long>(r.params), r.threads,
                std::string(offload::IsaName(r.isa)).c_str(),
                std::string(offload::HalfDtypeName(r.half_dtype)).c_str(), r.steps, r.seconds,
                r.params_per_s, r.bytes_per_s,
                static_cast<unsigned long long>(r.bytes_per_step / r.params));
  return text;
}

}  // namespace

void RegisterBenchAdam(CLI::App* bench, Outcome* outcome) {
  auto flags = std::make_shared<AdamFlags>();
  CLI::App* cmd =
      bench->add_subcommand("adam",
                            "Throughput of memplan's CPU AdamW step (fp32 master weights and "
                            "states, updated in place) "
                            "in params/s and bytes/s (28 bytes per param: read p, g, m, v; "
                            "write p, m, v; +2 with a "
                            "bf16/fp16 copy)");
  cmd->add_option("-n,--params", flags->params, "Parameters per step")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 36))
      ->capture_default_str();
  cmd->add_option("-t,--threads", flags->threads, "Threads sharing the step")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--param-dtype", flags->param_dtype,
                  "fp32: update the fp32 master weights only; bf16 or fp16: "
                  "also write them as "
                  "16-bit in the same pass (the GPU's copy)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  cmd->add_option("--isa", flags->isa,
                  "Kernel: auto (the best this CPU runs), avx512, avx2, scalar")
      ->check(CLI::IsMember({"auto", "avx512", "avx2", "scalar"}))
      ->capture_default_str();
  cmd->add_option("--seconds", flags->seconds,
                  "Time the steps for about this long (at least 3 steps, after "
                  "one warm-up)")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  cmd->add_flag("--triad", flags->triad,
                "Also run a STREAM triad (compiled, same threads, as much memory as the Adam "
                "arrays) and report AdamW's bytes/s as a fraction of it: the memory roofline");
  AddFormatOption(cmd, &flags->format, "Output format: text or json");
  cmd->footer(
      "\nExamples:\n"
      "  memplan bench adam --params 50000000 --threads 2\n"
      "  memplan bench adam --params 50000000 --threads 2 "
      "--param-dtype bf16 --format json\n"
      "  memplan bench adam --params 50000000 --threads 2 --triad\n"
      "\nExit status: 0 on success, 2 on bad input or when the memory "
      "cannot be had (one line on "
      "stderr).");
  cmd->callback([flags, outcome] {
    auto options = ToOptions(*flags);
    Status status = options.status();
    if (options.ok()) {
      auto result = bench::RunAdamBench(*options);
      if (result.ok() && flags->triad) {
        bench::TriadBenchOptions triad_options;
        triad_options.threads = flags->threads;
        // The same memory footprint as the Adam arrays (16 bytes per param, 24 per element).
        triad_options.elements = std::max<uint64_t>(1024, flags->params * 16 / 24);
        auto triad = bench::RunTriadBench(triad_options);
        if (!triad.ok()) {
          status = triad.status();
        } else if (flags->format == "json") {
          nlohmann::json out = ToJson(*result);
          out["triad"] = TriadJson(*triad, result->bytes_per_s);
          outcome->stdout_text = out.dump(2) + "\n";
          return;
        } else {
          outcome->stdout_text = ToText(*result) + TriadText(*triad, result->bytes_per_s);
          return;
        }
      } else if (result.ok()) {
        outcome->stdout_text =
            flags->format == "json" ? ToJson(*result).dump(2) + "\n" : ToText(*result);
        return;
      } else {
        status = result.status();
      }
    }
    outcome->exit_code = status.code() == StatusCode::kInternal ? kExitInternal : kExitBadInput;
    outcome->error = status.message();
  });
}

}  // namespace memplan::tools
