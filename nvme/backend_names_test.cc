// Tests of the --backend names the CLI takes from nvme/backend_names.h: the exact values and help
// words `memplan bench nvme` and `memplan bench swap` show, and that every value is one
// ParseBackendKind() accepts, as the backend a user means.
#include "nvme/backend_names.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "nvme/backend.h"

namespace memplan::nvme {
namespace {

TEST_CASE("backend names: the --backend values, names first, then their aliases") {
  CHECK(BackendFlagValues() ==
        std::vector<std::string>{"uring", "aio", "posix", "auto", "io_uring", "libaio"});
}

TEST_CASE("backend names: every --backend value parses, the aliases to their backend") {
  for (const std::string& value : BackendFlagValues()) {
    auto kind = ParseBackendKind(value);
    REQUIRE_MESSAGE(kind.ok(), value);
    CHECK(*kind != BackendKind::kMemory);  // a test backend, not a user's choice
  }
  CHECK(*ParseBackendKind("io_uring") == BackendKind::kUring);
  CHECK(*ParseBackendKind("libaio") == BackendKind::kAio);
}

TEST_CASE("backend names: the help texts' list, plain and described") {
  CHECK(BackendFlagChoices(false) == "uring, aio, posix or auto");
  CHECK(BackendFlagChoices(true) ==
        "uring (io_uring), aio (libaio, what DeepSpeed uses), posix (threads) or auto (the first "
        "that works, in that order)");
}

}  // namespace
}  // namespace memplan::nvme
