// The memplan CLI's subcommands: thin layers over the library. This is the only layer that prints
// to the terminal or chooses an exit code.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace memplan::tools {

// Exit codes: 0 success, 2 bad input or usage (file, field, flag), 1 an internal error.
constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitBadInput = 2;

// What a subcommand produced: text for stdout, or one error line for stderr.
struct Outcome {
  int exit_code = kExitOk;
  std::string stdout_text;
  std::string error;  // one line, no trailing newline
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

}  // namespace memplan::tools
