// CreateCudaRuntime in a build without the CUDA toolkit (MEMPLAN_WITH_CUDA=OFF, or not found).
#include "gpu/cuda_runtime_internal.h"
#include "gpu/gpu_runtime.h"

namespace memplan::gpu {

Result<std::unique_ptr<Runtime>> CreateCudaRuntime(int /*device*/) {
  return Status::Unavailable("no usable GPU: memplan was built without CUDA");
}

namespace internal {
int CudaDeviceOf(const Runtime& /*runtime*/) { return -1; }
std::string CudaDescription(const Runtime& /*runtime*/) { return ""; }
}  // namespace internal

}  // namespace memplan::gpu
