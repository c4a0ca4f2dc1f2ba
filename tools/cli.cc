#include "tools/cli.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/byte_size.h"
#include "common/file.h"
#include "common/printable.h"
#include "common/suggest.h"
#include "tools/output.h"
#include "tools/signals.h"

namespace memplan::tools {
namespace {

// Note [Number flags]: CLI11's Range lets NaN through (every comparison with NaN is false), a
// double option takes "inf" and "1e999" (= inf), and integers are read with strtoll base 0, so
// "010" is 8 and "-1" for an unsigned option is 2^64 - 1. Every numeric option of every
// subcommand, whoever adds it, gets the checks below, keyed on CLI11's type name for it.

// A float option: a decimal number (common/byte_size.h's ParseDecimalNumber: not "0x10", which
// strtod reads as 16, nor NaN or an infinity, whatever their spelling).
CLI::Validator FiniteNumber() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        const std::optional<double> v = ParseDecimalNumber(value);
        if (v && std::isfinite(*v)) return std::string();
        char* end = nullptr;
        const double spelled = std::strtod(value.c_str(), &end);  // "nan", "inf", "infinity"
        if (!v && !(end != value.c_str() && *end == '\0' && !std::isfinite(spelled))) {
          return "must be a decimal number, got '" + Printable(value) + "'";
        }
        return "must be a finite number, got '" + Printable(value) + "'";
      },
      "");
}

// An integer option: decimal digits with an optional sign ('-' only when `is_signed`); leading
// zeros are dropped so CLI11 does not read them as octal.
CLI::Validator DecimalInteger(bool is_signed) {
  return CLI::Validator(
      [is_signed](std::string& value) -> std::string {
        size_t i = 0;
        std::string sign;
        if (i < value.size() && (value[i] == '+' || value[i] == '-')) {
          if (value[i] == '-') sign = "-";
          ++i;
        }
        const size_t digits = i;
        while (i < value.size() && value[i] >= '0' && value[i] <= '9') ++i;
        if (i == digits || i != value.size()) {
          return "must be a whole decimal number, got '" + value + "'";
        }
        size_t first = value.find_first_not_of('0', digits);
        std::string number = first == std::string::npos ? "0" : value.substr(first);
        if (sign == "-" && number != "0" && !is_signed) return "must be >= 0, got '" + value + "'";
        value = (number == "0" ? "" : sign) + number;
        return std::string();
      },
      "");
}

void AddNumberChecks(CLI::App* app) {
  for (CLI::Option* option : app->get_options()) {
    const std::string type = option->get_type_name();
    if (type.rfind("FLOAT", 0) == 0) {
      option->transform(FiniteNumber());
    } else if (type.rfind("UINT", 0) == 0) {
      option->transform(DecimalInteger(false));
    } else if (type.rfind("INT", 0) == 0) {
      option->transform(DecimalInteger(true));
    }
  }
  for (CLI::App* sub : app->get_subcommands([](CLI::App*) { return true; })) {
    AddNumberChecks(sub);
  }
}

std::string WithoutTrailingNewlines(std::string text) {
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

void PrintError(const std::string& message) {
  const std::string line = "memplan: error: " + Printable(message) + "\n";
  [[maybe_unused]] ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
}

// Note [Escaped exceptions]: an exception that leaves a worker thread cannot be caught by RunCli;
// std::terminate would abort with a core dump. Instead: one line, the staged output files
// removed, exit 2. (An exception on the main thread is caught in RunCli, after unwinding.)
[[noreturn]] void OnTerminate() {
  std::string what = "an exception escaped a worker thread";
  if (std::exception_ptr current = std::current_exception()) {
    try {
      std::rethrow_exception(current);
    } catch (const std::exception& e) {
      what += ": " + std::string(e.what());
    } catch (...) {
    }
  }
  PrintError("internal error: " + what);
  RemoveStagedFilesForSignal();
  ::_exit(kExitBadInput);
}

// " (did you mean --x?)" for the first argument that looks like a long flag the chosen subcommand
// does not have, from that subcommand's own flags; "" when none is close.
std::string SuggestFlag(const CLI::App& app, const std::vector<std::string>& args) {
  const CLI::App* command = &app;
  for (const CLI::App* sub : app.get_subcommands()) command = sub;
  std::vector<std::string> flags;
  for (const CLI::Option* option : command->get_options()) {
    for (const std::string& name : option->get_lnames()) flags.push_back("--" + name);
  }
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string flag = args[i].substr(0, args[i].find('='));
    if (flag.rfind("--", 0) != 0 || flag.size() < 4) continue;
    if (std::find(flags.begin(), flags.end(), flag) != flags.end()) continue;
    std::string hint = DidYouMean(ClosestMatches(flag, flags));
    if (!hint.empty()) return hint;
  }
  return "";
}

}  // namespace

