// The one way the memplan CLI writes to stdout. Every write is checked, and so are the final
// flush and close: a full disk (> /dev/full), a closed stdout (>&-) or an NFS error at close is an
// error ("cannot write to stdout"), never a silent truncation with exit 0. A closed pipe still
// raises SIGPIPE as usual (`memplan inventory ... | head` ends quietly).
#pragma once

#include <string_view>

#include "common/status.h"

namespace memplan::tools {

// Writes all of `text` to file descriptor 1 (EINTR and short writes retried), then closes it.
// Errors: IoError "cannot write to stdout: <reason>".
Status WriteStdoutAndClose(std::string_view text);

}  // namespace memplan::tools
