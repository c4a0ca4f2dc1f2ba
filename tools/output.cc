#include "tools/output.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace memplan::tools {
namespace {

Status StdoutError(int err) {
  return Status::IoError(std::string("cannot write to stdout: ") + std::strerror(err));
}

}  // namespace

Status WriteStdoutAndClose(std::string_view text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDOUT_FILENO, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {  // stdout shared with a non-blocking owner
        struct pollfd p = {STDOUT_FILENO, POLLOUT, 0};
        ::poll(&p, 1, 1000);
        continue;
      }
      return StdoutError(errno);
    }
    done += static_cast<size_t>(n);
  }
  // close() reports deferred write errors (NFS, some FUSE filesystems). With nothing written, a
  // stdout closed from the start (EBADF) is no error.
  if (::close(STDOUT_FILENO) != 0 && !(errno == EBADF && text.empty()) && errno != EINTR) {
    return StdoutError(errno);
  }
  return Status::Ok();
}

}  // namespace memplan::tools
