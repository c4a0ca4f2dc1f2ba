// The names a user gives a Backend (the CLI's --backend flags), from one table in backend_names.cc:
// the canonical names of schedule/enums.h's BackendKind that a user may choose (memory, a test
// backend, is not one), their accepted aliases, and the words the --help texts describe them with.
#pragma once

#include <string>
#include <vector>

namespace memplan::nvme {

// Every value a --backend flag accepts: the names ("uring", "aio", "posix", "auto"), then their
// aliases ("io_uring", "libaio"), as ParseBackendKind() takes them.
std::vector<std::string> BackendFlagValues();

// The choices for a --help text, "uring, aio, posix or auto"; `described`: each with what it is,
// "uring (io_uring), aio (libaio, what DeepSpeed uses), posix (threads) or auto (...)".
std::string BackendFlagChoices(bool described);

}  // namespace memplan::nvme
