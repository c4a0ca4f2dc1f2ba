// Small file helpers shared by every module that reads or writes user files.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace memplan {

// Reads the whole file. Errors (NotFound / IoError / ResourceExhausted) name `path`. Files larger
// than `max_bytes` are refused without being read, so hostile inputs cannot exhaust memory.
Result<std::string> ReadFileToString(const std::string& path,
                                     uint64_t max_bytes = uint64_t{64} << 20);

// Reads exactly `length` bytes at `offset`; a short file is an error naming `path`.
Result<std::string> ReadFileRange(const std::string& path, uint64_t offset, uint64_t length);

// Size of a regular file; errors name `path`.
Result<uint64_t> FileSize(const std::string& path);

// Writes `contents` to `path` atomically and durably: a temporary file beside it (created with
// `mode`, which the umask does not narrow), fsync, rename over `path`, fsync of the directory, so
// that after a crash `path` holds either the old or the new contents and, once this returns OK,
// the new ones. When the write, fsync or rename fails, nothing is left behind and the previous
// file (if any) is untouched; when only the directory fsync fails, the new file is in place but
// its name may not survive a power loss (filesystems that cannot fsync a directory, EINVAL, count
// as success). A crash before the rename may leave a "<path>.tmp.XXXXXX" file behind.
Status WriteFileAtomically(const std::string& path, const std::string& contents,
                           uint32_t mode = 0644);

}  // namespace memplan
