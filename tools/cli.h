// The memplan command line as a function: what main() runs (Main), and what the CLI fuzz target
// (fuzz/cli_fuzz.cc) feeds arbitrary arguments to (RunCli).
#pragma once

#include <string>
#include <vector>

#include "tools/commands.h"

namespace memplan::tools {

// Parses and runs `args` (args[0] is the program name) without printing or writing anything: the
// Outcome holds the stdout text (help and version included), the files to write and the error
// line. Never throws: an exception escaping a subcommand (std::bad_alloc, a std::system_error)
// becomes the error "internal error: ..." with exit 2, after the stack has unwound (so the
// subcommand's temporary stores are removed).
Outcome RunCli(const std::vector<std::string>& args);

// main(): installs the SIGINT/SIGTERM handlers (tools/signals.h) and a std::terminate handler (an
// exception escaping a worker thread: one line, exit 2), runs RunCli, then carries the Outcome
// out: the files all or none (AtomicFileGroup), then stdout (tools/output.h), or the error line,
// escaped (common/printable.h), on stderr. Returns the exit status.
int Main(int argc, char** argv);

}  // namespace memplan::tools