Outcome RunCli(const std::vector<std::string>& args) {
  Outcome outcome;
  try {
    CLI::App app{
        "memplan: will a training job fit, where should each byte live, and how fast will it "
        "run?\nEstimates GPU/CPU memory per ZeRO stage and offload choice from a Hugging Face "
        "config.json, a tensor-shape list or safetensors headers, without loading weights, and "
        "measures the NVMe bandwidth and CPU optimizer speed an offload plan can count on."};
    app.name("memplan");
    app.set_version_flag("--version", std::string("memplan ") + MEMPLAN_VERSION);
    app.require_subcommand(1);
    app.footer("\nRun `memplan <command> --help` for a command's options.");
    RegisterEstimate(app, &outcome);
    RegisterInventory(app, &outcome);
    RegisterModels(app, &outcome);
    RegisterBench(app, &outcome);
    RegisterPlan(app, &outcome);
    RegisterCheck(app, &outcome);
    RegisterCapacity(app, &outcome);
    RegisterCalibrate(app, &outcome);
    AddNumberChecks(&app);
    std::vector<char*> argv;
    std::vector<std::string> copy = args.empty() ? std::vector<std::string>{"memplan"} : args;
    for (std::string& a : copy) argv.push_back(a.data());
    try {
      app.parse(static_cast<int>(argv.size()), argv.data());
    } catch (const CLI::ParseError& e) {
      outcome = Outcome();
      if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
        // --help, --help-all, --version: their text goes to stdout like any output.
        std::ostringstream out, err;
        outcome.exit_code = app.exit(e, out, err);
        outcome.stdout_text = out.str();
      } else {
        outcome.exit_code = kExitBadInput;
        const bool unknown_flag = dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr;
        outcome.error = WithoutTrailingNewlines(e.what()) +
                        (unknown_flag ? SuggestFlag(app, copy) : std::string()) + " (see --help)";
      }
    }
  } catch (const std::bad_alloc&) {
    outcome = Outcome();
    outcome.exit_code = kExitBadInput;
    outcome.error = "out of memory (the input asks for more than this machine has)";
  } catch (const std::exception& e) {
    outcome = Outcome();
    outcome.exit_code = kExitBadInput;
    outcome.error = "internal error: " + WithoutTrailingNewlines(e.what());
  } catch (...) {
    outcome = Outcome();
    outcome.exit_code = kExitBadInput;
    outcome.error = "internal error: unknown exception";
  }
  return outcome;
}

int Main(int argc, char** argv) {
  InstallSignalHandlers();
  std::set_terminate(OnTerminate);
  Outcome outcome = RunCli(std::vector<std::string>(argv, argv + argc));
  if (!outcome.error.empty()) {
    // A report that explains the error (`plan --emit-*` when no plan fits: why, and what would
    // make one fit) goes to stdout first.
    if (outcome.report_with_error) {
      [[maybe_unused]] Status ignored =
          WriteStdoutAndClose(Printable(outcome.stdout_text, /*keep_newlines=*/true));
    }
    PrintError(outcome.error);
    return outcome.exit_code == kExitOk ? kExitBadInput : outcome.exit_code;
  }
  if (!outcome.files.empty()) {
    AtomicFileGroup group;
    for (OutputFile& file : outcome.files) group.Add(file.path, std::move(file.contents));
    if (Status written = group.Commit(); !written.ok()) {
      Outcome failed;
      Fail(&failed, written);
      PrintError(failed.error);
      return failed.exit_code;
    }
  }
  // Text reports name files and tensors: nothing in them may drive the terminal. (JSON output is
  // unchanged: its strings hold no raw control characters, and \\uXXXX means the same in JSON.)
  if (Status out = WriteStdoutAndClose(Printable(outcome.stdout_text, /*keep_newlines=*/true));
      !out.ok()) {
    PrintError(out.message());
    return kExitBadInput;
  }
  return outcome.exit_code;
}

}  // namespace memplan::tools
