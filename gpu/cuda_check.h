// Checking CUDA runtime calls, and choosing the current device, for the files compiled only with
// CUDA (cuda_runtime.cc, nccl_collective.cc). Not installed.
//
//   MEMPLAN_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, bytes));
//     -> ResourceExhausted: "cudaMalloc(&ptr, bytes): cudaErrorMemoryAllocation: out of memory
//        (gpu/cuda_runtime.cc:210)"
//   MEMPLAN_CUDA_ON_DEVICE(device_);  // `device_` current until the end of the scope
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "common/status.h"

namespace memplan::gpu::internal {

// "gpu/cuda_runtime.cc" from __FILE__'s full path: enough to find the line, short enough for a
// one-line message.
inline const char* ShortFile(const char* file) {
  const char* last = nullptr;
  const char* before_last = nullptr;
  for (const char* p = file; *p != '\0'; ++p) {
    if (*p == '/') {
      before_last = last;
      last = p;
    }
  }
  return before_last != nullptr ? before_last + 1 : (last != nullptr ? last + 1 : file);
}

// Error mapping: out of device memory -> ResourceExhausted; a bad argument, including memory
// registered twice or not at all -> InvalidArgument; no device or a driver too old -> Unavailable;
// anything else (a failed copy, a corrupted context: CUDA's "sticky" errors, after which every
// later call fails too) -> IoError, the device having refused the transfer.
inline Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  // A failed call also leaves its error as the thread's "last error"; clear it, so that code
  // checking cudaGetLastError() after its own kernel launches (PyTorch does) does not blame itself
  // for ours. Sticky errors stay whatever we do.
  (void)cudaGetLastError();
  std::string msg = std::string(call) + ": " + cudaGetErrorName(err) + ": " +
                    cudaGetErrorString(err) + " (" + ShortFile(file) + ":" + std::to_string(line) +
                    ")";
  switch (err) {
    case cudaErrorMemoryAllocation: return Status::ResourceExhausted(std::move(msg));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle: return Status::InvalidArgument(std::move(msg));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver: return Status::Unavailable(std::move(msg));
    default: return Status::IoError(std::move(msg));
  }
}

}  // namespace memplan::gpu::internal

#define MEMPLAN_CUDA_STATUS(err, call) \
  ::memplan::gpu::internal::CudaStatus((err), (call), __FILE__, __LINE__)

// Runs the CUDA call `expr`; when it fails, returns a Status naming the call, the CUDA error and
// the file and line from the enclosing function.
#define MEMPLAN_CUDA_RETURN_IF_ERROR(expr)                  \
  do {                                                      \
    const cudaError_t memplan_cuda_err_ = (expr);           \
    if (memplan_cuda_err_ != cudaSuccess) {                 \
      return MEMPLAN_CUDA_STATUS(memplan_cuda_err_, #expr); \
    }                                                       \
  } while (0)

// Makes `device` current on the calling thread until the end of the enclosing scope (restoring the
// thread's previous device then), or returns the error from the enclosing function.
#define MEMPLAN_CUDA_ON_DEVICE(device)                                   \
  ::memplan::gpu::internal::ScopedDevice memplan_scoped_device_(device); \
  MEMPLAN_RETURN_IF_ERROR(memplan_scoped_device_.Enter())

namespace memplan::gpu::internal {

// True when `device`'s primary context exists, asked of the driver (cuDevicePrimaryCtxGetState,
// fetched through the runtime so that memplan does not link libcuda). False when unknown.
inline bool PrimaryContextActive(int device) {
  // CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active)
  using GetState = int (*)(int device, unsigned int* flags, int* active);
  static const GetState get_state = [] {
    void* fn = nullptr;
#if CUDART_VERSION >= 12050
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
#elif CUDART_VERSION >= 12000
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPoint("cuDevicePrimaryCtxGetState", &fn, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
#endif
    return reinterpret_cast<GetState>(fn);
  }();
  if (get_state == nullptr) return false;
  unsigned int flags = 0;
  int active = 0;
  return get_state(device, &flags, &active) == 0 && active != 0;
}

// Note [Current device]: the CUDA runtime keeps a current device per thread, and cudaMalloc,
// cudaEventCreate, cudaStreamCreate and NCCL's calls act on it; on a thread that never chose one it
// is device 0, and the first call that needs a context creates device 0's (hundreds of MiB on GPU
// 0, for a process that trains on GPU 3). Callers reach us from their own threads (the engine's
// transfer threads, Python's), which may never have chosen a device or may have chosen another for
// their own work, so every public call that reaches CUDA first makes ours current. Afterwards the
// caller's device is restored, like c10::cuda::CUDAGuard, but only when that device's context
// already exists (PyTorch's MaybeSetDevice rule): cudaSetDevice creates the context of the device
// it names, and restoring a fresh thread's implicit device 0 would create the very context this
// avoids; such a thread keeps ours. cudaGetDevice is a thread-local read, so the guard costs next
// to nothing when the device is already current.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) : device_(device) {}
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  ~ScopedDevice() {
    if (previous_ >= 0 && PrimaryContextActive(previous_) &&
        cudaSetDevice(previous_) != cudaSuccess) {
      (void)cudaGetLastError();  // ours, not the caller's: do not leave it for them to find
    }
  }

  Status Enter() {
    int current = -1;
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
    if (current != device_) {
      MEMPLAN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
      previous_ = current;
    }
    return Status::Ok();
  }

 private:
  const int device_;
  int previous_ = -1;  // the device to restore; -1: nothing to restore
};

}  // namespace memplan::gpu::internal
