// Names and option validation for the Backend seam (shared by every backend and by the CLI). The
// BackendKind names are schedule/enums.cc's: a Schedule names a backend.
#include <string>

#include "common/enum_names.h"
#include "nvme/backend.h"

namespace memplan::nvme {

namespace {

constexpr EnumName<OpType> kOpTypes[] = {
    {OpType::kRead, "read"}, {OpType::kWrite, "write"}, {OpType::kFsync, "fsync"}};

}  // namespace

std::string_view OpTypeName(OpType op) { return NameOf(kOpTypes, op); }

Status BackendOptions::Validate() const {
  if (queue_depth < 1 || queue_depth > 4096) {
    return Status::InvalidArgument("queue depth must be between 1 and 4096, got " +
                                   std::to_string(queue_depth));
  }
  if (posix_threads < 1 || posix_threads > 256) {
    return Status::InvalidArgument("POSIX backend threads must be between 1 and 256, got " +
                                   std::to_string(posix_threads));
  }
  return Status::Ok();
}

}  // namespace memplan::nvme
