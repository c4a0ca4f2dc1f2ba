// Small file helpers shared by every module that reads or writes user files.
//
// Note [User files]: every file a user names is read through ReadFileToString / ReadFileRange /
// FileSize, which open it with O_NONBLOCK and refuse anything but a regular file (a FIFO, a
// device, a socket, a directory), so a hostile path can neither hang memplan (a FIFO no one writes
// to) nor make it read forever (/dev/zero). Every file memplan writes goes through
// AtomicFileGroup (WriteFileAtomically for one file), which replaces only a regular file or
// creates a new one, never a symlink or a device node, and keeps the old file's mode.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/durability.h"
#include "common/status.h"

namespace memplan {

// Reads the whole file. Errors (NotFound / IoError / ResourceExhausted / InvalidArgument for a
// path that is not a regular file) name `path`. Files larger than `max_bytes` are refused without
// being read, so hostile inputs cannot exhaust memory.
Result<std::string> ReadFileToString(const std::string& path,
                                     uint64_t max_bytes = uint64_t{64} << 20);

// Reads exactly `length` bytes at `offset`; a short file is an error naming `path`.
Result<std::string> ReadFileRange(const std::string& path, uint64_t offset, uint64_t length);

// Size of a regular file; errors name `path`.
Result<uint64_t> FileSize(const std::string& path);

// OK when `path` is a directory (symlinks followed); otherwise NotFound / InvalidArgument naming
// `what` and `path`, e.g. RequireDirectory("/etc/passwd", "`nvme_path`") ->
// "`nvme_path` /etc/passwd: not a directory".
Status RequireDirectory(const std::string& path, std::string_view what);

// Note [Paths from data]
// A path memplan builds from data it was given (a shard name from a safetensors index, the Hub's
// X-Repo-Commit and ETag, a revision) names a file under a root memplan chose or was given (the
// index's directory, the Hugging Face cache). Every such path is built by PathUnder, which checks
// the name before anything is opened or created with it: relative, no empty, "." or ".."
// component, no NUL, no control character or line break, no backslash (a separator on Windows,
// where the same cache may be read), at most 4096 bytes; the joined path must then lie lexically
// under the root (checked again, so the rule and the join cannot disagree). The check is lexical
// on purpose: in a Hugging Face cache every file is a symlink into ../../blobs, which must keep
// working for readers. Writers go further: MakeDirectoriesUnder creates the directories between
// the root and the file one at a time and refuses one that exists as a symbolic link or as
// anything but a directory, and AtomicFileGroup never writes through a symlink at the file
// itself, so a link planted under the root cannot carry a write outside it.

// InvalidArgument "<what> '<relative>' <why>" unless `relative` passes Note [Paths from data]'s
// rule.
Status CheckRelativePath(std::string_view relative, std::string_view what);

// `root` + "/" + `relative`, once CheckRelativePath accepts `relative` and the joined path lies
// lexically under `root`; the errors name `what`.
Result<std::string> PathUnder(std::string_view root, std::string_view relative,
                              std::string_view what);

// Creates the directory `relative` (CheckRelativePath's rule) under the existing directory `root`,
// each missing component with mode 0777 less the umask. An existing component must be a real
// directory: a symbolic link (to anywhere) or another kind of file is refused
// (FailedPrecondition naming it), as is a component created concurrently as one. `root` itself
// may be a link (a user's cache on another disk). Errors name the path.
Status MakeDirectoriesUnder(const std::string& root, std::string_view relative);

// A set of output files written all-or-nothing: Commit() first writes each to a temporary file
// beside it ("<path>.tmp.XXXXXX": written and fsynced), and only when every one is written renames
// them into place, then fsyncs their directories. If anything fails before or during the renames,
// every target keeps its previous contents (or stays absent) and no temporary file is left; the
// error names the path. A target must be a new path or an existing regular file: a symlink, a
// device, a FIFO or a directory is refused before anything is written, as is the same file given
// twice. Mode: the one given, else the old file's (a replaced file keeps its permissions), else
// 0666 less the umask (as any new file). SIGINT, SIGTERM, SIGHUP and SIGQUIT are held during the
// renames (milliseconds), so a signal cannot leave half of a group in place. A crash (not a signal:
// see RemoveStagedFilesForSignal) may leave "<path>.tmp.*" or "<path>.old.*" files behind.
// Not thread-safe; use one group per thread.
class AtomicFileGroup {
 public:
  AtomicFileGroup() = default;
  explicit AtomicFileGroup(Durability durability) : durability_(durability) {}
  AtomicFileGroup(const AtomicFileGroup&) = delete;
  AtomicFileGroup& operator=(const AtomicFileGroup&) = delete;

  void Add(std::string path, std::string contents, std::optional<uint32_t> mode = std::nullopt);
  bool empty() const { return files_.empty(); }
  // Writes every file added, or none. The group is empty afterwards either way.
  Status Commit();

 private:
  struct File {
    std::string path;
    std::string contents;
    std::optional<uint32_t> mode;
  };
  std::vector<File> files_;
  Durability durability_ = Durability::kPowerLoss;
};

// One file, as an AtomicFileGroup of one: after a crash `path` holds either the old or the new
// contents and, once this returns OK, the new ones. When only the directory fsync fails, the new
// file is in place but its name may not survive a power loss (filesystems that cannot fsync a
// directory, EINVAL, count as success).
// `durability` kProcessCrash skips the fsyncs.
Status WriteFileAtomically(const std::string& path, const std::string& contents,
                           std::optional<uint32_t> mode = std::nullopt,
                           Durability durability = Durability::kPowerLoss);

// Removes the temporary files that AtomicFileGroup::Commit has created and not yet renamed (up to
// 32 at a time). Async-signal-safe: for the SIGINT / SIGTERM handler of a program (tools/) that
// then ends the process, so an interrupted write leaves nothing behind.
void RemoveStagedFilesForSignal() noexcept;

}  // namespace memplan
