// CreateNcclCollective in a build without NCCL (MEMPLAN_WITH_NCCL=OFF, no CUDA, or not found).
#include "offload/collective.h"

namespace memplan::offload {

Result<std::unique_ptr<Collective>> CreateNcclCollective(gpu::Runtime* /*runtime*/, int /*rank*/,
                                                         int /*world_size*/,
                                                         const std::string& /*unique_id*/,
                                                         const NcclOptions& /*options*/) {
  return Status::Unavailable("nccl collective: memplan was built without NCCL");
}

Result<std::string> NcclUniqueId() {
  return Status::Unavailable("nccl collective: memplan was built without NCCL");
}

}  // namespace memplan::offload
