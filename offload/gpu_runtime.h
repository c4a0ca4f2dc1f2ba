// gpu::Runtime: the seam through which the offload engine asks a GPU runtime to page-lock
// ("register") host memory it allocated itself, so copies between it and the GPU run at full
// bandwidth and asynchronously.
//
// Only the calls the engine needs are here; a CUDA implementation (cudaHostRegister /
// cudaHostUnregister) is added where the toolkit is found. HostOnlyRuntime() does nothing and
// succeeds, so every module is built and tested on a machine without a GPU.
//
// These calls may be slow and may take the runtime's own locks (cudaHostRegister serialises with
// every other CUDA call in the process), so callers never make them while holding a lock of their
// own; see Note [No runtime call under the lock] in pinned_pool.cc.
//
// Thread safety: implementations must be safe to call from any thread.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace memplan::gpu {

class Runtime {
 public:
  virtual ~Runtime() = default;

  // A short name for messages and logs ("host-only", "cuda").
  virtual std::string_view Name() const = 0;

  // Registers [ptr, ptr + bytes) with the runtime. The caller keeps ownership of the memory and
  // must call UnregisterHost(ptr) before freeing it. On failure nothing is registered.
  virtual Status RegisterHost(void* ptr, uint64_t bytes) = 0;

  // Undoes RegisterHost(ptr). Unregistering memory that was not registered is an error.
  virtual Status UnregisterHost(void* ptr) = 0;
};

// A runtime for machines without a GPU: registering does nothing and succeeds.
class HostOnlyRuntime final : public Runtime {
 public:
  std::string_view Name() const override { return "host-only"; }
  Status RegisterHost(void* /*ptr*/, uint64_t /*bytes*/) override { return Status::Ok(); }
  Status UnregisterHost(void* /*ptr*/) override { return Status::Ok(); }
};

// The process-wide host-only runtime; never destroyed, safe from any thread.
inline Runtime& DefaultHostOnlyRuntime() {
  static HostOnlyRuntime* const runtime = new HostOnlyRuntime();
  return *runtime;
}

}  // namespace memplan::gpu
