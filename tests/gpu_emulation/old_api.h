// Only for building these tests against the offload API as it was before issue 17
// (-DMEMPLAN_TEST_OLD_API; README.md, "Checking that a test catches its defect"): the names the
// tests use that did not exist then, doing what the old code did. Never part of a normal build.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "offload/collective.h"
#include "gpu/gpu_runtime.h"

namespace memplan::gpu {
constexpr int kCurrentDevice = 0;  // the old code's fixed device
struct Stream {                    // the old calls took none
  void* handle = nullptr;
};
}  // namespace memplan::gpu

namespace memplan::offload {
struct NcclOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // the old code had none
};
inline Result<std::unique_ptr<Collective>> CreateNcclCollective(gpu::Runtime* runtime, int rank,
                                                                int world_size,
                                                                const std::string& unique_id,
                                                                const NcclOptions& /*ignored*/) {
  return CreateNcclCollective(runtime, rank, world_size, unique_id);
}
}  // namespace memplan::offload
