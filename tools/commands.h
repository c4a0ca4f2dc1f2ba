// The memplan CLI's subcommands: thin layers over the library. This is the only layer that prints
// to the terminal or chooses an exit code.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/status.h"
#include "estimator/model_source.h"
#include "tools/setup_flags.h"

namespace memplan::tools {

// Exit codes: 0 success, 2 bad input or usage (file, field, flag), a failed write (stdout or an
// output file) or an unexpected exception, 1 an internal error (and `check`'s "problems found"),
// 128 + N when stopped by signal N (130 SIGINT, 143 SIGTERM).
constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitBadInput = 2;

// A file a subcommand asks for (-o, --emit-*, --svg): written by the driver (tools/cli.cc) after
// the command succeeds, with every other file of the run, all or nothing (AtomicFileGroup).
struct OutputFile {
  std::string path;
  std::string contents;
};

// What a subcommand produced: text for stdout and files to write, or one error line for stderr.
// Subcommands never print or write themselves: the driver does, checking every write.
struct Outcome {
  int exit_code = kExitOk;
  std::string stdout_text;
  std::vector<OutputFile> files;
  std::string error;  // one line, no trailing newline
  // With an error: stdout_text is a report that explains it, printed before the error line
  // (`plan --emit-*` when no plan fits). Otherwise an error prints nothing on stdout.
  bool report_with_error = false;
};

// Records `status` (an error) as the outcome: its message with the fields it names turned into
// flags (FieldsToFlags, with the command's `overrides`), and exit 1 for kInternal, else 2.
void Fail(Outcome* outcome, const Status& status, FieldFlags overrides = {});

// The model flags every subcommand that reads a model shares beyond --model and --model-class:
// --offline, --model-config, --expert-layout.
struct ModelSourceFlags {
  bool offline = false;
  std::string model_config;
  std::string expert_layout = "fused";

  void Add(CLI::App* cmd);
};

// Sends a subcommand's report to stdout, or to the file `output` (-o) when that is not empty.
void EmitReport(const std::string& output, std::string text, Outcome* outcome);

// Registers --format on `cmd`: text (for people) or json (for scripts), its default what `*format`
// holds. `help` is the command's own description of the two. Returns the option (to put it in a
// group).
CLI::Option* AddFormatOption(CLI::App* cmd, std::string* format, const std::string& help);

// Loads `spec` as the CLI does: repo ids not in the cache are fetched from the Hugging Face Hub
// (environment as huggingface_hub reads it) unless --offline or HF_HUB_OFFLINE; each fetch is
// announced on stderr as it starts (the only live output of a subcommand).
Result<estimator::ModelInventory> LoadModelForCli(const std::string& spec,
                                                  estimator::ModelClassChoice choice,
                                                  const ModelSourceFlags& flags);

// -m/--model, --model-class and the source flags, as every subcommand that reads a model
// registers and loads them.
struct ModelFlags {
  std::string spec;                  // --model
  std::string model_class = "auto";  // --model-class: auto or base
  ModelSourceFlags source;

  // Registers the flags; `model_help` says what --model is for this subcommand.
  void Add(CLI::App* cmd, const std::string& model_help, bool required);
  estimator::ModelClassChoice Choice() const;
  Result<estimator::ModelInventory> Load() const;
  // Load(), refusing a model without an architecture (a tensor-shape list or safetensors headers
  // without --model-config): "SPEC: <purpose> needs the architecture (...)".
  Result<estimator::ModelInventory> LoadArchitecture(std::string_view purpose) const;
};

// Each Register* adds a subcommand to `app` whose callback stores its Outcome in `*outcome`.
void RegisterEstimate(CLI::App& app, Outcome* outcome);
void RegisterInventory(CLI::App& app, Outcome* outcome);
void RegisterModels(CLI::App& app, Outcome* outcome);
// `memplan bench`, the parent of the subcommands below (tools/commands.cc).
void RegisterBench(CLI::App& app, Outcome* outcome);
// `memplan bench nvme` (tools/bench_nvme.cc) and `memplan bench adam` (tools/bench_adam.cc), added
// under `bench`.
void RegisterBenchNvme(CLI::App* bench, Outcome* outcome);
void RegisterBenchAdam(CLI::App* bench, Outcome* outcome);
void RegisterBenchSwap(CLI::App* bench, Outcome* outcome);
// `memplan plan` (tools/plan_command.cc) and `memplan check` (tools/check_command.cc).
void RegisterPlan(CLI::App& app, Outcome* outcome);
void RegisterCheck(CLI::App& app, Outcome* outcome);
// `memplan capacity` (tools/capacity_command.cc) and `memplan calibrate`
// (tools/calibrate_command.cc).
void RegisterCapacity(CLI::App& app, Outcome* outcome);
void RegisterCalibrate(CLI::App& app, Outcome* outcome);

}  // namespace memplan::tools
