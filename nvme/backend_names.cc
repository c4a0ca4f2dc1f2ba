// Names and option validation for the Backend seam (shared by every backend and by the CLI). The
// BackendKind names are schedule/enums.cc's: a Schedule names a backend.
#include "nvme/backend_names.h"

#include <iterator>
#include <string>

#include "common/enum_names.h"
#include "nvme/backend.h"

namespace memplan::nvme {

namespace {

constexpr EnumName<OpType> kOpTypes[] = {
    {OpType::kRead, "read"}, {OpType::kWrite, "write"}, {OpType::kFsync, "fsync"}};

// The backends a user chooses, in the order the CLI lists them: name, alias (or null), and what
// the name means, for --help.
struct UserBackend {
  BackendKind kind;
  const char* alias;
  const char* meaning;
};
constexpr UserBackend kUserBackends[] = {
    {BackendKind::kUring, "io_uring", "io_uring"},
    {BackendKind::kAio, "libaio", "libaio, what DeepSpeed uses"},
    {BackendKind::kPosix, nullptr, "threads"},
    {BackendKind::kAuto, nullptr, "the first that works, in that order"}};

}  // namespace

std::vector<std::string> BackendFlagValues() {
  std::vector<std::string> out;
  for (const UserBackend& b : kUserBackends) out.emplace_back(BackendKindName(b.kind));
  for (const UserBackend& b : kUserBackends) {
    if (b.alias != nullptr) out.emplace_back(b.alias);
  }
  return out;
}

std::string BackendFlagChoices(bool described) {
  std::string out;
  const size_t n = std::size(kUserBackends);
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) out += i + 1 == n ? " or " : ", ";
    out += BackendKindName(kUserBackends[i].kind);
    if (described) out += std::string(" (") + kUserBackends[i].meaning + ")";
  }
  return out;
}

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
