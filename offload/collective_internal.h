// Helpers shared by the Collective implementations (collective.cc, nccl_collective.cc). Not
// installed.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"
#include "offload/collective.h"

namespace memplan::offload::internal {

// count * ElementBytes(type); InvalidArgument for an invalid type, OutOfRange on overflow. `who`
// and `op` name the collective and the call in the message.
Result<uint64_t> CollectiveBytes(std::string_view who, std::string_view op, uint64_t count,
                                 ElementType type);

}  // namespace memplan::offload::internal
