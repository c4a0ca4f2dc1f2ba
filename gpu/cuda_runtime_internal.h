// What the rest of memplan_offload (CreateBestRuntime, the NCCL collective) needs to know about a
// gpu::Runtime beyond its interface. Implemented in cuda_runtime.cc, or cuda_runtime_stub.cc in a
// build without CUDA. Not installed.
#pragma once

#include <string>

#include "gpu/gpu_runtime.h"

namespace memplan::gpu::internal {

// The CUDA device ordinal `runtime` runs on, or -1 when it is not the CUDA runtime.
int CudaDeviceOf(const Runtime& runtime);

// "NVIDIA H100 80GB HBM3, 79.1 GiB, compute capability 9.0" for the CUDA runtime; "" otherwise.
std::string CudaDescription(const Runtime& runtime);

// The copy directions both runtimes keep one lane (stream or thread) for, indexed by
// CopyDirection, and their names in messages.
constexpr int kDirections = 3;

inline bool ValidDirection(CopyDirection direction) {
  const int d = static_cast<int>(direction);
  return d >= 0 && d < kDirections;
}

inline const char* DirectionName(CopyDirection direction) {
  switch (direction) {
    case CopyDirection::kHostToDevice: return "host-to-device";
    case CopyDirection::kDeviceToHost: return "device-to-host";
    case CopyDirection::kDeviceToDevice: return "device-to-device";
  }
  return "invalid direction";
}

}  // namespace memplan::gpu::internal
