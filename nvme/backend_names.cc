// Names and option validation for the Backend seam (shared by every backend and by the CLI).
#include <string>

#include "nvme/backend.h"

namespace memplan::nvme {

std::string_view OpTypeName(OpType op) {
  switch (op) {
    case OpType::kRead: return "read";
    case OpType::kWrite: return "write";
    case OpType::kFsync: return "fsync";
  }
  return "?";
}

std::string_view BackendKindName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kUring: return "uring";
    case BackendKind::kAio: return "aio";
    case BackendKind::kPosix: return "posix";
    case BackendKind::kMemory: return "memory";
  }
  return "?";
}

Result<BackendKind> ParseBackendKind(std::string_view text) {
  for (BackendKind kind : {BackendKind::kAuto, BackendKind::kUring, BackendKind::kAio,
                           BackendKind::kPosix, BackendKind::kMemory}) {
    if (text == BackendKindName(kind)) return kind;
  }
  if (text == "io_uring") return BackendKind::kUring;
  if (text == "libaio") return BackendKind::kAio;
  return Status::InvalidArgument("unknown backend '" + std::string(text) +
                                 "' (expected auto, uring, aio, posix or memory)");
}

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
