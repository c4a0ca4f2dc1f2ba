// SIGINT and SIGTERM in the memplan CLI. Main (tools/cli.cc) installs one handler for both, once.
//
// Outside a StopScope, a signal removes the temporary files of any output being written
// (common/file.h: RemoveStagedFilesForSignal) and ends the process with 128 + the signal number
// (130 for SIGINT, 143 for SIGTERM). Inside a StopScope, which a subcommand opens around work that
// cleans up after itself (bench nvme's bench file, bench swap's store), the first signal only
// raises the scope's flag: the work polls it, stops, removes what it made and returns, and the
// subcommand exits with ExitCode(). A second signal ends the process at once, as outside a scope,
// for a user who will not wait.
#pragma once

#include <atomic>

namespace memplan::tools {

void InstallSignalHandlers();

// One at a time (subcommands do not nest). Thread safety: the flag may be read from any thread.
class StopScope {
 public:
  StopScope();
  ~StopScope();
  StopScope(const StopScope&) = delete;
  StopScope& operator=(const StopScope&) = delete;

  // For the work's `stop` option.
  const std::atomic<bool>* flag() const;
  bool stopped() const;
  // 128 + the signal that stopped the work.
  int ExitCode() const;
};

}  // namespace memplan::tools
