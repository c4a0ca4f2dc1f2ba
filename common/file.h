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

// Writes `contents` to `path` atomically: a temporary file beside it, fsync, rename. On failure
// nothing is left behind and the previous file (if any) is untouched.
Status WriteFileAtomically(const std::string& path, const std::string& contents);

}  // namespace memplan
