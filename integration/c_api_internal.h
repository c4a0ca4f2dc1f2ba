// What the C API's two halves share (c_api.cc: the library and the offload engine;
// c_api_requests.cc: estimate, plan and capacity): the exported-symbol marker, the last-error slot
// and Guard(). Private to libmemplan_c.so (hidden visibility), never installed.
//
// The halves are separate so that the engine half builds without the estimator and the planner:
// the emulated-GPU test of the C API (tests/gpu_emulation/c_api_emulated_test.cc) links that half
// alone, in the ThreadSanitizer build, which then compiles neither (Note [CI time] in
// scripts/test.sh).
#ifndef MEMPLAN_INTEGRATION_C_API_INTERNAL_H_
#define MEMPLAN_INTEGRATION_C_API_INTERNAL_H_

#include <exception>
#include <new>
#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"
#include "memplan.h"

#define MEMPLAN_C_EXPORT extern "C" __attribute__((visibility("default")))

namespace memplan::capi {

// Records `function: message` as this thread's last error (memplan_last_error).
void SetLastError(const char* function, const std::string& message) noexcept;

memplan_status ToC(StatusCode code);

// Runs `body` (returning Status) as the C function `function`: the status code, the message
// recorded on failure, and no exception escaping.
template <typename Body>
memplan_status Guard(const char* function, Body&& body) noexcept {
  try {
    Status status = body();
    if (status.ok()) return MEMPLAN_OK;
    SetLastError(function, status.message());
    return ToC(status.code());
  } catch (const std::bad_alloc&) {
    SetLastError(function, "out of memory");
    return MEMPLAN_RESOURCE_EXHAUSTED;
  } catch (const std::exception& e) {
    SetLastError(function, std::string("internal error: ") + e.what());
    return MEMPLAN_INTERNAL;
  } catch (...) {
    SetLastError(function, "internal error: unknown exception");
    return MEMPLAN_INTERNAL;
  }
}

Status NullArgument(const char* name);

// Copies `text` into memory the caller frees with memplan_string_free (free()).
Status GiveString(const std::string& text, char** out);

// Dumps a JSON answer as the CLI prints it (two-space indent); invalid UTF-8 in a string is
// replaced rather than thrown about.
std::string Dump(const nlohmann::json& json);

}  // namespace memplan::capi

#endif  // MEMPLAN_INTEGRATION_C_API_INTERNAL_H_
