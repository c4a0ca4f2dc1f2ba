#include "tools/signals.h"

#include <signal.h>
#include <unistd.h>

#include "common/file.h"

namespace memplan::tools {
namespace {

std::atomic<bool> g_in_scope{false};
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free,
              "set from a signal handler");

extern "C" void HandleStopSignal(int signal) {
  if (g_in_scope.load() && !g_stop.load()) {
    g_signal.store(signal);
    g_stop.store(true);
    return;
  }
  RemoveStagedFilesForSignal();
  ::_exit(128 + signal);
}

}  // namespace

void InstallSignalHandlers() {
  struct sigaction action {};
  action.sa_handler = HandleStopSignal;
  sigemptyset(&action.sa_mask);
  sigaddset(&action.sa_mask, SIGINT);
  sigaddset(&action.sa_mask, SIGTERM);
  action.sa_flags = SA_RESTART;
  // Also where the shell ignored SIGINT (a background job of a script): a `kill -INT` sent to
  // memplan on purpose must still stop it cleanly.
  for (int signal : {SIGINT, SIGTERM}) ::sigaction(signal, &action, nullptr);
}

StopScope::StopScope() {
  g_stop.store(false);
  g_signal.store(0);
  g_in_scope.store(true);
}

StopScope::~StopScope() { g_in_scope.store(false); }

const std::atomic<bool>* StopScope::flag() const { return &g_stop; }

bool StopScope::stopped() const { return g_stop.load(); }

int StopScope::ExitCode() const { return 128 + g_signal.load(); }

}  // namespace memplan::tools
